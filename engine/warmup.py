"""The start's warm-up: each kind of forward a serving engine runs, once, before it serves.

On MLX's CUDA backend the first forward of a kind compiles kernels (NVRTC) in the step that first needs
it, and MLX keeps them for the process only. Measured on an H200 (8B llama, docs/tight_burst.md): a
cold burst's first step mixing a prompt chunk with decode rows took 3.4 s, its first 5-row decode 2.2 s,
where a warm one takes 15 ms. So the engine's thread runs, before its first request (AsyncEngine):
- prompt chunks, the first of one request crossing a chunk boundary;
- a mixed step (a chunk with decode rows) at each row count up to `rows`, requests joining one per step;
- decodes (pipelined) at each row count down from `rows` to 1, requests leaving one per step;
- greedy and sampled rows (temperature, top-p, top-k, a penalty, log-probabilities): their sampling
  graphs differ.
The paged kernel's instances (one per span length) are compiled by its self-check at the runner's start
(engine/model/kernels/paged_attention.py). Everything runs through `Engine.add_request` and `step`, so it
is the engine's own path; the requests' KV is freed when they finish.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.core.types import SamplingParams, StepRecord

logger = logging.getLogger(__name__)

WARMUP_ROWS = 8  # decode / mixed row counts covered: 1..8 (the compiled decode traces each count once)


def warmup_requests(rows: int, chunk_tokens: int, max_model_len: int) -> list[tuple[list[int], SamplingParams]]:
    """The warm-up's requests in the order they join, one per step: request k decodes 2 * (rows - k)
    tokens, so all `rows` decode together once the last joins and then leave one per step (the row
    counts go rows, rows - 1, ..., 1). The first prompt crosses a chunk boundary where the model's
    length allows."""
    out = []
    for k in range(rows):
        max_tokens = 2 * (rows - k)
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


@dataclass(frozen=True)
class Warmup:
    seconds: float
    steps: tuple[WarmupStep, ...]


def warm_up(engine, rows: int = WARMUP_ROWS) -> Warmup:
    """Run the warm-up (module docstring) on `engine` (an idle Engine, in the thread that will run it).
    Its requests are ordinary ones: a refusal (too little memory for them) ends the warm-up early,
    logged, as does a failed step; the engine serves either way."""
    started = time.perf_counter()
    config = engine.config
    rows = max(1, min(rows, config.max_num_seqs))
    ids, steps = [], []

    def step() -> None:
        record: StepRecord = engine.step()
        if record.plan is not None:
            steps.append(WarmupStep(len(record.plan.decodes), len(record.plan.prefills), record.plan.mixed,
                                    round(record.duration_s, 4)))

    try:
        for k, (prompt, sampling) in enumerate(warmup_requests(rows, config.prefill_chunk_size,
                                                               engine.max_model_len)):
            ids.append(f"warmup-{k}")
            engine.add_request(ids[-1], prompt, sampling)
            step()
        while engine.has_unfinished():
            step()
    except Exception:
        logger.exception("engine warm-up stopped early")
        for request_id in ids:
            engine.abort(request_id)
    engine.reset_prefix_cache()  # its prompts are no one's prefix
    return Warmup(time.perf_counter() - started, tuple(steps))
