"""deployments.telemetry.metrics against the real OpenTelemetry SDK: in-memory reader/exporter, a real Prometheus
endpoint scraped over HTTP, and a real OTLP/HTTP receiver decoding the protobuf bodies."""

from __future__ import annotations

import gzip
import json
import logging
import re
import socket
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from deployments.telemetry import metrics as tm
from deployments.telemetry import names
from deployments.telemetry.metrics import EngineGauges, RequestMetrics, Telemetry, TelemetryConfig

DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana-dashboard.json"


def _request(i: int = 0, **overrides) -> RequestMetrics:
    fields = dict(operation="chat", model="smollm2", replica="r0", num_input_tokens=100 + i,
                  num_output_tokens=11, ttft_s=0.1 + 0.01 * i, duration_s=1.1 + 0.01 * i, queue_s=0.02)
    fields.update(overrides)
    return RequestMetrics(**fields)


def _record_everything(telemetry: Telemetry) -> None:
    telemetry.record_request(_request())
    telemetry.record_request(_request(error_type="cancelled"))
    telemetry.record_step("r0", num_prefill_tokens=512, num_decode_tokens=3, duration_s=0.05,
                          budget_tokens=2048, free_transient_bytes=300 << 20)
    telemetry.set_engine_gauges("r0", EngineGauges(2, 3, 4 << 20, 1 << 20, 3 << 30, 2 << 30, 64 << 30))
    telemetry.record_admission("admitted", "fits")
    telemetry.record_admission("rejected", "kv_budget")
    telemetry.record_prefix_cache_lookup("r0", num_hit_tokens=64)
    telemetry.record_prefix_cache_evictions("r0", 2)
    telemetry.set_prefix_cache_bytes("r0", 1 << 20)
    telemetry.record_peak_exceeded("r0")


def _points(telemetry: Telemetry) -> dict[str, list]:
    """Metric name -> its data points, from the in-memory reader."""
    data = telemetry.metric_readers[0].get_metrics_data()
    return {metric.name: list(metric.data.data_points)
            for resource in data.resource_metrics for scope in resource.scope_metrics
            for metric in scope.metrics}


@pytest.fixture
def telemetry():
    instance = Telemetry.for_testing()
    yield instance
    instance.shutdown()


# ---- config ----

@pytest.mark.parametrize("field, value", [
    ("exporter", "statsd"), ("prometheus_port", 70000), ("prometheus_port", -1), ("export_interval_s", 0.0),
    ("export_timeout_s", -1.0), ("service_name", ""), ("otlp_endpoint", ""), ("bogus_field", 1),
])
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        TelemetryConfig(**{field: value})


def test_config_defaults_and_frozen():
    config = TelemetryConfig()
    assert (config.exporter, config.prometheus_port, config.otlp_endpoint) == ("prometheus", 9464, None)
    assert all(field.description for field in TelemetryConfig.model_fields.values())
    with pytest.raises(ValueError):
        config.prometheus_port = 1


# ---- metrics ----

def test_request_histograms_count_and_sum(telemetry):
    requests = [_request(i) for i in range(7)]
    for request in requests:
        telemetry.record_request(request)
    points = _points(telemetry)
    expected = {names.TIME_TO_FIRST_TOKEN.name: [r.ttft_s for r in requests],
                names.REQUEST_DURATION.name: [r.duration_s for r in requests],
                names.TIME_PER_OUTPUT_TOKEN.name: [(r.duration_s - r.ttft_s) / 10 for r in requests],
                names.QUEUE_TIME.name: [r.queue_s for r in requests]}
    for name, values in expected.items():
        (point,) = points[name]
        assert point.count == len(requests), name
        assert point.sum == pytest.approx(sum(values)), name
        assert point.attributes == {"gen_ai.operation.name": "chat", "gen_ai.request.model": "smollm2",
                                    "gen_ai.provider.name": "mlx", "replica": "r0"}
    assert points[names.TIME_TO_FIRST_TOKEN.name][0].explicit_bounds == names.TTFT_BUCKETS_S


def test_token_usage_by_type(telemetry):
    for i in range(5):
        telemetry.record_request(_request(i, num_output_tokens=20 + i))
    by_type = {p.attributes["gen_ai.token.type"]: p for p in _points(telemetry)[names.TOKEN_USAGE.name]}
    assert by_type["input"].count == by_type["output"].count == 5
    assert by_type["input"].sum == sum(100 + i for i in range(5))
    assert by_type["output"].sum == sum(20 + i for i in range(5))


def test_tpot_needs_two_tokens_and_errors_skip_latency_metrics(telemetry):
    assert _request(num_output_tokens=1).time_per_output_token_s is None
    assert _request(ttft_s=None).time_per_output_token_s is None
    assert _request(ttft_s=0.5, duration_s=2.5, num_output_tokens=5).time_per_output_token_s == 0.5
    telemetry.record_request(_request(num_output_tokens=1))
    telemetry.record_request(_request(error_type="timeout"))
    points = _points(telemetry)
    assert points[names.TIME_TO_FIRST_TOKEN.name][0].count == 1
    assert names.TIME_PER_OUTPUT_TOKEN.name not in points
    errors = [p for p in points[names.REQUEST_DURATION.name] if p.attributes.get("error.type") == "timeout"]
    assert len(errors) == 1 and errors[0].count == 1


def test_step_gauges_admission_prefix_cache(telemetry):
    _record_everything(telemetry)
    telemetry.set_engine_gauges("r0", EngineGauges(5, 1, 8 << 20, 2 << 20, None, None, 64 << 30))
    points = _points(telemetry)
    value = {name: pts[0].value for name, pts in points.items() if hasattr(pts[0], "value") and len(pts) == 1}
    assert value[names.REQUESTS_WAITING.name] == 5 and value[names.REQUESTS_RUNNING.name] == 1
    assert value[names.KV_RESERVED_BYTES.name] == 8 << 20 and value[names.MEMORY_LIMIT_BYTES.name] == 64 << 30
    assert value[names.PREDICTED_PEAK_BYTES.name] == 3 << 30  # None keeps the last known value
    assert value[names.PREFIX_CACHE_HIT_TOKENS.name] == 64 and value[names.PREFIX_CACHE_EVICTIONS.name] == 2
    assert value[names.PREFIX_CACHE_QUERIES.name] == value[names.PREFIX_CACHE_HITS.name] == 1
    assert value[names.PEAK_EXCEEDED.name] == 1 and value[names.PREFIX_CACHE_BYTES.name] == 1 << 20
    assert points[names.STEP_PREFILL_TOKENS.name][0].sum == 512
    assert points[names.STEP_DECODE_TOKENS.name][0].sum == 3
    decisions = {(p.attributes["outcome"], p.attributes["reason"]): p.value
                 for p in points[names.ADMISSION_DECISIONS.name]}
    assert decisions == {("admitted", "fits"): 1, ("rejected", "kv_budget"): 1}
    assert all(p.attributes == {"replica": "r0"} for p in points[names.REQUESTS_WAITING.name])


def test_record_methods_never_raise_and_warn_once(telemetry, caplog):
    with caplog.at_level(logging.WARNING, logger="deployments.telemetry.metrics"):
        for _ in range(3):
            telemetry.record_request(None)  # type: ignore[arg-type]
            telemetry.set_engine_gauges("r0", "not gauges")  # type: ignore[arg-type]
    warnings = [r for r in caplog.records if r.name == "deployments.telemetry.metrics"]
    assert len(warnings) == 2
    telemetry.record_request(_request())  # still records after a failure
    assert _points(telemetry)[names.REQUEST_DURATION.name][0].count == 1


# ---- traces ----

def test_spans_nest_across_an_inject_extract_hop():
    ingress, replica = Telemetry.for_testing(), Telemetry.for_testing()
    attributes = tm.request_span_attributes("chat", "smollm2", max_tokens=16, temperature=0.0)
    with ingress.start_span("chat smollm2", attributes) as root:
        carrier = json.loads(json.dumps(ingress.inject()))  # crosses a process as plain data
    assert set(carrier) == {"traceparent"}
    with replica.start_span("engine.generate", context=replica.extract(carrier)) as remote:
        with replica.start_span("engine.prefill"):
            pass
        remote.set_attributes(tm.usage_span_attributes(100, 11, ["stop"]))
    (root_span,) = ingress.span_exporters[0].get_finished_spans()
    prefill, generate = replica.span_exporters[0].get_finished_spans()
    assert root_span.parent is None and root_span.name == "chat smollm2"
    assert root_span.attributes["gen_ai.request.max_tokens"] == 16
    assert generate.context.trace_id == root.get_span_context().trace_id == prefill.context.trace_id
    assert generate.parent.span_id == root.get_span_context().span_id and generate.parent.is_remote
    assert prefill.parent.span_id == generate.context.span_id
    assert generate.attributes["gen_ai.usage.output_tokens"] == 11
    assert tuple(generate.attributes["gen_ai.response.finish_reasons"]) == ("stop",)
    for instance in (ingress, replica):
        instance.shutdown()


def test_extract_of_nothing_starts_a_new_trace(telemetry):
    with telemetry.start_span("orphan", context=telemetry.extract(None)):
        pass
    with telemetry.start_span("garbled", context=telemetry.extract({"traceparent": "zz"})):
        pass
    assert all(span.parent is None for span in telemetry.span_exporters[0].get_finished_spans())
    assert telemetry.inject() == {}  # no current span


def test_exporter_none_records_nothing_and_costs_nothing():
    telemetry = Telemetry.from_config(TelemetryConfig(exporter="none"))
    _record_everything(telemetry)
    with telemetry.start_span("noop") as span:
        assert not span.is_recording()
    assert telemetry.prometheus_url is None and telemetry.metric_readers == ()
    telemetry.shutdown()
    telemetry.shutdown()  # idempotent


# ---- Prometheus ----

def _scrape(url: str, accept: str = "text/plain") -> tuple[str, set[str]]:
    request = urllib.request.Request(url, headers={"Accept": accept})
    body = urllib.request.urlopen(request, timeout=5).read().decode()
    return body, set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)", body, re.M))


@pytest.fixture
def prometheus():
    instance = Telemetry.from_config(TelemetryConfig(prometheus_port=0))
    yield instance
    instance.shutdown()


def test_prometheus_endpoint_serves_the_documented_names(prometheus):
    _record_everything(prometheus)
    body, scraped = _scrape(prometheus.prometheus_url)
    documented = set(re.findall(r"\b(?:gen_ai|mlx_serve)_[a-z_]+", tm.__doc__.split("Labels:")[0]))
    assert len(documented) == len(names._SPECS)
    for name in documented:  # the module docstring lists the family names
        assert name in scraped or f"{name}_count" in scraped, name
    assert {"gen_ai_server_time_to_first_token_seconds_bucket", "gen_ai_client_token_usage_sum",
            "mlx_serve_admission_decisions_total", "mlx_serve_kv_cache_reserved_bytes"} <= scraped
    assert 'gen_ai_token_type="output"' in body and 'gen_ai_request_model="smollm2"' in body
    # a Prometheus server asks for OpenMetrics: the sample names are the same
    assert _scrape(prometheus.prometheus_url, "application/openmetrics-text; version=1.0.0")[1] == scraped


def test_prometheus_port_taken_warns_and_continues(caplog):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = TelemetryConfig(prometheus_port=taken.getsockname()[1])
        with caplog.at_level(logging.WARNING, logger="deployments.telemetry.metrics"):
            telemetry = Telemetry.from_config(config)
    assert telemetry.prometheus_url is None
    assert any("not started" in record.message for record in caplog.records)
    _record_everything(telemetry)
    telemetry.shutdown()


# ---- OTLP ----

class _Receiver(BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 - http.server's naming
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        self.server.bodies.append((self.path, body))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def collector():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Receiver)
    server.bodies = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("via_env", [False, True])
def test_otlp_http_delivers_metrics_and_spans(collector, monkeypatch, via_env):
    endpoint = f"http://127.0.0.1:{collector.server_address[1]}"
    if via_env:  # otlp_endpoint=None: the exporters read the standard variable
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    config = TelemetryConfig(exporter="otlp_http", otlp_endpoint=None if via_env else endpoint,
                             export_interval_s=60.0, service_name="otlp-test")
    telemetry = Telemetry.from_config(config)
    _record_everything(telemetry)
    with telemetry.start_span("chat smollm2"):
        with telemetry.start_span("engine.step"):
            pass
    telemetry.shutdown()  # flushes both signals
    metric_names, span_names = set(), set()
    for path, body in collector.bodies:
        if path == "/v1/metrics":
            request = ExportMetricsServiceRequest.FromString(body)
            metric_names |= {m.name for rm in request.resource_metrics for sm in rm.scope_metrics
                             for m in sm.metrics}
        elif path == "/v1/traces":
            request = ExportTraceServiceRequest.FromString(body)
            span_names |= {s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans}
            service = {a.key: a.value.string_value for a in request.resource_spans[0].resource.attributes}
            assert service["service.name"] == "otlp-test"
    assert {spec.name for spec in names._SPECS} <= metric_names
    assert span_names == {"chat smollm2", "engine.step"}


@pytest.mark.parametrize("exporter", ["otlp_http", "otlp_grpc"])
def test_unreachable_collector_costs_only_a_warning(exporter):
    config = TelemetryConfig(exporter=exporter, otlp_endpoint="http://127.0.0.1:1", export_interval_s=0.2,
                             export_timeout_s=0.5)
    telemetry = Telemetry.from_config(config)
    started = time.perf_counter()
    for i in range(500):
        telemetry.record_request(_request(i))
        with telemetry.start_span("request"):
            telemetry.record_step("r0", 1, 1)
    assert time.perf_counter() - started < 1.0
    time.sleep(0.3)  # let a periodic export fail in the background
    started = time.perf_counter()
    telemetry.shutdown()
    assert time.perf_counter() - started < 3.0


# ---- Grafana dashboard ----

_PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or",
                 "unless", "offset", "le", "inf", "nan"}


def _metric_identifiers(expr: str) -> set[str]:
    expr = re.sub(r'"[^"]*"', "", expr)                       # strings (label values)
    expr = re.sub(r"\$\{?\w+\}?", "", expr)                   # Grafana variables ($__rate_interval)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)          # label matchers, range selectors
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    words = re.findall(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(\()?", expr)
    return {word for word, call in words if not call and word.lower() not in _PROMQL_WORDS}


def _exprs(panels: list) -> list[str]:
    found = []
    for panel in panels:
        found += [target["expr"] for target in panel.get("targets", []) if "expr" in target]
        found += _exprs(panel.get("panels", []))
    return found


def test_dashboard_uses_only_exported_metric_names(prometheus):
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["__inputs"][0]["name"] == "DS_PROMETHEUS"
    assert any(v["type"] == "datasource" for v in dashboard["templating"]["list"])
    _record_everything(prometheus)
    _, exposed = _scrape(prometheus.prometheus_url)
    exprs = _exprs(dashboard["panels"])
    assert len(exprs) >= 15
    for variable in dashboard["templating"]["list"]:  # label_values(metric, label) -> metric
        exprs += re.findall(r"label_values\((\w+)", variable.get("definition", ""))
    used = set()
    for expr in exprs:
        identifiers = _metric_identifiers(expr)
        assert identifiers, expr
        assert identifiers <= exposed, (expr, identifiers - exposed)
        used |= identifiers
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in used
    assert "mlx_serve_admission_decisions_total" in used
