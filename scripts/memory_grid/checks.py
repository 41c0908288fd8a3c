"""Checks of recorded grids against the formulas (`check_steps`: the engine's own steps as recorded;
`mixed_check`: mixed forwards with a set; `decode_check`: decodes with the engine's sets), what a CPU
grid's stages hold per token (`stage_rows`), and `merge_grids` (--merge)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .fit import ratio_stats, read_keyed
from .predict import engine_predictions, fused_decodes, matmul_workspace, mixed_predictions, model_shape
from .shapes import decode_terms


def _step_model(p: dict, shapes: dict, coefficients):
    """The MemoryModel a step point's engine built (`steps_grid`'s memory flags: its decode's matmul
    workspaces there if it measured any, else the shape's), with `coefficients`."""
    from engine.core.memory.model import MemoryModel

    flags = dict(p["memory_model"])
    recorded = {"matmul_workspace": flags.pop("matmul_workspace")} if "matmul_workspace" in flags else shapes[p["variant"]]
    return MemoryModel(model_shape(shapes[p["variant"]]), coefficients=coefficients,
                       matmul_workspace=matmul_workspace(recorded), **flags)


def step_prediction(p: dict, shapes: dict, coefficients) -> int:
    """A recorded engine step's prediction with `coefficients`, from the memory plan and the memory
    model's arguments its engine recorded (`steps_grid`): the engine's own arithmetic, beside what the
    step predicted outside its forwards (pool growth, prefix copies: StepMemory.other_predicted_bytes)."""
    from engine.core.memory.model import PrefillChunkPlan, StepPlan

    plan, model = p["plan"], _step_model(p, shapes, coefficients)
    step = StepPlan(decode_context_lens=tuple(plan["decode_context_lens"]), decode_samples=plan["decode_samples"],
                    prefill_chunks=tuple(PrefillChunkPlan(**c) for c in plan["prefill_chunks"]))
    return max(model.step_transient_bytes(step, mixed=p["mixed"]), p.get("other_predicted", 0))


def check_steps(path: str, slack_bytes: int = 0, coefficients=None) -> dict:
    """Predicted / measured of a grid's engine steps (--grids steps, a CPU grid) per variant: min, median,
    max, and the steps above 1.2 x measured + `slack_bytes`: predicted again from the plans the steps
    recorded, with `coefficients` or (None) the engine's set for each variant's shape on the CPU
    (`coefficients_for`: a shape calibration where one ships); steps recorded without their plans, as
    recorded."""
    from engine.core.memory.coefficients import coefficients_for

    data = json.loads(Path(path).read_text())
    pts = [p for p in data["points"] if p["kind"] == "step" and p["measured"] > 0]

    def again(p):
        coef = coefficients or coefficients_for("cpu", None, model_shape(data["shapes"][p["variant"]]),
                                                cpu_math=p.get("path", "loops") == "loops")[0]
        return dict(p, predicted=step_prediction(p, data["shapes"], coef)) if p.get("plan") else p

    pts = [again(p) for p in pts]
    out = {}
    for v in sorted({p["variant"] for p in pts}):
        sel = [p for p in pts if p["variant"] == v]
        above = [p for p in sel if p["predicted"] > 1.2 * p["measured"] + slack_bytes]
        out[v] = dict(ratio_stats([p["predicted"] for p in sel], [p["measured"] for p in sel]),
                      underpredicted=sum(p["predicted"] < p["measured"] for p in sel),
                      above_1_2x_plus_slack=len(above),
                      smallest_measured_bytes=min(p["measured"] for p in sel),
                      above=[dict(workload=p["workload"], ratio=round(p["predicted"] / p["measured"], 3),
                                  measured=p["measured"], decodes=p["decodes"], chunks=[c[0] for c in p["chunks"]],
                                  mixed=p["mixed"]) for p in above])
    return out


def decode_check(spec: str, backend: str = "cuda") -> dict:
    """Predicted / measured of a grid's decode points (FILE or FILE:KEY) per variant, with the engine's set
    for each variant's shape on `backend` (under ops 8 on CUDA; a shape calibration where one ships) and
    with the backend's set alone (`backend_set_min`), and the measured bytes per row count."""
    from engine.core.memory.coefficients import coefficients_for, coefficients_for_backend

    data = read_keyed(spec)
    pts = [p for p in data["points"] if p["kind"] == "decode" and p["measured"] > 0]
    out = {}
    for v in sorted({p["variant"] for p in pts}):
        sel = [p for p in pts if p["variant"] == v]
        coef, what = coefficients_for(backend, 8 if backend == "cuda" else None, model_shape(data["shapes"][v]))
        fused = fused_decodes(data)  # for points that do not say
        pred = engine_predictions(sel, data["shapes"], coef, fused)
        alone = engine_predictions(sel, data["shapes"], coefficients_for_backend(backend, 8 if backend == "cuda" else None),
                                   fused)
        out[v] = dict(ratio_stats(pred, [p["measured"] for p in sel]), set=what,
                      backend_set_min=round(min(q / p["measured"] for q, p in zip(alone, sel)), 3),
                      underpredicted=sum(q < p["measured"] for q, p in zip(pred, sel)),
                      measured_mb_by_rows={b: sorted({round(p["measured"] / 1e6, 1) for p in sel if p["B"] == b})
                                           for b in sorted({p["B"] for p in sel})},
                      fused_decode=sorted({bool(p.get("fused_decode", fused)) for p in sel}))
    return out


def stage_rows(path: str, reference: str = "llama-d256") -> dict:
    """What a CPU grid's chunk stages (--grids stages) hold per token, in hidden-size rows (c * D * s bytes
    per row): per variant and chunk size, the projections' and the MLP's largest over contexts, the
    attention's least (its part that does not grow with the keys), each also less `reference`'s; and the
    largest relative difference between a chunk that gathers its row and the same chunk read as a view."""
    data = json.loads(Path(path).read_text())
    shapes, out = data["shapes"], {}
    per: dict = {}
    for p in data["points"]:
        if p["kind"] == "stage":
            sh = shapes[p["variant"]]
            rows = p["measured"] / (p["c"] * sh["D"] * sh["s"])
            key = (p["variant"], p["stage"], p["c"])
            per[key] = (min if p["stage"] == "attention" else max)(per.get(key, rows), rows)
    for (v, stage, c), rows in sorted(per.items()):
        if stage == "head":
            continue
        ref = per.get((reference, stage, c))
        entry = out.setdefault(v, {}).setdefault(stage, {})
        entry[c] = dict(rows=round(rows, 2), less_reference=None if ref is None else round(rows - ref, 2))
    views = {(p["variant"], p["c"], p["n"]): p["measured"] for p in data["points"]
             if p["kind"] == "prefill" and not p.get("gathers", True)}
    for p in data["points"]:
        key = (p["variant"], p.get("c"), p.get("n"))
        if p["kind"] == "prefill" and p.get("gathers", True) and key in views:
            gap = abs(p["measured"] - views[key]) / views[key]
            entry = out.setdefault(p["variant"], {})
            entry["gathered_vs_view_largest_gap"] = round(max(entry.get("gathered_vs_view_largest_gap", 0.0), gap), 3)
    return out


def mixed_check(path: str, coefficients=None, backend: str = "cuda", every_depth: bool = False) -> dict:
    """Predicted / measured of a grid's mixed points (--grids mixed) by variant, with `coefficients`, or
    (None) what the engine would use for each variant's shape on `backend` under ops 8. `every_depth`:
    also models the engine runs apart (`mixed_min_layers` 0), to see the formula on them."""
    from engine.core.memory.coefficients import coefficients_for

    data = read_keyed(path)  # FILE:KEY: the grid under KEY of a file of several
    pts = [p for p in data["points"] if p["kind"] == "mixed" and p["measured"] > 0]
    out: dict = {}
    for v in sorted({p["variant"] for p in pts}):
        idx = [i for i, p in enumerate(pts) if p["variant"] == v]
        coef = coefficients
        if coef is None:
            coef = coefficients_for(backend, 8, model_shape(data["shapes"][v]))[0]
        if every_depth:
            coef = dataclasses.replace(coef, mixed_min_layers=0)
        pred = {i: q for i, q in zip(idx, mixed_predictions([pts[i] for i in idx], data["shapes"], coef))}
        if pred[idx[0]] is None:
            out[v] = "runs apart (no deeper than mixed_min_layers)"
            continue
        out[v] = dict(ratio_stats([pred[i] for i in idx], [pts[i]["measured"] for i in idx]),
                      underpredicted=sum(pred[i] < pts[i]["measured"] for i in idx))
    return out


def merge_grids(prefill_path: str, *decode_paths: str) -> dict:
    """One grid of the prefill points of every grid and the decode points of `decode_paths` (same
    variants), e.g. to refit after a change of the decode kernel alone (a second machine's prefill
    points widen the fit's envelope; several decode grids: the decode paths a set must cover, such as
    the q/k rope fused and not). The decode points' terms are recomputed from their shapes with this
    script's formulas: `decode_paths` must have been measured with the current kernel."""
    if not decode_paths:
        raise ValueError("--merge: GRID,DECODE_GRID[,DECODE_GRID...]: no decode grid given")
    pre = read_keyed(prefill_path)  # FILE or FILE:KEY
    points = [p for p in pre["points"] if p["kind"] == "prefill"]
    for path in decode_paths:
        dec = read_keyed(path)
        missing = {p["variant"] for p in dec["points"]} - set(pre["shapes"])
        if missing:
            raise ValueError(f"variants {sorted(missing)} of {path} are not in {prefill_path}")
        fused = fused_decodes(dec)  # each decode point says whether its grid's decodes were fused
        points += [p if p["kind"] == "prefill" else
                   {"fused_decode": fused, **p,
                    "terms": decode_terms(dec["shapes"][p["variant"]], p["B"], p["n"], bool(p.get("paged")))}
                   for p in dec["points"] if p["kind"] in ("prefill", "decode")]
    return dict(bench="memory_grid_merged", prefill_from=prefill_path, decode_from=list(decode_paths),
                model=pre.get("model"), dtype=pre.get("dtype"), environment=dec["environment"],
                shapes=pre["shapes"], points=points)


def mixed_checks(paths: list[str], backend: str) -> dict:
    """--check-mixed: each grid's mixed points with the engine's sets for `backend` (under ops 8), with the
    backend's set alone, and with the engine's sets where models of every depth mix."""
    from engine.core.memory import coefficients as coefs

    return {f: {"engine's sets": mixed_check(f, None, backend),
                "backend set (no shape calibration)": mixed_check(f, coefs.coefficients_for_backend(backend, 8)),
                "engine's sets, models of every depth mixing": mixed_check(f, None, backend, every_depth=True)}
            for f in paths}


def step_phases(p: dict, shapes: dict, coefficients) -> list:
    """The stages (TransientTerms) of every forward of a recorded engine step (`step_prediction`): its
    transient, outside pool growth, is the largest's (for a mixed step, where the coefficient set runs a
    forward's stages apart: the CPU's)."""
    from engine.core.memory.model import PrefillChunkPlan

    plan, model = p["plan"], _step_model(p, shapes, coefficients)
    chunks = [PrefillChunkPlan(**c) for c in plan["prefill_chunks"]]
    rows, samples = list(plan["decode_context_lens"]), plan["decode_samples"]
    phases = []
    if p["mixed"] and chunks and rows and model.mixed:
        phases += model.mixed_phases(chunks[0], rows, samples)
        # MemoryModel.mixed_bytes, one layer at a time and its stages apart: never below the rows' decode
        # (where layers coexist, CUDA, its other bound is no stage: this reproduces the staged CPU path)
        if model.layer_factor == 1 and model.coefficients.head_apart:
            phases += model.decode_phases(rows, samples)
        chunks = chunks[1:]
    elif rows:
        phases += model.decode_phases(rows, samples)
    for c in chunks:
        phases += model.chunk_phases(c.num_tokens, c.context_len, c.computes_logits, c.samples, c.gathers)
    return phases
