"""Plain data exchanged between the engine's layers: requests, sampling parameters, outputs."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the model forward failed


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be a finite number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1,
               "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               "top_k", self.top_k, "must be an integer >= 0")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 1 << 64), "seed", self.seed,
               "must be an integer in [0, 2**64)")  # mx.random.key refuses others, on the engine thread
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop)} strings",
               f"must hold at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop", repr(s)[:40],
                   f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", t, "must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {why}")


@dataclass
class Request:
    """Engine-side state of one request. Progress is `num_computed_tokens` against `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None
    reserved_tokens: int = 0  # KV tokens reserved by the scheduler while running

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV this request can ever hold (the last sampled token is never fed back)."""
        return self.num_prompt_tokens + self.sampling.max_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class RequestOutput:
    """One incremental update for a request: what is new since the last update, plus totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None


@dataclass(frozen=True)
class CompletionOutput:
    """The whole result of one request, as the sync `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    num_cached_tokens: int = 0
