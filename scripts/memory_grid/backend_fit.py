"""The fit of a whole coefficient set for a backend (--backend): engine/core/memory/model.py's formulas with
layers_in_flight, the per-chunk and per-forward constants, fitted from above and scaled until
MemoryModel itself under-predicts no point of the grid."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .fit import base_coefficients, ceil_sig, read_keyed, envelope_fit, math_ceil, nnls, nnls_active_set, ratio_stats
from .lp import lp_pass
from .predict import engine_predictions, held_stages, holding_stage, point_phases
from .shapes import CPU_PAGE_BYTES, fixed_bytes, prefill_terms

# Columns of the joint fit: (coefficient, kind, term key in a point's "terms", scaled by layers in flight)
BACKEND_COLUMNS = (
    ("prefill_scores", "prefill", "prefill_scores", True), ("prefill_mask", "prefill", "prefill_mask", True),
    ("prefill_gather", "prefill", "prefill_gather", True),
    ("prefill_window_gather", "prefill", "prefill_window_gather", True), ("prefill_mlp", "prefill", "prefill_mlp", True),
    ("prefill_hidden", "prefill", "prefill_hidden", True), ("prefill_logits", "prefill", "prefill_logits", False),
    ("prefill_layer_rows", "prefill", "prefill_layer_rows", True),
    ("prefill_stage_rows", "prefill", "prefill_stage_rows", True),
    ("prefill_attention_hidden", "prefill", "prefill_attention_hidden", True),
    ("prefill_projection_hidden", "prefill", "prefill_projection_hidden", True),
    ("prefill_first_rows", "prefill", "prefill_first_rows", True),
    ("prefill_head_rows", "prefill", "prefill_head_rows", False),
    ("family_rows", "both", "family_rows", True),
    ("decode_gather", "decode", "decode_gather", True), ("decode_paged", "decode", "decode_paged", True),
    ("decode_scores", "decode", "decode_scores", True),
    ("decode_mlp", "decode", "decode_mlp", True), ("decode_hidden", "decode", "decode_hidden", True),
    ("decode_logits", "decode", "decode_logits", False),
)


def _fit_row(p: dict, shapes: dict, coef, names: list, stage_index: Optional[int] = None) -> tuple:
    """(the point's fit row: its terms per coefficient of `names`, then the per-chunk and per-forward
    constants; its measured bytes less what no coefficient scales). A point whose forward runs in stages
    (`head_apart`, `phases_apart`) is fitted on stage `stage_index`, else on the stage `coef` predicts
    largest: its transient."""
    phases = point_phases(p, shapes, coef)
    stage = phases[stage_index] if stage_index is not None else max(phases, key=lambda t: t.bytes(coef))
    row = [getattr(stage, n) for n in names] + [stage.prefill_overhead_bytes, stage.step_overhead_bytes]
    return row, p["measured"] - stage.fixed_bytes


def fit_backend_at(pts: list[dict], shapes: dict, layers_in_flight: int, base, exclude=(),
                   floors: Optional[dict] = None, min_fitted_chunk: int = 0, method: str = "envelope",
                   margin: float = 1.0, margin_bytes: int = 0, steps: Optional[list] = None,
                   step_shapes: Optional[dict] = None, step_bound: float = 1.2,
                   start: Optional[dict] = None, bounded: frozenset = frozenset()) -> tuple:
    """Joint fit (`envelope_fit`, from NNLS on relative error) of prefill and decode points with the
    per-layer terms counted min(L, layers_in_flight) times, one constant per forward and one more per
    prompt chunk; then every byte coefficient scaled up (and rounded up) until engine_predictions()
    under-predicts no point. A coefficient whose term is zero at every point (e.g. prefill_gather when
    every chunk read a view) keeps `base`'s value; one named in `exclude` is 0 (its term left out of the
    formula); one in `floors` (name -> value) is fitted no lower than that. Prompt chunks of fewer than
    `min_fitted_chunk` tokens bound the fit (never under) without pulling it toward them. Where the
    forwards run in stages (`base.head_apart`, `phases_apart`) each point is fitted on
    its largest stage (`_fit_row`) as the previous pass's fit predicts it: the first pass on the stages
    `_mlp_stages` guesses, by least squares (NNLS) alone, the next ones from above; the pass whose scaled
    fit has the least mean log ratio is kept. A model whose chunks' stages were measured alone
    (`stage_grid`) is fitted on those, each on its own stage, and its prompt chunks' peaks only checked
    (the scale-up above them). `method` "lp": a linear program (`_lp_pass`) on every point in place of the
    least squares and envelope, each point's prediction `margin` x its measure + `margin_bytes` or more,
    with `steps` (recorded engine steps) also bounded from above. Returns (coefficients, predictions)."""
    import numpy as np

    names = [c[0] for c in BACKEND_COLUMNS]
    columns = names + ["prefill_overhead_bytes", "step_overhead_bytes"]
    # the rows built with the excluded coefficients at 0: a family's own score arrays (a fixed term) count
    # where the backend's `prefill_scores` does not replace them (MemoryModel._chunk_attention)
    coef = dataclasses.replace(base, layers_in_flight=layers_in_flight, **{n: 0.0 for n in exclude if n in names})
    staged = {p["variant"] for p in pts if p["kind"] == "stage"}
    fitted = [p for p in pts if p["kind"] != "prefill" or p["variant"] not in staged]
    stages = _mlp_stages(fitted) if base.phases_apart else [None] * len(fitted)
    weights = np.array([0.0 if p["kind"] == "prefill" and p["c"] < min_fitted_chunk else 1.0 for p in fitted])
    best = None
    if method == "lp":  # every point from above (a chunk measured whole on the stage holding it), passes
        # from a given start whatever the shipped set (whose values base_coefficients carries), so that the
        # command beside a set reproduces it: which stage holds each point is read off the start first
        if start:  # (a coefficient the start lacks: 1)
            coef = dataclasses.replace(coef, **{k: 0.0 if k in exclude else start.get(k, 1.0) for k in columns
                                                if getattr(coef, k) is not None or k == "prefill_window_gather"})
        for _ in range(4):  # until the stages holding the points settle
            fitted_fields, worst = lp_pass(pts, shapes, coef, names, columns, exclude, floors, min_fitted_chunk,
                                            margin, margin_bytes, steps or [], step_shapes or {}, step_bound,
                                            bounded)
            coef = dataclasses.replace(coef, **fitted_fields, layers_in_flight=layers_in_flight)
            fields = {n: getattr(coef, n) for n in columns}
            fields.update(layers_in_flight=layers_in_flight)
            scaled, pred = _scale_above(pts, shapes, base, fields)
            score = worst if worst is not None else float(
                np.mean(np.log(np.array(pred, dtype=float) / [p["measured"] for p in pts])))
            if best is None or score < best[0]:
                best = (score, scaled, pred)
        return best[1], best[2]
    for first in [True] + [False] * (4 if base.head_apart or base.phases_apart else 0):
        rows, b = zip(*(_fit_row(p, shapes, coef, names, k) for p, k in zip(fitted, stages)))
        a, b = np.array(rows, dtype=float), np.maximum(np.array(b, dtype=float), 1.0)
        seen = np.abs(a).max(axis=0) > 0
        for i, name in enumerate(columns):
            if name in exclude:
                a[:, i] = 0
        fit_cols = np.abs(a).max(axis=0) > 0
        lower = np.array([(floors or {}).get(n, 0.0) for n, ok in zip(columns, fit_cols) if ok])
        x = np.zeros(a.shape[1])
        rel = a[:, fit_cols] / b[:, None]
        root = np.sqrt(weights)
        if base.head_apart or base.phases_apart:  # least squares of the ratios first: the stages' split
            start = np.maximum(nnls_active_set(rel * root[:, None], root), lower)
            x[fit_cols] = start if first else envelope_fit(rel, start, lower=lower, weights=weights)
        else:
            start = np.maximum(nnls(rel * root[:, None], root), lower)
            x[fit_cols] = envelope_fit(rel, start, lower=lower, weights=weights)
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
    held = held_stages(pts)
    for _ in range(20):
        coef = dataclasses.replace(base, **fields)
        pred = np.maximum(np.array(engine_predictions(pts, shapes, coef), dtype=float), 1)
        margin = dict.fromkeys(names, 1.0)
        for p, bv, pv in zip(pts, b, pred):
            stage = holding_stage(p, shapes, coef, held) if staged else None
            for n in names:
                if (getattr(stage, n) if staged else group.get(n, p["kind"]) == p["kind"]):
                    margin[n] = max(margin[n], bv / pv)
        fields = {k: (v if k not in margin or v is None else ceil_sig(v * margin[k] * (1 + 1e-9)))
                  for k, v in fields.items()}
        for k in ("step_overhead_bytes", "prefill_overhead_bytes"):
            fields[k] = math_ceil(fields[k])
        coef = dataclasses.replace(base, **fields)
        pred = engine_predictions(pts, shapes, coef)
        if all(pv >= mv for pv, mv in zip(pred, b)):
            return coef, pred
    raise RuntimeError("could not scale the fit above every point")


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
                forward_path: str = "", margin_bytes: int = 0, margin: float = 1.0, floors: str = "",
                min_fitted_chunk: int = 0, method: str = "envelope", step_variants: str = "",
                step_bound: float = 1.2, start: str = "") -> dict:
    """Fit a backend's TransientCoefficients (engine/core/memory/model.py's formulas, with layers_in_flight and
    step_overhead_bytes) to a grid JSON: for every layers_in_flight from 1 to the deepest model of the
    grid, the joint scaled-up fit above; keep the one with the smallest geometric mean of predicted /
    measured. With one depth in the grid layers_in_flight is not identifiable (it only rescales the
    per-layer coefficients): it is then that depth (valid for models up to that depth), or
    `layers_in_flight` if given (e.g. the window a multi-depth fit found, so that the terms the grid
    does not fit, kept at their base values, count as many layers as in the backend's set). `floors`
    ("name=value,..."): coefficients fitted no lower than those; `min_fitted_chunk`: smaller prompt
    chunks only bound the fit (`fit_backend_at`)."""
    data = read_keyed(path)
    shapes = data["shapes"]
    pts = fitted_points(data, variants, forward_path)
    every = pts
    if chunk_maxima:
        pts = largest_per_chunk(pts, shapes)
    depths = sorted({shapes[p["variant"]]["L"] for p in pts})
    top = max_layers_in_flight or depths[-1]
    candidates = list(range(1, top + 1)) if len(depths) > 1 else [depths[-1]]
    if layers_in_flight:
        candidates = [layers_in_flight]
    base = backend_base(backend, forward_path)
    lows = {name: float(value) for name, _, value in (t.partition("=") for t in floors.split(",") if t)}
    unknown = set(lows) - {c[0] for c in BACKEND_COLUMNS} - {"prefill_overhead_bytes", "step_overhead_bytes"}
    if unknown:
        raise ValueError(f"--min-terms: unknown coefficients {sorted(unknown)}")
    excluded = tuple(t for t in exclude.split(",") if t)
    # every recorded step of the fitted models from above; those of `step_variants` within the bound too
    bounded = frozenset(step_variants.split(",")) if step_variants else frozenset()
    fitted_variants = {p["variant"] for p in pts}
    steps = [p for p in data["points"] if p["kind"] == "step" and p.get("plan") and p["measured"] > 0
             and p["variant"] in fitted_variants and (not forward_path or p.get("path", "loops") == forward_path)
             ] if bounded else []
    lp = dict(margin=margin, margin_bytes=margin_bytes, steps=steps, step_shapes=shapes, step_bound=step_bound,
              bounded=bounded,
              start=read_keyed(start)["coefficients"] if start else None) if method == "lp" else {}
    scan, coef, pred = scan_layers_in_flight(pts, shapes, candidates, base, excluded, lows, min_fitted_chunk, method,
                                             **lp)
    if method != "lp" and (margin_bytes or margin != 1.0):  # beyond the grid's points: every byte coefficient and the constant raised
        scaled = {c[0]: ceil_sig(getattr(coef, c[0]) * margin) for c in BACKEND_COLUMNS
                  if getattr(coef, c[0]) is not None}
        coef = dataclasses.replace(coef, **scaled, prefill_overhead_bytes=math_ceil(coef.prefill_overhead_bytes * margin),
                                   step_overhead_bytes=math_ceil(coef.step_overhead_bytes * margin) + margin_bytes)
        pred = engine_predictions(pts, shapes, coef)
    if chunk_maxima:  # checked on every point of the grid
        pts = every
        pred = engine_predictions(pts, shapes, coef)
        if any(pv < p["measured"] for pv, p in zip(pred, pts)):
            raise RuntimeError("a point below its chunk size's largest is under-predicted")
    out = dict(grid=path, backend=backend, forward_path=forward_path or None, method=method,
               steps_bounded=sorted(bounded), steps_bound=step_bound if steps else None,
               start=start or None,
               variants=sorted({p["variant"] for p in pts}), excluded_terms=exclude,
               chunk_maxima=chunk_maxima, floors=lows, min_fitted_chunk=min_fitted_chunk,
               margin=margin, margin_bytes=margin_bytes,
               environment_mlx_env=data.get("environment", {}).get("mlx_env"),
               geometric_mean_ratio_by_layers_in_flight=scan)
    return fit_report(out, pts, pred, coef, backend)


def fitted_points(data: dict, variants: str, forward_path: str) -> list[dict]:
    """A grid's points a backend fit reads: prefill, decode and stage points of `variants` (all where
    empty) through `forward_path` (either where empty), the warm-up's and empty measures left out."""
    keep = set(v for v in variants.split(",") if v)
    pts = [p for p in data["points"] if p["variant"] != "warmup" and p["measured"] > 0
           and p["kind"] in ("prefill", "decode", "stage")
           and (not keep or p["variant"] in keep) and (not forward_path or p.get("path", "loops") == forward_path)]
    shapes = data["shapes"]
    for p in pts:  # grids measured before a term existed: its value from the point's shape
        if p["kind"] == "prefill":
            p["terms"] = {**prefill_terms(shapes[p["variant"]], p["c"], p["n"], bool(p["logits"])), **p["terms"]}
    return pts


def backend_base(backend: str, forward_path: str):
    """The set a backend's fit starts from: `base_coefficients` with the backend's way of running a
    forward's stages."""
    from engine.model.layers.cpu_math import QUERY_BLOCKS

    # sampling: the CPU value (no sampled rows in the grid); a decode's head apart from its layers on the
    # CPU (the runner waits between a forward's stages there)
    # and, through the engine's loops, each layer's attention apart from its MLP, its queries in blocks
    phases = backend == "cpu" and forward_path == "loops"
    return dataclasses.replace(base_coefficients(), head_apart=backend == "cpu", phases_apart=phases,
                               prefill_attention_hidden=base_coefficients().prefill_hidden * phases,
                               prefill_projection_hidden=base_coefficients().prefill_hidden * phases,
                               allocation_page_bytes=CPU_PAGE_BYTES if phases else 0,
                               attention_query_blocks=QUERY_BLOCKS if phases else 1)


def scan_layers_in_flight(pts: list[dict], shapes: dict, candidates: list[int], base, exclude: tuple,
                          floors: Optional[dict] = None, min_fitted_chunk: int = 0, method: str = "envelope",
                          **lp) -> tuple:
    """`fit_backend_at` at every layers_in_flight of `candidates`: (the geometric mean of predicted /
    measured of each, the coefficients and predictions of the least)."""
    import numpy as np

    best = None
    scan = {}
    for k in candidates:
        coef, pred = fit_backend_at(pts, shapes, k, base, exclude, floors, min_fitted_chunk, method, **lp)
        score = float(np.exp(np.mean(np.log(np.array(pred, dtype=float) / [p["measured"] for p in pts]))))
        scan[k] = round(score, 3)
        if best is None or score < best[0]:
            best = (score, coef, pred)
    return scan, best[1], best[2]


def fit_report(out: dict, pts: list[dict], pred: list[int], coef, backend: str) -> dict:
    """`out` with the fit's predicted / measured overall and by variant and kind, its coefficients and
    their Python literal."""
    meas = [p["measured"] for p in pts]
    out.update(predicted_over_measured=ratio_stats(pred, meas), by_group={})
    for v in out["variants"]:
        for kind in ("prefill", "decode", "stage"):
            idx = [i for i, p in enumerate(pts) if p["variant"] == v and p["kind"] == kind]
            if idx:
                out["by_group"][f"{v}/{kind}"] = ratio_stats([pred[i] for i in idx], [meas[i] for i in idx])
    fields = dataclasses.asdict(coef)
    fields.pop("mixed_min_layers")  # not fitted: EngineConfig.memory_coefficients keeps the backend's
    out["coefficients"] = fields
    out["python"] = (f"{backend.upper()}_COEFFICIENTS = TransientCoefficients(\n    "
                     + ", ".join(f"{k}={v!r}" for k, v in fields.items()) + ",\n)")
    return out
