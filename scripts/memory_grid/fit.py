"""Fit mode's arithmetic: the per-model least-squares fit of the grid's terms (`fit`) and the numerics
every fit shares (non-negative least squares, the fit from above, rounding up, ratio summaries)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .shapes import DECODE_TERMS, PREFILL_TERMS


def read_keyed(spec: str) -> dict:
    """The JSON at `spec`: FILE, or FILE:KEY for the run or grid under KEY of a file of several (A/B: nested)."""
    path, _, key = spec.partition(":")
    data = json.loads(Path(path).read_text())
    for part in (k for k in key.split("/") if k):
        data = data[part]
    return data


def base_coefficients():
    """The CPU set without its per-forward constants (step_overhead_bytes, prefill_overhead_bytes,
    prefill_layer_rows): what sets fitted elsewhere, and recorded runs' overrides, complete."""
    from engine.core.memory import coefficients as coefs

    return dataclasses.replace(coefs.CPU_COEFFICIENTS, step_overhead_bytes=0, prefill_overhead_bytes=0,
                               prefill_layer_rows=0.0, head_apart=False, phases_apart=False,
                               prefill_attention_hidden=0.0, prefill_projection_hidden=0.0,
                               prefill_head_rows=0.0, prefill_stage_rows=0.0, prefill_first_rows=0.0,
                               prefill_window_gather=None,
                               attention_query_blocks=1, allocation_page_bytes=0)


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
    from engine.core.memory import model as mem

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


def ceil_sig(x: float, digits: int = 4) -> float:
    """Round up to `digits` significant digits (a literal that stays an upper bound)."""
    import math

    if x <= 0:
        return 0.0
    e = math.floor(math.log10(x)) - digits + 1
    return float(f"{math.ceil(x / 10 ** e) * 10 ** e:.{digits}g}")


def ratio_stats(pred, meas) -> dict:
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


def envelope_fit(a, x0=None, penalties=(10.0, 1e3, 1e5), iters: int = 8000, lower=None, weights=None):
    """x >= `lower` (default 0) minimizing sum(w * (r - 1)^2) + lam * sum(min(r - 1, 0)^2) with r = a @ x,
    for growing lam: `a`'s rows are divided by the measured bytes, so r is predicted / measured and the
    fit hugs the points from above (an upper bound as tight as the formula allows) instead of through
    them, then needs only a small scale-up. `weights` w per row (default 1): a row of weight 0 only
    bounds the fit from below. Projected gradient on the column-scaled problem (numpy only)."""
    import numpy as np

    scale = np.maximum(np.abs(a).max(axis=0), 1e-30)
    s = a / scale
    low = np.zeros(s.shape[1]) if lower is None else np.asarray(lower, dtype=float) * scale
    w = np.ones(s.shape[0]) if weights is None else np.asarray(weights, dtype=float)
    x = x0 * scale if x0 is not None else np.clip(np.linalg.lstsq(s, np.ones(len(s)), rcond=None)[0], 0, None)
    x = np.maximum(x, low)
    lipschitz = np.linalg.norm(s, 2) ** 2
    for lam in penalties:
        step = 1.0 / (lipschitz * (1 + lam))
        for _ in range(iters):
            r = s @ x - 1
            x = np.maximum(x - step * (s.T @ (np.where(r < 0, w + lam, w) * r)), low)
    return x / scale


def math_ceil(x: float) -> int:
    import math

    return int(math.ceil(x))
