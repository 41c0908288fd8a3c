"""engine/model/layers/cpu_math.py: attention and SwiGLU with exp as a power compute what MLX's and mlx-lm's compute
(real MLX on the CPU), hold less memory than MLX's attention, and the CPU engine runs them by default."""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.activations import swiglu

from engine.model.layers import cpu_math
from engine.core.types import SamplingParams
from engine.model.runner import RunnerOptions


def normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


CASES = [  # (B, H, H_kv, T, L, mask)
    (1, 9, 3, 37, 37, "causal"),    # a first chunk: T not a multiple of the query blocks
    (1, 9, 3, 40, 300, "causal"),   # a later chunk: queries at the end of the keys
    (1, 4, 4, 2, 5, "causal"),      # fewer queries than blocks, no grouping
    (1, 9, 3, 1, 70, None),         # one query: every key
    (3, 9, 3, 1, 70, "rows"),       # a gathered decode: each row's own length
    (2, 4, 2, 5, 9, "full"),        # a boolean mask per head and query
]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[5]}-T{c[3]}-L{c[4]}" for c in CASES])
def test_attention_equals_mlx_attention(case, dtype):
    B, H, H_kv, T, L, kind = case
    q, k, v = normal((B, H, T, 64), 1, dtype), normal((B, H_kv, L, 64), 2, dtype), normal((B, H_kv, L, 64), 3, dtype)
    mask = kind
    if kind == "rows":
        mask = (mx.arange(L)[None] < mx.array([L, L - 9, 1])[:, None])[:, None, None, :]
    elif kind == "full":
        mask = (normal((B, H, T, L), 4) > 0) | (mx.arange(L) == 0)  # every query reads some key
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=mask)
    got = cpu_math.attention(q, k, v, 0.125, mask)
    assert got.shape == want.shape and got.dtype == want.dtype
    tolerance = 1e-5 if dtype == mx.float32 else 2e-2
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() <= tolerance


def test_attention_rejects_other_masks():
    q, k = normal((1, 2, 3, 8), 1), normal((1, 2, 3, 8), 2)
    with pytest.raises(ValueError, match="causal"):
        cpu_math.attention(q, k, k, 1.0, "sliding")
    with pytest.raises(ValueError, match="boolean"):
        cpu_math.attention(q, k, k, 1.0, mx.zeros((3, 3)))


def test_swiglu_equals_mlx_lm_including_saturated_gates():
    gate = mx.concatenate([normal((64, 96), 5) * 6, mx.array([[-200.0, -90.0, 0.0, 90.0, 200.0] * 19 + [1.0]])])
    up = normal(gate.shape, 6)
    want, got = swiglu(gate, up), cpu_math.swiglu(gate, up)
    assert not mx.isnan(got).any().item()
    assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()


def test_a_chunk_holds_less_than_mlx_attention():
    """The query blocks run one after another: a 512-query chunk over 1024 keys peaks under MLX's own
    attention (which holds its whole float32 scores and more), and under the same chunk in one block."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
    from bench_cpu_math import peak_over  # what scripts/bench_cpu_math.py reports

    q, k, v = normal((1, 9, 512, 64), 7), normal((1, 3, 1024, 64), 8), normal((1, 3, 1024, 64), 9)
    mx.eval(q, k, v)
    scores = 4 * 9 * 512 * 1024
    ours = peak_over(lambda: cpu_math.attention(q, k, v, 0.125, "causal"))
    one_block = peak_over(lambda: cpu_math.attention(q, k, v, 0.125, "causal", blocks=1))
    theirs = peak_over(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
    assert ours < theirs and ours < 0.9 * scores
    assert ours < one_block / 2  # the blocks, run one after another, are what keeps it small


@pytest.mark.parametrize("cpu_math_on", [True, False], ids=["cpu_math", "mlx_attention"])
def test_cpu_engine_greedy_equals_mlx_lm_either_way(make_engine, tiny_parts, reference_greedy, run_to_completion,
                                                    cpu_math_on):
    """The CPU engine runs cpu_math in its chunk, decode and mixed forwards by default, with the memory
    set fitted for it; off, MLX's attention and its own set. Either way mlx-lm's greedy tokens."""
    engine = make_engine(runner_options=RunnerOptions(cpu_math=cpu_math_on), prefill_chunk_size=32, max_num_seqs=3)
    runner = engine.runner
    assert runner.ops.cpu_math is cpu_math_on
    assert runner.chunk_path.ops is runner.ops and runner.decode_path.ops is runner.ops
    assert runner.mixed.path.ops is runner.ops
    # the tiny model's own calibration of the layer loops' set (engine/core/memory/coefficients.py)
    assert engine.memory_coefficients_source == ("tiny test model calibration of the cpu set" if cpu_math_on
                                                 else "cpu-mlx-attention set")
    # a prompt's last query reads its row's KV view as is with cpu_math, a copy with MLX's attention
    # (ReferenceOps.attend): the memory model counts the copy only where it is made
    assert engine.memory.copies_viewed_kv is not cpu_math_on
    prompts = {"a": [5, 9, 17, 4] * 20, "b": [7, 3] * 5, "c": list(range(3, 50))}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens = run_to_completion(engine)
    for rid, prompt in prompts.items():
        assert tokens[rid] == reference_greedy(tiny_parts[0], prompt, 8)
