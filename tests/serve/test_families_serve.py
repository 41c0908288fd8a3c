"""A non-llama family served end to end by the app's own classes, without Ray: the OpenAI ingress (its
tokenizer and chat template loaded from the model folder), an EngineReplica running the real AsyncEngine
on a tiny random Qwen3 checkpoint (explicit head_dim) built with mlx-lm's classes, over FastAPI's test
client. The chat answer is mlx-lm's own greedy generation of the chat-templated prompt."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from deployments.ingress.ingress import IngressSettings, OpenAIIngress
from deployments.replica.replica import EngineReplica
from engine.config import EngineConfig
from serve_fakes import LocalReplicaClient
from tests.engine.conftest import reference_greedy_ids
from tests.engine.family_checkpoints import build_checkpoint

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def qwen3_folder(tmp_path_factory):
    from engine.model.loader import resolve_model_path

    out = tmp_path_factory.mktemp("qwen3-serve") / "tiny-qwen3"
    return build_checkpoint(out, resolve_model_path("tiny", progress=False), "qwen3")


def test_qwen3_chat_through_the_app(qwen3_folder):
    from engine.model.loader import load_model

    config = EngineConfig(model=str(qwen3_folder), dtype="float32", prefill_chunk_size=16,
                          max_num_batched_tokens=32, memory_limit_bytes=2 << 30)
    replica = EngineReplica(config, replica_id="r0")
    ingress = OpenAIIngress(replica, IngressSettings(engine=config), client_factory=LocalReplicaClient)
    model, tokenizer = load_model(qwen3_folder)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True)
    want = reference_greedy_ids(model, prompt, 8, eos_ids=tokenizer.eos_token_ids)
    try:
        with TestClient(ingress.build_asgi_app()) as client:
            r = client.post("/v1/chat/completions", json={"model": "tiny-qwen3", "messages": MESSAGES,
                                                          "max_tokens": 8, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
    finally:
        replica.shutdown()
    assert len(prompt) > 16  # the templated prompt crosses a chunk boundary
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(want)
    detokenizer = tokenizer.detokenizer  # mlx-lm's streaming detokenizer, as its generate() uses it
    detokenizer.reset()
    for token in want:
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert body["choices"][0]["message"]["content"] == detokenizer.text
