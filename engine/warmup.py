"""The start's warm-up: the kinds of step a serving engine runs, once each, before it serves.

On MLX's CUDA backend the first forward of a kind compiles kernels (NVRTC) in the step that first needs
it, and MLX keeps them for the process only. Measured on an H200 (8B llama, docs/tight_burst.md): on a
fresh machine this warm-up's first prompt step took 10.7 s, its first step mixing a chunk with a decode
row 22.5 s and its first decode 4.0 s, every later one 75 ms or less; a replica that met them while
serving stalled every request for them. So the engine's thread runs, before its first request
(AsyncEngine):
- prompt chunks, the first prompt crossing a chunk boundary where the step budget allows;
- a chunk beside each count of decode rows from 1 to `rows` - 1 (mixed into one forward where the
  scheduler mixes), requests joining one per step;
- decodes (pipelined) of `rows` down to 1 rows, requests leaving one per step;
- greedy and sampled rows (temperature, top-p, top-k, a penalty, log-probabilities): their sampling
  graphs differ.
- where the engine packs prompt chunks (ExecutionConfig.max_packed_tokens), a burst of PACK_WARMUP_ROWS
  equal prompts arriving together: one packed forward of their first chunks (its batched RoPE, KV write
  and attention, and a head of several rows; each new number of rows in a pack still builds its own
  attention graph).
Not covered: grammar-constrained rows and decodes of more than `rows` rows (each new row count traces
the compiled decode again: a first 9- or 10-row decode took 19-24 ms against 13 on the H200,
scripts/data/h200_i24_tight_burst.json `token_major_at_eb7c392`, `bench_tight_burst.py --timings`). The
paged kernel is compiled by its self-check at the runner's start (engine/model/kernels/paged_attention.py);
the grid's attention graphs, where asked, by the engine's constructor (ExecutionConfig.max_warmup_chunk_shapes).
Everything runs through `Engine.add_request` and `step`, so it is the engine's own path, and its steps
count in the engine's stats; the requests' KV is freed when they finish and the prefix cache emptied.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.core.types import SamplingParams, StepRecord

logger = logging.getLogger(__name__)

WARMUP_ROWS = 8  # decode / mixed row counts covered: 1..8 (the compiled decode traces each count once)
PACK_WARMUP_ROWS = 4  # prompts of the packed burst (where the engine packs)


def warmup_requests(rows: int, chunk_tokens: int, max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
    """The warm-up's requests in the order they join, one per step: request k decodes 2 * (rows - k)
    tokens, so all `rows` decode together once the last joins and then leave one per step (the row
    counts go rows, rows - 1, ..., 1). The first prompt crosses a chunk boundary where the model's
    length allows."""
    out = []
    for k in range(rows):
        max_tokens = max(1, min(2 * (rows - k), max_model_len // 2 - 1))  # a short model keeps a prompt
        length = min(chunk_tokens + 40 if k == 0 else 24 + 8 * k, max_model_len - max_tokens - 1)
        prompt = [5 + (7 * k + i) % 50 for i in range(max(1, length))]
        if k % 2:  # sampled rows beside greedy ones (seeded: the warm-up is deterministic)
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8, top_p=0.9,
                                      top_k=40, seed=k, repetition_penalty=1.1, logprobs=2 if k == 1 else None)
        else:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out.append((prompt, sampling))
    return out


@dataclass(frozen=True)
class WarmupStep:
    """One step of the warm-up: what it ran and how long it took."""
    decode_rows: int
    prefill_chunks: int
    mixed: bool
    seconds: float
    largest_pack: int = 1  # prompt chunks in its packed forward (1: none packed)


@dataclass(frozen=True)
class Warmup:
    seconds: float
    steps: tuple[WarmupStep, ...]


def warm_up(engine, rows: int = WARMUP_ROWS) -> Warmup:
    """Run the warm-up (module docstring) on `engine` (an idle Engine, in the thread that will run it).
    Its requests are ordinary ones: a refusal (too little memory for them) ends the joining early, with a
    warning, and a failed step the warm-up, logged; the engine serves either way."""
    started = time.perf_counter()
    config = engine.config
    rows = max(1, min(rows, config.max_num_seqs))
    ids, steps = [], []

    def step() -> None:
        record: StepRecord = engine.step()
        if record.plan is not None:
            steps.append(WarmupStep(len(record.plan.decodes), len(record.plan.prefills), record.plan.mixed,
                                    round(record.duration_s, 4), max(record.plan.packs, default=1)))

    try:
        for k, (prompt, sampling) in enumerate(warmup_requests(rows, config.prefill_chunk_size,
                                                               engine.max_model_len)):
            try:
                engine.add_request(f"warmup-{k}", prompt, sampling)
            except ValueError as exc:  # refused (the limits leave no room for it): the others go on
                logger.warning("engine warm-up: request %d refused (%s)", k, exc)
                break
            ids.append(f"warmup-{k}")
            step()
        while engine.has_unfinished():
            step()
        if engine.memory.packed:  # a burst whose first chunks run as one packed forward
            length = max(1, min(config.prefill_chunk_size, engine.memory.max_packed_tokens // PACK_WARMUP_ROWS,
                                engine.max_model_len - 2))
            for k in range(min(PACK_WARMUP_ROWS, config.max_num_seqs)):
                engine.add_request(f"warmup-pack-{k}", [7 + (5 * k + i) % 50 for i in range(length)],
                                   SamplingParams(max_tokens=1, ignore_eos=True))
                ids.append(f"warmup-pack-{k}")
            while engine.has_unfinished():
                step()
    except Exception:
        logger.exception("engine warm-up stopped early")
        for request_id in ids:
            engine.abort(request_id)
    engine.reset_prefix_cache()  # its prompts are no one's prefix
    return Warmup(time.perf_counter() - started, tuple(steps))
