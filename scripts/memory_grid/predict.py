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


def _model_of(sh: dict, coefficients, paged: bool = False, copies_viewed_kv: bool = True,
              copies_every_view: bool = False):
    from engine.core.memory.model import MemoryModel

    return MemoryModel(model_shape(sh), coefficients=coefficients, paged_decode=paged, mixed=True,
                       copies_viewed_kv=copies_viewed_kv, copies_every_view=copies_every_view)


def mixed_predictions(pts: list[dict], shapes: dict, coefficients) -> list[Optional[int]]:
    """engine/core/memory/model.py's prediction of every mixed grid point; None where the engine would run that
    step apart (a model no deeper than the set's `mixed_min_layers`, `MemoryModel.mixed`)."""
    from engine.core.memory.model import PrefillChunkPlan

    out = []
    for p in pts:
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")))
        chunk = PrefillChunkPlan(p["c"], p["n"], bool(p["logits"]), gathers=p.get("gathers", True))
        out.append(m.mixed_bytes(chunk, [p["decode_n"]] * p["B"]) if m.mixed else None)
    return out


def engine_predictions(pts: list[dict], shapes: dict, coefficients) -> list[int]:
    """engine/core/memory/model.py's own prediction of every grid point (max(layers, logits) in decode, int
    truncation): what the engine will use, so the no-under-prediction check is on this, not the fit."""
    out = []
    for p in pts:  # the copy of a viewed row's KV as this engine makes it: not where the point's said it
        # would not (cpu_math's attention); grids from before the copy were CUDA's, where it now does
        m = _model_of(shapes[p["variant"]], coefficients, bool(p.get("paged")), p.get("copies_viewed_kv", True),
                      bool(p.get("copies_every_view")))
        gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
        if p["kind"] == "prefill":
            out.append(m.prefill_chunk_bytes(p["c"], p["n"], bool(p["logits"]), gathers=gathers))
        elif p["kind"] == "stage":  # one kind of a chunk's stages alone (`stage_grid`)
            stage = m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)[CHUNK_STAGES.index(p["stage"])]
            out.append(int(stage.bytes(coefficients)))
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
                  copies_every_view=bool(p.get("copies_every_view")))
    gathers = p.get("gathers", True)  # False: the row was read as a view of the pool, or paged
    if p["kind"] == "prefill":
        return m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)
    if p["kind"] == "stage":  # one kind of a chunk's stages, measured alone (`stage_grid`)
        k = CHUNK_STAGES.index(p["stage"])
        return m.chunk_phases(p["c"], p["n"], bool(p["logits"]), gathers=gathers)[k:k + 1]
    return m.decode_phases([p["n"]] * p["B"], gathers=gathers)
