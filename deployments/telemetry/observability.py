"""Telemetry of the Serve processes: one `Telemetry` per process, and what the ingress records per request.

Each process (the ingress, every engine replica) builds its own `deployments.telemetry.metrics.Telemetry` from
`AppArgs.telemetry` through a `TelemetryFactory(config, role)`; tests inject `Telemetry.for_testing()`.
With the Prometheus exporter, ports are per process so replicas on one host never collide:

    ingress              prometheus_port              (e.g. http://127.0.0.1:9464/metrics)
    admission controller prometheus_port + 1          (role "admission")
    replica of rank k    prometheus_port + 2 + k      (e.g. http://127.0.0.1:9466/metrics)

A port already taken falls back to a free one (port 0) with a warning; every process logs its URL on the
"ray.serve" logger ("<role>: Prometheus metrics at <url>") and reports it (`OpenAIIngress.metrics_url`,
`EngineReplica.stats()["prometheus_url"]`); `prometheus_urls()` collects them from a running app, and
scripts/serve prints the planned ones (`python -m deployments.telemetry.observability config/serve.yaml`).

One trace per request: the ingress's server span ("chat <model>" / "text_completion <model>") is the
parent of the replica's spans (see deployments/replica/telemetry.py); its context travels to the replica
as a W3C carrier dict in `GenerateRequest.trace_context`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from deployments.telemetry import metrics as tm
from deployments.telemetry.metrics import RequestMetrics, Telemetry, TelemetryConfig

logger = logging.getLogger(__name__)
serve_logger = logging.getLogger("ray.serve")  # Serve shows this logger's records in `serve run` and replica logs

TelemetryFactory = Callable[[TelemetryConfig, str], Telemetry]  # (config, role: "ingress" | "replica")
OPERATIONS = {"chat": "chat", "completion": "text_completion"}  # PreparedRequest.kind -> GenAI operation


def replica_rank() -> Optional[int]:
    """This Serve replica's rank in its deployment (0..n-1); None outside Serve."""
    try:
        from ray import serve

        rank = serve.get_replica_context().rank
        return int(getattr(rank, "rank", rank))
    except Exception:  # not inside a Serve replica, or a Serve without ranks
        return None


ROLE_PORT_OFFSETS = {"ingress": 0, "admission": 1}  # replicas: 2 + rank


def prometheus_port(config: TelemetryConfig, role: str, rank: Optional[int] = None) -> int:
    """The port a process of `role` asks for (see the module docstring); 0: any free port."""
    if config.prometheus_port == 0:
        return 0
    if role == "replica":
        offset: Optional[int] = 2 + ((replica_rank() if rank is None else rank) or 0)
    else:
        offset = ROLE_PORT_OFFSETS.get(role)  # another role: any free port
    port = 0 if offset is None else config.prometheus_port + offset
    return port if port <= 65535 else 0


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def process_telemetry(config: TelemetryConfig, role: str) -> Telemetry:
    """The Telemetry of this process (the default TelemetryFactory); never raises for a taken port."""
    if config.exporter != "prometheus":
        return Telemetry.from_config(config)
    port = prometheus_port(config, role)
    if port and not _port_free(config.prometheus_host, port):
        logger.warning("%s: Prometheus port %d is taken; using a free port", role, port)
        port = 0
    telemetry = Telemetry.from_config(config.model_copy(update={"prometheus_port": port}))
    if telemetry.prometheus_url is None and port:  # lost a race for the port: take any free one
        telemetry.shutdown()
        telemetry = Telemetry.from_config(config.model_copy(update={"prometheus_port": 0}))
    serve_logger.log(logging.INFO if port == prometheus_port(config, role) else logging.WARNING,
                     "%s: Prometheus metrics at %s", role, telemetry.prometheus_url)
    return telemetry


def planned_prometheus_urls(config: TelemetryConfig, num_replicas: int) -> list[str]:
    """The URLs a fresh app asks for (scripts/serve prints them; a taken port moves, see the logs)."""
    if config.exporter != "prometheus":
        return []
    host = f"[{config.prometheus_host}]" if ":" in config.prometheus_host else config.prometheus_host

    def url(role: str, rank: Optional[int] = None) -> str:
        port = prometheus_port(config, role, rank)
        return f"{role}{'' if rank is None else f' {rank}'}: " + \
            (f"http://{host}:{port}/metrics" if port else "a free port (logged)")

    return [url("ingress")] + [url("replica", k) for k in range(num_replicas)]


def admission_telemetry_factory(config: TelemetryConfig) -> Callable[[], Telemetry]:
    """For AdmissionController(telemetry_factory=...): the controller's own Telemetry (picklable)."""
    return functools.partial(process_telemetry, config, "admission")


@contextlib.contextmanager
def admission_span(telemetry: Optional[Telemetry], trace_context: Optional[dict[str, str]],
                   count: bool = False) -> Iterator[Callable[[str, str], None]]:
    """Hook for admission: a "mlx_serve.admission" span, child of the request's server span (from the
    GenerateRequest's carrier), around `reserve`; call the yielded `record(outcome, reason)` with the
    decision. count=True also counts it (mlx_serve.admission.decisions), for a caller whose Admitter has
    no telemetry of its own.

        with admission_span(telemetry, request.trace_context) as record:
            decision = await controller.reserve(...)
            record(decision.outcome, decision.reason)
    """
    if telemetry is None:
        yield lambda outcome, reason: None
        return
    span = telemetry.tracer.start_span("mlx_serve.admission", context=telemetry.extract(trace_context))

    def record(outcome: str, reason: str) -> None:
        span.set_attributes({"mlx_serve.admission.outcome": outcome, "mlx_serve.admission.reason": reason})
        if count:
            telemetry.record_admission(outcome, reason)  # type: ignore[arg-type]

    try:
        yield record
    except BaseException as e:
        span.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        span.end()


def prometheus_urls(app_name: str, replica_deployment: str, num_replicas: int,
                    max_calls: int = 64) -> dict[str, Optional[str]]:
    """{"ingress": url, "replica <id>": url, ...} of a running app, by sampling the handles (the router
    picks a replica per call). Synchronous: call it outside an event loop (scripts/serve, tests)."""
    from ray import serve

    urls: dict[str, Optional[str]] = {"ingress": serve.get_app_handle(app_name).metrics_url.remote().result()}
    replicas = serve.get_deployment_handle(replica_deployment, app_name=app_name)
    seen: dict[str, Optional[str]] = {}
    for _ in range(max_calls):
        stats = replicas.stats.remote().result()
        seen[f"replica {stats['replica_id']}"] = stats.get("prometheus_url")
        if len(seen) >= num_replicas:
            break
    return {**urls, **dict(sorted(seen.items()))}


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

    def __init__(self, telemetry: Telemetry, prepared: Any) -> None:
        self._telemetry = telemetry
        self._failed = False
        self._operation = OPERATIONS.get(prepared.kind, prepared.kind)
        self._model = prepared.model
        now = time.monotonic_ns()
        self._received_ns = getattr(prepared, "received_ns", 0) or now
        self._dispatched_ns = now
        self._first_token_ns: Optional[int] = None
        self._queue_s: Optional[float] = None
        self._choices: dict[int, Any] = {}  # index -> last GenerateOutput
        self._replica: Optional[str] = None
        self._output_error: Optional[str] = None
        self.span = self._start_span(prepared)

    def _start_span(self, prepared: Any) -> trace.Span:
        first = prepared.samplings[0]
        attributes = tm.request_span_attributes(self._operation, self._model, first.max_tokens,
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
    def on_output(self, index: int, out: Any) -> None:
        """Every GenerateOutput of every choice, in arrival order."""
        if self._first_token_ns is None and out.num_new_tokens > 0:
            self._first_token_ns = time.monotonic_ns()
            self.span.add_event("gen_ai.first_token")
        if self._queue_s is None and getattr(out, "queue_s", None) is not None:  # arrival -> first step
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
        self.span.set_attributes(tm.usage_span_attributes(num_input, num_output, reasons))
        if self._replica:
            self.span.set_attribute(tm.REPLICA, self._replica)
        if failure is not None:
            self.span.set_attribute(tm.ERROR_TYPE, failure)
            self.span.set_status(Status(StatusCode.ERROR, failure))
        self.span.end()


def main(argv: Optional[list[str]] = None) -> None:
    """`python -m deployments.telemetry.observability config/serve.yaml`: the Prometheus URLs the app will use."""
    import sys

    import yaml

    from deployments.app import parse_args

    path = (argv if argv is not None else sys.argv[1:] or ["config/serve.yaml"])[0]
    for app in yaml.safe_load(open(path)).get("applications", []):
        args = parse_args(app.get("args"))
        replicas = args.num_replicas or (args.autoscaling.max_replicas if args.autoscaling else 1)
        lines = planned_prometheus_urls(args.telemetry, replicas)
        print(f"[serve] {app.get('name')}: telemetry exporter {args.telemetry.exporter}" +
              "".join(f"\n[serve]   Prometheus {line}" for line in lines) +
              ("\n[serve]   (a taken port moves to a free one: see the log line '<role>: Prometheus metrics "
               "at <url>')" if lines else ""))


if __name__ == "__main__":
    main()
