"""engine/core/memory/model.py's predictions of grid points: the MemoryModel of a grid's shape, each
point's prediction as the engine makes it, and the stages (TransientTerms) a fit reads."""

from __future__ import annotations

import dataclasses
from typing import Optional

from .shapes import CHUNK_STAGES


def model_shape(sh: dict):
    """The ModelShape of a grid's shape (`shape_of`; grids recorded before it: llamas, from their dimensions)."""
    from engine.core.memory.model import ModelShape

    if "model_shape" in sh:
        fields = dict(sh["model_shape"], layer_windows=tuple(sh["model_shape"].get("layer_windows") or ()))
        return ModelShape(**fields)
    return ModelShape(num_layers=sh["L"], hidden_size=sh["D"], num_heads=sh["H"], num_kv_heads=sh["Hkv"],
                      head_dim=sh["d"], intermediate_size=sh["I"], vocab_size=sh["V"], dtype_bytes=sh["s"])


def matmul_workspace(sh: dict):
    """The decode's matmul workspaces the engine measured for a grid's shape (recorded by `decode_grid`
    as its `matmul_workspace`, and by `memory_flags` in a step point's; none in grids from before, or on
    the CPU): in the model's predictions, and so out of what a fit's coefficients explain (a decode's
    fixed bytes)."""
    from engine.core.memory.workspace import MatmulWorkspace

    ws = sh.get("matmul_workspace") or {}
    return MatmulWorkspace(tuple(ws.get("per_layer", ())), tuple(ws.get("head", ())))


def _model_of(sh: dict, coefficients, paged: bool = False, copies_viewed_kv: bool = True,
              copies_every_view: bool = False, fused_decode: bool = False):
    from engine.core.memory.model import MemoryModel

    return MemoryModel(model_shape(sh), coefficients=coefficients, paged_decode=paged, mixed=True,
                       copies_viewed_kv=copies_viewed_kv, copies_every_view=copies_every_view,
                       matmul_workspace=matmul_workspace(sh), fused_decode=fused_decode)


def fused_decodes(data: dict) -> bool:
    """Whether a grid's decodes ran the fused q/k rope kernel, for grids whose points do not say: those
    recorded while it was opt-in (their run's MLX_SERVE_FUSED_ROPE=1). A merged grid's environment is its
    last decode grid's: one merged before its points said (`checks.merge_grids`) reads as unfused, as the
    fit that made it read every point."""
    if data.get("bench") == "memory_grid_merged":
        return False
    return data.get("environment", {}).get("mlx_env", {}).get("MLX_SERVE_FUSED_ROPE") == "1"


def mixed_predictions(pts: list[dict], shapes: dict, coefficients, fused_decode: bool = False) -> list[Optional[int]]:
    """engine/core/memory/model.py's prediction of every mixed grid point; None where the engine would run that
    step apart (a model no deeper than the set's `mixed_min_layers`, `MemoryModel.mixed`). `fused_decode`
    as for `engine_predictions`."""
    from engine.core.memory.model import PrefillChunkPlan

    out = []
    for p in pts:
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")),
                      fused_decode=p.get("fused_decode", fused_decode))
        chunk = PrefillChunkPlan(p["c"], p["n"], bool(p["logits"]), gathers=p.get("gathers", True))
        out.append(m.mixed_bytes(chunk, [p["decode_n"]] * p["B"]) if m.mixed else None)
    return out


def engine_predictions(pts: list[dict], shapes: dict, coefficients, fused_decode: bool = False) -> list[int]:
    """engine/core/memory/model.py's own prediction of every grid point (max(layers, logits) in decode, int
    truncation): what the engine will use, so the no-under-prediction check is on this, not the fit.
    `fused_decode`: the grid's decodes ran the fused q/k rope kernel (`fused_decodes`), where a point does
    not say (its `fused_decode`: grids recorded since the kernel became CUDA's default)."""
    out = []
    for p in pts:  # the copy of a viewed row's KV as this engine makes it: not where the point's said it
        # would not (cpu_math's attention); grids from before the copy were CUDA's, where it now does
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")), p.get("copies_viewed_kv", True),
                      bool(p.get("copies_every_view")), p.get("fused_decode", fused_decode))
        gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
        if p["kind"] == "prefill":
            out.append(m.prefill_chunk_bytes(p["c"], p["n"], bool(p["logits"]), gathers=gathers))
        elif p["kind"] == "stage":  # one kind of a chunk's stages alone (`stage_grid`)
            stages = stage_phases(m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers), p["stage"])
            out.append(int(max(t.bytes(coefficients) for t in stages)))
        else:
            out.append(m.decode_bytes([p["n"]] * p["B"], gathers=gathers))
    return out


def point_phases(p: dict, shapes: dict, coefficients) -> tuple:
    """The TransientTerms of a grid point's stages as engine/core/memory/model.py builds them with
    `coefficients` (its layers_in_flight, and which stages it runs apart: the transient is the largest
    stage's), a family's extra arrays and windows included."""
    paged = bool(p.get("paged"))
    if paged and coefficients.decode_paged is None:  # a set not fitted on paged decodes yet: fit one
        coefficients = dataclasses.replace(coefficients, decode_paged=1.0)
    # the copy of a viewed row's KV only where the point's engine made it (`fixed_bytes`)
    m = _model_of(shapes[p["variant"]], coefficients, paged, copies_viewed_kv=bool(p.get("copies_viewed_kv")),
                  copies_every_view=bool(p.get("copies_every_view")), fused_decode=bool(p.get("fused_decode")))
    gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
    if p["kind"] == "prefill":
        return m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)
    if p["kind"] == "stage":  # one kind of a chunk's stages, measured alone (`stage_grid`)
        return stage_phases(m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers), p["stage"])
    return m.decode_phases([p["n"]] * p["B"], gathers=gathers)


def stage_phases(phases: tuple, kind: str) -> tuple:
    """The phases of a chunk (MemoryModel.chunk_phases, its stages apart) that a stage grid point of
    `kind` (CHUNK_STAGES) measured: the MLP's are every phase between the attention and the head (a MoE
    layer's stage of its experts' outputs too, which `stage_grid` counts as the MLP's)."""
    k = CHUNK_STAGES.index(kind)
    if kind == "head":
        return phases[-1:]
    if kind == "mlp":
        return phases[2:-1]
    return phases[k:k + 1]


def held_stages(pts: list[dict]) -> dict:
    """(variant, chunk, context) -> the kind of stage measured largest there (`stage_grid`), its bytes."""
    held: dict = {}
    for p in pts:
        key = (p["variant"], p.get("c"), p["n"])
        if p["kind"] == "stage" and p["measured"] > held.get(key, ("", 0))[1]:
            held[key] = (p["stage"], p["measured"])
    return held


def holding_stage(p: dict, shapes: dict, coef, held: dict, gathered_attention: bool = True):
    """The stage (TransientTerms) of a grid point that holds its transient (`_scale_above`): the one
    `coef` predicts largest, or for a chunk whose stages were measured alone the one measured largest
    (the stages were measured reading views: for a chunk that gathers, its attention where that is
    predicted larger, unless not `gathered_attention`: the gathered KV in place of the view's copy, which
    this engine's grids measure the same)."""
    phases = point_phases(p, shapes, coef)
    kind = held.get((p["variant"], p.get("c"), p["n"])) if p["kind"] == "prefill" else None
    if kind is None:
        return max(phases, key=lambda t: t.bytes(coef))
    stage = max(stage_phases(phases, kind[0]), key=lambda t: t.bytes(coef))
    attention = phases[CHUNK_STAGES.index("attention")]
    return (attention if gathered_attention and p.get("gathers", True) and attention.bytes(coef) > stage.bytes(coef)
            else stage)
