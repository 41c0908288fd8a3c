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
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import emit  # noqa: E402
from memory_grid.backend_fit import fit_backend  # noqa: E402
from memory_grid.checks import check_steps, decode_check, merge_grids, mixed_checks, stage_rows  # noqa: E402
from memory_grid.fit import fit  # noqa: E402
from memory_grid.measure import measure  # noqa: E402
from memory_grid.replay import fit_scale, replay_runs  # noqa: E402


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_analysis_arguments(p)
    add_measure_arguments(p)
    return p


def add_analysis_arguments(p: argparse.ArgumentParser) -> None:
    """The fit's, checks' and replay's options (and --append / --remeasure, in their place in --help)."""
    p.add_argument("--fit", default=None, help="fit coefficients to a grid JSON (no measuring)")
    p.add_argument("--merge", default=None, metavar="GRID,DECODE_GRID[,DECODE_GRID...]",
                   help="write (--out) one grid of every grid's prefill points and the decode points of the grids "
                        "after the first (each FILE or FILE:KEY)")
    p.add_argument("--fit-variants", default="", help="--fit: only these variants (comma-separated)")
    p.add_argument("--fit-method", default="envelope", choices=["envelope", "lp"],
                   help="--backend: least squares then an envelope from above (envelope), or a linear program: "
                        "every point from above, the sum of predicted / measured least (lp)")
    p.add_argument("--fit-steps", default="", metavar="VARIANTS",
                   help="--fit-method lp: the grid's recorded engine steps (--grids steps) of these variants "
                        "(comma-separated) from above too, and their excess over --fit-steps-bound least")
    p.add_argument("--fit-start", default="", metavar="FIT_JSON[:KEY]",
                   help="--fit-method lp: the coefficients (a --fit --json output) whose stages first hold each "
                        "point (default: the shipped set's, through base_coefficients)")
    p.add_argument("--fit-steps-bound", type=float, default=1.2,
                   help="--fit-steps: the predicted / measured each step's stages should stay within")
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
    p.add_argument("--check-decodes", default=None, metavar="GRID_JSON[:KEY]",
                   help="predicted / measured of grids' decode points (comma-separated) with the engine's set for "
                        "each shape on --backend (default cuda, under ops 8)")
    p.add_argument("--stage-rows", default=None, metavar="GRID_JSON",
                   help="what a CPU grid's chunk stages hold per token, in hidden rows (checks.stage_rows)")
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
    p.add_argument("--min-terms", default="", metavar="NAME=VALUE,...",
                   help="--backend: coefficients fitted no lower than these (e.g. an array the data cannot "
                        "separate from others but which must exist)")
    p.add_argument("--fit-min-chunk", type=int, default=0,
                   help="--backend: prompt chunks of fewer tokens only bound the fit (never under-predicted) "
                        "without pulling it toward them")
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


def add_measure_arguments(p: argparse.ArgumentParser) -> None:
    """Measure mode's options (and the output's)."""
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


def main(argv=None):
    args = parser().parse_args(argv)
    if args.merge:
        result = merge_grids(*args.merge.split(","))
        emit(result, args.json, args.out)
        return
    if args.check_steps:
        emit(check_steps(args.check_steps, args.slack_bytes), True, None)
        return
    if args.check_mixed:
        emit(mixed_checks(args.check_mixed.split(","), args.backend or "cuda"), True, None)
        return
    if args.check_decodes:
        emit({f: decode_check(f, args.backend or "cuda") for f in args.check_decodes.split(",")}, True, None)
        return
    if args.stage_rows:
        emit(stage_rows(args.stage_rows), True, None)
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
            result = replay_runs(args.replay_prefill.split(","), args.backend or "cuda", args.replay_views, coefficients)
    elif args.fit and args.backend:
        result = fit_backend(args.fit, args.fit_variants, args.backend, args.max_layers_in_flight,
                             args.exclude_terms, args.chunk_maxima, args.layers_in_flight, args.fit_path,
                             args.margin_bytes, args.margin, args.min_terms, args.fit_min_chunk, args.fit_method,
                             args.fit_steps, args.fit_steps_bound, args.fit_start)
        if not args.json:
            print(result.pop("python"))
    else:
        result = fit(args.fit, args.fit_variants, args.layer_scaled) if args.fit else measure(args)
    emit(result, args.json, None if args.fit else args.out)


if __name__ == "__main__":
    main()
