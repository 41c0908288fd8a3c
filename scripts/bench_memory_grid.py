"""Calibration grid of the memory model: measured transient of single prefill chunks (c tokens at
context n) and of batched decode steps (B rows of context n), through this engine, plus a fit.

    python scripts/bench_memory_grid.py --model llama-8b --dtype bfloat16 --variants --out grid.json
    python scripts/bench_memory_grid.py --fit scripts/data/h200_pool_grid.json   # anywhere: arithmetic only

Measure mode runs the engine on one prompt per chunk size (every chunk of it is one grid point:
(c, c), (c, 2c), ... (c, n), the last one with logits), then B prompts decoding together for each
B in --decode-rows (rows aborted one group at a time). `--variants` adds 2-layer random llamas of
other shapes (the per-layer transient does not depend on the layer count), so every term of the
formula varies independently and the coefficients can be separated. Every point carries the raw term
values of engine/core/memory/model.py's formulas, so fitting is a linear problem.

Fit mode: non-negative least squares of measured bytes on the terms, then scaled up so that no
point is under-predicted (the engine needs an upper bound), printed as a TransientCoefficients.
With --backend NAME: a whole coefficient set for that backend, with engine/core/memory/model.py's
layers_in_flight (scanned), step_overhead_bytes and prefill_overhead_bytes, fitted from above
(`envelope_fit`) and checked point by point with MemoryModel itself. --fit-variants llama-8b fits one
model alone (a per-deployment calibration, EngineConfig.memory_coefficients):

    python scripts/bench_memory_grid.py --fit scripts/data/h200_pool_grid.json --backend cuda

--grids stages (MLX's CPU backend): each stage of the engine's chunk loop measured alone (`stage_grid`),
which the CPU fit reads stage by stage. --append --remeasure replaces a grid's points of the models and
grids a run measures again.

Replay mode (--replay-prefill a.json,b.json [--replay-views]): the engine steps of bench_prefill_memory.py
results, predicted again from their recorded plans with --backend's coefficients (default cuda; on CUDA
the ops-8 set); --fit-scale TERMS scales some of them by the one factor that puts the tightest recorded
step at --margin (a calibration from runs of one kind of step):

    python scripts/bench_memory_grid.py --replay-prefill scripts/data/h200_s5_prefill_default.json --replay-views
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import (LLAMA_8B, LLAMA_TEST, DTYPES, LoadedModel, build_random_model,  # noqa: E402
                          emit, environment, free_memory, load_bench_model, random_prompts)
from bench_engine import Meter, StepRecorder, make_engine  # noqa: E402

import mlx.core as mx  # noqa: E402

PREFILL_TERMS = ("prefill_scores", "prefill_mask", "prefill_gather", "prefill_mlp", "prefill_hidden",
                 "prefill_logits", "decode_scores", "prefill_layer_rows")
DECODE_TERMS = ("decode_gather", "decode_paged", "decode_scores", "decode_logits", "decode_mlp", "decode_hidden")

# 2-layer variants: each changes some of heads / hidden / MLP / vocabulary against the 8B shape.
VARIANTS = {
    "8b-2layers": dict(LLAMA_8B, num_hidden_layers=2),
    "d2048-h16-i8192-v32k": dict(LLAMA_8B, num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=128, intermediate_size=8192, vocab_size=32000),
    "d4096-h64-i4096": dict(LLAMA_8B, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=64, intermediate_size=4096),
}
TEST_VARIANTS = {
    "test-2layers": dict(LLAMA_TEST, num_hidden_layers=2),
    "test-wide-mlp": dict(LLAMA_TEST, num_hidden_layers=2, intermediate_size=2048, vocab_size=32000),
    # the shapes of scripts/calibrate_memory.py and tests/engine/test_memory_measured.py (head_dim 64)
    "d256-h4-i512-v32k": dict(LLAMA_TEST, num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=32000),
    "d1024-h16-i2816-v16k": dict(LLAMA_TEST, num_hidden_layers=2, hidden_size=1024, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=64, intermediate_size=2816, vocab_size=16000),
}


def family_variants(spec: str) -> dict:
    """--families: families (model_type, or model_type:bits for mlx-lm's quantized format; all: every one) ->
    the configs of the engine tests' tiny checkpoints of them at hidden size 256
    (tests/engine/test_families.py's memory test; head_dim 64 where the family's config gives it)."""
    from tests.engine.family_checkpoints import FAMILY_CONFIGS, family_config

    names = []
    for name in (n for n in spec.split(",") if n):  # mistral: llama's module and shape
        names += [f for f in FAMILY_CONFIGS if f != "mistral"] if name == "all" else [name]
    out = {}
    for name in names:
        family, _, bits = name.partition(":")
        extra = {} if family in ("llama", "mistral", "qwen2", "phi3") else {"head_dim": 64}
        config = family_config(family, hidden_size=256, intermediate_size=512, **extra)
        if bits:
            config["quantization"] = {"group_size": 32, "bits": int(bits)}
        out[f"{family}{'-q' + bits if bits else ''}-d256"] = config
    return out


def loops_family(config: dict) -> bool:
    """Whether the engine's layer loops run this config's model (the families of
    engine/model/layers/block.py, float weights: engine/model/layers/bound.py)."""
    from engine.core.model_config import SUPPORTED_MODEL_TYPES
    from engine.model.layers.block import LOOP_BLOCKS

    module = SUPPORTED_MODEL_TYPES.get(config.get("model_type", "llama"))
    return (module in LOOP_BLOCKS or module == "gemma3") and not config.get("quantization")


# The families the engine's layer loops ran before they took Qwen3-MoE and Gemma 1-3 (the runs under
# scripts/data that --replay-prefill reads were recorded then: those families ran mlx-lm's modules)
REPLAYED_LOOP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def random_model(label: str, config: dict, base: LoadedModel, init: str, seed: int) -> LoadedModel:
    """A random model of `config` (quantized as its "quantization" says) with `base`'s tokenizer and dtype."""
    from mlx.utils import tree_flatten

    config = dict(config)
    quantization = config.pop("quantization", None)
    model = build_random_model(config, base.dtype, init, seed)
    if quantization:
        from mlx_lm.utils import quantize_model

        model, config = quantize_model(model, config, group_size=quantization["group_size"],
                                       bits=quantization["bits"])
        mx.eval(model.parameters())  # quantized now, not in the first measured forward
    params = tree_flatten(model.parameters())
    return LoadedModel(label, model, base.tokenizer, config, base.dtype, None,
                       sum(p.nbytes for _, p in params), sum(p.size for _, p in params), 0.0)


def shape_of(config: dict, dtype_bytes: int, layer_loops: bool = True) -> dict:
    """The shape's dimensions as the grid's terms read them, and `model_shape`: the engine's ModelShape
    of the model (engine/core/memory/shape.py: a family's extra arrays, its windows), which the fit
    predicts with."""
    from engine.core.memory.shape import ModelShape

    shape = ModelShape.from_config(config, dtype_bytes, module_forwards=not (layer_loops and loops_family(config)))
    return dict(H=shape.num_heads, Hkv=shape.num_kv_heads, d=shape.head_dim, D=shape.hidden_size,
                I=shape.intermediate_size, V=shape.vocab_size, L=shape.num_layers, s=dtype_bytes,
                model_shape=dataclasses.asdict(shape))


def prefill_terms(sh: dict, c: int, n: int, logits: bool) -> dict:
    return dict(prefill_scores=4 * sh["H"] * c * n if c > 1 else 0, prefill_mask=c * n,
                prefill_gather=n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                prefill_mlp=c * sh["I"] * sh["s"], prefill_hidden=c * sh["D"] * sh["s"],
                prefill_logits=4 * sh["V"] * int(logits), decode_scores=4 * sh["H"] * n if c == 1 else 0,
                prefill_layer_rows=sh["I"] * sh["s"] if c > 1 else 0)


def fixed_bytes(sh: dict, p: dict) -> int:
    """The formula's term with no coefficient at a grid point: the copy of a viewed row's KV that a
    chunk ending its prompt reads with its last position (MemoryModel.prefill_chunk_bytes). 0 for a
    point of an older grid (no `copies_viewed_kv`): its engine made no copy, so its measure holds none,
    and subtracting one would let the fit under-predict today's engine, which makes it."""
    copies = (p["kind"] == "prefill" and p.get("copies_viewed_kv") and p["c"] > 1 and p.get("logits")
              and not p.get("gathers", True))
    return p["n"] * sh["Hkv"] * 2 * sh["d"] * sh["s"] if copies else 0


def decode_terms(sh: dict, b: int, n: int, paged: bool = False, block: int = 256) -> dict:
    """`paged`: attention read the pool in place (no gathered copy; the kernel's partials instead, one
    per span of PAGED_PARTIAL_KEYS keys: older grids, measured with one per pool block, keep the terms they
    recorded)."""
    from engine.core.memory.model import PAGED_PARTIAL_KEYS

    spans = -(-n // block) * max(1, block // PAGED_PARTIAL_KEYS)
    return dict(decode_gather=0 if paged else b * n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                decode_paged=b * sh["H"] * spans * (sh["d"] + 2) * 4 if paged else 0,
                decode_scores=4 * b * sh["H"] * n, decode_logits=4 * b * sh["V"],
                decode_mlp=b * sh["I"] * sh["s"], decode_hidden=b * sh["D"] * sh["s"])


def run_steps(engine, recorder, meter, until) -> list[dict]:
    """Step the engine until `until()`; one record per step (predicted, measured, time, plan). `meter`:
    also measures each whole step (None: not, as for pipelined decodes, whose engine measurement spans
    steps and which a reset of MLX's peak in between would cut)."""
    out = []
    while not until():
        if meter is not None:
            meter.begin(engine.stats().kv_allocated_bytes)
        t = time.perf_counter()
        record = recorder.step()
        outputs = record.outputs
        if meter is not None:
            mx.synchronize()
        dt = time.perf_counter() - t
        whole = meter.end(engine.stats().kv_allocated_bytes) if meter is not None else None
        for o in outputs:
            if o.error:
                raise RuntimeError(f"{o.request_id}: {o.error}")
        own = record.memory  # None: the step failed or scheduled nothing
        plan = record.plan
        if plan is None:
            continue
        slices = sorted(record.slice_reads)  # rows whose KV this step read as a view of the pool
        out.append(dict(step_s=dt, measured=own.measured_bytes if own is not None else whole,
                        whole_step_measured=whole, predicted=plan.predicted_transient_bytes,
                        decodes=len(plan.decodes), context_lens=None,
                        chunks=[(c.num_forward_tokens, c.start + c.num_forward_tokens, c.completes_prompt) for c in plan.prefills],
                        outputs=len(outputs), slice_reads=slices))
    return out


def forward_path(engine) -> str:
    """Which forwards the engine runs: "loops" (the engine's layer loops) or "modules" (mlx-lm's), which
    the CPU's two coefficient sets are for (coefficients_for's cpu_math)."""
    return "loops" if engine.execution_paths().chunk_loop else "modules"


def prefill_grid(lm: LoadedModel, chunks: list[int], length: int, shape: dict, label: str,
                 read_slices: bool = True, layer_loops: bool = True) -> list[dict]:
    """`read_slices`: False reads every chunk's KV as a gather (RunnerOptions.read_slices);
    `layer_loops`: False runs mlx-lm's modules (RunnerOptions.layer_loops)."""
    from engine.core.types import SamplingParams

    points = []
    for c in chunks:
        prompt = random_prompts([length], lm.config["vocab_size"], seed=c)[0]
        # a budget of one chunk: every step is one chunk's forward (a larger one takes further chunks)
        engine = make_engine(lm, [length], 4, chunk=c, max_num_batched_tokens=c, max_num_seqs=min(16, c),
                             read_slices=read_slices, layer_loops=layer_loops)
        path = forward_path(engine)
        recorder = StepRecorder(engine)
        meter = Meter()
        engine.add_request("g", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
        steps = run_steps(engine, recorder, meter,
                          lambda: "g" in recorder.finished or recorder.num_output_tokens.get("g", 0) >= 1)
        meter.result(0, None, [0.0], 0.0)
        for st in steps:
            if st["decodes"] or len(st["chunks"]) != 1:
                continue
            cc, n, logits = st["chunks"][0]
            gathers = "g" not in st["slice_reads"]
            terms = prefill_terms(shape, cc, n, logits)
            terms["prefill_gather"] *= gathers
            points.append(dict(kind="prefill", variant=label, path=path, c=cc, n=n, logits=logits, B=1, gathers=gathers,
                               copies_viewed_kv=engine.memory.copies_viewed_kv, measured=st["measured"],
                               predicted=st["predicted"], step_s=st["step_s"],
                               whole_step_measured=st["whole_step_measured"], terms=terms))
        engine.abort("g")
        engine = recorder = None  # the next engine starts from nothing alive but the weights
        free_memory()
    return points


# MLX's CPU allocator's page (Linux x86): an array of a page or more takes whole pages, which the tiny
# model's odd-sized chunks show (TransientCoefficients.allocation_page_bytes, docs/memory.md)
CPU_PAGE_BYTES = 4096
# MemoryModel.chunk_phases' stages where the runner waits between them (phases_apart), by their index
CHUNK_STAGES = ("projections", "attention", "mlp", "head")


def stage_grid(lm: LoadedModel, chunks: list[int], length: int, label: str) -> list[dict]:
    """The stages of the engine's chunk loop where the runner waits between them (MLX's CPU backend,
    ModelRunner.stage_waits): one prompt per chunk size, each chunk's forward built by the engine's
    runner and evaluated one stage at a time as `launch` does, each stage's peak over what was alive
    before the forward. Per chunk a point per kind of stage (CHUNK_STAGES, ChunkPath.forward's order in each
    layer: the KV write's pool arrays and the rotated queries, the attention's blocks and its residual,
    the MLP's norm and its residual; the head: the last stage of a chunk that samples), the largest's peak:
    the fit then sees each stage alone, where a step's peak shows only its largest."""
    from engine.core.types import SamplingParams
    from engine.model.runner import ModelRunner, PrefillWork
    from engine.model.sampling import RequestSampler

    if mx.default_device() != mx.cpu:
        return []  # the chunk loop's stages are waited for on MLX's CPU backend only
    points = []
    for c in chunks:
        # the runner the engine builds on the CPU (Engine's defaults), one row of `length` tokens
        runner, blocks = ModelRunner(lm.model, block_size=256, cpu_math=True, stage_waits=True, max_rows=1,
                                     max_forward_tokens=c), -(-length // 256)
        if runner.chunk_path is None:
            return []  # mlx-lm's modules: a layer is one stage
        runner.grow_pool(blocks)
        runner.add_row("s", list(range(blocks)), RequestSampler(SamplingParams(max_tokens=1), 0))
        prompt = random_prompts([length], lm.config["vocab_size"], seed=c)[0]
        for start in range(0, length, c):
            t, sample = min(c, length - start), start + c >= length
            forward = runner.prefill(PrefillWork("s", prompt[start:start + t], start, sample))
            mx.synchronize()
            base = mx.get_active_memory()  # each stage's peak over what the forward found alive
            peaks: dict = {}
            after_write, residuals = False, 0
            for i, stage in enumerate(forward.stages):
                if i == len(forward.stages) - 1:  # the head, or (a chunk that samples nothing) its KV
                    kind = "head" if sample else None
                elif len(stage) == 2:  # a layer's KV write (its K and V pool arrays) ...
                    kind, after_write, residuals = "projections", True, 0
                elif isinstance(stage[0], list):  # a sparse MLP's own stages (block.moe_mlp)
                    kind = "mlp"
                elif stage[0].ndim == 4:  # ... its rotated queries, then its attention's blocks
                    kind, after_write = "projections" if after_write else "attention", False
                else:  # its residual stream after the attention, then the MLP's norm and the MLP
                    residuals += 1
                    kind = "attention" if residuals == 1 else "mlp"
                mx.reset_peak_memory()
                mx.eval(*stage)
                if kind is not None:
                    peaks[kind] = max(peaks.get(kind, 0), mx.get_peak_memory() - base)
                stage.clear()
            for kind in CHUNK_STAGES:
                if kind in peaks:
                    points.append(dict(kind="stage", stage=kind, variant=label, path="loops", c=t, n=start + t,
                                       logits=sample, B=1, gathers=False, copies_viewed_kv=False,
                                       measured=peaks[kind], predicted=0))
        runner = forward = None
        free_memory()
    return points


def start_decoding(engine, prompts: list[list[int]], max_tokens: int):
    """One request per prompt, stepped until each has decoded once: (recorder, meter, request ids)."""
    from engine.core.types import SamplingParams

    recorder, meter = StepRecorder(engine), Meter()
    ids = [f"d{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(rid, p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    run_steps(engine, recorder, meter, lambda: all(recorder.num_output_tokens.get(i, 0) >= 1 for i in ids))
    return recorder, meter, ids


def keep_rows(recorder, alive: list[str], b: int, grid: str) -> list[str]:
    """Abort all but the first `b` decoding rows; the ones left (StepRecorder: the engine's outputs)."""
    for rid in alive[b:]:
        recorder.abort(rid)
    alive = [i for i in alive[:b] if i not in recorder.finished]
    if len(alive) < b:
        raise RuntimeError(f"{grid} grid: rows finished early ({len(alive)} < {b})")
    return alive


def decode_grid(lm: LoadedModel, rows: list[int], contexts: list[int], shape: dict, label: str,
                steps_per_point: int = 3, layer_loops: bool = True, pipelined: bool = False) -> list[dict]:
    """`pipelined`: the engine's pipelined decode steps (each measured from its launch to its end, while
    the next one's graph is built), else one synchronous decode forward per point."""
    points = []
    rows = sorted(rows, reverse=True)
    for n in contexts:
        b_max = rows[0]
        prompts = random_prompts([n] * b_max, lm.config["vocab_size"], seed=n)
        # Rows that finish their prompt first decode while the others prefill: room for those tokens.
        max_tokens = steps_per_point * (len(rows) + 1) + (n * b_max) // 256 + 8
        # Synchronous decode steps: one forward's transient per point, unless `pipelined` (a pipelined
        # step's window also holds what building the next decode's graph allocates: its KV indices).
        engine = make_engine(lm, [n] * b_max, max_tokens, max_num_seqs=max(16, b_max), async_decode=pipelined,
                             layer_loops=layer_loops)
        path = forward_path(engine)
        recorder, meter, alive = start_decoding(engine, prompts, max_tokens)
        for b in rows:
            alive = keep_rows(recorder, alive, b, "decode")
            free_memory()
            done = [0]

            def until():
                done[0] += 1
                return done[0] > steps_per_point

            for st in run_steps(engine, recorder, None if pipelined else meter, until):
                if st["chunks"] or st["decodes"] != b:
                    continue
                ctx = max(recorder.num_tokens[i] for i in alive) - 1
                paged = engine.memory.paged_decode  # else decode gathers (engine/model/kv_pool.py)
                terms = decode_terms(shape, b, ctx, paged, engine.memory.kv_step)
                points.append(dict(kind="decode", variant=label, path=path, B=b, n=ctx, c=1, logits=True,
                                   gathers=not paged, paged=paged, pipelined=pipelined,
                                   measured=st["measured"], predicted=st["predicted"], step_s=st["step_s"],
                                   whole_step_measured=st["whole_step_measured"], terms=terms))
        meter.result(0, None, [0.0], 0.0)
        keep_rows(recorder, alive, 0, "")
        engine = recorder = None
        free_memory()
    return points


# The engine tests' workloads (tests/engine/test_families.py's memory test, a mixed arrival): prompt
# lengths, max_tokens, the step of arrival of each prompt, prefill_chunk_size, max_num_batched_tokens.
STEP_WORKLOADS = (((165, 100, 275), 4, (0, 0, 0), 128, 256), ((5, 40, 200, 90), 6, (0, 0, 1, 3), 128, 256),
                  ((700, 300, 60, 2), 5, (0, 1, 2, 2), 64, 256), ((900, 520, 33), 3, (0, 0, 4), 256, 1024))


def steps_grid(lm: LoadedModel, label: str) -> list[dict]:
    """Every engine step of `STEP_WORKLOADS` (prompt chunks, decodes, mixed forwards together, as the
    engine schedules them): its plan, its prediction with the coefficients of the time of recording and
    its measured transient (`--check-steps` reads them)."""
    from engine.core.types import SamplingParams

    points = []
    for w, (lengths, max_tokens, arrivals, chunk, budget) in enumerate(STEP_WORKLOADS):
        prompts = random_prompts(list(lengths), lm.config["vocab_size"], seed=w)
        engine = make_engine(lm, list(lengths), max_tokens, chunk=chunk, max_num_batched_tokens=budget,
                             max_num_seqs=4)
        path = forward_path(engine)
        free_memory()
        step, pending = 0, sorted(range(len(lengths)), key=lambda i: arrivals[i])
        while pending or engine.has_unfinished():
            while pending and arrivals[pending[0]] <= step:
                i = pending.pop(0)
                engine.add_request(f"w{w}-{i}", prompts[i], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            record, step = engine.step(), step + 1
            if record.memory is None or record.plan is None:
                continue
            plan = record.plan
            points.append(dict(kind="step", variant=label, path=path, workload=w, decodes=len(plan.decodes),
                               chunks=[(c.num_forward_tokens, c.start + c.num_forward_tokens, c.completes_prompt) for c in plan.prefills],
                               mixed=plan.mixed, pipelined=record.memory.pipelined,
                               predicted=record.memory.predicted_bytes, measured=record.memory.measured_bytes))
        engine = None
        free_memory()
    return points


def check_steps(path: str, slack_bytes: int = 0) -> dict:
    """Predicted / measured of a grid's engine steps (--grids steps) per variant, as recorded: min,
    median, max, and the steps above 1.2 x measured + `slack_bytes`."""
    data = json.loads(Path(path).read_text())
    pts = [p for p in data["points"] if p["kind"] == "step" and p["measured"] > 0]
    out = {}
    for v in sorted({p["variant"] for p in pts}):
        sel = [p for p in pts if p["variant"] == v]
        out[v] = dict(_ratio_stats([p["predicted"] for p in sel], [p["measured"] for p in sel]),
                      underpredicted=sum(p["predicted"] < p["measured"] for p in sel),
                      above_1_2x_plus_slack=sum(p["predicted"] > 1.2 * p["measured"] + slack_bytes for p in sel),
                      smallest_measured_bytes=min(p["measured"] for p in sel))
    return out


def mixed_grid(lm: LoadedModel, chunks: list[int], rows: list[int], contexts: list[int], shape: dict,
               label: str) -> list[dict]:
    """Mixed steps (engine/model/layers/mixed.py): a probe prompt of c tokens in one forward with B
    decoding rows of context n (after a first such probe, unmeasured: on CUDA every new shape builds
    kernels and attention graphs once, and the pool may grow), and the same probe in an engine that does
    not mix (the step's chunk and decode forwards apart: `apart_measured`, what the mixed forward adds
    to). Both engines are chosen at construction (mixed_probes); a probe is a whole prompt, so its step
    is one chunk of c tokens, which ends the prompt (logits), beside the rows."""
    points = []
    rows = sorted(rows, reverse=True)
    for n in contexts:
        mixed, mixes, paged, kv_step = mixed_probes(lm, chunks, rows, n, mixing=True)
        apart = mixed_probes(lm, chunks, rows, n, mixing=False)[0]
        for (b, c), (warm, st, ctx) in mixed.items():
            other = apart.get((b, c))
            if warm is None or st is None or other is None or other[1] is None:
                continue
            apart_st = other[1]
            cc, end, logits = st["chunks"][0]
            gathers = not any(s.startswith("m") for s in st["slice_reads"])
            terms = prefill_terms(shape, cc, end, logits)
            terms["prefill_gather"] *= gathers
            points.append(dict(kind="mixed", variant=label, c=cc, n=end, logits=logits, B=b,
                               decode_n=ctx, gathers=gathers, paged=paged, mixed=mixes,
                               measured=st["measured"], predicted=st["predicted"],
                               apart_measured=apart_st["measured"], apart_predicted=apart_st["predicted"],
                               warm_measured=warm["measured"], warm_step_s=warm["step_s"],
                               step_s=st["step_s"], apart_step_s=apart_st["step_s"], terms=terms,
                               decode_terms=decode_terms(shape, b, ctx, paged, kv_step)))
    return points


def mixed_probes(lm: LoadedModel, chunks: list[int], rows: list[int], n: int, mixing: bool) -> tuple:
    """One engine's probes for `mixed_grid`: rows of context n prefilled in large chunks, then for each
    B (rows aborted one group at a time) and c a warm probe and a measured one. `mixing`: the engine
    mixes every probe step, beyond its transient bound (StepOptions.mix_beyond_bound); else it has no
    mixed forwards (RunnerOptions.mixed_batches=False). Returns ({(B, c): (warm step, probe step, the
    rows' context)}, whether the engine mixes, whether its decodes are paged, its KV step)."""
    from engine.core.types import SamplingParams

    b_max, big = rows[0], max(max(chunks), 512)
    vocab = lm.config["vocab_size"]
    prompts = random_prompts([n] * b_max, vocab, seed=n)
    max_tokens = (n * b_max) // big + len(rows) * len(chunks) * 8 + 16
    # a budget that takes any probe whole beside every row: each probe is one step
    engine = make_engine(lm, [n] * b_max + [max(chunks)], max_tokens, chunk=big,
                         max_num_batched_tokens=max(big, 2048) + b_max, max_num_seqs=max(64, b_max + 1),
                         async_decode=False, mix_beyond_bound=mixing, mixed_batches=mixing)
    recorder, meter, alive = start_decoding(engine, prompts, max_tokens)
    seeds = {("warm", True): 2, ("probe", True): 1, ("probe", False): 0, ("warm", False): 3}
    found = {}
    for b in rows:
        alive = keep_rows(recorder, alive, b, "mixed")
        for c in chunks:
            steps = {}
            for mode in ("warm", "probe"):  # the warm probe builds the shapes' kernels, grows the pool
                free_memory()
                probe = f"m{b}-{c}-{mode}"
                prompt = random_prompts([c], vocab, seed=n + 10 * c + b + seeds[mode, mixing])[0]
                engine.add_request(probe, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
                taken = run_steps(engine, recorder, meter, lambda: probe in recorder.finished)  # noqa: B023
                steps[mode] = next((st for st in taken if st["decodes"] == b and len(st["chunks"]) == 1), None)
            found[b, c] = (steps["warm"], steps["probe"], max(recorder.num_tokens[i] for i in alive) - 1)
    result = (found, engine.execution_paths().mixed_batches, engine.memory.paged_decode, engine.memory.kv_step)
    meter.result(0, None, [0.0], 0.0)
    keep_rows(recorder, alive, 0, "")
    engine = recorder = None
    free_memory()
    return result


def measure(args) -> dict:
    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    chunks = [int(x) for x in args.chunks.split(",")]
    rows = [int(x) for x in args.decode_rows.split(",")]
    contexts = [int(x) for x in args.decode_contexts.split(",")]
    grids = set(args.grids.split(","))
    if grids - {"prefill", "prefill-gathers", "decode", "mixed", "steps", "stages"}:
        raise ValueError(f"--grids {args.grids!r}: expected some of prefill,prefill-gathers,decode,mixed,steps,stages")
    log = (lambda *a: print(*a, file=sys.stderr, flush=True))
    result = dict(bench="memory_grid", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  environment=environment(), points=[], shapes={})
    models = [(args.model, lm)]
    if args.variants:
        table = VARIANTS if args.model == "llama-8b" else TEST_VARIANTS
        for name, cfg in table.items():
            models.append((name, cfg))
    models += [(name, cfg) for name, cfg in family_variants(args.families).items()]
    if args.modules:  # the same models through mlx-lm's modules, where the engine's loops take them
        models += [(f"{name}/modules", m) for name, m in models if loops_family(m if isinstance(m, dict) else m.config)]
    if args.append and args.out and Path(args.out).exists():  # one more run's points in the same grid
        result = {**json.loads(Path(args.out).read_text()), f"argv_{args.grids.replace(',', '_')}": sys.argv[1:]}
        if args.remeasure:  # this run's points replace the grid's of the same models and grids
            result["points"] = [p for p in result["points"]
                                if not remeasured(p, {label for label, _ in models}, grids)]
    # Warm-up (kernels compile on first use): a short prefill and a 2-row decode.
    prefill_grid(lm, [min(chunks)], min(chunks) * 2, shape_of(lm.config, DTYPES[lm.dtype].size), "warmup")
    decode_grid(lm, [2], [min(contexts)], shape_of(lm.config, DTYPES[lm.dtype].size), "warmup", 1)
    for label, m in models:
        t = time.perf_counter()
        loops = not label.endswith("/modules")
        if isinstance(m, dict):
            m = random_model(label, m, lm, args.init, args.seed)
        sh = shape_of(m.config, DTYPES[m.dtype].size, loops)
        result["shapes"][label] = sh
        for _ in range(args.repeat - 1 if "prefill" in grids else 0):  # earlier passes build each shape's kernels: time the last
            prefill_grid(m, chunks, args.prefill_length, sh, label, layer_loops=loops)
        pts = prefill_grid(m, chunks, args.prefill_length, sh, label, layer_loops=loops) if "prefill" in grids else []
        if "prefill-gathers" in grids:  # the same chunks, each reading its KV as a gathered copy
            pts += prefill_grid(m, chunks, args.prefill_length, sh, label, read_slices=False, layer_loops=loops)
        if "decode" in grids:
            pts += decode_grid(m, rows, contexts, sh, label, layer_loops=loops, pipelined=args.pipelined)
        if "steps" in grids:
            pts += steps_grid(m, label)
        if "stages" in grids and loops:
            pts += stage_grid(m, chunks, args.prefill_length, label)
        if "mixed" in grids:
            pts += mixed_grid(m, [int(x) for x in args.mixed_chunks.split(",")],
                              [int(x) for x in args.mixed_rows.split(",")],
                              [int(x) for x in args.mixed_contexts.split(",")], sh, label)
        result["points"] += pts
        log(f"{label}: {len(pts)} points in {time.perf_counter() - t:.1f} s")
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1, default=str) + "\n")
        if m is not lm:
            del m
        free_memory()
    worst = max(result["points"], key=lambda p: p["measured"] / max(p["predicted"], 1))
    result["worst_under_prediction"] = dict(worst, ratio_measured_over_predicted=worst["measured"] / max(worst["predicted"], 1))
    return result


def remeasured(point: dict, labels: set, grids: set) -> bool:
    """Whether a grid's `point` is one a run measuring `grids` of the models `labels` measures again."""
    if point["variant"] not in labels:
        return False
    if point["kind"] == "prefill":  # prefill: chunks read as views; prefill-gathers: every chunk gathered
        return ("prefill-gathers" if point.get("gathers") and "prefill-gathers" in grids else "prefill") in grids
    return {"decode": "decode", "step": "steps", "mixed": "mixed", "stage": "stages"}.get(point["kind"]) in grids


# --------------------------------------------------------------------------- fit
def base_coefficients():
    """The CPU set without its per-forward constants (step_overhead_bytes, prefill_overhead_bytes,
    prefill_layer_rows): what sets fitted elsewhere, and recorded runs' overrides, complete."""
    from engine.core.memory import coefficients as coefs

    return dataclasses.replace(coefs.CPU_COEFFICIENTS, step_overhead_bytes=0, prefill_overhead_bytes=0,
                               prefill_layer_rows=0.0, head_apart=False, phases_apart=False,
                               prefill_attention_hidden=0.0, prefill_projection_hidden=0.0,
                               prefill_head_rows=0.0, attention_query_blocks=1, allocation_page_bytes=0)


def nnls(a, b, iters: int = 5000):
    """Non-negative least squares (projected gradient on the column-scaled problem; numpy only)."""
    import numpy as np

    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    x_a = a / scale
    x = np.clip(np.linalg.lstsq(x_a, b, rcond=None)[0], 0, None)
    step = 1.0 / (np.linalg.norm(x_a, 2) ** 2)
    for _ in range(iters):
        x = np.clip(x - step * (x_a.T @ (x_a @ x - b)), 0, None)
    return x / scale


def layer_scaled_terms(p: dict, sh: dict) -> dict:
    """Terms of a CUDA-shaped formula: every per-layer activation counted for all L layers (measured
    on the H200: MLX frees a buffer when the GPU has run the kernels that read it, and the host
    encodes the whole forward ahead, so each layer's intermediates are alive together), plus the
    contiguous K/V copy each layer's attention makes of its [1, H_kv, n, d] slices."""
    L, s = sh["L"], sh["s"]
    if p["kind"] == "prefill":
        c, n = p["c"], p["n"]
        return dict(L_mlp=L * c * sh["I"] * s, L_hidden=L * c * sh["D"] * s,
                    L_kv_copy=L * 2 * n * sh["Hkv"] * sh["d"] * s, logits=4 * sh["V"] * int(p["logits"]))
    b, n = p["B"], p["n"]
    return dict(L_gather=L * 2 * b * n * sh["Hkv"] * sh["d"] * s if b > 1 else 0,
                L_kv_copy=L * 2 * n * sh["Hkv"] * sh["d"] * s if b == 1 else 0,
                L_mlp=L * b * sh["I"] * s, logits=4 * b * sh["V"])


def _fit_rows(sel: list[dict], names: list[str], key) -> dict:
    import numpy as np

    a = np.array([[key(p).get(t, 0) for t in names] for p in sel], dtype=float)
    b = np.array([p["measured"] for p in sel], dtype=float)
    w = 1.0 / b  # relative error: small chunks count as much as big ones
    x = nnls(a * w[:, None], b * w)
    pred = a @ x
    margin = max(float(np.max(b / np.maximum(pred, 1))), 1.0)  # scaled up: never under-predict
    x_up = x * margin
    ratio = (a @ x_up) / b
    base_pred = np.array([p["predicted"] for p in sel], dtype=float)
    return dict(num_points=len(sel), coefficients={n: round(float(v), 4) for n, v in zip(names, x_up)},
                raw_fit=[float(v) for v in x], margin=margin,
                fitted_over_measured=dict(min=float(ratio.min()), median=float(np.median(ratio)),
                                          max=float(ratio.max())),
                engine_cpu_coefficients_over_measured=dict(
                    min=float((base_pred / b).min()), median=float(np.median(base_pred / b)),
                    max=float((base_pred / b).max())))


def fit(path: str, variants: str = "", layer_scaled: bool = False, base: str = "CPU_COEFFICIENTS") -> dict:
    """Fit the engine's formula (per model: its terms have no layer count) or, with `layer_scaled`,
    the layer-aware formula above across every variant."""
    from engine.core.memory import coefficients as coefs, model as mem

    data = json.loads(Path(path).read_text())
    keep = set(v for v in variants.split(",") if v)
    pts = [p for p in data["points"] if p["variant"] != "warmup" and p["measured"] > 0
           and (not keep or p["variant"] in keep)]
    out: dict = {"variants": sorted({p["variant"] for p in pts}), "layer_scaled": layer_scaled}
    fitted = dataclasses.asdict(getattr(mem, base))
    for kind, terms in (("prefill", PREFILL_TERMS), ("decode", DECODE_TERMS)):
        sel = [p for p in pts if p["kind"] == kind]
        if not sel:
            continue
        if layer_scaled:
            key = (lambda p: layer_scaled_terms(p, data["shapes"][p["variant"]]))
            names = [t for t in key(sel[0])]
        else:
            key = (lambda p: p["terms"])
            names = [t for t in terms if any(p["terms"].get(t) for p in sel)]
        names = [t for t in names if any(key(p).get(t) for p in sel)]
        out[kind] = _fit_rows(sel, names, key)
        if not layer_scaled:
            fitted.update(out[kind]["coefficients"])
    if not layer_scaled:
        out["coefficients"] = fitted
        out["python"] = "TransientCoefficients(" + ", ".join(f"{k}={v}" for k, v in fitted.items()) + ")"
    return out


# --------------------------------------------------------------------------- backend fit (--backend)
# Columns of the joint fit: (coefficient, kind, term key in a point's "terms", scaled by layers in flight)
BACKEND_COLUMNS = (
    ("prefill_scores", "prefill", "prefill_scores", True), ("prefill_mask", "prefill", "prefill_mask", True),
    ("prefill_gather", "prefill", "prefill_gather", True), ("prefill_mlp", "prefill", "prefill_mlp", True),
    ("prefill_hidden", "prefill", "prefill_hidden", True), ("prefill_logits", "prefill", "prefill_logits", False),
    ("prefill_layer_rows", "prefill", "prefill_layer_rows", True),
    ("prefill_attention_hidden", "prefill", "prefill_attention_hidden", True),
    ("prefill_projection_hidden", "prefill", "prefill_projection_hidden", True),
    ("prefill_head_rows", "prefill", "prefill_head_rows", False),
    ("family_rows", "both", "family_rows", True),
    ("decode_gather", "decode", "decode_gather", True), ("decode_paged", "decode", "decode_paged", True),
    ("decode_scores", "decode", "decode_scores", True),
    ("decode_mlp", "decode", "decode_mlp", True), ("decode_hidden", "decode", "decode_hidden", True),
    ("decode_logits", "decode", "decode_logits", False),
)


def _model_shape(sh: dict):
    """The ModelShape of a grid's shape (`shape_of`; grids recorded before it: llamas, from their dimensions)."""
    from engine.core.memory.model import ModelShape

    if "model_shape" in sh:
        fields = dict(sh["model_shape"], layer_windows=tuple(sh["model_shape"].get("layer_windows") or ()))
        return ModelShape(**fields)
    return ModelShape(num_layers=sh["L"], hidden_size=sh["D"], num_heads=sh["H"], num_kv_heads=sh["Hkv"],
                      head_dim=sh["d"], intermediate_size=sh["I"], vocab_size=sh["V"], dtype_bytes=sh["s"])


def _model_of(sh: dict, coefficients, paged: bool = False, copies_viewed_kv: bool = True):
    from engine.core.memory.model import MemoryModel

    return MemoryModel(_model_shape(sh), coefficients=coefficients, paged_decode=paged, mixed=True,
                       copies_viewed_kv=copies_viewed_kv)


def mixed_predictions(pts: list[dict], shapes: dict, coefficients) -> list[Optional[int]]:
    """engine/core/memory/model.py's prediction of every mixed grid point; None where the engine would run that
    step apart (a model no deeper than the set's `mixed_min_layers`, `MemoryModel.mixed`)."""
    from engine.core.memory.model import PrefillChunkPlan

    out = []
    for p in pts:
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")))
        chunk = PrefillChunkPlan(p["c"], p["n"], bool(p["logits"]), gathers=p.get("gathers", True))
        out.append(m.mixed_bytes(chunk, [p["decode_n"]] * p["B"]) if m.mixed else None)
    return out


def mixed_check(path: str, coefficients=None, backend: str = "cuda", every_depth: bool = False) -> dict:
    """Predicted / measured of a grid's mixed points (--grids mixed) by variant, with `coefficients`, or
    (None) what the engine would use for each variant's shape on `backend` under ops 8. `every_depth`:
    also models the engine runs apart (`mixed_min_layers` 0), to see the formula on them."""
    from engine.core.memory.coefficients import coefficients_for

    data = json.loads(Path(path).read_text())
    pts = [p for p in data["points"] if p["kind"] == "mixed" and p["measured"] > 0]
    out: dict = {}
    for v in sorted({p["variant"] for p in pts}):
        idx = [i for i, p in enumerate(pts) if p["variant"] == v]
        coef = coefficients
        if coef is None:
            coef = coefficients_for(backend, 8, _model_shape(data["shapes"][v]))[0]
        if every_depth:
            coef = dataclasses.replace(coef, mixed_min_layers=0)
        pred = {i: q for i, q in zip(idx, mixed_predictions([pts[i] for i in idx], data["shapes"], coef))}
        if pred[idx[0]] is None:
            out[v] = "runs apart (no deeper than mixed_min_layers)"
            continue
        out[v] = dict(_ratio_stats([pred[i] for i in idx], [pts[i]["measured"] for i in idx]),
                      underpredicted=sum(pred[i] < pts[i]["measured"] for i in idx))
    return out


def engine_predictions(pts: list[dict], shapes: dict, coefficients) -> list[int]:
    """engine/core/memory/model.py's own prediction of every grid point (max(layers, logits) in decode, int
    truncation): what the engine will use, so the no-under-prediction check is on this, not the fit."""
    out = []
    for p in pts:  # the copy of a viewed row's KV as this engine makes it: not where the point's said it
        # would not (cpu_math's attention); grids from before the copy were CUDA's, where it now does
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")), p.get("copies_viewed_kv", True))
        gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
        if p["kind"] == "prefill":
            out.append(m.prefill_chunk_bytes(p["c"], p["n"], bool(p["logits"]), gathers=gathers))
        elif p["kind"] == "stage":  # one kind of a chunk's stages alone (`stage_grid`)
            stage = m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)[CHUNK_STAGES.index(p["stage"])]
            out.append(int(stage.bytes(coefficients)))
        else:
            out.append(m.decode_bytes([p["n"]] * p["B"], gathers=gathers))
    return out


def _ceil_sig(x: float, digits: int = 4) -> float:
    """Round up to `digits` significant digits (a literal that stays an upper bound)."""
    import math

    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - digits + 1
    return float(f"{math.ceil(x / 10 ** e) * 10 ** e:.{digits}g}")


def _ratio_stats(pred, meas) -> dict:
    import numpy as np

    r = np.array(pred, dtype=float) / np.array(meas, dtype=float)
    return dict(min=round(float(r.min()), 3), median=round(float(np.median(r)), 3), max=round(float(r.max()), 3),
                num_points=int(r.size))


def nnls_active_set(a, b, max_iter: int = 500):
    """Non-negative least squares, exactly (Lawson and Hanson's active set method; numpy only), on the
    column-scaled problem."""
    import numpy as np

    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    s = a / scale
    n = s.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    for _ in range(max_iter):
        grad = s.T @ (b - s @ x)
        if free.all() or grad[~free].max(initial=-np.inf) <= 1e-10 * max(1.0, np.abs(grad).max()):
            break
        free[np.argmax(np.where(free, -np.inf, grad))] = True
        while True:
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(s[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            shrink = free & (z <= 0)
            alpha = np.min(x[shrink] / np.maximum(x[shrink] - z[shrink], 1e-300))
            x = x + alpha * (z - x)
            free &= x > 1e-12
            x[~free] = 0.0
    return x / scale


def envelope_fit(a, x0=None, penalties=(10.0, 1e3, 1e5), iters: int = 8000):
    """x >= 0 minimizing sum((r - 1)^2) + lam * sum(min(r - 1, 0)^2) with r = a @ x, for growing lam:
    `a`'s rows are divided by the measured bytes, so r is predicted / measured and the fit hugs the
    points from above (an upper bound as tight as the formula allows) instead of through them, then
    needs only a small scale-up. Projected gradient on the column-scaled problem (numpy only)."""
    import numpy as np

    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    s = a / scale
    x = x0 * scale if x0 is not None else np.clip(np.linalg.lstsq(s, np.ones(len(s)), rcond=None)[0], 0, None)
    lipschitz = np.linalg.norm(s, 2) ** 2
    for lam in penalties:
        step = 1.0 / (lipschitz * (1 + lam))
        for _ in range(iters):
            r = s @ x - 1
            x = np.clip(x - step * (s.T @ (np.where(r < 0, 1 + lam, 1.0) * r)), 0, None)
    return x / scale


def point_phases(p: dict, shapes: dict, coefficients) -> tuple:
    """The TransientTerms of a grid point's stages as engine/core/memory/model.py builds them with
    `coefficients` (its layers_in_flight, and which stages it runs apart: the transient is the largest
    stage's), a family's extra arrays and windows included."""
    paged = bool(p.get("paged"))
    if paged and coefficients.decode_paged is None:  # a set not fitted on paged decodes yet: fit one
        coefficients = dataclasses.replace(coefficients, decode_paged=1.0)
    # the copy of a viewed row's KV only where the point's engine made it (`fixed_bytes`)
    m = _model_of(shapes[p["variant"]], coefficients, paged, copies_viewed_kv=bool(p.get("copies_viewed_kv")))
    gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
    if p["kind"] == "prefill":
        return m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)
    if p["kind"] == "stage":  # one kind of a chunk's stages, measured alone (`stage_grid`)
        k = CHUNK_STAGES.index(p["stage"])
        return m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)[k:k + 1]
    return m.decode_phases([p["n"]] * p["B"], gathers=gathers)


def _fit_row(p: dict, shapes: dict, coef, names: list, stage_index: Optional[int] = None) -> tuple:
    """(the point's fit row: its terms per coefficient of `names`, then the per-chunk and per-forward
    constants; its measured bytes less what no coefficient scales). A point whose forward runs in stages
    (`head_apart`, `phases_apart`) is fitted on stage `stage_index`, else on the stage `coef` predicts
    largest: its transient."""
    phases = point_phases(p, shapes, coef)
    stage = phases[stage_index] if stage_index is not None else max(phases, key=lambda t: t.bytes(coef))
    row = [getattr(stage, n) for n in names] + [stage.prefill_overhead_bytes, stage.step_overhead_bytes]
    return row, p["measured"] - stage.fixed_bytes


def fit_backend_at(pts: list[dict], shapes: dict, layers_in_flight: int, base, exclude=()) -> tuple:
    """Joint fit (`envelope_fit`, from NNLS on relative error) of prefill and decode points with the
    per-layer terms counted min(L, layers_in_flight) times, one constant per forward and one more per
    prompt chunk; then every byte coefficient scaled up (and rounded up) until engine_predictions()
    under-predicts no point. A coefficient whose term is zero at every point (e.g. prefill_gather when
    every chunk read a view) keeps `base`'s value; one named in `exclude` is 0 (its term left out of the
    formula). Where the forwards run in stages (`base.head_apart`, `phases_apart`) each point is fitted on
    its largest stage (`_fit_row`) as the previous pass's fit predicts it: the first pass on the stages
    `_mlp_stages` guesses, by least squares (NNLS) alone, the next ones from above; the pass whose scaled
    fit has the least mean log ratio is kept. A model whose chunks' stages were measured alone
    (`stage_grid`) is fitted on those, each on its own stage, and its prompt chunks' peaks only checked
    (the scale-up above them). Returns (coefficients, predictions)."""
    import numpy as np

    names = [c[0] for c in BACKEND_COLUMNS]
    coef = dataclasses.replace(base, layers_in_flight=layers_in_flight)
    staged = {p["variant"] for p in pts if p["kind"] == "stage"}
    fitted = [p for p in pts if p["kind"] != "prefill" or p["variant"] not in staged]
    stages = _mlp_stages(fitted) if base.phases_apart else [None] * len(fitted)
    best = None
    for first in [True] + [False] * (4 if base.head_apart or base.phases_apart else 0):
        rows, b = zip(*(_fit_row(p, shapes, coef, names, k) for p, k in zip(fitted, stages)))
        a, b = np.array(rows, dtype=float), np.maximum(np.array(b, dtype=float), 1.0)
        seen = np.abs(a).max(axis=0) > 0
        for i, name in enumerate(names + ["prefill_overhead_bytes", "step_overhead_bytes"]):
            if name in exclude:
                a[:, i] = 0
        fit_cols = np.abs(a).max(axis=0) > 0
        x = np.zeros(a.shape[1])
        rel = a[:, fit_cols] / b[:, None]
        if base.head_apart or base.phases_apart:  # least squares of the ratios first: the stages' split
            start = nnls_active_set(rel, np.ones_like(b))
            x[fit_cols] = start if first else envelope_fit(rel, start)
        else:
            x[fit_cols] = envelope_fit(rel, nnls(rel, np.ones_like(b)))
        fields = {n: float(v) if ok or n in exclude else getattr(base, n)
                  for n, v, ok in zip(names, x[:-2], seen[:-2])}  # base's None (decode_paged) stays None
        fields.update(layers_in_flight=layers_in_flight, prefill_overhead_bytes=float(x[-2]),
                      step_overhead_bytes=float(x[-1]))
        coef = dataclasses.replace(base, **fields)
        scaled, pred = _scale_above(pts, shapes, base, fields)
        score = float(np.mean(np.log(np.array(pred, dtype=float) / [p["measured"] for p in pts])))
        if best is None or score < best[0]:
            best = (score, scaled, pred)
        stages = [None] * len(fitted)  # the next pass: each point on the stage this fit predicts largest
    return best[1], best[2]


def _mlp_stages(pts: list[dict]) -> list:
    """The first pass's stage of each point of a fit whose prompt chunks run their layers' projections,
    attention and MLP apart (MemoryModel.chunk_phases: 0, 1, 2): a chunk measured within 5% of the least
    of its series (one variant, chunk size and kind of read, over contexts) is fitted on its MLP stage,
    which does not grow with the context; the others on their attention stage; decodes, a prompt's last
    chunks (a chunk size of their own) and the projections' stages measured alone (`stage_grid`) on
    their largest stage as the base predicts it."""
    series: dict = {}
    for p in pts:
        if p["kind"] == "prefill":
            series.setdefault((p["variant"], p["c"], p.get("gathers", True)), []).append(p["measured"])
    stages = []
    for p in pts:
        measured = series.get((p["variant"], p["c"], p.get("gathers", True)), []) if p["kind"] == "prefill" else []
        if len(measured) < 3:  # a decode, or a prompt's last chunk (its own size): as the base predicts
            stages.append(None)
        else:
            stages.append(2 if p["measured"] <= 1.05 * min(measured) else 1)
    return stages


def _scale_above(pts: list[dict], shapes: dict, base, fields: dict) -> tuple:
    """Scale a fit's coefficients up, round up and re-check (int truncation, decode's max) until
    engine_predictions() under-predicts no point: (coefficients, predictions). Each coefficient by the
    largest measured / predicted of the points where its term is in the stage that holds their transient
    (one stage per forward where they run together: then by that kind's largest, prefill or decode). A
    chunk's peak of a model whose chunks' stages were measured alone (`stage_grid`) is held by the stage
    measured largest at its size and context (or by its attention where it gathers and that is larger)."""
    import numpy as np

    names = [c[0] for c in BACKEND_COLUMNS] + ["prefill_overhead_bytes", "step_overhead_bytes"]
    b = np.array([p["measured"] for p in pts], dtype=float)
    staged = base.head_apart or base.phases_apart
    group = {c[0]: c[1] for c in BACKEND_COLUMNS}
    group["prefill_overhead_bytes"] = "prefill"
    held: dict = {}  # (variant, chunk, context) -> the kind of stage measured largest there, its bytes
    for p in pts:
        key = (p["variant"], p.get("c"), p["n"])
        if p["kind"] == "stage" and p["measured"] > held.get(key, ("", 0))[1]:
            held[key] = (p["stage"], p["measured"])
    for _ in range(20):
        coef = dataclasses.replace(base, **fields)
        pred = np.maximum(np.array(engine_predictions(pts, shapes, coef), dtype=float), 1)
        margin = dict.fromkeys(names, 1.0)
        for p, bv, pv in zip(pts, b, pred):
            stage = _holding_stage(p, shapes, coef, held) if staged else None
            for n in names:
                if (getattr(stage, n) if staged else group.get(n, p["kind"]) == p["kind"]):
                    margin[n] = max(margin[n], bv / pv)
        fields = {k: (v if k not in margin or v is None else _ceil_sig(v * margin[k] * (1 + 1e-9)))
                  for k, v in fields.items()}
        for k in ("step_overhead_bytes", "prefill_overhead_bytes"):
            fields[k] = math_ceil(fields[k])
        coef = dataclasses.replace(base, **fields)
        pred = engine_predictions(pts, shapes, coef)
        if all(pv >= mv for pv, mv in zip(pred, b)):
            return coef, pred
    raise RuntimeError("could not scale the fit above every point")


def _holding_stage(p: dict, shapes: dict, coef, held: dict):
    """The stage (TransientTerms) of a grid point that holds its transient (`_scale_above`): the one
    `coef` predicts largest, or for a chunk whose stages were measured alone the one measured largest."""
    phases = point_phases(p, shapes, coef)
    kind = held.get((p["variant"], p.get("c"), p["n"])) if p["kind"] == "prefill" else None
    if kind is None:
        return max(phases, key=lambda t: t.bytes(coef))
    stage = phases[CHUNK_STAGES.index(kind[0])]
    attention = phases[CHUNK_STAGES.index("attention")]
    return attention if p.get("gathers", True) and attention.bytes(coef) > stage.bytes(coef) else stage


def math_ceil(x: float) -> int:
    import math

    return int(math.ceil(x))


def largest_per_chunk(pts: list[dict], shapes: dict) -> list[dict]:
    """Prefill points reduced to the largest of each (variant, chunk size, gathers), measured less the
    formula's fixed terms (what the fitted terms explain); decode points kept. For a backend whose chunk
    transient levels off as the context grows (CUDA: attention never materializes the scores), fitting
    only those makes the bound hug each chunk size's worst case instead of every short-context point
    below it."""
    top: dict = {}
    fitted = {id(p): p["measured"] - fixed_bytes(shapes[p["variant"]], p) for p in pts}
    for p in pts:
        if p["kind"] == "prefill":
            key = (p["variant"], p["c"], p.get("gathers", True))
            if key not in top or fitted[id(p)] > fitted[id(top[key])]:
                top[key] = p
    return list(top.values()) + [p for p in pts if p["kind"] != "prefill"]


def fit_backend(path: str, variants: str = "", backend: str = "cuda", max_layers_in_flight: int = 0,
                exclude: str = "", chunk_maxima: bool = False, layers_in_flight: int = 0,
                forward_path: str = "", margin_bytes: int = 0, margin: float = 1.0) -> dict:
    """Fit a backend's TransientCoefficients (engine/core/memory/model.py's formulas, with layers_in_flight and
    step_overhead_bytes) to a grid JSON: for every layers_in_flight from 1 to the deepest model of the
    grid, the joint scaled-up fit above; keep the one with the smallest geometric mean of predicted /
    measured. With one depth in the grid layers_in_flight is not identifiable (it only rescales the
    per-layer coefficients): it is then that depth (valid for models up to that depth), or
    `layers_in_flight` if given (e.g. the window a multi-depth fit found, so that the terms the grid
    does not fit, kept at their base values, count as many layers as in the backend's set)."""
    import numpy as np

    from engine.core.memory import coefficients as coefs, model as mem

    data = json.loads(Path(path).read_text())
    keep = set(v for v in variants.split(",") if v)
    pts = [p for p in data["points"] if p["variant"] != "warmup" and p["measured"] > 0
           and p["kind"] in ("prefill", "decode", "stage")
           and (not keep or p["variant"] in keep) and (not forward_path or p.get("path", "loops") == forward_path)]
    shapes = data["shapes"]
    for p in pts:  # grids measured before a term existed: its value from the point's shape
        if p["kind"] == "prefill":
            p["terms"] = {**prefill_terms(shapes[p["variant"]], p["c"], p["n"], bool(p["logits"])), **p["terms"]}
    every = pts
    if chunk_maxima:
        pts = largest_per_chunk(pts, shapes)
    depths = sorted({shapes[p["variant"]]["L"] for p in pts})
    top = max_layers_in_flight or depths[-1]
    candidates = list(range(1, top + 1)) if len(depths) > 1 else [depths[-1]]
    if layers_in_flight:
        candidates = [layers_in_flight]
    # sampling: the CPU value (no sampled rows in the grid); a decode's head apart from its layers on the
    # CPU (the runner waits between a forward's stages there)
    # and, through the engine's loops, each layer's attention apart from its MLP, its queries in blocks
    phases = backend == "cpu" and forward_path == "loops"
    from engine.model.layers.cpu_math import QUERY_BLOCKS

    base = dataclasses.replace(base_coefficients(), head_apart=backend == "cpu", phases_apart=phases,
                               prefill_attention_hidden=base_coefficients().prefill_hidden * phases,
                               prefill_projection_hidden=base_coefficients().prefill_hidden * phases,
                               allocation_page_bytes=CPU_PAGE_BYTES if phases else 0,
                               attention_query_blocks=QUERY_BLOCKS if phases else 1)
    best = None
    scan = {}
    for k in candidates:
        coef, pred = fit_backend_at(pts, shapes, k, base, tuple(t for t in exclude.split(",") if t))
        score = float(np.exp(np.mean(np.log(np.array(pred, dtype=float) / [p["measured"] for p in pts]))))
        scan[k] = round(score, 3)
        if best is None or score < best[0]:
            best = (score, coef, pred)
    _, coef, pred = best
    if margin_bytes or margin != 1.0:  # beyond the grid's points: every byte coefficient and the constant raised
        scaled = {c[0]: _ceil_sig(getattr(coef, c[0]) * margin) for c in BACKEND_COLUMNS
                  if getattr(coef, c[0]) is not None}
        coef = dataclasses.replace(coef, **scaled, prefill_overhead_bytes=math_ceil(coef.prefill_overhead_bytes * margin),
                                   step_overhead_bytes=math_ceil(coef.step_overhead_bytes * margin) + margin_bytes)
        pred = engine_predictions(pts, shapes, coef)
    if chunk_maxima:  # checked on every point of the grid
        pts = every
        pred = engine_predictions(pts, shapes, coef)
        if any(pv < p["measured"] for pv, p in zip(pred, pts)):
            raise RuntimeError("a point below its chunk size's largest is under-predicted")
    meas = [p["measured"] for p in pts]
    out = dict(grid=path, backend=backend, forward_path=forward_path or None,
               variants=sorted({p["variant"] for p in pts}), excluded_terms=exclude,
               chunk_maxima=chunk_maxima, margin=margin, margin_bytes=margin_bytes,
               environment_mlx_env=data.get("environment", {}).get("mlx_env"),
               geometric_mean_ratio_by_layers_in_flight=scan,
               predicted_over_measured=_ratio_stats(pred, meas), by_group={})
    for v in out["variants"]:
        for kind in ("prefill", "decode", "stage"):
            idx = [i for i, p in enumerate(pts) if p["variant"] == v and p["kind"] == kind]
            if idx:
                out["by_group"][f"{v}/{kind}"] = _ratio_stats([pred[i] for i in idx], [meas[i] for i in idx])
    fields = dataclasses.asdict(coef)
    fields.pop("mixed_min_layers")  # not fitted: EngineConfig.memory_coefficients keeps the backend's
    out["coefficients"] = fields
    out["python"] = (f"{backend.upper()}_COEFFICIENTS = TransientCoefficients(\n    "
                     + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ",\n)")
    return out


# --------------------------------------------------------------------------- replay (--replay-prefill)
def prefill_bench_plans(data: dict, views: bool = False) -> list:
    """StepPlans of the engine way of a bench_prefill_memory.py JSON, rebuilt from what each step
    recorded (chunks as (tokens, context end), number of decoding rows) and the prompt lengths: a chunk
    computes logits when it ends a prompt; a prompt of P tokens whose last chunk ran j steps ago decodes
    with P + j keys; rows are greedy (the bench's SamplingParams); `views`: every chunk read its row as a
    view of the pool (the JSON does not record it). Checked by recomputing the recorded predictions
    (`replay_prefill`)."""
    from engine.core.memory.model import PrefillChunkPlan, StepPlan

    lengths = sorted(data["lengths"])
    finished: dict = {}  # prompt length -> step index of its last chunk
    plans = []
    for i, st in enumerate(data["ways"]["engine"]["steps"]):
        ends = [end for _, end in st["chunks"]]
        pending = [n for n in lengths if n not in finished]
        chunks = tuple(PrefillChunkPlan(c, end, computes_logits=end in pending, gathers=not views)
                       for c, end in st["chunks"])
        decoding = sorted(finished.items())
        if len(decoding) != st["decodes"]:
            raise ValueError(f"step {i}: {st['decodes']} decoding rows recorded, {len(decoding)} rebuilt")
        plans.append(StepPlan(decode_context_lens=tuple(n + (i - k) for n, k in decoding), prefill_chunks=chunks))
        for n in pending:
            if n in ends:
                finished[n] = i
    return plans


def replay_prefill(path: str, backend: str = "cuda", views: bool = False, coefficients: Optional[dict] = None) -> dict:
    """Predicted / measured transient of every engine step of a prefill benchmark JSON, with the
    recorded plans and `backend`'s coefficients (pure arithmetic on engine/core/memory/model.py). Decodes are
    paged when the run's engine asked for it on a GPU. The rebuilt plans are checked first: they must
    give the predictions the run recorded, with the coefficients it ran with. Those are known for a run on
    the CPU (the CPU set) and for one with `memory_coefficients` in its config (complete sets, as the fit
    prints them), or the CPU set for GPU runs from before the CUDA sets; for other runs
    `recorded_predictions_reproduced` is None."""
    from bench_common import RANDOM_SHAPES

    from engine.core.memory import coefficients as coefs, model as mem

    path, _, key = path.partition(":")  # FILE:KEY: the run under KEY of a file of several
    data = json.loads(Path(path).read_text())
    data = data[key] if key else data
    if data["model"] not in RANDOM_SHAPES:  # the JSON records the model's name, not its shape
        raise ValueError(f"model {data['model']!r}: only the random shapes' are known here ({sorted(RANDOM_SHAPES)})")
    config = RANDOM_SHAPES[data["model"]]
    loops = config.get("model_type", "llama") in REPLAYED_LOOP_FAMILIES and not config.get("quantization")
    shape = mem.ModelShape.from_config(config, DTYPES[data["dtype"]].size, module_forwards=not loops)
    engine = data["ways"]["engine"]
    steps, config = engine["steps"], engine.get("config", {})
    on_gpu = "gpu" in str(data["environment"].get("device", ""))
    # recorded before EngineConfig.execution: a top-level field
    paged = bool(config.get("execution", {}).get("paged_attention", config.get("paged_attention"))) and on_gpu \
        and loops  # only the engine's loops read the pool in place
    plans = prefill_bench_plans(data, views)
    mixed = [bool(st.get("mixed")) for st in steps]  # decode rows in the first chunk's forward
    carried = deferred_steps(data, plans)
    recorded = None
    if not on_gpu:
        recorded = coefs.coefficients_for_backend("cpu")
    elif config.get("memory_coefficients"):
        recorded = coefs.with_overrides(base_coefficients(), config["memory_coefficients"])
    wanted = [st["predicted"] for st in steps]
    reproduced = None
    if recorded is not None:
        check = mem.MemoryModel(shape, coefficients=recorded, paged_decode=paged, copies_viewed_kv=False)
        again = _carry([check.step_transient_bytes(pl, mixed=m) for pl, m in zip(plans, mixed)], carried)
        if again != wanted:  # the rebuilt plans are the engine's
            raise ValueError(f"rebuilt plans do not reproduce the recorded predictions: {again}")
        reproduced = True
    else:  # GPU runs of engines that predicted with the CPU set (before the CUDA sets existed)
        cpu = mem.MemoryModel(shape, coefficients=coefs.coefficients_for_backend("cpu"), copies_viewed_kv=False)
        if _carry([cpu.step_transient_bytes(pl, mixed=m) for pl, m in zip(plans, mixed)], carried) == wanted:
            reproduced = True
    # the engine's set for the shape (a shape calibration where one ships), or `coefficients` (complete
    # but for a family's `family_rows` in older fits: the backend's)
    family = dict(family_rows=coefs.coefficients_for_backend(backend, 8).family_rows)
    coef = (coefs.with_overrides(base_coefficients(), {**family, **coefficients}) if coefficients
            else coefs.coefficients_for(backend, 8, shape)[0])
    # the recorded runs' engines read a viewed chunk's last query without a copy
    model = mem.MemoryModel(shape, coefficients=coef, paged_decode=paged, copies_viewed_kv=False)
    own = [model.step_transient_bytes(pl, mixed=m) for pl, m in zip(plans, mixed)]
    pred, carried = _carry(own, carried), _carried_above(own, carried)
    meas = [st["measured"] for st in steps]
    peak = max(range(len(steps)), key=lambda i: meas[i])
    ratios = [p / m for p, m in zip(pred, meas)]
    own = [r for r, c in zip(ratios, carried) if not c]  # a carried step may have measured a tail alone
    return dict(file=path, backend=backend, mlx_env=data["environment"].get("mlx_env"), views=views,
                paged_decodes=paged, recorded_predictions_reproduced=reproduced, coefficients=coef,
                steps=[dict(predicted=p, measured=m, ratio=round(r, 3), carried=c)
                       for p, m, r, c in zip(pred, meas, ratios, carried)],
                min_uncarried_step_ratio=round(min(own), 3), max_uncarried_step_ratio=round(max(own), 3),
                peak_step=peak, ratio_at_peak_step=round(ratios[peak], 3),
                max_predicted_over_max_measured=round(max(pred) / max(meas), 3),
                min_step_ratio=round(min(ratios), 3), max_step_ratio=round(max(ratios), 3),
                underpredicted_steps=sum(r < 1 for r in ratios),
                max_predicted_bytes=max(pred), max_measured_bytes=max(meas))


def fit_scale(paths: list[str], backend: str, views: bool, coefficients: Optional[dict], terms: list[str],
              margin: float) -> dict:
    """One factor for the coefficients `terms` of the replay's set (`replay_prefill`: the engine's for
    the shape, or `coefficients` over the backend's) such that the tightest step of the recorded runs
    (a carried one aside) is predicted at `margin` x its measure, from above: a calibration of a model
    whose runs measured one kind of step (e.g. one chunk size), the other terms kept. Prints the set."""
    first = replay_prefill(paths[0], backend, views, coefficients)["coefficients"]
    fixed = {f.name: getattr(first, f.name) for f in dataclasses.fields(first)
             if isinstance(getattr(first, f.name), (int, float)) and not isinstance(getattr(first, f.name), bool)
             and f.name != "mixed_min_layers"}

    def tightest(factor: float) -> float:
        over = {**fixed, **{t: fixed[t] * factor for t in terms}}
        return min(replay_prefill(f, backend, views, over)["min_uncarried_step_ratio"] for f in paths)

    low, high = 0.0, 4.0
    for _ in range(40):  # the tightest ratio grows with the factor
        mid = (low + high) / 2
        low, high = (mid, high) if tightest(mid) < margin else (low, mid)
    scaled = {**fixed, **{t: _ceil_sig(fixed[t] * high) for t in terms}}
    runs = [replay_prefill(f, backend, views, scaled) for f in paths]
    for run in runs:
        run.pop("coefficients")
    return dict(terms=terms, margin=margin, factor=round(high, 4), coefficients=scaled, runs=runs)


def deferred_steps(data: dict, plans: list) -> list[bool]:
    """Per step of a prefill benchmark's engine run: whether its record also holds the previous step's
    last forward, left running into it (StepExecutor's overlapped steps: a last prompt chunk that samples
    nothing; the record then carries that forward's prediction and measure). Known from the run's config
    or from a record whose prediction is above its plan's."""
    engine = data["ways"]["engine"]
    config = engine.get("config", {})
    overlap = config.get("overlap_steps", config.get("execution", {}).get("overlap_steps")) or any(
        st.get("plan_predicted") is not None and st["predicted"] > st["plan_predicted"] for st in engine["steps"])
    ends = [bool(pl.prefill_chunks) and not pl.prefill_chunks[-1].computes_logits for pl in plans]
    return [bool(overlap) and i > 0 and ends[i - 1] for i in range(len(plans))]


def _carry(predictions: list[int], carried: list[bool]) -> list[int]:
    """Each step's prediction as its record holds it: with the previous step's where that step's last
    forward ran into it (`deferred_steps`; the executor records the larger)."""
    return [max(p, predictions[i - 1]) if c else p for i, (p, c) in enumerate(zip(predictions, carried))]


def _carried_above(predictions: list[int], carried: list[bool]) -> list[bool]:
    """The steps whose recorded prediction is the previous step's deferred chunk's, above their own: their
    measure may be that chunk's tail alone, so their ratio says nothing of the formula's tightness."""
    return [c and predictions[i - 1] > p for i, (p, c) in enumerate(zip(predictions, carried))]


def merge_grids(prefill_path: str, decode_path: str) -> dict:
    """One grid of the prefill points of both grids and the decode points of `decode_path` (same
    variants), e.g. to refit after a change of the decode kernel alone (a second machine's prefill
    points widen the fit's envelope). The decode points' terms are recomputed from their shapes with
    this script's formulas: `decode_path` must have been measured with the current kernel."""
    pre, dec = (json.loads(Path(f).read_text()) for f in (prefill_path, decode_path))
    missing = {p["variant"] for p in dec["points"]} - set(pre["shapes"])
    if missing:
        raise ValueError(f"variants {sorted(missing)} of {decode_path} are not in {prefill_path}")
    points = [p for p in pre["points"] + dec["points"] if p["kind"] == "prefill"]
    for p in dec["points"]:
        if p["kind"] == "decode":
            terms = decode_terms(dec["shapes"][p["variant"]], p["B"], p["n"], bool(p.get("paged")))
            points.append({**p, "terms": terms})
    return dict(bench="memory_grid_merged", prefill_from=prefill_path, decode_from=decode_path,
                model=pre.get("model"), dtype=pre.get("dtype"), environment=dec["environment"],
                shapes=pre["shapes"], points=points)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit", default=None, help="fit coefficients to a grid JSON (no measuring)")
    p.add_argument("--merge", default=None, metavar="GRID,DECODE_GRID",
                   help="write (--out) one grid of both's prefill points and the second's decode points")
    p.add_argument("--fit-variants", default="", help="--fit: only these variants (comma-separated)")
    p.add_argument("--fit-path", default="", choices=["", "loops", "modules"],
                   help="--backend: only the points of forwards through the engine's layer loops, or mlx-lm's "
                        "modules (the CPU's two sets; grids recorded before the label: loops)")
    p.add_argument("--layer-scaled", action="store_true", help="--fit: the layer-aware CUDA formula")
    p.add_argument("--backend", default=None,
                   help="--fit: fit a whole TransientCoefficients set for this backend (e.g. cuda) with "
                        "layers_in_flight and step_overhead_bytes; prints its Python literal")
    p.add_argument("--check-steps", default=None, metavar="GRID_JSON",
                   help="predicted / measured of a grid's engine steps (--grids steps) per variant")
    p.add_argument("--slack-bytes", type=int, default=0,
                   help="--check-steps: count the steps predicted above 1.2 x measured + this")
    p.add_argument("--append", action="store_true",
                   help="measure mode: add the points and shapes to --out's grid instead of replacing it")
    p.add_argument("--remeasure", action="store_true",
                   help="--append: the run's points replace the grid's points of the same models and --grids")
    p.add_argument("--check-mixed", default=None, metavar="GRID_JSON",
                   help="predicted / measured of grids' mixed points (comma-separated) with --backend's set "
                        "(default cuda, the ops-8 set)")
    p.add_argument("--replay-coefficients", default=None, metavar="FIT_JSON",
                   help="--replay-prefill with the coefficients of a --fit --json output (e.g. a per-model fit)")
    p.add_argument("--fit-scale", default=None, metavar="TERMS",
                   help="--replay-prefill: scale these coefficients (comma-separated) by one factor so that the "
                        "tightest recorded step is predicted at --margin x its measure (fit_scale)")
    p.add_argument("--replay-views", action="store_true",
                   help="--replay-prefill: the run's prompt chunks read their rows as views of the pool")
    p.add_argument("--replay-prefill", default=None,
                   help="bench_prefill_memory.py JSONs (comma-separated): the engine steps' predicted / "
                        "measured with --backend's coefficients (default cuda), from the recorded plans")
    p.add_argument("--exclude-terms", default="",
                   help="--backend: coefficients fixed at 0, their terms left out (comma-separated; e.g. "
                        "prefill_scores,prefill_mask where attention never materializes the scores)")
    p.add_argument("--chunk-maxima", action="store_true",
                   help="--backend: fit each chunk size's largest prefill point only (largest_per_chunk)")
    p.add_argument("--layers-in-flight", type=int, default=0,
                   help="--backend: fit with this layers_in_flight only (default: scan, or the grid's depth)")
    p.add_argument("--max-layers-in-flight", type=int, default=0, help="--backend: scan 1..this (default: deepest)")
    p.add_argument("--margin", type=float, default=1.0,
                   help="--backend: the fit's byte coefficients and constants times this (see --margin-bytes)")
    p.add_argument("--margin-bytes", type=int, default=0,
                   help="--backend: added to the fit's step_overhead_bytes (what the grid's fresh process does "
                        "not see: a long-running one serves arrays from larger cached buffers)")
    p.add_argument("--model", default="llama-8b")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--init", choices=["normal", "zeros"], default="normal")
    p.add_argument("--chunks", default="128,256,512,1024,2048")
    p.add_argument("--prefill-length", type=int, default=8192, help="one prompt per chunk size, this long")
    p.add_argument("--decode-rows", default="16,8,4,2,1")
    p.add_argument("--decode-contexts", default="1024,4096,8192")
    p.add_argument("--grids", default="prefill,decode",
                   help="which grids to measure: some of prefill,prefill-gathers,decode,mixed,steps (prefill-gathers: "
                        "the prefill grid with every chunk's KV gathered; mixed: a chunk's forward with decoding "
                        "rows, engine/model/layers/mixed.py, beside the same step apart; steps: every engine step "
                        "of the engine tests' workloads, STEP_WORKLOADS)")
    p.add_argument("--mixed-chunks", default="16,128,512,2048")
    p.add_argument("--mixed-rows", default="32,8,2")
    p.add_argument("--mixed-contexts", default="1024,8192")
    p.add_argument("--variants", action="store_true", help="also 2-layer models of other shapes")
    p.add_argument("--families", default="",
                   help="also the engine tests' tiny checkpoints of these families at hidden size 256 "
                        "(comma-separated model types, model_type:bits for quantized ones, or all)")
    p.add_argument("--modules", action="store_true",
                   help="also every model through mlx-lm's modules (RunnerOptions.layer_loops off): the "
                        "forwards the CPU's cpu-mlx-attention set is for")
    p.add_argument("--pipelined", action="store_true",
                   help="decode grid: the engine's pipelined decode steps, not synchronous ones")
    p.add_argument("--repeat", type=int, default=1, help="prefill passes per model (the last is kept)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.merge:
        result = merge_grids(*args.merge.split(","))
        emit(result, args.json, args.out)
        return
    if args.check_steps:
        emit(check_steps(args.check_steps, args.slack_bytes), True, None)
        return
    if args.check_mixed:
        from engine.core.memory import coefficients as coefs, model as mem

        backend = args.backend or "cuda"
        result = {f: {"engine's sets": mixed_check(f, None, backend),
                      "backend set (no shape calibration)": mixed_check(f, coefs.coefficients_for_backend(backend, 8)),
                      "engine's sets, models of every depth mixing": mixed_check(f, None, backend, every_depth=True)}
                  for f in args.check_mixed.split(",")}
        emit(result, True, None)
        return
    if args.replay_prefill:
        coefficients = None
        if args.replay_coefficients:
            fitted = Path(args.replay_coefficients).read_text().strip().splitlines()[-1]
            coefficients = json.loads(fitted)["coefficients"]
        if args.fit_scale:
            result = fit_scale(args.replay_prefill.split(","), args.backend or "cuda", args.replay_views,
                               coefficients, args.fit_scale.split(","), args.margin)
        else:
            result = [replay_prefill(f, args.backend or "cuda", args.replay_views, coefficients)
                      for f in args.replay_prefill.split(",")]
            for run in result:
                run.pop("coefficients")
    elif args.fit and args.backend:
        result = fit_backend(args.fit, args.fit_variants, args.backend, args.max_layers_in_flight,
                             args.exclude_terms, args.chunk_maxima, args.layers_in_flight, args.fit_path,
                             args.margin_bytes, args.margin)
        if not args.json:
            print(result.pop("python"))
    else:
        result = fit(args.fit, args.fit_variants, args.layer_scaled) if args.fit else measure(args)
    emit(result, args.json, None if args.fit else args.out)


if __name__ == "__main__":
    main()
