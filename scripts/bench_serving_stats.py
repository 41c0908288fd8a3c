"""bench_serving.py's records and summaries, shared with bench_http.py and bench_constrained.py: each
request's token times (`RequestRecord`), a run's summary (`summarize`), arrival times, and the comparison of
two backends over timed passes (`compare`)."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from typing import Optional


@dataclasses.dataclass
class RequestRecord:
    index: int
    sent_s: float  # from the start of the run
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    num_output_tokens: int = 0
    error: Optional[str] = None
    status: Optional[int] = None

    @property
    def ttft_s(self) -> Optional[float]:
        return self.token_times_s[0] - self.sent_s if self.token_times_s else None

    @property
    def tpot_s(self) -> Optional[float]:
        t = self.token_times_s
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None


def percentile(values: list[float], q: float) -> Optional[float]:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(records: list[RequestRecord], wall_s: float) -> dict:
    ok = [r for r in records if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    # every gap between two tokens of a request: their median is steadier than TPOT's mean on a busy host
    gaps = [b - a for r in ok for a, b in zip(r.token_times_s, r.token_times_s[1:])]
    out_tokens = sum(r.num_output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in records:
        if r.error is not None:
            key = str(r.status) if r.status is not None else r.error.split(":")[0]
            errors[key] = errors.get(key, 0) + 1
    return dict(
        num_requests=len(records), num_ok=len(ok), errors=errors, wall_s=wall_s,
        ttft_mean_s=statistics.fmean(ttft) if ttft else None, ttft_p50_s=percentile(ttft, 0.5),
        ttft_p95_s=percentile(ttft, 0.95), tpot_mean_s=statistics.fmean(tpot) if tpot else None,
        itl_p50_s=percentile(gaps, 0.5),
        output_tokens=out_tokens, output_tok_per_s=out_tokens / wall_s if wall_s > 0 else None,
        first_error=next((r.error for r in records if r.error), None),
    )


def trace_summary(result: dict) -> dict:
    """Per run of a bench_serving result recorded with --trace-steps: its pipelined decode steps (traced
    steps whose decode a launch thread encoded) and their median milliseconds."""
    out = {}
    for name, run in result["runs"].items():
        steps = [t["step"] for t in run.get("step_trace_ms") or [] if "prev_encoded_at" in t]
        out[name] = dict(pipelined_steps=len(steps), median_step_ms=round(statistics.median(steps), 2) if steps else None)
    return out


def arrival_times(n: int, rate: Optional[float], seed: int) -> list[float]:
    """All at 0 (closed loop), or a Poisson process of `rate` requests/s."""
    if not rate:
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _passes(runs: dict, backend: str, c) -> list:
    """Every timed pass of `backend` at concurrency `c`, in pass order (the keys' #repeat suffix)."""
    out, rep = [], 0
    while (r := runs.get(f"{backend}@{c}" + (f"#{rep}" if rep else ""))) is not None:
        out.append(r)
        rep += 1
    return out


def compare(runs: dict, concurrencies, ours: str, theirs: str) -> dict:
    """`ours` against `theirs` per concurrency: the ratio of their medians over the timed passes (with
    --repeat, passes alternate backends, so drift of the machine falls on both), and each pass's ratio
    (the two ran one after the other). The targets are judged on the medians."""
    out = {}
    for c in concurrencies:
        pairs = [(a, b) for a, b in zip(_passes(runs, ours, c), _passes(runs, theirs, c))
                 if a.get("ttft_mean_s") and b.get("ttft_mean_s")]
        if not pairs:
            continue
        med = {k: [statistics.median(p[i][k] or 0 for p in pairs) for i in (0, 1)]
               for k in ("ttft_mean_s", "output_tok_per_s")}
        ttft, tok = med["ttft_mean_s"][0] / med["ttft_mean_s"][1], med["output_tok_per_s"][0] / (med["output_tok_per_s"][1] or 1)
        out[str(c)] = dict(
            passes=len(pairs), ttft_ratio=ttft, tok_per_s_ratio=tok,
            ttft_ratio_per_pass=[a["ttft_mean_s"] / b["ttft_mean_s"] for a, b in pairs],
            tok_per_s_ratio_per_pass=[(a["output_tok_per_s"] or 0) / (b["output_tok_per_s"] or 1) for a, b in pairs],
            engine_ttft_le_mlx_lm=ttft <= 1.0, engine_tok_per_s_ge_1_2x_mlx_lm=tok >= 1.2,
        )
    return out


def fmt(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"
