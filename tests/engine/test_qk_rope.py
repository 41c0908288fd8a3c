"""The fused q/k norm + RoPE kernel's plumbing (engine/model/kernels/qk_rope.py), on the CPU where the
kernel itself cannot run: which rotations it takes, how the runner enables it (its self-check against
ReferenceOps.rope_qkv decides), and that the decode loop then calls it for every layer."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.model.kernels import qk_rope
from engine.model.layers.ops import ReferenceOps, RopeSpec


def test_it_takes_full_non_traditional_rotations_of_head_sizes_a_warp_pair_splits():
    ok = RopeSpec(nn.RoPE(128, base=10000.0), 128)
    assert qk_rope.supports(ok, 128, mx.bfloat16) is None and qk_rope.supports(ok, 128, mx.float32) is None
    assert "partial" in qk_rope.supports(RopeSpec(nn.RoPE(64), 128), 128, mx.bfloat16)
    assert "partial" in qk_rope.supports(RopeSpec(nn.RoPE(128, traditional=True), 128), 128, mx.bfloat16)
    assert "head size" in qk_rope.supports(RopeSpec(nn.RoPE(96), 96), 96, mx.bfloat16)
    assert "dtype" in qk_rope.supports(ok, 128, mx.int32)


class ReferenceKernel:
    """Stands for the CUDA kernel on this CPU: the reference's results (or wrong ones), counting calls."""

    wrong = False

    def __init__(self, ropes, norm_eps=()):
        self.ids, self.calls = {id(r) for r in ropes}, 0

    def handles(self, rope) -> bool:
        return id(rope) in self.ids

    def __call__(self, qkv, offsets, rope, heads, kv_heads, norms=None):
        self.calls += 1
        q, k, v = ReferenceOps().rope_qkv(qkv, offsets, rope, heads, kv_heads, norms)
        return (q + 1.0, k, v) if self.wrong else (q, k, v)


def test_the_runner_enables_it_only_if_it_passes_its_self_check(tiny_parts, monkeypatch, make_engine,
                                                                  reference_greedy):
    from engine.model.runner import ModelRunner

    monkeypatch.setattr(qk_rope, "CudaQKRope", ReferenceKernel)
    monkeypatch.setattr(qk_rope, "supports", lambda *args: None)  # the tiny model's heads are 16 wide
    runner = ModelRunner(tiny_parts[0], fused_rope=True)
    kernel = runner.ops.qk_rope
    assert isinstance(kernel, ReferenceKernel) and kernel.calls == 1  # the self-check (one kind of layer)
    assert ModelRunner(tiny_parts[0]).ops.qk_rope is None  # not asked for
    monkeypatch.setattr(ReferenceKernel, "wrong", True)
    assert ModelRunner(tiny_parts[0], fused_rope=True).ops.qk_rope is None  # differs: not used
    # enabled, every decode layer's rotation goes through it and greedy tokens are mlx-lm's
    monkeypatch.setattr(ReferenceKernel, "wrong", False)
    engine = make_engine(max_num_seqs=2)
    assert qk_rope.enable(engine.runner.ops, engine.runner.decode_path, mx.float32) is None
    kernel = engine.runner.ops.qk_rope
    prompt = list(range(5, 30))
    from engine.core.types import SamplingParams
    engine.add_request("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    tokens = []
    while engine.has_unfinished():
        tokens += [t for o in engine.step().outputs for t in o.new_token_ids]
    assert tokens == reference_greedy(tiny_parts[0], prompt, 5)
    assert kernel.calls >= 1 + 4 * len(engine.runner.decode_path.layers)  # self-check, then each layer a step


@pytest.mark.skipif(not (hasattr(mx, "cuda") and mx.cuda.is_available()), reason="the kernel runs on CUDA only")
def test_the_cuda_kernel_equals_the_reference():
    """On a CUDA device: the kernel against ReferenceOps.rope_qkv for Llama 3's, Qwen3's (head norms) and
    Gemma 3's (two bases, linear scaling) rotations, 1-64 rows at offsets up to 32k."""
    from mlx_lm.models.rope_utils import initialize_rope

    cases = [(initialize_rope(128, 500000.0, False, {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor":
                                                    4.0, "original_max_position_embeddings": 8192,
                                                    "rope_type": "llama3"}, 131072), 32, 8, False),
             (nn.RoPE(128, base=1000000.0), 32, 8, True),
             (nn.RoPE(256, base=10000.0), 16, 8, True), (nn.RoPE(256, base=1000000.0, scale=0.125), 16, 8, True)]
    for module, heads, kv_heads, with_norms in cases:
        rope = RopeSpec(module, module.dims)
        d = module.dims
        for dtype in (mx.bfloat16, mx.float32):
            norms = ((mx.random.uniform(0.5, 1.5, (d,)).astype(dtype), 1e-6),
                     (mx.random.uniform(0.5, 1.5, (d,)).astype(dtype), 1e-6)) if with_norms else None
            kernel = qk_rope.CudaQKRope([rope], ((1e-6, 1e-6),))
            for rows in (1, 16, 64):
                qkv = mx.random.normal((rows, 1, (heads + 2 * kv_heads) * d)).astype(dtype)
                offsets = mx.random.randint(0, 32768, (rows,)).astype(mx.int32)
                got = kernel(qkv, offsets, rope, heads, kv_heads, norms)
                want = ReferenceOps().rope_qkv(qkv, offsets, rope, heads, kv_heads, norms)
                for a, b in zip(got, want):
                    assert a.shape == b.shape and a.dtype == b.dtype
                    assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=2e-2 if dtype != mx.float32
                                       else 1e-4, rtol=2e-2).item()


def test_an_engine_whose_decodes_run_the_kernel_predicts_them_with_more_layers_in_flight(monkeypatch, make_engine):
    """The engine builds its memory model after the runner: where the runner enabled the kernel (on CUDA
    by default; here the reference stands in), a decode's per-layer terms count FUSED_DECODE_LAYERS_FACTOR
    times the layers in flight (engine/core/memory/model.py), its prompt chunks as before."""
    from engine.core.memory.model import FUSED_DECODE_LAYERS_FACTOR
    from engine.engine import Engine

    plain = make_engine(max_num_seqs=2)
    assert not plain.memory.fused_decode and plain.execution_paths().fused_rope is False
    build = Engine._build_runner

    def with_kernel(*args, **kwargs):
        runner = build(*args, **kwargs)
        runner.ops.qk_rope = ReferenceKernel(runner.decode_path.ropes)
        return runner

    monkeypatch.setattr(Engine, "_build_runner", staticmethod(with_kernel))
    fused = make_engine(max_num_seqs=2)
    m, p = fused.memory, plain.memory
    assert m.fused_decode and fused.execution_paths().fused_rope
    assert m.decode_layer_factor == min(m.shape.num_layers, FUSED_DECODE_LAYERS_FACTOR * m.layer_factor) > p.layer_factor
    # its layers' stage (the tiny model's logits, a stage of their own on the CPU, outweigh both)
    layers = [model.decode_phases([40, 40])[0].bytes(model.coefficients) for model in (m, p)]
    assert layers[0] > layers[1] and m.decode_bytes([40, 40]) >= p.decode_bytes([40, 40])
    assert m.prefill_chunk_bytes(16, 40, True) == p.prefill_chunk_bytes(16, 40, True)


def test_device_constants_are_padded_past_the_scalar_pool():
    """Kernels' constant inputs (engine/model/kernels/constants.py): their values first, padded with zeros
    to more than the 8 bytes MLX's CUDA allocator keeps in managed memory the device reads in place."""
    from engine.model.kernels.constants import SCALAR_POOL_BYTES, device_constant

    for values, dtype in (([0.125], mx.float32), ([1.0, 13.2877], mx.float32), ([512], mx.int32),
                          ([0], mx.bfloat16), (list(range(7)), mx.int32)):
        a = device_constant(values, dtype)
        assert a.dtype == dtype and a.nbytes > SCALAR_POOL_BYTES and a.ndim == 1
        assert a[:len(values)].tolist() == mx.array(values, dtype).tolist() and not a[len(values):].any().item()
    freqs = mx.arange(64, dtype=mx.float16) / 7  # an array (Llama3RoPE's frequencies): copied, cast, padded
    a = device_constant(freqs, mx.float32)
    assert a.shape == (65,) and a.dtype == mx.float32 and mx.array_equal(a[:64], freqs.astype(mx.float32)).item()
