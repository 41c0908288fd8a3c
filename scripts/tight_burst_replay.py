"""Replay mode of bench_tight_burst.py (--replay): the burst through the Scheduler alone (pure Python, no
forward runs), with the memory model the engine builds for a random shape (bench_common.RANDOM_SHAPES) on
MLX's CUDA backend: the layer loops' coefficients for ops 8, paged decodes, mixed steps, chunks read as
views of the pool; without the decode's matmul workspaces, which the engine measures on the device when it
starts (engine/model/matmul_workspace.py): its decodes predict a little less than the engine's. Every step
samples a token for each decode row and each prompt it ends; requests finish at max_tokens. What it counts is what the engine's records count (bench_tight_burst.step_summary):
distinct (forward tokens, context) pairs of prompt chunks, those no earlier run of the process had (the
bench's warm-up burst first), steps, steps cut by memory, tokens computed (pads included), KV's share.
Pipelined decodes and deferred chunks change no plan of a step that holds a prompt chunk, so they are
not modelled.

    python scripts/bench_tight_burst.py --replay --model llama-8b --dtype bfloat16 --headroom-gb 3,6,12 \
        --max-num-seqs 64 --max-model-len 8448 --granules 128,256,512,1024 --pad-last-chunk off,on \
        --weights-bytes 16060522512 --json
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from bench_common import DTYPES, RANDOM_SHAPES

from engine.engine import KV_BLOCK_TOKENS

CUDA_OPS_PER_BUFFER = 8


def _gpu_default(field: str):
    """EngineConfig's default for `field` as the engine resolves it on a GPU."""
    from engine.config import EngineConfig
    return getattr(EngineConfig().for_backend("cuda"), field)


@dataclasses.dataclass(frozen=True)
class ReplaySetting:
    """One engine configuration of the replay: the bench's options, the rest EngineConfig's GPU defaults."""

    headroom_bytes: int
    weights_bytes: int
    max_num_seqs: int
    max_model_len: int
    pad_last_chunk: bool
    chunk_granule: int
    max_num_batched_tokens: int = dataclasses.field(default_factory=lambda: _gpu_default("max_num_batched_tokens"))
    prefill_chunk_size: int = dataclasses.field(default_factory=lambda: _gpu_default("prefill_chunk_size"))
    memory_margin_fraction: float = dataclasses.field(default_factory=lambda: _gpu_default("memory_margin_fraction"))
    prefix_cache_fraction: float = dataclasses.field(default_factory=lambda: _gpu_default("prefix_cache_fraction"))
    # the decodes through the fused q/k rope kernel (the memory model's FUSED_DECODE_LAYERS_FACTOR): CUDA's
    # default since 38481f2; the recorded runs this replays ran without it
    fused_decode: bool = False


def build_scheduler(model: str, dtype: str, setting: ReplaySetting):
    """The scheduler, memory model and KV manager Engine.__init__ builds for `model` on MLX's CUDA backend
    under memory limit weights + headroom (engine/engine.py: _build_memory_model, _kv_budget)."""
    from engine.core.kv_manager import KVManager
    from engine.core.memory.coefficients import coefficients_for
    from engine.core.memory.model import MemoryModel, ModelShape
    from engine.core.scheduler import Scheduler, SchedulerConfig

    shape = ModelShape.from_config(RANDOM_SHAPES[model], DTYPES[dtype].size, setting.weights_bytes,
                                   module_forwards=False)
    if shape.layer_windows:  # the engine keeps those layers' KV in rings counted with the weights: not built here
        raise ValueError(f"--replay: {model} has sliding-window layers, which this replay does not model")
    coefficients, _ = coefficients_for("cuda", CUDA_OPS_PER_BUFFER, shape, cpu_math=False,
                                       prefill_chunk_size=setting.prefill_chunk_size)
    memory = MemoryModel(shape, kv_step=KV_BLOCK_TOKENS, coefficients=coefficients, paged_decode=True,
                         mixed=True, copies_viewed_kv=True, fused_decode=setting.fused_decode)
    available = setting.headroom_bytes
    max_memory = available - int(setting.memory_margin_fraction * available)
    floor = memory.floor_transient_bytes(setting.prefill_chunk_size, setting.max_model_len)
    kv_budget = memory.kv_budget_bytes(max_memory, floor)
    kv = KVManager(KV_BLOCK_TOKENS, memory.kv_bytes_per_token, kv_budget,
                   int(setting.prefix_cache_fraction * kv_budget))
    config = SchedulerConfig(setting.max_num_seqs, setting.max_num_batched_tokens, setting.prefill_chunk_size,
                             setting.max_model_len, max_memory_bytes=max_memory,
                             pad_last_chunk=setting.pad_last_chunk, chunk_granule=setting.chunk_granule)
    return Scheduler(config, memory, kv, view_reads=True)


def replay_run(model: str, dtype: str, setting: ReplaySetting, prompts: list[list[int]], new_tokens: list[int],
               seen_shapes: set) -> dict:
    """Steps of the burst through the scheduler: step records of bench_tight_burst.step_entry's keys that
    step_summary reads, and that summary (`seen_shapes` updated)."""
    from bench_tight_burst import step_summary

    from engine.core.types import FinishReason, Request, SamplingParams

    scheduler = build_scheduler(model, dtype, setting)
    for i, (prompt, m) in enumerate(zip(prompts, new_tokens)):
        scheduler.add(Request(f"b{i}", list(prompt), SamplingParams(max_tokens=m, ignore_eos=True)))
    steps, max_kv = [], 0
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        max_kv = max(max_kv, scheduler.kv.pool_bytes)
        steps.append(dict(
            predicted=out.predicted_transient_bytes, measured=0, free_transient_bytes=out.free_transient_bytes,
            memory_limited=out.memory_limited, chunks=len(out.prefills), decodes=len(out.decodes),
            chunk_shapes=[[c.num_forward_tokens, c.start + c.num_forward_tokens, 0, c.num_pad_tokens]
                          for c in out.prefills],
            forwards=[None] * (len(out.prefills) + (bool(out.decodes) and not out.mixed))))
        sampled = {c.request_id: 1 for c in out.prefills if c.completes_prompt}
        sampled.update({i: 1 for i in out.decodes})
        for request in scheduler.update(out, sampled):
            if request.num_output_tokens >= request.sampling.max_tokens:
                scheduler.finish(request.request_id, FinishReason.LENGTH, request.num_computed_tokens)
    summary = step_summary(steps, seen_shapes)
    for key in ("max_measured_bytes", "num_underpredicted_steps", "underpredicted_steps", "step_ratio_min",
                "step_ratio_median"):
        summary.pop(key)
    return dict(headroom_bytes=setting.headroom_bytes, kv_budget_bytes=scheduler.kv.kv_budget_bytes,
                kv_share_of_headroom=scheduler.kv.kv_budget_bytes / setting.headroom_bytes,
                kv_peak_share_of_headroom=max_kv / setting.headroom_bytes,
                transient_bound_bytes=scheduler.transient_bound_bytes,
                floor_transient_bytes=scheduler.floor_transient_bytes,
                num_chunk_tokens=sum(c[0] for s in steps for c in s["chunk_shapes"]), **summary,
                chunk_shapes_per_step=[[c[:2] for c in s["chunk_shapes"]] for s in steps])


def replay(args, prompts: list[list[int]], new_tokens: list[int], headrooms: list[int],
           weights_bytes: Optional[int]) -> dict:
    """Every (granule, pad) variant at every headroom, each in its own "process": the bench's warm-up
    burst first (at the largest headroom), then the headrooms in order, shapes new to that sequence."""
    weights = weights_bytes or RANDOM_SHAPES[args.model].get("weights_bytes") or 0
    granules = [int(g) for g in args.granules.split(",")]
    pads = [p == "on" for p in (args.pad_last_chunk if args.pad_last_chunk != "auto" else "off").split(",")]
    # the step budget of `--budgets` (its first), else the engine's CUDA default
    budget = {"max_num_batched_tokens": int(args.budgets.split(",")[0])} if args.budgets else {}
    variants = {}
    for granule in granules:
        for pad in pads:
            def setting(headroom: int) -> ReplaySetting:
                return ReplaySetting(headroom, weights, args.max_num_seqs, args.max_model_len, pad, granule, **budget)
            seen: set = set()
            small = [p[: max(8, len(p) // 8)] for p in prompts[:6]]
            replay_run(args.model, args.dtype, setting(max(headrooms)), small,
                       [min(8, m) for m in new_tokens[:6]], seen)
            runs = {str(h): replay_run(args.model, args.dtype, setting(h), prompts, new_tokens, seen)
                    for h in headrooms}
            if not args.steps:
                for run in runs.values():
                    run.pop("chunk_shapes_per_step")
            variants[f"granule_{granule}_pad_{'on' if pad else 'off'}"] = runs
    return dict(method=__doc__.split("\n\n")[0].replace("\n", " "), weights_bytes=weights,
                prompt_tokens=sum(len(p) for p in prompts), variants=variants)


def step_timings(steps: list[dict], granule: int = 128) -> dict:
    """--timings: where a recorded model run's time went (its `steps` records, --steps): decode-only steps
    (in all, and the first of each row count, synchronous or pipelined, which may compile), and prompt-chunk forwards on the grid
    (tokens and context multiples of `granule`) and off it (a prompt's last chunk, with its sampling),
    each at its shape's first forward in the run and repeated. A forward's time: launch to the end of its
    wait (forwards left running into the next step have none)."""
    import statistics

    def ms(values: list) -> Optional[float]:
        return round(1e3 * statistics.median(values), 1) if values else None

    decodes = [s for s in steps if not s["chunk_shapes"]]
    first_rows: dict[str, float] = {}  # "rows" or "rows pipelined" (a decode built on the last one's tokens)
    for s in decodes:
        first_rows.setdefault(f"{s['decodes']}{' pipelined' if s['pipelined'] else ''}", s["duration_s"])
    forwards: dict[str, dict[str, list]] = {g: {"first": [], "repeated": []} for g in ("on_grid", "off_grid")}
    seen: set = set()
    for s in steps:
        for (tokens, context, *_), (launch, waited) in zip(s["chunk_shapes"], s["forwards"]):
            if waited is None:
                continue
            grid = "on_grid" if tokens % granule == 0 and context % granule == 0 else "off_grid"
            forwards[grid]["repeated" if (tokens, context) in seen else "first"].append(waited - launch)
            seen.add((tokens, context))
    return dict(
        decode_steps=len(decodes), decode_s=round(sum(s["duration_s"] for s in decodes), 2),
        first_decode_of_row_count_s={rows: round(t, 3) for rows, t in first_rows.items()},
        chunk_forwards={grid: dict(num=sum(map(len, v.values())), first_median_ms=ms(v["first"]),
                                   repeated_median_ms=ms(v["repeated"]),
                                   total_s=round(sum(map(sum, v.values())), 2))
                        for grid, v in forwards.items()})
