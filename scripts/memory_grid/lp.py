"""The linear-program fit of a coefficient set (`--fit-method lp`): every grid point from above with a
margin, every recorded engine step from above, the steps' excess over a bound least (`lp_pass`), solved
by scipy's HiGHS (`lp_fit`)."""

from __future__ import annotations

from .checks import step_phases
from .predict import held_stages, holding_stage


def lp_fit(a, b, measured, lower, weights, hi=None, hi_fixed=None, hi_measured=None, hi_step=None,
           bound: float = 1.2):
    """x >= `lower` minimizing sum(w * (a @ x) / measured) subject to a @ x >= b: every point from above
    (b: its measured bytes less what no coefficient scales, and the slack it must keep), the predicted /
    measured summed over the points as small as the formula allows (a linear program: scipy's HiGHS).
    With `hi` (rows of stages' terms, `hi_fixed` their bytes no coefficient scales, `hi_measured` the
    measure of the step each belongs to, `hi_step` its index): first the least sum over the steps of
    e_s >= 0 with every stage of step s <= (`bound` + e_s) x its measure (a weight of 1000: the steps'
    excess over `bound`), then the sum above. Rows are divided by their measured bytes and columns by
    their largest term, for the solver's conditioning. Returns (x, the largest e_s or None)."""
    import numpy as np
    from scipy.optimize import linprog

    rel = a / measured[:, None]
    scale = np.maximum(np.abs(rel).max(axis=0), 1e-30)
    rel = rel / scale
    cost = (np.asarray(weights, dtype=float)[:, None] * rel).sum(axis=0) / max(len(rel), 1)
    a_ub, b_ub = -rel, -b / measured
    bounds = [(lo * s, None) for lo, s in zip(lower, scale)]
    n = len(scale)
    num_steps = 0
    if hi is not None and len(hi):
        # two hinges per step: its excess over `bound` (weight 1000) and, for headroom, over bound - 0.1
        # (weight 10): the program then keeps steps below the bound where that costs no step its bound
        num_steps = int(max(hi_step)) + 1
        top = (hi / hi_measured[:, None]) / scale
        for level, weight in ((bound, 1000.0), (bound - 0.1, 10.0)):
            excess = np.zeros((len(top), num_steps))
            excess[np.arange(len(top)), np.asarray(hi_step, dtype=int)] = -1.0
            a_ub = np.vstack([np.hstack([a_ub, np.zeros((len(a_ub), num_steps))]),
                              np.hstack([top, np.zeros((len(top), a_ub.shape[1] - n)), excess])])
            b_ub = np.concatenate([b_ub, level - hi_fixed / hi_measured])
            cost, bounds = np.append(cost, np.full(num_steps, weight)), bounds + [(0, None)] * num_steps
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, bounds=bounds, method="highs")
    if res.status != 0:
        raise RuntimeError(f"the LP fit failed: {res.message}")
    return res.x[:n] / scale, (float(res.x[n:n + num_steps].max()) if num_steps else None)


def lp_pass(pts: list[dict], shapes: dict, coef, names: list, columns: list, exclude, floors,
             min_fitted_chunk: int, margin: float, margin_bytes: int, steps: list, step_shapes: dict,
             step_bound: float = 1.2, bounded: frozenset = frozenset()) -> tuple:
    """One pass of the LP fit (`lp_fit`) on every point, each on the stage that holds its transient as
    `coef` predicts it (`_holding_stage`: a chunk's, where its stages were measured alone, the one
    measured largest), each predicted at least `margin` x its measure + `margin_bytes`; with `steps`
    (recorded engine steps, `steps_grid`), each of those from above too, and the excess of the `bounded`
    variants' steps' stages over `step_bound` least (`lp_fit`'s hi). Returns (the fitted coefficients and constants, that
    largest ratio or None)."""
    import numpy as np

    held = held_stages(pts)
    stages = [holding_stage(p, shapes, coef, held, gathered_attention=False) for p in pts]
    measured = [p["measured"] for p in pts]
    weights = [0.0 if p["kind"] == "prefill" and p["c"] < min_fitted_chunk else 1.0 for p in pts]
    hi, hi_fixed, hi_measured, hi_step = [], [], [], []
    for k, p in enumerate(steps):
        phases = step_phases(p, step_shapes, coef)
        if p.get("other_predicted", 0) < p["measured"]:  # else pool growth's prediction covers it
            stages.append(max(phases, key=lambda t: t.bytes(coef)))
            measured.append(p["measured"])
            weights.append(0.0)
        for t in phases if p["variant"] in bounded else ():
            hi.append(t)
            hi_fixed.append(t.fixed_bytes)
            hi_measured.append(p["measured"])
            hi_step.append(k)

    def row(t):
        return [getattr(t, n) for n in names] + [t.prefill_overhead_bytes, t.step_overhead_bytes]

    a = np.array([row(t) for t in stages], dtype=float)
    measured = np.array(measured, dtype=float)
    # the grid's points (each on a fresh buffer cache) keep the margin; the engine's steps were measured
    # as a serving process runs them (a warm cache): `margin_bytes` above them
    grid = np.arange(len(measured)) < len(pts)
    b = np.maximum(np.where(grid, margin * measured, measured) + margin_bytes
                   - np.array([t.fixed_bytes for t in stages]), 1.0)
    top = np.array([row(t) for t in hi], dtype=float) if hi else None
    for i, name in enumerate(columns):
        if name in exclude:
            a[:, i] = 0
            if top is not None:
                top[:, i] = 0
    fit_cols = np.abs(a).max(axis=0) > 0
    lower = np.array([(floors or {}).get(n, 0.0) for n, ok in zip(columns, fit_cols) if ok])
    x = np.zeros(a.shape[1])
    x[fit_cols], worst = lp_fit(a[:, fit_cols], b, measured, lower, np.array(weights),
                                None if top is None else top[:, fit_cols], np.array(hi_fixed, dtype=float),
                                np.array(hi_measured, dtype=float), hi_step, step_bound)
    fields = {n: float(v) for n, v, ok in zip(names, x[:-2], fit_cols[:-2]) if ok}
    fields.update(prefill_overhead_bytes=float(x[-2]), step_overhead_bytes=float(x[-1]))
    return fields, worst
