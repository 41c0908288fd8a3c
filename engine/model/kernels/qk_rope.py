"""A decode step's q/k head norms, RoPE and q/k/v layout in one kernel, on MLX's CUDA backend.

Per layer the decode loop (engine/model/layers/decode_path.py, `ReferenceOps.rope_qkv`) turns the fused
q/k/v product [B, 1, (H + 2 H_kv) d] into q [B, H, 1, d], k and v [B, H_kv, 1, d]: RoPE of q and of k
(two kernels), their head RMSNorms before it where the family has them (Qwen3, Gemma 3: two more), and
v's copy into its layout. At 16 rows a decode step's time is the host's launch of its kernels
(docs/decode.md), so each kernel a layer drops is a step's time. This one does all of it: one thread
block per (row, head) of D / 2 threads, each rotating one pair (i, i + D / 2) of the head's dims, as
MLX's non-traditional RoPE does, with MLX's own arithmetic (rms_norm.cu, rope.cu: float sums and
rotation, the normed value rounded to the weights' type before the weight's product and the rotation).

`ReferenceOps.rope_qkv` stays the definition; `self_check` compares the two before the runner uses the
kernel (RunnerOptions.fused_rope), which falls back to the reference where it fails.
"""

from __future__ import annotations

import logging
from typing import Optional

import mlx.core as mx

from engine.model.kernels.constants import device_constant

logger = logging.getLogger(__name__)

# grid: B * (H + 2 HKV) blocks of D / 2 threads; inputs: qkv [B, (H + 2 HKV) D], offsets [B],
# q_norm and k_norm [D] and their eps [2] (unread without NORM), rope [2] (scale, log2 of the base;
# FREQS: rope holds the scale and freqs the D / 2 frequencies, as Llama3RoPE passes them to mx.fast.rope).
# K_ROW / V_ROW: where a row's key / value head goes: the outputs k and v [B, HKV, D] (LAYOUT_ROWS), or
# (POOL_ROWS) the KV pool's arrays [slots * HKV, D] in place, at rows[b * HKV + h] (the rows the decode's
# KV write scatters to, engine/model/forward_view.py ForwardView)
LAYOUT_ROWS = """
#define K_ROW(b, h) (k + ((size_t)(b) * HKV + (h)) * D)
#define V_ROW(b, h) (v + ((size_t)(b) * HKV + (h)) * D)
"""
POOL_ROWS = """
#define K_ROW(b, h) (const_cast<T*>(k_pool) + (size_t)rows[(b) * HKV + (h)] * D)
#define V_ROW(b, h) (const_cast<T*>(v_pool) + (size_t)rows[(b) * HKV + (h)] * D)
"""
SOURCE = """
  constexpr int NH = H + 2 * HKV;
  constexpr int HALF = D / 2;
  static_assert(HALF % 32 == 0 && HALF <= 1024, "qk_rope: D / 2 a multiple of a warp");
  const int tid = threadIdx.x;
  const int g = blockIdx.x;
  const int b = g / NH;
  const int hd = g % NH;
  const T* x = qkv + (size_t)g * D;
  if (hd >= H + HKV) {  // v: its layout only
    T* o = V_ROW(b, hd - H - HKV);
    o[tid] = x[tid];
    o[tid + HALF] = x[tid + HALF];
    return;
  }
  const bool is_q = hd < H;
  T a = x[tid];
  T c = x[tid + HALF];
  if (NORM) {
    __shared__ float partial[HALF / 32];
    const float fa = static_cast<float>(a);
    const float fc = static_cast<float>(c);
    float ss = fa * fa + fc * fc;
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
    if (tid % 32 == 0) partial[tid / 32] = ss;
    __syncthreads();
    ss = 0.0f;
    for (int i = 0; i < HALF / 32; ++i) ss += partial[i];
    const float r = rsqrt(ss / D + eps[is_q ? 0 : 1]);
    const T* w = is_q ? q_norm : k_norm;
    a = w[tid] * static_cast<T>(fa * r);
    c = w[tid + HALF] * static_cast<T>(fc * r);
  }
  const float L = rope[0] * static_cast<float>(offsets[b]);
  float inv_freq;
  if (FREQS) {
    inv_freq = 1.0 / freqs[tid];
  } else {
    const float d = static_cast<float>(tid) / static_cast<float>(HALF);
    inv_freq = exp2(-d * rope[1]);
  }
  const float theta = L * inv_freq;
  const float ct = cos(theta);
  const float st = sin(theta);
  const float x1 = static_cast<float>(a);
  const float x2 = static_cast<float>(c);
  T* o = is_q ? q + ((size_t)b * H + hd) * D : K_ROW(b, hd - H);
  o[tid] = static_cast<T>(x1 * ct - x2 * st);
  o[tid + HALF] = static_cast<T>(x1 * st + x2 * ct);
"""


def supports(rope, head_dim: int, dtype) -> Optional[str]:
    """Why the kernel cannot rotate with `rope` (an engine/model/layers/ops.py RopeSpec) at this head
    size and dtype (None: it can)."""
    module = rope.module
    if type(module).__name__ not in ("RoPE", "Llama3RoPE"):
        return f"rotary embedding {type(module).__name__}"
    if module.dims != head_dim or module.traditional:
        return "partial or traditional rotation"
    if head_dim % 64 or head_dim > 2048:
        return f"head size {head_dim} (a multiple of 64 up to 2048)"
    if dtype not in (mx.float16, mx.bfloat16, mx.float32):
        return f"dtype {dtype}"
    return None


class CudaQKRope:
    """The kernel (module docstring), called as `ReferenceOps.rope_qkv` is, for the RopeSpecs it was
    given (their parameters made into arrays once, outside any compiled trace)."""

    def __init__(self, ropes: list, norm_eps: tuple = ()):
        """`ropes`: the RopeSpecs it rotates with; `norm_eps`: the (q, k) eps pairs of the layers' head
        norms. Their arrays are made here, once, outside any compiled trace."""
        names = ["qkv", "offsets", "q_norm", "k_norm", "eps", "rope", "freqs"]
        self._kernel = mx.fast.cuda_kernel(name="qk_rope", input_names=names, output_names=["q", "k", "v"],
                                           source=LAYOUT_ROWS + SOURCE)
        # the same, writing k and v into the KV pool in place (`rope_into_pool`)
        self._pool_kernel = mx.fast.cuda_kernel(name="qk_rope_pool", input_names=names + ["k_pool", "v_pool", "rows"],
                                                output_names=["q"], source=POOL_ROWS + SOURCE)
        self._params = {}
        for rope in ropes:
            # Llama3RoPE's D / 2 frequencies (a copy: the model's array stays its own)
            freqs = device_constant([0.0] if rope.freqs is None else rope.freqs, mx.float32)
            self._params[rope] = (device_constant([rope.scale, rope.log2_base], mx.float32), freqs)  # by identity
        # every block reads these: in device memory (engine/model/kernels/constants.py says why)
        self._eps = {pair: device_constant(list(pair), mx.float32) for pair in set(norm_eps) | {(0.0, 0.0)}}
        self._unread = {t: device_constant([0], t) for t in (mx.float16, mx.bfloat16, mx.float32)}
        mx.eval(list(self._params.values()), list(self._eps.values()), list(self._unread.values()))

    def handles(self, rope) -> bool:
        return rope in self._params

    def __call__(self, qkv: mx.array, offsets: mx.array, rope, heads: int, kv_heads: int,
                 norms: Optional[tuple] = None) -> tuple:
        """qkv [B, 1, (H + 2 H_kv) d] -> q [B, H, 1, d], k and v [B, H_kv, 1, d]; `norms` as
        `ReferenceOps.rope_qkv`'s ((weight, eps) of the q heads' RMSNorm, the k heads'), or None."""
        B, d = qkv.shape[0], rope.head_dim
        return tuple(self._run(self._kernel, qkv, offsets, rope, heads, kv_heads, norms, [],
                               [(B, heads, 1, d), (B, kv_heads, 1, d), (B, kv_heads, 1, d)]))

    def rope_into_pool(self, qkv: mx.array, offsets: mx.array, rope, heads: int, kv_heads: int,
                       norms: Optional[tuple], k_pool: mx.array, v_pool: mx.array, rows: mx.array) -> mx.array:
        """As `__call__`, but k and v go into the pool arrays k_pool and v_pool [slots * H_kv, d] in place,
        at rows `rows` [B * H_kv] (row b * H_kv + h: row b's head h), instead of being returned: -> q.

        MLX does not know the pool changed: what reads it must depend on q (the paged attention takes q),
        and nothing may hold the pool arrays as a graph's input expecting their old contents. Such a
        write needs no donated buffer, so it does not wait for forwards still reading the pool."""
        (q,) = self._run(self._pool_kernel, qkv, offsets, rope, heads, kv_heads, norms,
                         [k_pool, v_pool, rows.astype(mx.int32)], [(qkv.shape[0], heads, 1, rope.head_dim)])
        return q

    def _run(self, kernel, qkv: mx.array, offsets: mx.array, rope, heads: int, kv_heads: int,
             norms: Optional[tuple], extra: list, output_shapes: list) -> list:
        """`kernel` (either variant) over qkv: one block per (row, head) of d / 2 threads; `extra`: the
        variant's inputs after the common ones."""
        B, d, dtype = qkv.shape[0], rope.head_dim, qkv.dtype
        params, freqs = self._params[rope]
        if norms is None:
            q_norm = k_norm = self._unread[dtype]
            eps = self._eps[(0.0, 0.0)]
        else:
            (q_norm, q_eps), (k_norm, k_eps) = norms
            pair = (float(q_eps), float(k_eps))
            eps = self._eps[pair] if pair in self._eps else device_constant(list(pair), mx.float32)
        nh = heads + 2 * kv_heads
        return kernel(
            inputs=[qkv.reshape(B, nh * d), offsets.astype(mx.int32), q_norm, k_norm, eps, params, freqs] + extra,
            template=[("T", dtype), ("D", d), ("H", heads), ("HKV", kv_heads), ("NORM", norms is not None),
                      ("FREQS", rope.freqs is not None)],
            grid=(B * nh * (d // 2), 1, 1), threadgroup=(d // 2, 1, 1),
            output_shapes=output_shapes, output_dtypes=[dtype] * len(output_shapes))


def self_check(kernel, reference, ropes: list, heads: int, kv_heads: int, norms: Optional[tuple], dtype) -> None:
    """Run `kernel` against `reference` (both called as `ReferenceOps.rope_qkv`) for each of the model's
    RopeSpecs on rows at offsets 0, 7 and 3000; raise if it fails or differs."""
    d = ropes[0].head_dim
    qkv = mx.random.normal((3, 1, (heads + 2 * kv_heads) * d), key=mx.random.key(7)).astype(dtype)
    offsets = mx.array([0, 7, 3000], mx.int32)
    for rope in ropes:  # as the compiled decode layers call it (decode_path.CompiledLayers)
        got = mx.compile(lambda x, o, r=rope: kernel(x, o, r, heads, kv_heads, norms))(qkv, offsets)
        want = reference(qkv, offsets, rope, heads, kv_heads, norms)
        for name, a, b in zip("qkv", got, want):
            _require_close("fused q/k rope kernel", name, a, b)


def _require_close(what: str, name: str, got: mx.array, want: mx.array) -> None:
    """Raise unless `got` is `want` within the dtype's tolerance, relative to the values (NaN fails)."""
    tolerance = 1e-4 if want.dtype == mx.float32 else 5e-2
    want = want.astype(mx.float32)
    err = mx.abs(got.astype(mx.float32) - want).max().item()
    if not err <= tolerance * max(1.0, mx.abs(want).max().item()):
        raise RuntimeError(f"{what}: {name} differs from the reference by {err}")


def self_check_pool(kernel, reference, rope, heads: int, kv_heads: int, norms: Optional[tuple], dtype) -> None:
    """`rope_into_pool` against `reference`: q as returned, k and v in the pool's rows (in place: read back
    after the call), the other rows untouched; raise if it fails or differs."""
    d, B = rope.head_dim, 3
    qkv = mx.random.normal((B, 1, (heads + 2 * kv_heads) * d), key=mx.random.key(8)).astype(dtype)
    offsets = mx.array([0, 7, 3000], mx.int32)
    slots = [5, 1, 9]  # rows b * H_kv + h of the pool: slot * H_kv + h
    rows = mx.array([s * kv_heads + h for s in slots for h in range(kv_heads)], mx.int32)
    k_pool, v_pool = mx.zeros((12 * kv_heads, d), dtype), mx.zeros((12 * kv_heads, d), dtype)
    mx.eval(k_pool, v_pool)
    q = kernel.rope_into_pool(qkv, offsets, rope, heads, kv_heads, norms, k_pool, v_pool, rows)
    mx.eval(q)
    want_q, want_k, want_v = reference(qkv, offsets, rope, heads, kv_heads, norms)
    unwritten = mx.array([r for r in range(12 * kv_heads) if r not in set(rows.tolist())])
    for name, got, want in (("q", q, want_q), ("k", k_pool[rows], want_k.reshape(B * kv_heads, d)),
                            ("v", v_pool[rows], want_v.reshape(B * kv_heads, d))):
        _require_close("fused q/k rope kernel into the pool", name, got, want)
    if mx.abs(k_pool[unwritten]).max().item() or mx.abs(v_pool[unwritten]).max().item():
        raise RuntimeError("fused q/k rope kernel into the pool: wrote rows it was not given")


def enable(ops, decode_path, dtype, into_pool: bool = False) -> Optional[str]:
    """Give `ops` (the layer loops' ReferenceOps) the kernel for `decode_path`'s layers if every layer's
    rotation allows it and it passes `self_check` here; returns why not (None: enabled). `into_pool`: and
    let a paged decode write its keys and values into the pool with it (`rope_into_pool`,
    `ops.rope_writes_kv`) if that passes `self_check_pool` (else it scatters them, logged)."""
    from engine.model.layers.decode_path import qk_norms
    from engine.model.layers.ops import ReferenceOps

    ropes, d = decode_path.ropes, decode_path.head_dim
    why = next((w for w in (supports(r, d, dtype) for r in ropes) if w is not None), None)
    norms = [qk_norms(layer) for layer in decode_path.layers]
    if why is None and any(n is not None and (n[0][0].dtype != dtype or n[1][0].dtype != dtype) for n in norms):
        why = "head norm weights of another dtype than the activations"  # MLX's rms_norm would promote
    if why is not None:
        return why
    try:
        kernel = CudaQKRope(ropes, tuple((float(n[0][1]), float(n[1][1])) for n in norms if n is not None))
        distinct = list({r.key(): r for r in ropes}.values())
        self_check(kernel, ReferenceOps().rope_qkv, distinct, decode_path.heads, decode_path.kv_heads,
                   qk_norms(decode_path.layers[0]), dtype)
    except Exception as exc:  # noqa: BLE001 - any failure means: do without it
        return f"{type(exc).__name__}: {exc}"
    ops.qk_rope = kernel
    if into_pool:
        try:
            self_check_pool(kernel, ReferenceOps().rope_qkv, distinct[0], decode_path.heads, decode_path.kv_heads,
                            qk_norms(decode_path.layers[0]), dtype)
            ops.rope_writes_kv = True
        except Exception as exc:  # noqa: BLE001 - the decode scatters its KV instead
            logger.warning("decode KV written by scatter, not by the fused q/k rope kernel (%s: %s)",
                           type(exc).__name__, exc)
    return None
