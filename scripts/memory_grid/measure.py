"""Measure mode: the engine's steps of the engine tests' workloads (`steps_grid`), mixed steps beside the
same step apart (`mixed_grid`), and `measure`, which runs the grids --grids names on every model."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from bench_common import (DTYPES, LoadedModel, build_random_model, environment, free_memory, load_bench_model,
                          log, random_prompts)
from bench_engine import make_engine

from .grids import decode_grid, forward_path, keep_rows, prefill_grid, run_steps, stage_grid, start_decoding
from .shapes import TEST_VARIANTS, VARIANTS, decode_terms, family_variants, loops_family, prefill_terms, shape_of

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
                               plan=step_plan_dict(plan.memory_plan), memory_model=memory_flags(engine.memory),
                               other_predicted=record.memory.other_predicted_bytes,
                               predicted=record.memory.predicted_bytes, measured=record.memory.measured_bytes))
        engine = None
        free_memory()
    return points


def step_plan_dict(plan) -> Optional[dict]:
    """A step's memory plan (SchedulerOutput.memory_plan) as plain data (`predict.step_prediction` reads it)."""
    return None if plan is None else dataclasses.asdict(plan)


def memory_flags(memory) -> dict:
    """The MemoryModel arguments besides the shape and the set that a step's prediction depends on (its
    decode's matmul workspaces as plain lists, where the engine measured any: predict.matmul_workspace)."""
    flags = dict(kv_step=memory.kv_step, paged_decode=memory.paged_decode, mixed=memory.mixed,
                 copies_viewed_kv=memory.copies_viewed_kv, copies_every_view=memory.copies_every_view,
                 fused_decode=memory.fused_decode)
    if memory.matmul_workspace:
        flags["matmul_workspace"] = {"per_layer": list(memory.matmul_workspace.per_layer),
                                     "head": list(memory.matmul_workspace.head)}
    return flags


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
        t = time.perf_counter()
        mixed, mixes, paged, kv_step = mixed_probes(lm, chunks, rows, n, mixing=True)
        apart = mixed_probes(lm, chunks, rows, n, mixing=False)[0]
        # a run cut by a time limit still shows how far it got (the points are written at the end)
        log(f"{label}: mixed probes at context {n} in {time.perf_counter() - t:.1f} s")
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


def grid_models(args, lm: LoadedModel) -> list[tuple]:
    """(label, the loaded model or the config of a random one) of every model the run measures."""
    models = [(args.model, lm)]
    if args.variants:
        table = VARIANTS if args.model == "llama-8b" else TEST_VARIANTS
        for name, cfg in table.items():
            models.append((name, cfg))
    models += [(name, cfg) for name, cfg in family_variants(args.families).items()]
    if args.modules:  # the same models through mlx-lm's modules, where the engine's loops take them
        models += [(f"{name}/modules", m) for name, m in models if loops_family(m if isinstance(m, dict) else m.config)]
    return models


def model_points(args, m: LoadedModel, sh: dict, label: str, grids: set, chunks: list[int], rows: list[int],
                 contexts: list[int]) -> list[dict]:
    """The points of the grids `grids` of one model (`sh`: its shape_of)."""
    loops = not label.endswith("/modules")
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
    return pts


def measure(args) -> dict:
    lm = load_bench_model(args.model, args.dtype, args.layers, args.init, args.seed)
    chunks = [int(x) for x in args.chunks.split(",")]
    rows = [int(x) for x in args.decode_rows.split(",")]
    contexts = [int(x) for x in args.decode_contexts.split(",")]
    grids = set(args.grids.split(","))
    if grids - {"prefill", "prefill-gathers", "decode", "mixed", "steps", "stages"}:
        raise ValueError(f"--grids {args.grids!r}: expected some of prefill,prefill-gathers,decode,mixed,steps,stages")
    result = dict(bench="memory_grid", argv=sys.argv[1:], model=args.model, dtype=lm.dtype,
                  environment=environment(), points=[], shapes={})
    models = grid_models(args, lm)
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
        if isinstance(m, dict):
            m = random_model(label, m, lm, args.init, args.seed)
        sh = shape_of(m.config, DTYPES[m.dtype].size, not label.endswith("/modules"))
        result["shapes"][label] = sh
        pts = model_points(args, m, sh, label, grids, chunks, rows, contexts)
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
