"""End to end: real Ray Serve, the tiny model, two engine replicas, the `openai` client, the handle API.

One Ray cluster for the session (conftest), one application for this module. Requests are small
(short prompts, max_tokens <= 32 mostly) so the module runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import openai
import pytest

from deployments.app import APP_NAME, REPLICA_DEPLOYMENT, build_app
from deployments.errors import BadRequestError, ModelNotFoundError
from deployments.ingress.schemas import (
    ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse, CompletionRequest, CompletionResponse,
)
from conftest import named_actor  # noqa: E402

MODEL = "tiny"
MAX_MODEL_LEN = 2048
ENGINE = {"model": MODEL, "max_num_seqs": 4, "max_num_batched_tokens": 256, "prefill_chunk_size": 128,
          "max_model_len": MAX_MODEL_LEN, "memory_limit_bytes": 2 << 30}
APP_ARGS = {
    "engine": ENGINE,
    "num_replicas": 2,
    # Both on this one node (the default is one per node); admission gives each half of the limit.
    "replica": {"num_cpus": 0.5, "health_check_period_s": 2.0, "max_replicas_per_node": 2},
    "ingress": {"num_cpus": 0.1},
    "max_n": 2,
    "max_tokens_cap": 2000,
}
PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def base_url(ray_cluster):
    from ray import serve

    serve.run(build_app(APP_ARGS), name=APP_NAME, route_prefix="/")
    yield ray_cluster
    serve.delete(APP_NAME)


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def reference_engine():
    """The engine's own sync API on the same tiny model, for greedy equality."""
    from engine.config import EngineConfig
    from engine.engine import Engine

    engine = Engine.from_config(EngineConfig(**ENGINE))
    yield engine
    shutdown = getattr(engine, "shutdown", None)
    if shutdown:
        shutdown()


def test_models_and_health(client, base_url):
    assert [m.id for m in client.models.list().data] == [MODEL]
    r = httpx.get(f"{base_url}/health", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_completion_greedy_equals_engine(client, reference_engine):
    from engine.core.types import SamplingParams

    resp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0)
    ids = reference_engine.tokenizer.encode(PROMPT)
    [expected] = reference_engine.generate([ids], SamplingParams(max_tokens=16))
    assert resp.choices[0].text == expected.text
    assert resp.usage.completion_tokens == len(expected.token_ids)
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].finish_reason == expected.finish_reason.value


def test_chat_stream_matches_non_stream(client):
    full = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason


def test_two_replicas_share_concurrent_requests(base_url):
    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        return await http.post(f"{base_url}/v1/completions", json={
            "model": MODEL, "prompt": f"{i} {PROMPT}", "max_tokens": 24, "temperature": 0, "ignore_eos": True})

    async def run_all() -> list:
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*(one(http, i) for i in range(12)))

    responses = asyncio.run(run_all())
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses]
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in responses)
    assert len({r.headers["x-replica-id"] for r in responses}) == 2


def test_handle_api(base_url):
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)

    async def calls() -> None:
        chat = await handle.chat.remote(ChatCompletionRequest(model=MODEL, messages=MESSAGES, max_tokens=6,
                                                              temperature=0))
        assert isinstance(chat, ChatCompletionResponse) and chat.usage.completion_tokens >= 1
        chunks = [c async for c in handle.options(stream=True).chat_stream.remote(
            {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "temperature": 0})]
        assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
        comp = await handle.completions.remote(CompletionRequest(model=MODEL, prompt=PROMPT, max_tokens=4))
        assert isinstance(comp, CompletionResponse)
        streamed = [c async for c in handle.options(stream=True).completions_stream.remote(
            CompletionRequest(model=MODEL, prompt=PROMPT, max_tokens=4, n=2, seed=1))]
        assert {c.choices[0].index for c in streamed} == {0, 1}
        with pytest.raises(BadRequestError) as err:
            await handle.chat.remote({"model": MODEL, "messages": MESSAGES, "max_tokens": 0})
        assert err.value.param == "max_tokens"
        with pytest.raises(ModelNotFoundError):
            await handle.completions.remote({"model": "nope", "prompt": "x"})

    asyncio.run(calls())


def test_n_choices_never_hang(base_url):
    """n > 1 fans out one replica call per choice, in flight at once. With Serve's shared request id
    these calls used to lose one of the two within a few requests (the stream never ended)."""
    from ray import serve

    handle = serve.get_app_handle(APP_NAME)

    async def streamed(i: int) -> set:
        gen = handle.options(stream=True).completions_stream.remote(
            CompletionRequest(model=MODEL, prompt=PROMPT, max_tokens=3, n=2, seed=i))
        return {c.choices[0].index async for c in gen}

    async def all_requests() -> None:
        for i in range(15):
            assert await asyncio.wait_for(streamed(i), 20) == {0, 1}

    asyncio.run(all_requests())
    with httpx.Client(timeout=20) as http:
        for i in range(5):
            r = http.post(f"{base_url}/v1/completions",
                          json={"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "n": 2, "seed": i})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2


@pytest.mark.parametrize("body, status, param", [
    (b"{oops", 400, None),
    (json.dumps({"model": MODEL}).encode(), 400, "messages"),
    (json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 0}).encode(), 400, "max_tokens"),
    (json.dumps({"model": MODEL, "messages": MESSAGES, "temperature": -0.5}).encode(), 400, "temperature"),
    (json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi " * 2100}]}).encode(), 400,
     "messages"),
    (json.dumps({"model": "gpt-4o", "messages": MESSAGES}).encode(), 404, "model"),
])
def test_bad_input_gets_error_object(base_url, body, status, param):
    r = httpx.post(f"{base_url}/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"]
    ok = httpx.post(f"{base_url}/v1/chat/completions", timeout=30,
                    json={"model": MODEL, "messages": MESSAGES, "max_tokens": 2})
    assert ok.status_code == 200  # the app keeps serving


def test_openai_client_sees_typed_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi " * 2100, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MESSAGES)


def test_client_disconnect_frees_the_engine(base_url):
    from ray import serve

    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base_url}/v1/chat/completions",
                                                        json=body) as r:
        assert r.status_code == 200
        replica_id = r.headers["x-replica-id"]
        lines = r.iter_lines()
        for _ in range(4):
            next(lines)
    closed = time.monotonic()
    handle = serve.get_deployment_handle(REPLICA_DEPLOYMENT, app_name=APP_NAME)

    async def running_on_that_replica() -> int:
        for _ in range(50):  # the router picks a replica per call; sample until ours answers
            stats = await asyncio.wait_for(handle.stats.remote(), 10)
            assert stats.cpu_threads == str(os.cpu_count())  # not Ray's OMP_NUM_THREADS=1
            assert stats.niceness == 0  # not Ray's worker niceness of 15 (deployments/cluster_env.py)
            if stats.replica_id == replica_id:
                return stats.engine.num_running + stats.engine.num_waiting
        raise AssertionError(f"replica {replica_id} never answered")

    async def wait_idle() -> float:
        while time.monotonic() - closed < 5:
            if await running_on_that_replica() == 0:
                return time.monotonic() - closed
            await asyncio.sleep(0.05)
        raise AssertionError("the engine still runs the disconnected request after 5 s")

    assert asyncio.run(wait_idle()) < 1.0


def test_replica_death_mid_stream_is_an_error_event(base_url):
    """Last in the module: kills one engine replica (Serve restarts it) while it streams."""
    import ray

    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    events = []
    with httpx.Client(timeout=60) as http, http.stream("POST", f"{base_url}/v1/completions", json=body) as r:
        replica_id = r.headers["x-replica-id"]
        [actor] = [a for a in ray.util.list_named_actors(all_namespaces=True)
                   if a["name"].endswith(f"#{replica_id}")]
        for line in r.iter_lines():
            if line:
                events.append(line)
            if len(events) == 3:
                ray.kill(named_actor(actor["name"], actor["namespace"]), no_restart=False)
    assert "data: [DONE]" not in events
    error = json.loads(events[-1][len("data: "):])["error"]
    assert error["type"] == "internal_error" and "replica" in error["message"]
    ok = httpx.post(f"{base_url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.headers["x-replica-id"] != replica_id  # the survivor serves
