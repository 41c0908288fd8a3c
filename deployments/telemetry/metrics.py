"""OpenTelemetry metrics and traces of the engine, the replicas and the ingress.

Names follow the OpenTelemetry GenAI semantic conventions; project metrics use the `mlx_serve.` prefix.
Every `Telemetry` owns its MeterProvider and TracerProvider (the global ones are set only with
`set_global=True`), and no record method ever raises: telemetry must not break serving.

Prometheus names (OTel Prometheus exporter; tests/unit/test_telemetry.py scrapes them): dots become
underscores, unit "s" appends `_seconds` ("By" and `{token}`-style units append nothing), counters append
`_total`, histograms expose `_bucket`, `_sum` and `_count`:

  histograms  gen_ai_server_time_to_first_token_seconds, gen_ai_server_time_per_output_token_seconds,
              gen_ai_server_request_duration_seconds, gen_ai_client_token_usage, mlx_serve_queue_time_seconds,
              mlx_serve_step_prefill_tokens, mlx_serve_step_decode_tokens, mlx_serve_step_duration_seconds
  gauges      mlx_serve_requests_waiting, mlx_serve_requests_running, mlx_serve_kv_cache_reserved_bytes,
              mlx_serve_kv_cache_used_bytes, mlx_serve_prefill_predicted_peak_bytes,
              mlx_serve_prefill_measured_peak_bytes, mlx_serve_memory_limit_bytes,
              mlx_serve_prefix_cache_bytes, mlx_serve_step_budget_tokens, mlx_serve_step_free_transient_bytes
  counters    mlx_serve_admission_decisions_total, mlx_serve_prefix_cache_queries_total,
              mlx_serve_prefix_cache_hits_total, mlx_serve_prefix_cache_hit_tokens_total,
              mlx_serve_prefix_cache_evictions_total, mlx_serve_replica_peak_exceeded_total

Labels: dots become underscores too (`gen_ai_operation_name`, `gen_ai_request_model`, `gen_ai_provider_name`,
`gen_ai_token_type`, `error_type`, `replica`, `outcome`, `reason`), plus the exporter's `otel_scope_*` labels
and a `target_info` series.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, ContextManager, Mapping, Optional, Sequence

from opentelemetry import metrics, trace
from opentelemetry.context import Context
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader, MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Span, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from pydantic import BaseModel, ConfigDict, Field

from deployments.telemetry.exporters import EXPORT_LOGGERS, ExportFailureLog, PrometheusEndpoint, otlp_exporters
from deployments.telemetry.names import (
    ADMISSION_DECISIONS, AdmissionOutcome, ERROR_TYPE, ExporterKind,
    GEN_AI_OPERATION_NAME, GEN_AI_PROVIDER_NAME, GEN_AI_REQUEST_MAX_TOKENS, GEN_AI_REQUEST_MODEL,
    GEN_AI_REQUEST_TEMPERATURE, GEN_AI_RESPONSE_FINISH_REASONS, GEN_AI_TOKEN_TYPE,
    GEN_AI_USAGE_INPUT_TOKENS, GEN_AI_USAGE_OUTPUT_TOKENS, InstrumentSpec, KV_RESERVED_BYTES,
    KV_USED_BYTES, MEASURED_PEAK_BYTES, MEMORY_LIMIT_BYTES, Operation, PEAK_EXCEEDED,
    PREDICTED_PEAK_BYTES, PREFIX_CACHE_BYTES, STEP_BUDGET_TOKENS, STEP_FREE_BYTES, PREFIX_CACHE_EVICTIONS, PREFIX_CACHE_HITS,
    PREFIX_CACHE_HIT_TOKENS, PREFIX_CACHE_QUERIES, PROVIDER, QUEUE_TIME, REPLICA,
    REQUESTS_RUNNING, REQUESTS_WAITING, REQUEST_DURATION, STEP_DECODE_TOKENS,
    STEP_DURATION, STEP_PREFILL_TOKENS, TIME_PER_OUTPUT_TOKEN, TIME_TO_FIRST_TOKEN,
    TOKEN_USAGE, _SPECS,
)

_logger = logging.getLogger(__name__)



class TelemetryConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    exporter: ExporterKind = Field(
        "prometheus", description="'prometheus': an HTTP /metrics endpoint (metrics only); 'otlp_http' / "
        "'otlp_grpc': push metrics and spans to a collector; 'none': nothing leaves the process.",
    )
    prometheus_host: str = Field("127.0.0.1", min_length=1, description="Address /metrics binds; 0.0.0.0 "
                                 "when Prometheus scrapes from another host (URLs then name the node's IP).")
    prometheus_port: int = Field(
        9464, ge=0, le=65535, description="Port of /metrics; 0 picks a free one (see prometheus_url). A port "
        "already taken (several replicas on a host) costs a warning and no endpoint.",
    )
    otlp_endpoint: Optional[str] = Field(
        None, min_length=1, description="Collector base URL (http://host:4318 HTTP, http://host:4317 gRPC); "
        "/v1/metrics and /v1/traces are appended for HTTP. None: OTEL_EXPORTER_OTLP_* env or defaults.",
    )
    export_interval_s: float = Field(5.0, gt=0.0, le=3600.0, description="Period of OTLP exports.")
    export_timeout_s: float = Field(
        2.0, gt=0.0, le=60.0, description="Most time one OTLP export (retries included) takes, in the "
        "exporter's background thread; bounds shutdown too.",
    )
    service_name: str = Field("mlx-serve", min_length=1, description="The service.name resource attribute.")
    traces: bool = Field(True, description="Record spans (exported by the OTLP exporters only).")


@dataclasses.dataclass(frozen=True)
class RequestMetrics:
    """One finished request; times in seconds from its arrival at the server."""

    operation: Operation
    model: str
    replica: str
    num_input_tokens: int
    num_output_tokens: int
    ttft_s: Optional[float]
    duration_s: float
    queue_s: Optional[float] = None
    error_type: Optional[str] = None

    @property
    def time_per_output_token_s(self) -> Optional[float]:
        if self.ttft_s is None or self.num_output_tokens <= 1:
            return None
        return max(self.duration_s - self.ttft_s, 0.0) / (self.num_output_tokens - 1)


@dataclasses.dataclass(frozen=True)
class EngineGauges:
    """A replica's engine state at one moment; None: not known yet (not recorded)."""

    num_waiting: int
    num_running: int
    kv_reserved_bytes: int
    kv_used_bytes: int
    predicted_peak_bytes: Optional[int]
    measured_peak_bytes: Optional[int]
    memory_limit_bytes: int


def request_span_attributes(operation: str, model: str, max_tokens: Optional[int] = None,
                            temperature: Optional[float] = None) -> dict[str, Any]:
    """Span attributes of a request; the GenAI span name is f"{operation} {model}"."""
    attributes: dict[str, Any] = {GEN_AI_OPERATION_NAME: operation, GEN_AI_REQUEST_MODEL: model,
                                  GEN_AI_PROVIDER_NAME: PROVIDER}
    if max_tokens is not None:
        attributes[GEN_AI_REQUEST_MAX_TOKENS] = max_tokens
    if temperature is not None:
        attributes[GEN_AI_REQUEST_TEMPERATURE] = temperature
    return attributes


def usage_span_attributes(num_input_tokens: int, num_output_tokens: int,
                          finish_reasons: Sequence[str] = ()) -> dict[str, Any]:
    return {GEN_AI_USAGE_INPUT_TOKENS: num_input_tokens, GEN_AI_USAGE_OUTPUT_TOKENS: num_output_tokens,
            GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons)}


def _never_raises(method: Callable[..., None]) -> Callable[..., None]:
    """A failing record is logged once per method and instance, never raised into serving code."""

    @functools.wraps(method)
    def guarded(self: "Telemetry", *args: Any, **kwargs: Any) -> None:
        try:
            method(self, *args, **kwargs)
        except Exception:  # noqa: BLE001 - telemetry must not break serving
            if method.__name__ not in self._failed_methods:
                self._failed_methods.add(method.__name__)
                _logger.warning("telemetry %s failed; later failures are not logged", method.__name__,
                                exc_info=True)

    return guarded


def _create_instruments(meter: metrics.Meter) -> dict[InstrumentSpec, Any]:
    create = {"counter": lambda spec: meter.create_counter(spec.name, spec.unit, spec.description),
              "gauge": lambda spec: meter.create_gauge(spec.name, spec.unit, spec.description),
              "histogram": lambda spec: meter.create_histogram(
                  spec.name, spec.unit, spec.description, explicit_bucket_boundaries_advisory=spec.buckets)}
    return {spec: create[spec.kind](spec) for spec in _SPECS}


class Telemetry:
    """Meters and tracer of one process. Build with `from_config` (or `for_testing`), end with `shutdown`."""

    def __init__(self, config: TelemetryConfig, *, metric_readers: Sequence[MetricReader] = (),
                 span_exporters: Sequence[SpanExporter] = (), batch_spans: bool = True,
                 set_global: bool = False, prometheus: Optional[PrometheusEndpoint] = None) -> None:
        self.config = config
        self._failed_methods: set[str] = set()
        self._prometheus = prometheus
        self.metric_readers = tuple(metric_readers)
        self.span_exporters = tuple(span_exporters) if config.traces else ()
        resource = Resource.create({SERVICE_NAME: config.service_name})
        self._meter_provider = MeterProvider(metric_readers=self.metric_readers, resource=resource)
        self._tracer_provider = self._build_tracer_provider(resource, batch_spans)
        self._propagator = TraceContextTextMapPropagator()
        self._instruments = _create_instruments(self._meter_provider.get_meter("mlx_serve", "0.1.0"))
        self._tracer = self._tracer_provider.get_tracer("mlx_serve", "0.1.0")
        self._is_shut_down = False
        self._export_log: Optional[ExportFailureLog] = None
        if any(isinstance(r, PeriodicExportingMetricReader) for r in self.metric_readers) or self.span_exporters:
            self._export_log = ExportFailureLog()
            for name in EXPORT_LOGGERS:
                logging.getLogger(name).addFilter(self._export_log)
        if set_global:
            metrics.set_meter_provider(self._meter_provider)
            trace.set_tracer_provider(self._tracer_provider)

    def _build_tracer_provider(self, resource: Resource, batch_spans: bool) -> trace.TracerProvider:
        if not self.span_exporters:
            return trace.NoOpTracerProvider()  # nowhere to send spans: skip their cost
        provider = TracerProvider(resource=resource)
        for exporter in self.span_exporters:  # batching keeps exports off the caller's thread
            provider.add_span_processor(BatchSpanProcessor(
                exporter, schedule_delay_millis=self.config.export_interval_s * 1000,
                export_timeout_millis=self.config.export_timeout_s * 1000) if batch_spans
                else SimpleSpanProcessor(exporter))
        return provider

    @classmethod
    def from_config(cls, config: Optional[TelemetryConfig] = None, *,
                    set_global: bool = False) -> "Telemetry":
        config = config or TelemetryConfig()
        if config.exporter == "prometheus":
            endpoint = PrometheusEndpoint(config.prometheus_host, config.prometheus_port)
            return cls(config, metric_readers=[endpoint.reader], set_global=set_global, prometheus=endpoint)
        if config.exporter == "none":
            return cls(config, set_global=set_global)
        metric_exporter, span_exporter = otlp_exporters(config.exporter, config.otlp_endpoint,
                                                        config.export_timeout_s, config.traces)
        reader = PeriodicExportingMetricReader(
            metric_exporter, export_interval_millis=config.export_interval_s * 1000,
            export_timeout_millis=config.export_timeout_s * 1000)
        return cls(config, metric_readers=[reader], span_exporters=[span_exporter] if span_exporter else [],
                   set_global=set_global)

    @classmethod
    def for_testing(cls, config: Optional[TelemetryConfig] = None) -> "Telemetry":
        """In-memory reader and span exporter: `metric_readers[0]`, `span_exporters[0]` (spans sync)."""
        config = config or TelemetryConfig(exporter="none")
        return cls(config, metric_readers=[InMemoryMetricReader()], span_exporters=[InMemorySpanExporter()],
                   batch_spans=False)

    @property
    def prometheus_url(self) -> Optional[str]:
        """URL of this process's /metrics endpoint; None when it is not served."""
        return self._prometheus.url if self._prometheus else None

    @property
    def tracer(self) -> trace.Tracer:
        return self._tracer

    def shutdown(self) -> None:
        """Flush and stop exporters (bounded by export_timeout_s each); idempotent, never raises."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        timeout_ms = self.config.export_timeout_s * 1000
        for close in (lambda: self._meter_provider.shutdown(timeout_millis=timeout_ms),
                      getattr(self._tracer_provider, "shutdown", lambda: None),
                      self._prometheus.close if self._prometheus else (lambda: None), self._remove_export_log):
            try:
                close()
            except Exception:  # noqa: BLE001 - shutting down must not fail the caller
                _logger.warning("telemetry shutdown step failed", exc_info=True)

    def _remove_export_log(self) -> None:
        for name in EXPORT_LOGGERS if self._export_log else ():
            logging.getLogger(name).removeFilter(self._export_log)

    # ---- metrics ----

    def _genai_attributes(self, operation: str, model: str, replica: str) -> dict[str, str]:
        return {GEN_AI_OPERATION_NAME: operation, GEN_AI_REQUEST_MODEL: model, GEN_AI_PROVIDER_NAME: PROVIDER,
                REPLICA: replica}

    @_never_raises
    def record_request(self, request: RequestMetrics) -> None:
        attributes = self._genai_attributes(request.operation, request.model, request.replica)
        duration_attributes = dict(attributes)
        if request.error_type is not None:
            duration_attributes[ERROR_TYPE] = request.error_type
        self._instruments[REQUEST_DURATION].record(request.duration_s, duration_attributes)
        usage = self._instruments[TOKEN_USAGE]
        usage.record(request.num_input_tokens, {**attributes, GEN_AI_TOKEN_TYPE: "input"})
        usage.record(request.num_output_tokens, {**attributes, GEN_AI_TOKEN_TYPE: "output"})
        if request.queue_s is not None:
            self._instruments[QUEUE_TIME].record(request.queue_s, attributes)
        if request.error_type is not None:
            return  # the semconv latency metrics are for successful responses
        if request.ttft_s is not None:
            self._instruments[TIME_TO_FIRST_TOKEN].record(request.ttft_s, attributes)
        tpot_s = request.time_per_output_token_s
        if tpot_s is not None:
            self._instruments[TIME_PER_OUTPUT_TOKEN].record(tpot_s, attributes)

    @_never_raises
    def record_step(self, replica: str, num_prefill_tokens: int, num_decode_tokens: int,
                    duration_s: Optional[float] = None, budget_tokens: Optional[int] = None,
                    free_transient_bytes: Optional[int] = None) -> None:
        """One engine step; `budget_tokens` / `free_transient_bytes`: what the scheduler sized it to."""
        attributes = {REPLICA: replica}
        self._instruments[STEP_PREFILL_TOKENS].record(num_prefill_tokens, attributes)
        self._instruments[STEP_DECODE_TOKENS].record(num_decode_tokens, attributes)
        if duration_s is not None:
            self._instruments[STEP_DURATION].record(duration_s, attributes)
        if budget_tokens is not None:
            self._instruments[STEP_BUDGET_TOKENS].set(budget_tokens, attributes)
        if free_transient_bytes is not None:
            self._instruments[STEP_FREE_BYTES].set(free_transient_bytes, attributes)

    @_never_raises
    def set_engine_gauges(self, replica: str, gauges: EngineGauges) -> None:
        attributes = {REPLICA: replica}
        values = ((REQUESTS_WAITING, gauges.num_waiting), (REQUESTS_RUNNING, gauges.num_running),
                  (KV_RESERVED_BYTES, gauges.kv_reserved_bytes), (KV_USED_BYTES, gauges.kv_used_bytes),
                  (PREDICTED_PEAK_BYTES, gauges.predicted_peak_bytes),
                  (MEASURED_PEAK_BYTES, gauges.measured_peak_bytes),
                  (MEMORY_LIMIT_BYTES, gauges.memory_limit_bytes))
        for name, value in values:
            if value is not None:
                self._instruments[name].set(value, attributes)

    @_never_raises
    def record_admission(self, outcome: AdmissionOutcome, reason: str) -> None:
        self._instruments[ADMISSION_DECISIONS].add(1, {"outcome": outcome, "reason": reason})

    @_never_raises
    def record_prefix_cache_lookup(self, replica: str, num_hit_tokens: int) -> None:
        attributes = {REPLICA: replica}
        self._instruments[PREFIX_CACHE_QUERIES].add(1, attributes)
        if num_hit_tokens > 0:
            self._instruments[PREFIX_CACHE_HITS].add(1, attributes)
            self._instruments[PREFIX_CACHE_HIT_TOKENS].add(num_hit_tokens, attributes)

    @_never_raises
    def record_prefix_cache_evictions(self, replica: str, num_evictions: int = 1) -> None:
        self._instruments[PREFIX_CACHE_EVICTIONS].add(num_evictions, {REPLICA: replica})

    @_never_raises
    def set_prefix_cache_bytes(self, replica: str, num_bytes: int) -> None:
        self._instruments[PREFIX_CACHE_BYTES].set(num_bytes, {REPLICA: replica})

    @_never_raises
    def record_peak_exceeded(self, replica: str, count: int = 1) -> None:
        """count=0 at start exposes the series at 0, so increase() works before the first event."""
        self._instruments[PEAK_EXCEEDED].add(count, {REPLICA: replica})

    # ---- traces ----

    def start_span(self, name: str, attributes: Optional[Mapping[str, Any]] = None,
                   context: Optional[Context] = None,
                   kind: SpanKind = SpanKind.INTERNAL) -> ContextManager[Span]:
        """Context manager: a current span, child of `context` (from `extract`) or of the current span."""
        return self._tracer.start_as_current_span(name, context=context, kind=kind, attributes=attributes)

    def inject(self, context: Optional[Context] = None) -> dict[str, str]:
        """W3C trace-context carrier (a plain dict) of `context` or the current span, for another process."""
        carrier: dict[str, str] = {}
        try:
            self._propagator.inject(carrier, context=context)
        except Exception:  # noqa: BLE001 - a lost trace link must not fail the request
            _logger.warning("trace-context inject failed", exc_info=True)
        return carrier

    def extract(self, carrier: Optional[Mapping[str, str]]) -> Context:
        """Context whose parent span is the one `inject` wrote into `carrier` (an empty one if none)."""
        try:
            return self._propagator.extract(dict(carrier or {}))
        except Exception:  # noqa: BLE001 - a malformed carrier starts a new trace
            _logger.warning("trace-context extract failed", exc_info=True)
            return Context()
