"""Where the telemetry of a process goes: OTLP exporters, a Prometheus /metrics endpoint, and the log
filter that keeps an unreachable collector from flooding the logs."""

from __future__ import annotations

import logging
import socket
from typing import Any, Optional

from opentelemetry.sdk.trace.export import SpanExporter

_logger = logging.getLogger(__name__)


def otlp_exporters(exporter: str, base: Optional[str], timeout_s: float,
                   traces: bool) -> tuple[Any, Optional[SpanExporter]]:
    """The OTLP metric and span exporters of `exporter` ("otlp_http" or "otlp_grpc"); imported here so
    grpc loads only when asked for."""
    if exporter == "otlp_http":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        root = base.rstrip("/") if base else None  # None: the exporters resolve the OTEL_* env themselves
        return (OTLPMetricExporter(endpoint=root and f"{root}/v1/metrics", timeout=timeout_s),
                OTLPSpanExporter(endpoint=root and f"{root}/v1/traces", timeout=timeout_s) if traces else None)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return (OTLPMetricExporter(endpoint=base, timeout=timeout_s),
            OTLPSpanExporter(endpoint=base, timeout=timeout_s) if traces else None)


# Loggers of the OTLP exporters and of the SDK's export loops: they log an ERROR per failed export.
EXPORT_LOGGERS = ("opentelemetry.exporter.otlp.common.http",
                   "opentelemetry.exporter.otlp.proto.http.metric_exporter",
                   "opentelemetry.exporter.otlp.proto.http.trace_exporter",
                   "opentelemetry.exporter.otlp.proto.grpc.exporter",
                   "opentelemetry.sdk.metrics._internal.export", "opentelemetry.sdk._shared_internal")


class ExportFailureLog(logging.Filter):
    """An unreachable collector costs one warning per process, not an ERROR every export interval."""

    def __init__(self) -> None:
        super().__init__()
        self.warned = False
        self.num_dropped = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "mlx_serve_export_warning", False):
            return True  # debug noise, or the one warning another Telemetry of this process let through
        if self.warned:
            self.num_dropped += 1
            return False
        self.warned = record.mlx_serve_export_warning = True
        message = record.getMessage()
        record.levelno, record.levelname, record.args = logging.WARNING, "WARNING", None
        record.msg = f"OTLP export failed ({message}); serving goes on, later failures are not logged"
        record.exc_info = record.exc_text = None
        return True


def advertised_host(host: str) -> str:
    """The host of a /metrics URL bound to `host`: a wildcard bind (0.0.0.0, ::) names this node's IP (Ray's
    node address when Ray runs here), so the URL works from the other hosts that scrape it."""
    if host in ("0.0.0.0", "::", ""):
        try:
            import ray

            host = ray.util.get_node_ip_address() if ray.is_initialized() else socket.gethostname()
        except Exception:  # noqa: BLE001 - a name is better than a wildcard
            host = socket.gethostname()
    return f"[{host}]" if ":" in host else host


class PrometheusEndpoint:
    """A /metrics HTTP server over this instance's own registry (never prometheus_client's global one)."""

    def __init__(self, host: str, port: int) -> None:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        registry = CollectorRegistry(auto_describe=True)
        self.reader = PrometheusMetricReader(registry=registry)
        self.url: Optional[str] = None
        self._server = None
        try:
            self._server, _thread = start_http_server(port, addr=host, registry=registry)
        except OSError as error:  # several replicas on one host: the port is taken
            _logger.warning("Prometheus endpoint %s:%d not started (%s); this process serves no /metrics",
                            host, port, error)
            return
        self.url = f"http://{advertised_host(host)}:{self._server.server_port}/metrics"

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
