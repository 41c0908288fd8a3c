"""Telemetry of an engine replica: per-step tokens, periodic engine gauges, and each request's spans.

The engine thread calls `ReplicaObserver.on_step` after every step (AsyncEngine.on_step): it records the
step's prefill/decode tokens and duration, the memory it predicted and measured, and each prefill chunk
into the list of that request (plain data; the request's coroutine reads it when the prefill is over).
A daemon thread sets the engine gauges every `gauge_interval_s`, and the prefix cache's size and
evictions (from the engine's cumulative stats). Each request's prefix-cache lookup (a hit of
`num_cached_tokens`, or a miss) is counted when its first output arrives.

Spans of one request on the replica, children of the ingress's server span (context from
`GenerateRequest.trace_context`), made from recorded times when each stage is over:

    mlx_serve.replica.generate         (SERVER)  the replica call
      mlx_serve.engine.queue                     received -> the engine's first step of the request
      mlx_serve.engine.prefill                   first step -> first output; an event per prompt chunk
      mlx_serve.engine.decode                    first output -> last output
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any, Optional

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine import EngineStats, StepRecord

from deployments.engine_client import EngineClient
from deployments.messages import GenerateOutput, GenerateRequest
from deployments.telemetry.metrics import EngineGauges, Telemetry, usage_span_attributes
from deployments.telemetry.names import ERROR_TYPE, REPLICA

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ChunkEvent:
    """One prompt chunk of a request, as the engine thread saw it."""

    time_ns: int  # wall clock at the start of its step
    start: int
    num_tokens: int


class GaugeReporter:
    """A daemon thread setting the engine gauges now and then every `interval_s`."""

    def __init__(self, observer: "ReplicaObserver", interval_s: float) -> None:
        self._observer = observer
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mlx-serve-gauges", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._observer.report_gauges()
            if self._stop.wait(self._interval_s):
                return

    def close(self) -> None:
        self._stop.set()


class ReplicaObserver:
    """All telemetry of one EngineReplica; no method raises into serving code."""

    def __init__(self, telemetry: Telemetry, replica_id: str, engine: EngineClient, gauge_interval_s: float = 1.0,
                 prefix_cache: bool = False) -> None:
        self.telemetry = telemetry
        self.replica_id = replica_id
        self.prefix_cache = prefix_cache
        self._engine = engine
        self._num_evictions: Optional[int] = None  # the engine's cumulative count at the last report
        self._chunks: dict[str, list[ChunkEvent]] = {}  # request id -> chunks; engine thread appends
        self._lock = threading.Lock()
        self._window_memory: Optional[tuple[int, int]] = None  # max (predicted, measured) since last report
        self._last_memory: Optional[tuple[int, int]] = None
        engine.on_step = self.on_step
        telemetry.record_peak_exceeded(replica_id, 0)  # the series exist from the start
        if prefix_cache:
            telemetry.record_prefix_cache_evictions(replica_id, 0)
        self._gauges = GaugeReporter(self, gauge_interval_s)

    # ------------------------------------------------------------------ engine thread

    def on_step(self, step: StepRecord) -> None:
        """AsyncEngine.on_step: called on the engine thread, before the step's outputs are delivered."""
        plan = step.plan
        self.telemetry.record_step(self.replica_id, step.num_prefill_tokens, step.num_decode_tokens,
                                   step.duration_s, None if plan is None else plan.step_budget_tokens,
                                   None if plan is None else plan.free_transient_bytes)
        for chunk in step.prefill_chunks:
            events = self._chunks.get(chunk.request_id)
            if events is not None:
                events.append(ChunkEvent(step.start_time_ns, chunk.start, chunk.num_tokens))
        memory = step.memory
        if memory is None:
            return
        if memory.measured_bytes > memory.predicted_bytes:
            self.telemetry.record_peak_exceeded(self.replica_id)
        with self._lock:
            old = self._window_memory or (0, 0)
            self._window_memory = (max(old[0], memory.predicted_bytes), max(old[1], memory.measured_bytes))

    # ------------------------------------------------------------------ gauge thread

    def report_gauges(self) -> None:
        try:
            self.telemetry.set_engine_gauges(self.replica_id, self.gauges())
            if self.prefix_cache:
                self._report_prefix_cache(self._engine.stats())
        except Exception:  # noqa: BLE001 - e.g. stats() of an engine shutting down
            logger.debug("engine gauges not read", exc_info=True)

    def _report_prefix_cache(self, stats: EngineStats) -> None:
        evictions = stats.prefix_cache_evictions
        self.telemetry.set_prefix_cache_bytes(self.replica_id, stats.prefix_cache_bytes)
        if self._num_evictions is not None and evictions > self._num_evictions:
            self.telemetry.record_prefix_cache_evictions(self.replica_id, evictions - self._num_evictions)
        self._num_evictions = evictions

    def gauges(self) -> EngineGauges:
        """The engine's state now; the transient peaks are the largest since the previous call (the last
        known ones when no step ran in between)."""
        stats = self._engine.stats()
        with self._lock:
            window, self._window_memory = self._window_memory, None
            self._last_memory = window or self._last_memory
            predicted, measured = self._last_memory or (None, None)
        return EngineGauges(
            num_waiting=stats.num_waiting, num_running=stats.num_running,
            kv_reserved_bytes=stats.kv_reserved_bytes, kv_used_bytes=stats.kv_used_bytes,
            predicted_peak_bytes=predicted, measured_peak_bytes=measured,
            memory_limit_bytes=stats.memory_limit_bytes)

    # ------------------------------------------------------------------ requests

    def start(self, request: GenerateRequest) -> "RequestTrace":
        self._chunks[request.request_id] = []
        return RequestTrace(self, request)

    def chunks_of(self, request_id: str) -> list[ChunkEvent]:
        return list(self._chunks.get(request_id) or ())

    def forget(self, request_id: str) -> None:
        self._chunks.pop(request_id, None)

    def close(self) -> None:
        self._gauges.close()
        if self._engine.on_step == self.on_step:
            self._engine.on_step = None
        self.telemetry.shutdown()


class RequestTrace:
    """The spans of one request on the replica, and its queue time (sent back on the first output)."""

    def __init__(self, observer: ReplicaObserver, request: GenerateRequest) -> None:
        self._observer = observer
        self._request_id = request.request_id
        self._received_ns = time.time_ns()
        self._first_output_ns: Optional[int] = None
        self._last: Optional[GenerateOutput] = None
        self._error: Optional[str] = None
        self._failed = False
        tracer = observer.telemetry.tracer
        parent = observer.telemetry.extract(request.trace_context)
        self._span = tracer.start_span("mlx_serve.replica.generate", context=parent, kind=SpanKind.SERVER,
                                       start_time=self._received_ns,
                                       attributes={REPLICA: observer.replica_id,
                                                   "mlx_serve.request.id": request.request_id})
        self._context = trace.set_span_in_context(self._span)

    def on_output(self, out: GenerateOutput) -> GenerateOutput:
        """Pass-through of each GenerateOutput; the first gets `queue_s` and closes queue and prefill."""
        try:
            self._last = out
            if self._first_output_ns is None:
                self._first_output_ns = time.time_ns()
                if self._observer.prefix_cache:
                    self._observer.telemetry.record_prefix_cache_lookup(self._observer.replica_id,
                                                                        out.num_cached_tokens)
                queue_s = self._end_prefill()
                if queue_s is not None:
                    return dataclasses.replace(out, queue_s=queue_s)
        except Exception:  # noqa: BLE001 - telemetry must not break serving
            self._warn("on_output")
        return out

    def fail(self, exc: BaseException) -> None:
        self._error = type(exc).__name__

    def _child(self, name: str, start_ns: int, end_ns: int, **attributes: Any) -> trace.Span:
        span = self._observer.telemetry.tracer.start_span(name, context=self._context, start_time=start_ns,
                                                          attributes=attributes or None)
        span.end(end_time=max(end_ns, start_ns))
        return span

    def _end_prefill(self) -> Optional[float]:
        """Queue and prefill spans from the engine thread's chunk records; the queue time in seconds."""
        chunks = self._observer.chunks_of(self._request_id)
        end_ns = self._first_output_ns or time.time_ns()
        if not chunks and self._first_output_ns is None:  # ended before its first step: it only queued
            self._child("mlx_serve.engine.queue", self._received_ns, end_ns)
            return None
        first_step_ns = chunks[0].time_ns if chunks else self._received_ns
        if chunks:
            self._child("mlx_serve.engine.queue", self._received_ns, first_step_ns)
        tracer = self._observer.telemetry.tracer
        prefill = tracer.start_span("mlx_serve.engine.prefill", context=self._context, start_time=first_step_ns,
                                    attributes={"mlx_serve.prefill.num_chunks": len(chunks),
                                                "mlx_serve.prefill.num_tokens": sum(c.num_tokens for c in chunks)})
        for c in chunks:
            prefill.add_event("mlx_serve.prefill.chunk", {"start": c.start, "num_tokens": c.num_tokens},
                              timestamp=c.time_ns)
        prefill.end(end_time=max(end_ns, first_step_ns))
        return (first_step_ns - self._received_ns) / 1e9 if chunks else None

    def finish(self, finished: bool) -> None:
        """End the spans; `finished` is False when the caller went away before the last output."""
        try:
            end_ns = time.time_ns()
            if self._first_output_ns is None:  # ended before any output: whatever ran was queue/prefill
                self._end_prefill()
            else:
                self._child("mlx_serve.engine.decode", self._first_output_ns, end_ns)
            self._end_span(finished, end_ns)
        except Exception:  # noqa: BLE001
            self._warn("finish")
        finally:
            self._observer.forget(self._request_id)

    def _end_span(self, finished: bool, end_ns: int) -> None:
        last = self._last
        if last is not None:
            reasons = [last.finish_reason] if last.finish_reason else []
            self._span.set_attributes(usage_span_attributes(last.num_prompt_tokens, last.num_output_tokens,
                                                               reasons))
            self._span.set_attribute("mlx_serve.prefix_cache.hit_tokens", last.num_cached_tokens)
        error = self._error or (None if finished else "cancelled")
        if error is None and last is not None and last.finish_reason in ("error", "abort"):
            error = "EngineError" if last.finish_reason == "error" else "aborted"
        if error is not None:
            self._span.set_attribute(ERROR_TYPE, error)
            self._span.set_status(Status(StatusCode.ERROR, error))
        self._span.end(end_time=end_ns)

    def _warn(self, where: str) -> None:
        if not self._failed:
            self._failed = True
            logger.warning("replica request telemetry (%s) failed", where, exc_info=True)
