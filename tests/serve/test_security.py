"""Security settings of the API, without Ray: the API key on every /v1 route (and from the environment),
the request body limit (declared and chunked), and the `n` / `max_tokens` caps of AppArgs."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deployments.app import API_KEY_ENV, AppArgs
from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.replica.replica import EngineReplica
from engine.config import EngineConfig
from serve_fakes import FakeEngine, LocalReplicaClient

MODEL = "tiny"
KEY = "s3cret-key"
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
ROUTES = [("GET", "/v1/models", None), ("GET", f"/v1/models/{MODEL}", None),
          ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
          ("POST", "/v1/chat/completions", CHAT)]


@pytest.fixture(scope="module")
def tokenizer():
    from mlx_lm.utils import load_tokenizer

    from engine.model.loader import resolve_model_path

    return load_tokenizer(resolve_model_path("tiny"))


def client_for(tokenizer, **settings) -> TestClient:
    engine = FakeEngine(EngineConfig(model=MODEL, max_model_len=128))
    replica = EngineReplica(engine.config, engine_factory=lambda cfg: engine, replica_id="r0")
    ingress = OpenAIIngress(replica, IngressSettings(engine=engine.config, **settings),
                            tokenizer_factory=lambda cfg: tokenizer, client_factory=LocalReplicaClient)
    return TestClient(ingress.build_asgi_app())


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
def test_every_v1_route_needs_the_key(tokenizer, method, path, body):
    with client_for(tokenizer, api_key=KEY) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}):
            r = client.request(method, path, json=body, headers=headers)
            assert r.status_code == 401, (headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
        r = client.request(method, path, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 200, r.text


def test_health_stays_open(tokenizer):
    with client_for(tokenizer, api_key=KEY) as client:
        assert client.get("/health").status_code == 200


def test_api_key_from_the_environment(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert AppArgs().ingress_settings().api_key is None
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert AppArgs().ingress_settings().api_key == "from-env"
    assert AppArgs(api_key="from-yaml").ingress_settings().api_key == "from-yaml"  # serve.yaml wins
    monkeypatch.setenv(API_KEY_ENV, "")
    assert AppArgs().ingress_settings().api_key is None  # empty means unset, never an empty key


def test_body_limit_declared_and_chunked(tokenizer):
    with client_for(tokenizer, max_request_body_bytes=2048) as client:
        big = {**CHAT, "user": "x" * 4096}
        r = client.post("/v1/chat/completions", json=big)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def chunks():  # no Content-Length: the limit is enforced while reading
            yield b'{"model": "tiny", "user": "'
            for _ in range(8):
                yield b"x" * 512
            yield b'", "messages": [{"role": "user", "content": "hi"}]}'

        r = client.post("/v1/chat/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200


def test_n_and_max_tokens_caps(tokenizer):
    with client_for(tokenizer, max_n=3, max_tokens_cap=8) as client:
        r = client.post("/v1/chat/completions", json={**CHAT, "n": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n" and "3" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json={**CHAT, "n": 3}).status_code == 200
        r = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 9})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        unset = {k: v for k, v in CHAT.items() if k != "max_tokens"}
        r = client.post("/v1/chat/completions", json=unset)  # no max_tokens: the cap is the default
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8


def test_caps_are_validated_in_app_args():
    for bad in ({"max_n": 0}, {"max_n": 1000}, {"max_tokens_cap": 0}, {"max_request_body_bytes": 10}):
        with pytest.raises(ValueError) as err:
            AppArgs(**bad)
        assert next(iter(bad)) in str(err.value)
