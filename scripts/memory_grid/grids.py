"""The grid's measurements of single forwards through this engine: prompt chunks (`prefill_grid`), the
stages of the CPU's chunk loop alone (`stage_grid`) and batched decode steps (`decode_grid`)."""

from __future__ import annotations

import time

import mlx.core as mx

from bench_common import LoadedModel, free_memory, random_prompts
from bench_engine import Meter, StepRecorder, make_engine
from .shapes import CHUNK_STAGES, decode_terms, prefill_terms


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
                               copies_viewed_kv=engine.memory.copies_viewed_kv,
                               copies_every_view=engine.memory.copies_every_view, measured=st["measured"],
                               predicted=st["predicted"], step_s=st["step_s"],
                               whole_step_measured=st["whole_step_measured"], terms=terms))
        engine.abort("g")
        engine = recorder = None  # the next engine starts from nothing alive but the weights
        free_memory()
    return points


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
        runner.add_row("s", list(range(blocks)), RequestSampler(SamplingParams(max_tokens=1), 0),
                       ring=0 if runner.pool.ring_layers else None)  # a sliding-window model's ring
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
                                       copies_every_view=True,  # cpu_math's attention copies the view
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
        ws = engine.memory.matmul_workspace  # what the engine measured: the fit takes it out (predict.py)
        if ws:
            shape["matmul_workspace"] = {"per_layer": list(ws.per_layer), "head": list(ws.head)}
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
                                   fused_decode=engine.memory.fused_decode,
                                   measured=st["measured"], predicted=st["predicted"], step_s=st["step_s"],
                                   whole_step_measured=st["whole_step_measured"], terms=terms))
        meter.result(0, None, [0.0], 0.0)
        keep_rows(recorder, alive, 0, "")
        engine = recorder = None
        free_memory()
    return points
