"""Which of the runner's ways of building forwards the engine asks for (engine/model/runner.py's
ModelRunner takes them as arguments of the same names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RunnerOptions:
    """Which of the runner's ways of building forwards the engine asks for (where the model and the
    backend take them). The defaults are what measured best and what the engine runs; tests and
    benchmarks pass others to compare (ModelRunner's arguments of the same names)."""

    fuse_projections: bool = True
    layer_loops: bool = True
    mixed_batches: bool = True
    compiled_decode: bool = True  # on MLX's CUDA backend only
    cpu_math: bool = True  # on MLX's CPU backend only
    read_slices: bool = True  # False: every prompt chunk gathers its KV (to measure what views save)
    # the paged kernel's first pass: on tensor cores where it applies (mma_attention), else tiled, else the
    # span kernel; False rules a variant out (to compare them: both False for the span kernel)
    tiled_attention: bool = True
    mma_attention: bool = True
    # CUDA: decode's q/k norms and RoPE in one kernel (None: on CUDA). With fewer kernels a layer more of a
    # decode's layers share MLX's committed batches: the memory model counts them
    # (engine/core/memory/model.py FUSED_DECODE_LAYERS_FACTOR)
    fused_rope: Optional[bool] = None
    # CUDA: decode's o and down products added to the residual inside their matmuls (None: on CUDA)
    fused_residual: Optional[bool] = None
    # CUDA: a paged decode's host-made inputs (KV write slots, block table, lengths, RoPE offsets) as views
    # of one managed-memory array instead of four (forward_view.step_inputs, docs/decode.md; None: on CUDA)
    pack_step_inputs: Optional[bool] = None
    # CUDA, with fused_rope: a paged decode's keys and values written into the pool by the rope kernel, in
    # place, instead of two scatters a layer (qk_rope.CudaQKRope.rope_into_pool; None: on CUDA)
    rope_writes_kv: Optional[bool] = None
    # on a GPU, also the loops of families not yet validated there (engine/model/families.py
    # GPU_LOOP_FAMILIES): for the runs that validate them
    gpu_unvalidated_loops: bool = False
