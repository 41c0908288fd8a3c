"""Kernels' constant inputs (a scale, a span's keys, RoPE's parameters) in the device's own memory.

MLX's CUDA backend keeps an array the host makes in managed memory, and one of 8 bytes or less in a
small pool of managed pages that the device reads in place (`cudaMemAdviseSetAccessedBy`) wherever the
host last touched them: the host makes every scalar of a graph there, so a kernel whose every block reads
such a constant reads it across the host link (on an H200, Nsight Compute timed the fused q/k rope kernel,
whose blocks each read two such floats, at 22 us a call where kernels of its size take 5). An array of
more than 8 bytes that a device operation writes is allocated in device memory: `device_constant` makes
its values one, padded with zeros to more than 8 bytes (kernels read the first elements).
"""

from __future__ import annotations

import mlx.core as mx

# the largest array MLX's CUDA allocator places in its managed scalar pool (allocator.cpp small_block_size)
SCALAR_POOL_BYTES = 8


def device_constant(values, dtype) -> mx.array:
    """`values` (a list of numbers, or an array) as a 1-D array of `dtype` written by a device operation
    (a concatenation, which never reuses its inputs' memory) and padded with zeros past SCALAR_POOL_BYTES
    (at least one). Lazy: it is evaluated with the first graph that reads it, or by the caller."""
    host = (values.astype(dtype) if isinstance(values, mx.array) else mx.array(values, dtype)).reshape(-1)
    pad = max(1, SCALAR_POOL_BYTES // host.itemsize + 1 - host.size)
    return mx.concatenate([host, mx.zeros((pad,), dtype)])
