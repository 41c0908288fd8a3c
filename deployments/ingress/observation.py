"""What the ingress records per API request: one server span and, when it ends, its RequestMetrics.

One trace per request: the ingress's server span ("chat <model>" / "text_completion <model>") is the
parent of the replica's spans (deployments/replica/telemetry.py); its context travels to the replica as a
W3C carrier dict in `GenerateRequest.trace_context`.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from deployments.ingress.protocol import PreparedRequest
from deployments.messages import GenerateOutput
from deployments.telemetry.metrics import (RequestMetrics, Telemetry, request_span_attributes,
                                           usage_span_attributes)
from deployments.telemetry.names import ERROR_TYPE, REPLICA

logger = logging.getLogger(__name__)

OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # PreparedRequest.kind -> GenAI operation


def _guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Observation must never fail a request: log once per observation, then go quiet."""

    @functools.wraps(method)
    def guarded(self: "RequestObservation", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - telemetry must not break serving
            if not self._failed:
                self._failed = True
                logger.warning("request telemetry %s failed", method.__name__, exc_info=True)
            return None

    return guarded


def error_type(exc: BaseException) -> str:
    """The error.type of a failed request: "cancelled" for a caller gone away, else the error's class."""
    if isinstance(exc, (GeneratorExit, KeyboardInterrupt)) or type(exc).__name__ == "CancelledError":
        return "cancelled"
    return type(exc).__name__


class RequestObservation:
    """One API request at the ingress: its server span, and its RequestMetrics when it ends.

    `received_ns` is time.monotonic_ns() at arrival (PreparedRequest.received_ns); 0 means now."""

    def __init__(self, telemetry: Telemetry, prepared: PreparedRequest) -> None:
        self._telemetry = telemetry
        self._failed = False
        self._operation = OPERATIONS.get(prepared.kind, prepared.kind)
        self._model = prepared.model
        now = time.monotonic_ns()
        self._received_ns = prepared.received_ns or now
        self._dispatched_ns = now
        self._first_token_ns: Optional[int] = None
        self._queue_s: Optional[float] = None
        self._choices: dict[int, GenerateOutput] = {}  # index -> its last output
        self._replica: Optional[str] = None
        self._output_error: Optional[str] = None
        self.span = self._start_span(prepared)

    def _start_span(self, prepared: PreparedRequest) -> trace.Span:
        first = prepared.samplings[0]
        attributes = request_span_attributes(self._operation, self._model, first.max_tokens,
                                                first.temperature)
        attributes.update({"gen_ai.response.id": prepared.request_id,
                           "gen_ai.request.choice.count": len(prepared.samplings)})
        start_wall_ns = time.time_ns() - (time.monotonic_ns() - self._received_ns)
        return self._telemetry.tracer.start_span(f"{self._operation} {self._model}", kind=SpanKind.SERVER,
                                                 attributes=attributes, start_time=start_wall_ns)

    def carrier(self) -> dict[str, str]:
        """The W3C trace context of the server span, for GenerateRequest.trace_context."""
        try:
            return self._telemetry.inject(trace.set_span_in_context(self.span))
        except Exception:  # noqa: BLE001 - a lost trace link must not fail the request
            return {}

    @_guarded
    def on_output(self, index: int, out: GenerateOutput) -> None:
        """Every GenerateOutput of every choice, in arrival order."""
        if self._first_token_ns is None and out.num_new_tokens > 0:
            self._first_token_ns = time.monotonic_ns()
            self.span.add_event("gen_ai.first_token")
        if self._queue_s is None and out.queue_s is not None:  # arrival -> first step
            self._queue_s = (self._dispatched_ns - self._received_ns) / 1e9 + out.queue_s
        self._choices[index] = out
        self._replica = self._replica or out.replica_id
        if out.error is not None or out.finish_reason in ("error", "abort"):
            self._output_error = self._output_error or ("aborted" if out.finish_reason == "abort"
                                                        else "EngineError")

    @_guarded
    def finish(self, exc: Optional[BaseException] = None) -> None:
        """Record the request's metrics and end its span; `exc` is what ended it early, if anything."""
        outs = list(self._choices.values())
        failure = self._output_error or (error_type(exc) if exc is not None else None)
        num_input = max((o.num_prompt_tokens for o in outs), default=0)
        num_output = sum(o.num_output_tokens for o in outs)
        end_ns = time.monotonic_ns()
        ttft_s = None if self._first_token_ns is None else (self._first_token_ns - self._received_ns) / 1e9
        self._telemetry.record_request(RequestMetrics(
            operation=self._operation, model=self._model, replica=self._replica or "none",
            num_input_tokens=num_input, num_output_tokens=num_output, ttft_s=ttft_s,
            duration_s=(end_ns - self._received_ns) / 1e9, queue_s=self._queue_s, error_type=failure))
        reasons = [o.finish_reason for o in outs if o.finish_reason]
        self.span.set_attributes(usage_span_attributes(num_input, num_output, reasons))
        if self._replica:
            self.span.set_attribute(REPLICA, self._replica)
        if failure is not None:
            self.span.set_attribute(ERROR_TYPE, failure)
            self.span.set_status(Status(StatusCode.ERROR, failure))
        self.span.end()
