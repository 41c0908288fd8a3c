"""A fake AsyncEngine (the real contract, no model) and a replica client without Ray.

The fake emits one token per `step_s`: token ids count up from the prompt length; each token's text is
"w<i> ". It honours max_tokens, stop_token_ids, abort and cancellation, and keeps a running set like the
real engine, so the Serve layer is tested fast and deterministically.
"""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Optional

from engine.config import EngineConfig
from engine.core.types import FinishReason, RequestOutput, SamplingParams


@dataclass(frozen=True)
class FakeStats:
    num_waiting: int
    num_running: int
    kv_used_bytes: int
    kv_reserved_bytes: int
    memory_limit_bytes: int
    weights_bytes: int


class FakeEngine:
    def __init__(self, config: EngineConfig, step_s: float = 0.001, fail_at: Optional[int] = None) -> None:
        self.config = config
        self.step_s = step_s
        self.fail_at = fail_at  # emit an error output after this many tokens
        self.max_model_len = config.max_model_len or 2048
        self.model_name = "fake"
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.healthy = True

    async def generate(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams):
        if len(prompt_token_ids) + sampling.max_tokens > self.max_model_len:
            raise ValueError(f"prompt of {len(prompt_token_ids)} + max_tokens={sampling.max_tokens} > "
                             f"max_model_len={self.max_model_len}")
        self.running.add(request_id)
        n_prompt = len(prompt_token_ids)
        try:
            for i in range(sampling.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.fail_at is not None and i == self.fail_at:
                    yield RequestOutput(request_id, [], "", n_prompt, i, True, FinishReason.ERROR,
                                        error="boom")
                    return
                token = n_prompt + i
                stop = token in sampling.stop_token_ids
                last = stop or i + 1 == sampling.max_tokens
                reason = (FinishReason.STOP if stop else FinishReason.LENGTH) if last else None
                yield RequestOutput(request_id, [token], "" if stop else f"w{i} ", n_prompt, i + 1, last,
                                    reason)
                if last:
                    return
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def stats(self) -> FakeStats:
        return FakeStats(0, len(self.running), 0, 0, 1 << 30, 0)

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        self.healthy = False


def fake_engine_factory(config: EngineConfig) -> FakeEngine:
    return FakeEngine(config)


class LocalReplicaClient:
    """The ingress's replica client, calling an EngineReplica in-process (no Ray)."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica

    async def generate(self, request):
        async with aclosing(self.replica.generate(request)) as stream:
            async for out in stream:
                yield out

    async def call(self, method: str, timeout_s: float) -> Any:
        return getattr(self.replica, method)()
