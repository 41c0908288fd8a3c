"""What the runner is given (a row's prompt chunk, a decode row) and gives back (a built `Forward`), and
how a forward is waited for (`finish`): plain pieces the executor (engine/executor.py) and the runner
(engine/model/runner.py) share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from engine.model.sampling import DeferredSampling


@dataclass(frozen=True)
class PrefillWork:
    """Compute `token_ids` of one row at positions [start, start + len), then `num_pad_tokens` more
    (ScheduledChunk's); sample the last real position if it ends the prompt."""

    request_id: str
    token_ids: list[int]
    start: int
    sample: bool
    num_pad_tokens: int = 0

    def forward_token_ids(self) -> list[int]:
        """The tokens, then the pad (the last token repeated: any valid id would do)."""
        return list(self.token_ids) + list(self.token_ids[-1:]) * self.num_pad_tokens


@dataclass(frozen=True)
class DecodeWork:
    request_id: str
    token_id: int  # the last sampled token, fed back (-1: given by `decode`'s lazy `tokens`)


@dataclass
class Forward:
    """A built forward: `stages` are evaluated one after another by `launch`; `tokens` are its sampled
    token ids (None for a prompt chunk that samples nothing)."""

    stages: list
    tokens: Optional[mx.array]
    sampling: Optional[DeferredSampling] = None  # builds `tokens` at launch (ModelRunner.decode)

    def finish(self) -> None:
        """Wait for it, then let go of its arrays: a prompt chunk's are the pool's arrays as it left
        them, which the next forward (built, not launched yet) writes in place only if nothing else
        holds them."""
        finish(*self.stages[-1])
        self.stages = []


def stage_list(arrays) -> list:
    """One stage of a forward (what a layer loop appended: an array, or a tuple of them) as a list."""
    return list(arrays) if isinstance(arrays, tuple) else [arrays]


def finish(*arrays) -> None:
    """Evaluate and wait until the device is idle, its finished kernels' buffers released.

    Every forward writes the KV pool in place: MLX can update an array in place (donate it) only when
    nothing else holds its buffer, and MLX's GPU backends hold a kernel's inputs until a completion
    handler runs after the kernel. A forward encoded while the previous one is still in flight would
    therefore copy whole pool arrays (slow, and a transient as large as the pool). So forwards that
    write the pool never overlap on the device; only Python work (building the next graph, reading
    outputs) overlaps a running forward."""
    if arrays:
        mx.eval(*arrays)
    mx.synchronize()
