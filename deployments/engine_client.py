"""EngineClient: the typed contract between an engine replica and its engine.

`engine.AsyncEngine` satisfies it structurally; tests pass a fake that does too. The replica is built
with an `EngineFactory` (config -> EngineClient) and calls nothing beyond this surface: no probing for
optional methods, no stats read by string keys.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Optional, Protocol

from engine import EngineConfig, EngineStats, RequestOutput, SamplingParams, StepRecord

StepObserver = Callable[[StepRecord], None]


class EngineClient(Protocol):
    """What EngineReplica calls on its engine (AsyncEngine's public surface)."""

    # Called on the engine thread after each step that ran a forward (None: nobody observes). Set it
    # before requests arrive; it must be cheap.
    on_step: Optional[StepObserver]
    warmup_s: Optional[float]  # how long the engine's warm-up took (None: none ran)

    @classmethod
    def from_config(cls, config: EngineConfig) -> "EngineClient": ...

    @property
    def tokenizer(self) -> Any: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def model_name(self) -> str: ...

    def generate(self, request_id: str, prompt_token_ids: Sequence[int],
                 sampling: SamplingParams) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs; raises ValueError (before the first) for a request that can never fit."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def prefix_block_hash_chains(self) -> tuple[tuple[int, ...], ...]:
        """The prefix cache's block-hash chains, most recently used first (empty: no prefix cache)."""
        ...

    def is_healthy(self) -> bool: ...

    def shutdown(self) -> None: ...


EngineFactory = Callable[[EngineConfig], EngineClient]


def default_engine_factory(config: EngineConfig) -> EngineClient:
    """The real engine; AsyncEngine (its thread, MLX) is loaded only when a replica builds one."""
    from engine import AsyncEngine

    return AsyncEngine.from_config(config)
