"""A fake AsyncEngine (deployments.engine_client.EngineClient, no model) and a replica client without Ray.

The fake emits one token per `step_s`: token ids count up from the prompt length; each token's text is
"w<i> ". It honours max_tokens, stop_token_ids, abort and cancellation, and keeps a running set like the
real engine, so the Serve layer is tested fast and deterministically.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any, Optional

from engine import EngineConfig, EngineStats, FinishReason, RequestOutput, SamplingParams, StepRecord

from deployments.engine_client import EngineClient
from deployments.messages import GenerateOutput, GenerateRequest, ReplicaInfo, ReplicaStats


def fake_stats(num_running: int = 0, max_model_len: int = 2048, **overrides: int) -> EngineStats:
    """EngineStats of an engine with a GiB to spare, KV of 8 bytes a token in steps of 256."""
    fields: dict[str, int] = dict(
        num_waiting=0, num_running=num_running, kv_reserved_bytes=0, kv_used_bytes=0, kv_budget_bytes=1 << 29,
        kv_bytes_per_token=8, kv_cache_step=256, weights_bytes=0, memory_limit_bytes=1 << 30,
        transient_bound_bytes=0, max_predicted_transient_bytes=0, max_measured_transient_bytes=0,
        max_model_len=max_model_len, num_steps=0, num_forward_calls=0)
    return EngineStats(**{**fields, **overrides})


class FakeEngine:
    def __init__(self, config: EngineConfig, step_s: float = 0.001, fail_at: Optional[int] = None) -> None:
        self.config = config
        self.step_s = step_s
        self.fail_at = fail_at  # emit an error output after this many tokens
        self.max_model_len = config.max_model_len or 2048
        self.model_name = "fake"
        self.tokenizer: Any = None  # the replica never tokenizes
        self.on_step: Optional[Callable[[StepRecord], None]] = None  # no steps: never called
        self.warmup_s: Optional[float] = None
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.healthy = True

    @classmethod
    def from_config(cls, config: EngineConfig) -> "FakeEngine":
        return cls(config)

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                       sampling: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
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

    def stats(self) -> EngineStats:
        return fake_stats(num_running=len(self.running), max_model_len=self.max_model_len)

    def prefix_block_hash_chains(self) -> tuple[tuple[int, ...], ...]:
        return ()

    def is_healthy(self) -> bool:
        return self.healthy

    def shutdown(self) -> None:
        self.healthy = False


def fake_engine_factory(config: EngineConfig) -> EngineClient:
    return FakeEngine(config)


class LocalReplicaClient:
    """The ingress's replica client (deployments.replica.client.ReplicaClient), calling an EngineReplica
    in-process (no Ray)."""

    def __init__(self, replica: Any) -> None:
        self.replica = replica

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        async with aclosing(self.replica.generate(request)) as stream:
            async for out in stream:
                yield out

    async def info(self, timeout_s: float) -> ReplicaInfo:
        return self.replica.info()

    async def stats(self, timeout_s: float) -> ReplicaStats:
        return self.replica.stats()
