"""Telemetry of the running app: metrics and traces recorded by the ingress and the replicas.

(a) In memory, no Ray: the plain OpenAIIngress and EngineReplica on the real engine (tiny model), one
    injected `Telemetry.for_testing()` for both; requests over HTTP (FastAPI TestClient) and the handle
    methods, streaming or not. Histogram counts, token sums and the span tree of each request are checked
    against the responses. An unreachable OTLP collector costs one warning and no request.
(b) Real Ray Serve (the session's cluster, conftest): the Prometheus endpoints of the ingress, the
    replica and the admission controller, found through the app as scripts/serve finds them, scraped
    over HTTP.
(c) Every metric the Grafana dashboard queries is in that scrape.
"""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import re
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from deployments.app import build_app, parse_args
from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.telemetry.discovery import collect_endpoints
from deployments.replica.replica import EngineReplica
from engine.config import EngineConfig
from deployments.telemetry.metrics import Telemetry, TelemetryConfig
from serve_fakes import FakeEngine, LocalReplicaClient

from conftest import free_port

MODEL = "tiny"
ENGINE = {"model": MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 64, "prefill_chunk_size": 32,
          "max_model_len": 512, "memory_limit_bytes": 2 << 30}
MESSAGES = [{"role": "user", "content": "Say hello."}]
LONG_PROMPT = " ".join(f"word{i}" for i in range(40))  # > prefill_chunk_size tokens: several chunks
DASHBOARD = Path(__file__).resolve().parents[2] / "config" / "grafana-dashboard.json"


class PicklingReplicaClient(LocalReplicaClient):
    """Sends each GenerateRequest through pickle, as Ray does: the trace carrier must be plain data."""

    async def generate(self, request):
        async for out in super().generate(pickle.loads(pickle.dumps(request))):
            yield out


# ------------------------------------------------------------------ (a) in memory


def sse_chunks(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


async def handle_calls(ingress: OpenAIIngress) -> list[tuple[str, dict, int]]:
    """Handle-style calls (what a DeploymentHandle runs): (id, usage, n) per request."""
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    chat = await ingress.chat({**base, "messages": [{"role": "user", "content": LONG_PROMPT}], "max_tokens": 6})
    one = await ingress.completions({**base, "prompt": "The capital of France is", "max_tokens": 1})
    chunks = [c async for c in ingress.completions_stream(
        {**base, "prompt": LONG_PROMPT, "max_tokens": 3, "n": 2, "seed": 1, "stream": True,
         "stream_options": {"include_usage": True}})]
    return [(chat.id, chat.usage.model_dump(), 1), (one.id, one.usage.model_dump(), 1),
            (chunks[-1].id, chunks[-1].usage.model_dump(), 2)]


def http_calls(ingress: OpenAIIngress) -> list[tuple[str, dict, int]]:
    base = {"model": MODEL, "temperature": 0, "ignore_eos": True}
    with TestClient(ingress.build_asgi_app()) as client:
        r = client.post("/v1/chat/completions", json={**base, "messages": MESSAGES, "max_tokens": 5})
        assert r.status_code == 200, r.text
        s = client.post("/v1/completions", json={**base, "prompt": "Once upon a time", "max_tokens": 4,
                                                 "stream": True, "stream_options": {"include_usage": True}})
        assert s.status_code == 200, s.text
    last = sse_chunks(s.text)[-1]
    return [(r.json()["id"], r.json()["usage"], 1), (last["id"], last["usage"], 1)]


@pytest.fixture(scope="module")
def recorded():
    """Run the requests once; keep the metrics data and the spans (read before the replica closes)."""
    import mlx.core as mx

    # Start like a fresh replica process: buffers that earlier tests left in MLX's buffer cache are
    # reused for smaller requests and counted at their full size, inflating measured peaks
    # (docs/memory.md, "Measured peaks in a long-running process").
    mx.clear_cache()
    telemetry = Telemetry.for_testing()
    replica = EngineReplica(ENGINE, replica_id="r0", telemetry_factory=lambda config, role: telemetry)
    ingress = OpenAIIngress(replica, IngressSettings(engine=EngineConfig(**ENGINE)),
                            client_factory=PicklingReplicaClient,
                            telemetry_factory=lambda config, role: telemetry)
    try:
        requests = http_calls(ingress) + asyncio.run(handle_calls(ingress))
        time.sleep(1.2)  # one more gauge report, after the last step
        data = telemetry.metric_readers[0].get_metrics_data()
        spans = telemetry.span_exporters[0].get_finished_spans()
    finally:
        replica.shutdown()
    points = {m.name: list(m.data.data_points) for rm in data.resource_metrics for sm in rm.scope_metrics
              for m in sm.metrics}
    return requests, points, spans


def total(points: list, field: str = "count", **attributes) -> float:
    return sum(getattr(p, field) for p in points
               if all(p.attributes.get(k.replace("__", ".")) == v for k, v in attributes.items()))


def test_request_histograms_count_every_request(recorded):
    requests, points, _ = recorded
    n = len(requests)
    assert total(points["gen_ai.server.request.duration"]) == n
    assert total(points["gen_ai.server.time_to_first_token"]) == n
    assert total(points["mlx_serve.queue.time"]) == n
    assert total(points["gen_ai.server.time_per_output_token"]) == n - 1  # not the max_tokens=1 request
    assert total(points["gen_ai.server.request.duration"], gen_ai__operation__name="chat") == 2
    assert total(points["gen_ai.server.request.duration"], gen_ai__operation__name="text_completion") == 3
    assert {p.attributes["replica"] for p in points["gen_ai.server.request.duration"]} == {"r0"}
    assert not any("error.type" in p.attributes for p in points["gen_ai.server.request.duration"])


def test_token_usage_matches_the_responses(recorded):
    requests, points, _ = recorded
    usage = points["gen_ai.client.token.usage"]
    prompt = sum(u["prompt_tokens"] for _, u, _ in requests)
    completion = sum(u["completion_tokens"] for _, u, _ in requests)
    assert total(usage, "sum", gen_ai__token__type="input") == prompt
    assert total(usage, "sum", gen_ai__token__type="output") == completion
    assert total(usage, gen_ai__token__type="input") == len(requests)
    # Engine steps: each of the n choices prefills what the prefix cache did not hold; all but its first
    # token are decodes. (Only the chats share a prefix, the template's; the n=2 choices run together.)
    num_engine_requests = sum(n for _, _, n in requests)
    cached = [u["prompt_tokens_details"]["cached_tokens"] for _, u, _ in requests]
    assert sum(cached) > 0
    assert total(points["mlx_serve.step.prefill_tokens"], "sum") == sum(
        (u["prompt_tokens"] - c) * n for (_, u, n), c in zip(requests, cached))
    assert total(points["mlx_serve.prefix_cache.queries"], "value") == num_engine_requests
    assert total(points["mlx_serve.prefix_cache.hit_tokens"], "value") == sum(cached)
    assert total(points["mlx_serve.step.decode_tokens"], "sum") == completion - num_engine_requests
    assert total(points["mlx_serve.step.duration"]) == total(points["mlx_serve.step.prefill_tokens"])


def test_engine_gauges_are_reported(recorded):
    _, points, _ = recorded
    value = {name: [p.value for p in points[name] if p.attributes["replica"] == "r0"]
             for name in ("mlx_serve.requests.running", "mlx_serve.requests.waiting",
                          "mlx_serve.kv_cache.reserved_bytes", "mlx_serve.memory.limit_bytes",
                          "mlx_serve.prefill.predicted_peak_bytes", "mlx_serve.prefill.measured_peak_bytes")}
    assert value["mlx_serve.requests.running"] == [0] and value["mlx_serve.requests.waiting"] == [0]
    assert value["mlx_serve.kv_cache.reserved_bytes"] == [0]
    assert value["mlx_serve.memory.limit_bytes"] == [2 << 30]
    [predicted], [measured] = (value["mlx_serve.prefill.predicted_peak_bytes"],
                               value["mlx_serve.prefill.measured_peak_bytes"])
    assert 0 < measured <= predicted
    assert total(points["mlx_serve.replica.peak_exceeded"], "value") == 0


def test_one_trace_per_request_with_every_stage(recorded):
    requests, _, spans = recorded
    servers = {s.attributes.get("gen_ai.response.id"): s for s in spans if s.parent is None}
    assert len(servers) == len(requests) == len({s.context.trace_id for s in spans})
    for request_id, usage, n in requests:
        server = servers[request_id]
        trace = [s for s in spans if s.context.trace_id == server.context.trace_id]
        assert server.name in (f"chat {MODEL}", f"text_completion {MODEL}")
        assert server.kind.name == "SERVER" and server.attributes["gen_ai.provider.name"] == "mlx"
        assert server.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert server.attributes["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
        assert list(server.attributes["gen_ai.response.finish_reasons"]) == ["length"] * n
        replicas = [s for s in trace if s.name == "mlx_serve.replica.generate"]
        assert len(replicas) == n and all(s.parent.span_id == server.context.span_id for s in replicas)
        for replica in replicas:
            children = {s.name: s for s in trace if s.parent and s.parent.span_id == replica.context.span_id}
            assert set(children) == {"mlx_serve.engine.queue", "mlx_serve.engine.prefill",
                                     "mlx_serve.engine.decode"}
            queue, prefill, decode = (children[f"mlx_serve.engine.{k}"] for k in ("queue", "prefill", "decode"))
            assert queue.end_time <= prefill.end_time <= decode.end_time <= replica.end_time
            assert server.start_time <= replica.start_time and replica.end_time <= server.end_time
            chunks = [e.attributes for e in prefill.events if e.name == "mlx_serve.prefill.chunk"]
            hit = replica.attributes["mlx_serve.prefix_cache.hit_tokens"]
            assert chunks[0]["start"] == hit  # the prefix cache held the first `hit` tokens
            assert sum(c["num_tokens"] for c in chunks) == usage["prompt_tokens"] - hit
            assert max(c["num_tokens"] for c in chunks) <= ENGINE["prefill_chunk_size"]
            assert replica.attributes["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
        assert len(trace) == 1 + 4 * n


def test_long_prompt_prefills_in_several_chunks(recorded):
    _, _, spans = recorded
    prefills = [s for s in spans if s.name == "mlx_serve.engine.prefill"]
    for span in prefills:
        num_tokens, num_chunks = (span.attributes[f"mlx_serve.prefill.num_{k}"] for k in ("tokens", "chunks"))
        assert num_chunks == len(span.events) >= -(-num_tokens // ENGINE["prefill_chunk_size"])
    # at least the long chat, and both choices of the long n=2 completion
    assert sum(len(s.events) > 1 for s in prefills) >= 3


@pytest.mark.parametrize("exporter", ["otlp_http", "otlp_grpc"])
def test_unreachable_collector_costs_a_warning_only(exporter, caplog):
    config = TelemetryConfig(exporter=exporter, otlp_endpoint="http://127.0.0.1:1", export_interval_s=0.1,
                             export_timeout_s=0.3)
    engine = FakeEngine(EngineConfig(model=MODEL, max_model_len=128))
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0", telemetry=config)
    ingress = OpenAIIngress(replica, IngressSettings(engine=engine.config, telemetry=config),
                            client_factory=LocalReplicaClient)

    async def calls() -> list:
        return [await ingress.chat({"model": MODEL, "messages": MESSAGES, "max_tokens": 3}) for _ in range(20)]

    with caplog.at_level(logging.WARNING):
        started = time.perf_counter()
        responses = asyncio.run(calls())
        time.sleep(0.5)  # several export intervals fail in the background
        replica.shutdown()
        ingress.__del__()
    assert time.perf_counter() - started < 5.0
    assert all(r.usage.completion_tokens == 3 for r in responses)
    otel = [r for r in caplog.records if r.name.startswith("opentelemetry")]
    assert otel and all(r.levelno == logging.WARNING for r in otel)
    assert len(otel) <= 2  # one per Telemetry (ingress, replica), not one per export


# ------------------------------------------------------------------ (b), (c) real Serve, real scrape


@pytest.fixture(scope="module")
def served(ray_cluster):
    """One app (one replica) exporting to Prometheus; its endpoints by role, as scripts/serve finds them
    (deployments/telemetry/discovery.py); the request count it served."""
    from ray import serve

    app_name = "mlx-llm-telemetry"
    args = {"engine": ENGINE, "num_replicas": 1, "replica": {"num_cpus": 0.5, "health_check_period_s": 2.0},
            "ingress": {"num_cpus": 0.1}, "telemetry": {"exporter": "prometheus", "prometheus_port": free_port()}}
    serve.run(build_app(args), name=app_name, route_prefix="/telemetry")
    base = f"{ray_cluster}/telemetry/v1"
    body = {"model": MODEL, "temperature": 0, "ignore_eos": True, "max_tokens": 4}
    with httpx.Client(timeout=60) as http:
        for stream in (False, True):
            r = http.post(f"{base}/chat/completions", json={**body, "messages": MESSAGES, "stream": stream})
            assert r.status_code == 200, r.text
            r = http.post(f"{base}/completions", json={**body, "prompt": LONG_PROMPT, "stream": stream})
            assert r.status_code == 200, r.text
    yield {e.role: e.url for e in collect_endpoints(app_name, parse_args(args))}, 4
    serve.delete(app_name)


def scrape(url: str) -> dict[str, float]:
    """Prometheus text -> {series (name + labels): value}."""
    text = httpx.get(url, timeout=10).text
    series = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            series[key] = float(value)
    return series


def names(series: dict[str, float]) -> set[str]:
    return {key.split("{", 1)[0] for key in series}


def test_each_process_serves_prometheus(served):
    urls, _ = served
    assert set(urls) == {"ingress", "replica", "admission"}
    assert all(re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", u) for u in urls.values()), urls
    assert len(set(urls.values())) == 3  # three processes on one host: three ports


def test_scrape_shows_request_and_engine_metrics(served):
    urls, num_requests = served
    ingress = scrape(urls["ingress"])
    assert "gen_ai_server_time_to_first_token_seconds_bucket" in names(ingress)
    counts = [v for k, v in ingress.items() if k.startswith("gen_ai_server_request_duration_seconds_count")]
    assert sum(counts) == num_requests
    ttft = [v for k, v in ingress.items() if k.startswith("gen_ai_server_time_to_first_token_seconds_count")]
    assert sum(ttft) == num_requests
    replica_url = urls["replica"]
    replica = scrape(replica_url)
    assert {"mlx_serve_requests_running", "mlx_serve_requests_waiting", "mlx_serve_kv_cache_used_bytes",
            "mlx_serve_step_prefill_tokens_bucket", "mlx_serve_step_decode_tokens_sum",
            "mlx_serve_prefix_cache_hits_total"} <= names(replica)  # the second identical chat hit
    # The gauges are set every gauge_interval_s (1 s): once the requests are done they read 0 within it.
    deadline = time.monotonic() + 5.0
    while sum(v for k, v in replica.items() if k.startswith("mlx_serve_requests_running{")) != 0:
        assert time.monotonic() < deadline, "mlx_serve_requests_running stayed above 0"
        time.sleep(0.2)
        replica = scrape(replica_url)


def dashboard_metrics() -> set[str]:
    """Metric names in the dashboard's queries: gen_ai_* / mlx_serve_* words that are not label names."""
    text = json.dumps(json.loads(DASHBOARD.read_text()))
    labels = set(re.findall(r"(\w+)\s*(?:=~|!=|=)", text))
    labels |= {w for group in re.findall(r"\bby \(([^)]*)\)", text) for w in re.findall(r"\w+", group)}
    labels |= set(re.findall(r"label_values\([^,]+,\s*(\w+)\)", text))
    return set(re.findall(r"\b(?:gen_ai|mlx_serve)_[a-z0-9_]+", text)) - labels


def test_dashboard_metrics_are_all_in_the_scrape(served):
    urls, _ = served
    wanted = dashboard_metrics()
    assert len(wanted) > 20
    deadline = time.monotonic() + 5  # the transient-peak gauges come with the next report (1 s)
    while True:
        scraped = set().union(*(names(scrape(u)) for u in urls.values()))
        missing = wanted - scraped
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert not missing, sorted(missing)
