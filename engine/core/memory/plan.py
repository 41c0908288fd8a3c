"""What one engine step computes, as the memory model reads it: plain ints (engine/core/memory/model.py)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillChunkPlan:
    num_tokens: int  # c: tokens computed in this chunk
    context_len: int  # n: tokens of KV the chunk attends to, itself included
    computes_logits: bool = True  # only the chunk that ends a prompt reaches the LM head
    samples: bool = False  # ... and samples (not greedy) from them
    gathers: bool = True  # False: the row's KV is read as a view of the pool (consecutive blocks)


@dataclass(frozen=True)
class StepPlan:
    """What one engine step computes, as the memory model needs it (plain ints)."""

    decode_context_lens: tuple[int, ...] = ()  # n per decoding row, this step's token included
    decode_samples: int = 0  # decoding rows that sample (temperature > 0)
    prefill_chunks: tuple[PrefillChunkPlan, ...] = ()
    packs: tuple[int, ...] = ()  # consecutive chunks per forward (SchedulerOutput.packs); empty: one each


def pack_groups(items: tuple, packs: tuple[int, ...]) -> list[tuple]:
    """`items` (a step's prompt chunks) cut into its forwards' groups: `packs` consecutive items each
    (SchedulerOutput.packs), or one each where `packs` is empty. ValueError if they do not add up."""
    if not packs:
        return [(item,) for item in items]
    if sum(packs) != len(items) or min(packs) < 1:
        raise ValueError(f"packs={packs} do not cut {len(items)} chunks")
    groups, at = [], 0
    for n in packs:
        groups.append(tuple(items[at:at + n]))
        at += n
    return groups


def round_up(n: int, step: int) -> int:
    return ((n + step - 1) // step) * step
