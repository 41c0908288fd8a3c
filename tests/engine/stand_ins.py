"""Stand-ins for CUDA-only kernels in CPU tests of the engine's plumbing around them."""

from __future__ import annotations

from engine.model.kernels.paged_attention import ReferenceAttention
from engine.model.layers.ops import ReferenceOps


class PoolWritingRope:
    """A stand-in for qk_rope.CudaQKRope on the CPU: the reference rotation, and `rope_into_pool` writing
    k and v into the pool's arrays at the given rows (a scatter into the same array objects, where the CUDA
    kernel writes their buffers) and returning q; counts its calls."""

    def __init__(self):
        self.reference = ReferenceOps()
        self.into_pool = 0

    def handles(self, rope) -> bool:
        return True

    def __call__(self, *args):
        return self.reference.rope_qkv(*args)

    def rope_into_pool(self, qkv, offsets, rope, heads, kv_heads, norms, k_pool, v_pool, rows):
        q, k, v = self.reference.rope_qkv(qkv, offsets, rope, heads, kv_heads, norms)
        d = k.shape[-1]
        k_pool[rows] = k.reshape(-1, d)
        v_pool[rows] = v.reshape(-1, d)
        self.into_pool += 1
        return q


class OrderedReferenceAttention(ReferenceAttention):
    """ReferenceAttention marked as reading the pool only after the queries (as the CUDA kernels do): true
    beside PoolWritingRope, whose scatter the gather depends on; never beside the CUDA rope kernel."""

    reads_pool_after_queries = True
