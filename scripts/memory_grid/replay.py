"""Replay mode (--replay-prefill): the engine steps of bench_prefill_memory.py runs, their plans rebuilt
from the JSON and predicted again with a backend's coefficients (`replay_prefill`), and the one-factor
calibration of some coefficients on such runs (`fit_scale`, --fit-scale)."""

from __future__ import annotations

import dataclasses
from typing import Optional

from bench_common import DTYPES

from .fit import base_coefficients, ceil_sig, read_keyed
from .shapes import REPLAYED_LOOP_FAMILIES


def prefill_bench_plans(data: dict, views: bool = False) -> list:
    """StepPlans of the engine way of a bench_prefill_memory.py JSON, rebuilt from what each step
    recorded (chunks as (tokens, context end), number of decoding rows) and the prompt lengths: each chunk
    continues the first prompt (in arrival order, `lengths`) whose prefilled tokens plus the chunk's end
    where it says (the scheduler serves its waiting prompts first come, first served); a chunk computes
    logits when it ends its prompt; a prompt of P tokens whose last chunk ran j steps ago decodes with
    P + j keys; rows are greedy (the bench's SamplingParams); `views`: every chunk read its row as a view
    of the pool (the JSON does not record it). Checked by recomputing the recorded predictions
    (`replay_prefill`)."""
    from engine.core.memory.model import PrefillChunkPlan, StepPlan

    lengths = list(data["lengths"])
    done = [0] * len(lengths)  # tokens prefilled per prompt
    finished: dict = {}  # prompt index -> step index of its last chunk
    plans = []
    for i, st in enumerate(data["ways"]["engine"]["steps"]):
        decoding = sorted(finished.items())
        if len(decoding) != st["decodes"]:
            raise ValueError(f"step {i}: {st['decodes']} decoding rows recorded, {len(decoding)} rebuilt")
        chunks = []
        for c, end in st["chunks"]:
            k = next((k for k, n in enumerate(lengths) if done[k] < n and done[k] + c == end), None)
            if k is None:
                raise ValueError(f"step {i}: no prompt of {lengths} (prefilled {done}) ends a chunk of {c} at {end}")
            done[k] = end
            chunks.append(PrefillChunkPlan(c, end, computes_logits=end == lengths[k], gathers=not views))
        plans.append(StepPlan(decode_context_lens=tuple(lengths[k] + (i - j) for k, j in decoding),
                              prefill_chunks=tuple(chunks)))
        finished.update((k, i) for k, n in enumerate(lengths) if done[k] == n and k not in finished)
    return plans


def replay_prefill(path: str, backend: str = "cuda", views: bool = False, coefficients: Optional[dict] = None) -> dict:
    """Predicted / measured transient of every engine step of a prefill benchmark JSON, with the
    recorded plans and `backend`'s coefficients (pure arithmetic on engine/core/memory/model.py). Decodes are
    paged when the run's engine asked for it on a GPU. The rebuilt plans are checked first: they must
    give the predictions the run recorded, with the coefficients it ran with. Those are known for a run on
    the CPU (the CPU set) and for one with `memory_coefficients` in its config (complete sets, as the fit
    prints them), or the CPU set for GPU runs from before the CUDA sets; for other runs
    `recorded_predictions_reproduced` is None."""
    from engine.core.memory import coefficients as coefs, model as mem

    data = read_keyed(path)  # FILE:KEY: the run under KEY of a file of several
    path = path.partition(":")[0]
    shape, loops = replayed_shape(data)
    engine = data["ways"]["engine"]
    steps, config = engine["steps"], engine.get("config", {})
    on_gpu = "gpu" in str(data["environment"].get("device", ""))
    # recorded before EngineConfig.execution: a top-level field
    paged = bool(config.get("execution", {}).get("paged_attention", config.get("paged_attention"))) and on_gpu \
        and loops  # only the engine's loops read the pool in place
    plans = prefill_bench_plans(data, views)
    mixed = [bool(st.get("mixed")) for st in steps]  # decode rows in the first chunk's forward
    carried = deferred_steps(data, plans)
    # runs recorded before the engine copied a viewed chunk's KV for its last query say nothing of it
    copies = bool(engine.get("copies_viewed_kv"))
    every = bool(engine.get("copies_every_view"))  # ... nor of cpu_math's copy of every viewed chunk's KV
    fused = bool(engine.get("fused_decode"))  # ... nor (before 38481f2) of fused decodes: there were none
    reproduced = reproduce_recorded(shape, plans, mixed, carried, [st["predicted"] for st in steps],
                                    config, paged, on_gpu, copies, every, fused)
    # the engine's set for the shape (a shape calibration where one ships), or `coefficients` (complete
    # but for a family's `family_rows` in older fits: the backend's)
    family = dict(family_rows=coefs.coefficients_for_backend(backend, 8).family_rows)
    coef = (coefs.with_overrides(base_coefficients(), {**family, **coefficients}) if coefficients
            else coefs.coefficients_for(backend, 8, shape if loops else None,
                                        prefill_chunk_size=config.get("prefill_chunk_size"))[0])
    model = mem.MemoryModel(shape, coefficients=coef, paged_decode=paged, copies_viewed_kv=copies,
                            copies_every_view=every, fused_decode=fused)
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


def replayed_shape(data: dict) -> tuple:
    """(the ModelShape of a recorded run's model as its engine counted it, whether that engine ran it
    through its layer loops): the loops of the families they ran when the older runs were recorded, and of
    the others where the run asked for them on a GPU (GPU_UNVALIDATED_LOOPS_ENV); a model's sliding-window
    layers keep their KV in rings (engine/model/kv_pool.py: the engine's pool always has them)."""
    from bench_common import RANDOM_SHAPES
    from bench_engine import GPU_UNVALIDATED_LOOPS_ENV

    from engine.core.memory import model as mem

    from .shapes import loops_family

    if data["model"] not in RANDOM_SHAPES:  # the JSON records the model's name, not its shape
        raise ValueError(f"model {data['model']!r}: only the random shapes' are known here ({sorted(RANDOM_SHAPES)})")
    config = RANDOM_SHAPES[data["model"]]
    asked = (data["environment"].get("mlx_env") or {}).get(GPU_UNVALIDATED_LOOPS_ENV) == "1"
    recorded = data["ways"]["engine"].get("chunk_loop")  # runs since it was recorded say it
    loops = recorded if recorded is not None else not config.get("quantization") and (
        config.get("model_type", "llama") in REPLAYED_LOOP_FAMILIES or (asked and loops_family(config)))
    shape = mem.ModelShape.from_config(config, DTYPES[data["dtype"]].size, module_forwards=not loops)
    if shape.layer_windows:
        shape = dataclasses.replace(shape, num_kv_layers=sum(w is None for w in shape.layer_windows))
    return shape, loops


def reproduce_recorded(shape, plans: list, mixed: list[bool], carried: list[bool], wanted: list[int], config: dict,
                       paged: bool, on_gpu: bool, copies: bool = False, every: bool = False,
                       fused: bool = False) -> Optional[bool]:
    """Whether the rebuilt plans give the predictions the run recorded (`wanted`) with the coefficients it
    ran with (`replay_prefill`): True, or None where those are not known; a ValueError where they are
    and the plans do not give them."""
    from engine.core.memory import coefficients as coefs, model as mem

    recorded = None
    if not on_gpu:
        recorded = coefs.coefficients_for_backend("cpu")
    elif config.get("memory_coefficients"):
        recorded = coefs.with_overrides(base_coefficients(), config["memory_coefficients"])
    if recorded is not None:
        check = mem.MemoryModel(shape, coefficients=recorded, paged_decode=paged, copies_viewed_kv=copies,
                                copies_every_view=every, fused_decode=fused)
        again = _carry([check.step_transient_bytes(pl, mixed=m) for pl, m in zip(plans, mixed)], carried)
        if again != wanted:  # the rebuilt plans are the engine's
            raise ValueError(f"rebuilt plans do not reproduce the recorded predictions: {again}")
        return True
    # GPU runs of engines that predicted with the CPU set (before the CUDA sets existed)
    cpu = mem.MemoryModel(shape, coefficients=coefs.coefficients_for_backend("cpu"), copies_viewed_kv=False)
    if _carry([cpu.step_transient_bytes(pl, mixed=m) for pl, m in zip(plans, mixed)], carried) == wanted:
        return True
    return None


def replay_runs(paths: list[str], backend: str, views: bool, coefficients: Optional[dict]) -> list[dict]:
    """`replay_prefill` of each run, without the coefficients it predicted with (--replay-prefill)."""
    result = [replay_prefill(f, backend, views, coefficients) for f in paths]
    for run in result:
        run.pop("coefficients")
    return result


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
    scaled = {**fixed, **{t: ceil_sig(fixed[t] * high) for t in terms}}
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
