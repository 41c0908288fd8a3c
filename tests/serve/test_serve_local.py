"""The Serve layer without Ray: OpenAIIngress's FastAPI app and handle methods over a fake engine.

The classes are plain (house rule 6), so they are built directly: EngineReplica with a fake engine
factory, OpenAIIngress with an in-process replica client and the tiny model's real tokenizer.
"""

from __future__ import annotations

import asyncio
import json
import os
from contextlib import aclosing
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from deployments.app import AppArgs, build_app_with, parse_args, read_configured_apps, serve_ingress_class
from deployments.errors import BadRequestError, EngineError, ModelNotFoundError, ServiceUnavailableError
from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.messages import AbortRequest, GenerateRequest
from deployments.replica.replica import EngineReplica
from deployments.ingress.schemas import ChatCompletionRequest, ChatCompletionResponse, CompletionRequest
from engine.config import EngineConfig
from engine.core.types import SamplingParams
from serve_fakes import FakeEngine, LocalReplicaClient

MODEL = "tiny"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    from engine.model.loader import resolve_model_path

    return load_tokenizer(resolve_model_path("tiny"))


def make_ingress(tokenizer, engine=None, **settings):
    engine = engine or FakeEngine(EngineConfig(model=MODEL, max_model_len=128))
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    args = IngressSettings(engine=engine.config, **settings)
    ingress = OpenAIIngress(replica, args, tokenizer_factory=lambda cfg: tokenizer,
                            client_factory=LocalReplicaClient)
    return ingress, engine


@pytest.fixture()
def setup(tokenizer):
    ingress, engine = make_ingress(tokenizer, max_n=2, max_request_body_bytes=4096)
    with TestClient(ingress.build_asgi_app()) as client:
        yield client, engine, ingress


def sse(text: str) -> list:
    events = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    return [e if e == "[DONE]" else json.loads(e) for e in events]


def test_models(setup):
    client, _, _ = setup
    r = client.get("/v1/models")
    assert r.status_code == 200
    assert r.json()["data"][0]["id"] == "tiny" and r.json()["object"] == "list"
    assert r.json()["data"][0]["max_model_len"] > 0  # asked of a replica, before any request
    assert client.get("/v1/models/tiny").json()["id"] == "tiny"
    assert client.get("/v1/models/nope").status_code == 404


def test_chat_and_usage(setup, tokenizer):
    client, _, _ = setup
    r = client.post("/v1/chat/completions", json=CHAT)
    assert r.status_code == 200, r.text
    body = r.json()
    n_prompt = len(tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True))
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "w0 w1 w2 w3 "}
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] == n_prompt and body["usage"]["completion_tokens"] == 4
    assert body["usage"]["total_tokens"] == n_prompt + 4
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert body["system_fingerprint"] == "r0" and r.headers["x-replica-id"] == "r0"


def test_completion_token_ids_and_stop(setup):
    client, _, _ = setup
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8,
                                             "stop_token_ids": [5], "temperature": 0})
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0] == {"index": 0, "text": "w0 w1 ", "finish_reason": "stop", "logprobs": None}
    assert body["usage"]["completion_tokens"] == 3


def test_stream_chat_with_usage(setup):
    client, _, _ = setup
    r = client.post("/v1/chat/completions",
                    json={**CHAT, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"]["content"] for c in chunks[:-1]) == "w0 w1 w2 w3 "
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_n_choices(setup):
    client, _, _ = setup
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a b", "max_tokens": 2, "n": 2})
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1] and all(c["text"] == "w0 w1 " for c in choices)
    assert r.json()["usage"]["completion_tokens"] == 4
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "n": 2,
                                             "stream": True})
    events = sse(r.text)
    assert events[-1] == "[DONE]" and {e["choices"][0]["index"] for e in events[:-1]} == {0, 1}


@pytest.mark.parametrize("payload, param", [
    ({"model": MODEL}, "messages"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({**CHAT, "temperature": -1}, "temperature"),
    ({**CHAT, "top_p": 0}, "top_p"),
    ({**CHAT, "messages": []}, "messages"),
    ({**CHAT, "n": 3}, "n"),
    ({**CHAT, "max_tokens": 500}, "max_tokens"),
    ({**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}, "messages"),
    ({**CHAT, "functions": [{"name": "f"}]}, "functions"),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({**CHAT, "logit_bias": {"a": 1.0}}, "logit_bias"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({**CHAT, "stop": ["x"] * 17}, "stop"),
])
def test_bad_chat_requests(setup, payload, param):
    client, _, _ = setup
    r = client.post("/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["message"]
    assert client.post("/v1/chat/completions", json=CHAT).status_code == 200  # still serving


def test_other_errors(setup):
    client, _, _ = setup
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert client.get("/v1/nothing").json()["error"]["type"] == "invalid_request_error"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 5000})
    assert r.status_code == 413 and "error" in r.json()
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 10**9]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = client.post("/v1/completions", json={"model": MODEL, "prompt": ["a", "b"]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert client.get("/health").json() == {"status": "ok", "num_replicas_checked": 1}


def test_engine_errors(tokenizer):
    engine = FakeEngine(EngineConfig(model=MODEL, max_model_len=128), fail_at=2)
    ingress, _ = make_ingress(tokenizer, engine)
    with TestClient(ingress.build_asgi_app()) as client:
        r = client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        r = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        events = sse(r.text)
        assert "[DONE]" not in events and "error" in events[-1]
        assert events[0]["choices"][0]["delta"]["content"] == "w0 "
        engine.healthy = False
        r = client.get("/health")
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        assert r.headers["retry-after"]


def test_api_key(tokenizer):
    ingress, _ = make_ingress(tokenizer, api_key="sekret")
    with TestClient(ingress.build_asgi_app()) as client:
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 401
        ok = client.post("/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        assert client.get("/health").status_code == 200


async def test_handle_methods(tokenizer):
    ingress, _ = make_ingress(tokenizer)
    resp = await ingress.chat(ChatCompletionRequest(**CHAT))
    assert isinstance(resp, ChatCompletionResponse) and resp.choices[0].message.content == "w0 w1 w2 w3 "
    chunks = [c async for c in ingress.completions_stream(CompletionRequest(model=MODEL, prompt="hi",
                                                                            max_tokens=3))]
    assert "".join(c.choices[0].text for c in chunks) == "w0 w1 w2 "
    with pytest.raises(BadRequestError) as e:
        await ingress.chat({**CHAT, "temperature": -1})
    assert e.value.param == "temperature"
    with pytest.raises(ModelNotFoundError):
        await ingress.completions({"model": "x", "prompt": "hi"})


async def test_replica_cancel_aborts_engine():
    engine = FakeEngine(EngineConfig(model=MODEL), step_s=0.01)
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    request = GenerateRequest("req-1", [1, 2, 3], SamplingParams(max_tokens=1000))

    async def consume():
        async for _ in replica.generate(request):
            pass

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.05)
    assert replica.stats().engine.num_running == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert replica.stats().engine.num_running == 0 and "req-1" in engine.aborted
    # closing the generator at a yield (what Ray Serve does on disconnect) aborts too
    request2 = GenerateRequest("req-2", [1], SamplingParams(max_tokens=1000))
    async with aclosing(replica.generate(request2)) as gen:
        await gen.__anext__()
    assert "req-2" in engine.aborted and replica.stats().engine.num_running == 0


async def test_replica_abort_before_and_after_arrival():
    """The ingress's explicit abort: a request aborted before it arrives never reaches the engine; a live
    one is aborted in the engine."""
    engine = FakeEngine(EngineConfig(model=MODEL), step_s=0.01)
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    assert await replica.abort(AbortRequest("early", "r0")) is False
    outs = [o async for o in replica.generate(GenerateRequest("early", [1, 2], SamplingParams(max_tokens=5)))]
    assert outs == [] and "early" not in engine.aborted and not engine.running
    # the id is forgotten once used: a later request with it runs
    again = [o async for o in replica.generate(GenerateRequest("early", [1, 2], SamplingParams(max_tokens=2)))]
    assert again[-1].finished
    task = asyncio.create_task(_drain(replica.generate(GenerateRequest("live", [1], SamplingParams(max_tokens=1000)))))
    await asyncio.sleep(0.05)
    assert await replica.abort(AbortRequest("live", "r0")) is True and "live" in engine.aborted
    task.cancel()


async def _drain(stream) -> None:
    async for _ in stream:
        pass


async def test_replica_errors():
    engine = FakeEngine(EngineConfig(model=MODEL, max_model_len=16))
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    with pytest.raises(BadRequestError):
        async for _ in replica.generate(GenerateRequest("x", [1] * 10, SamplingParams(max_tokens=10))):
            pass
    replica.check_health()
    engine.healthy = False
    with pytest.raises(EngineError):
        replica.check_health()
    with pytest.raises(ServiceUnavailableError):
        replica.info()


def test_app_args():
    with pytest.raises(ValueError, match="max_num_seqs"):
        parse_args({"engine": {"max_num_seqs": 0}})
    with pytest.raises(ValueError, match="num_cpus"):
        parse_args({"replica": {"num_cpus": -1}})
    with pytest.raises(ValueError, match="bogus"):
        parse_args({"bogus": 1})
    args = parse_args({"engine": {"model": "tiny"}, "num_replicas": 2, "replica": {"resources": {"h": 1}}})
    opts = args.replica_deployment_options()
    assert opts["num_replicas"] == 2 and opts["ray_actor_options"]["resources"] == {"h": 1}
    # the CPU matmuls use every core (Ray would set OMP_NUM_THREADS=1 for num_cpus 0.5), or as asked
    env = opts["ray_actor_options"]["runtime_env"]["env_vars"]
    assert env["OPENBLAS_NUM_THREADS"] == env["OMP_NUM_THREADS"] == str(os.cpu_count())
    env = parse_args({"replica": {"cpu_threads": 3}}).replica_deployment_options()["ray_actor_options"]
    assert env["runtime_env"]["env_vars"]["OPENBLAS_NUM_THREADS"] == "3"
    with pytest.raises(ValueError, match="cpu_threads"):
        parse_args({"replica": {"cpu_threads": -1}})
    auto = AppArgs(autoscaling={"min_replicas": 1, "max_replicas": 3}, num_replicas=None)
    assert "autoscaling_config" in auto.replica_deployment_options()
    assert args.ingress_settings().model_name() == "tiny"
    assert AppArgs().ingress_settings().model_name() == "SmolLM2-135M-Instruct"


def test_serve_yaml_args_validate():
    import yaml

    path = Path(__file__).resolve().parents[2] / "config" / "serve.yaml"
    [entry] = yaml.safe_load(path.read_text())["applications"]
    assert entry["import_path"] == "deployments.app:build_app"
    [app] = read_configured_apps(str(path))  # what the supervisor and the metrics CLI read
    assert app.name == entry["name"]
    args = app.args
    assert args.replica.num_cpus + args.ingress.num_cpus <= 1.0  # fits a 2-core box with room to spare


def test_metrics_cli_prints_each_process_url(tmp_path, capsys):
    """`python -m deployments.app metrics <serve.yaml>` (scripts/serve runs it): one URL per process."""
    from deployments.app import main

    config = tmp_path / "serve.yaml"
    config.write_text("applications:\n- name: a\n  import_path: deployments.app:build_app\n  args:\n"
                      "    num_replicas: 2\n    telemetry: {exporter: prometheus, prometheus_port: 9000}\n")
    main(["metrics", str(config)])
    out = capsys.readouterr().out
    assert "ingress: http://127.0.0.1:9000/metrics" in out
    assert "replica 0: http://127.0.0.1:9002/metrics" in out and "replica 1: http://127.0.0.1:9003/metrics" in out
    assert "admission: http://127.0.0.1:9001/metrics" in out  # the admission controller (on by default)
    with pytest.raises(ValueError, match="num_replicas"):
        config.write_text("applications:\n- name: a\n  args: {num_replicas: 0}\n")
        main(["metrics", str(config)])


def test_builder_keeps_classes_plain():
    assert not hasattr(OpenAIIngress, "__serve_build_asgi_app__")
    sub = serve_ingress_class(OpenAIIngress)
    assert sub.__serve_build_asgi_app__ is OpenAIIngress.build_asgi_app
    app = build_app_with({"engine": {"model": "tiny"}})
    assert type(app).__name__ == "Application"


class _FakeResponseGenerator:
    """Stands for Ray's DeploymentResponseGenerator: yields items, or dies before / after some."""

    def __init__(self, items, die_after=None):
        self.items, self.die_after, self.cancelled = list(items), die_after, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        from ray.exceptions import ActorDiedError

        for i, item in enumerate(self.items):
            if i == self.die_after:
                raise ActorDiedError()
            yield item

    def cancel(self):
        self.cancelled = True


class _FakeHandle:
    def __init__(self, generators):
        self.generators, self.calls = list(generators), 0

    def options(self, **_):
        return self

    @property
    def generate(self):
        return self

    def remote(self, request):
        self.calls += 1
        return self.generators.pop(0)


async def test_handle_client_retries_a_replica_that_died_before_output():
    from deployments.replica.client import HandleReplicaClient

    request = GenerateRequest("r", [1], SamplingParams())
    handle = _FakeHandle([_FakeResponseGenerator([1, 2], die_after=0), _FakeResponseGenerator([1, 2])])
    assert [x async for x in HandleReplicaClient(handle).generate(request)] == [1, 2] and handle.calls == 2
    handle = _FakeHandle([_FakeResponseGenerator([1, 2, 3], die_after=1)])
    seen = []
    with pytest.raises(EngineError, match="ActorDiedError"):
        async for x in HandleReplicaClient(handle).generate(request):
            seen.append(x)
    assert seen == [1] and handle.calls == 1  # output already went out: no silent retry
