"""Telemetry of the Serve processes: one `Telemetry` per process, its Prometheus port and URL.

Each process (the ingress, every engine replica) builds its own `deployments.telemetry.metrics.Telemetry` from
`AppArgs.telemetry` through a `TelemetryFactory(config, role)`; tests inject `Telemetry.for_testing()`.
With the Prometheus exporter, ports are per process so replicas on one host never collide:

    ingress              prometheus_port              (e.g. http://127.0.0.1:9464/metrics)
    admission controller prometheus_port + 1          (role "admission")
    replica of rank k    prometheus_port + 2 + k      (e.g. http://127.0.0.1:9466/metrics)

A port already taken falls back to a free one (port 0) with a warning; every process logs its URL on the
"ray.serve" logger ("<role>: Prometheus metrics at <url>") and reports it (`OpenAIIngress.metrics_url`,
`EngineReplica.stats().prometheus_url`); deployments/telemetry/discovery.py collects them from a running
app, and scripts/serve prints the planned ones (`python -m deployments.app metrics config/serve.yaml`).

What each request records: deployments/ingress/observation.py (the ingress's server span and metrics) and
deployments/replica/telemetry.py (the replica's spans, children of it).
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Callable, Iterator
from typing import Optional

from opentelemetry.trace import Status, StatusCode

from deployments.telemetry.metrics import Telemetry, TelemetryConfig
from deployments.serve_context import replica_rank
from deployments.telemetry.names import REPLICA

logger = logging.getLogger(__name__)
serve_logger = logging.getLogger("ray.serve")  # Serve shows this logger's records in `serve run` and replica logs

TelemetryFactory = Callable[[TelemetryConfig, str], Telemetry]  # (config, role: "ingress" | "replica")


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


def planned_prometheus_urls(config: TelemetryConfig, num_replicas: int, admission: bool = False) -> list[str]:
    """The URLs a fresh app asks for (scripts/serve prints them; a taken port moves, see the logs), the
    admission controller's among them when `admission`."""
    if config.exporter != "prometheus":
        return []
    host = f"[{config.prometheus_host}]" if ":" in config.prometheus_host else config.prometheus_host

    def url(role: str, rank: Optional[int] = None) -> str:
        port = prometheus_port(config, role, rank)
        return f"{role}{'' if rank is None else f' {rank}'}: " + \
            (f"http://{host}:{port}/metrics" if port else "a free port (logged)")

    return [url("ingress")] + ([url("admission")] if admission else []) + \
        [url("replica", k) for k in range(num_replicas)]


@contextlib.contextmanager
def admission_span(telemetry: Optional[Telemetry], trace_context: Optional[dict[str, str]],
                   count: bool = False) -> Iterator[Callable[..., None]]:
    """A "mlx_serve.admission" span, child of the request's server span (from the GenerateRequest's
    carrier), around a reserve (reserve, wait in the queue, admit or refuse); call the yielded
    `record(outcome, reason, replica_id=None, waited_s=None, message=None)` with the decision. The
    admission controller does (deployments/admission/actor.py). count=True also counts it
    (mlx_serve.admission.decisions), for a caller whose Admitter has no telemetry of its own.

        with admission_span(telemetry, trace_context) as record:
            decision = await admitter.reserve(...)
            record(decision.outcome, decision.reason, replica_id, decision.waited_s, decision.message)
    """
    if telemetry is None:
        yield lambda *args, **kwargs: None
        return
    span = telemetry.tracer.start_span("mlx_serve.admission", context=telemetry.extract(trace_context))

    def record(outcome: str, reason: str, replica_id: Optional[str] = None, waited_s: Optional[float] = None,
               message: Optional[str] = None) -> None:
        span.set_attributes({"mlx_serve.admission.outcome": outcome, "mlx_serve.admission.reason": reason})
        if replica_id is not None:
            span.set_attribute(REPLICA, replica_id)
        if waited_s is not None:
            span.set_attribute("mlx_serve.admission.wait_s", waited_s)
        if outcome != "admitted":
            span.set_status(Status(StatusCode.ERROR, f"{reason}: {message}" if message else reason))
        if count:
            telemetry.record_admission(outcome, reason)  # type: ignore[arg-type]

    try:
        yield record
    except BaseException as e:
        span.set_status(Status(StatusCode.ERROR, type(e).__name__))
        raise
    finally:
        span.end()
