"""Fused q/k/v and gate/up projections (engine/model/layers/fused.py) on a real llama."""

from __future__ import annotations

import collections
import re
import tempfile

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from engine.model.layers.fused import GROUPS, FusedPart, fuse_projections
from engine.model.runner import RunnerOptions


def small_llama(bias=False):
    args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=96,
                           num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=128,
                           attention_bias=bias, mlp_bias=bias)
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def op_counts(array) -> collections.Counter:
    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, array)
        text = f.read()
    return collections.Counter(re.search(r'label ="?([A-Za-z]+)', line).group(1) for line in text.splitlines()
                               if "shape=rectangle" in line or "shape=box" in line)


@pytest.mark.parametrize("bias", [False, True])
def test_fused_model_holds_one_copy_and_its_modules_compute_the_original_layers(bias):
    """mlx-lm's modules running the fused model compute exactly what they did; the group's product,
    which the engine's layer loops call, has every part's columns."""
    model = small_llama(bias)
    x = mx.array([[5, 9, 17]])
    before = model(x)
    params = dict(tree_flatten(model.parameters()))
    assert fuse_projections(model) == 4  # two groups in each of two layers
    fused_params = dict(tree_flatten(model.parameters()))
    assert sum(p.nbytes for p in fused_params.values()) == sum(p.nbytes for p in params.values())
    assert "model.layers.0.self_attn.qkv_proj.weight" in fused_params
    assert "model.layers.1.mlp.gate_up_proj.weight" in fused_params
    assert not any(".q_proj." in n or ".up_proj." in n for n in fused_params)
    attn = model.model.layers[0].self_attn
    assert isinstance(attn.k_proj, FusedPart)
    assert mx.array_equal(attn.k_proj.weight, params["model.layers.0.self_attn.k_proj.weight"]).item()

    assert mx.array_equal(model(x), before).item()  # each part alone: exactly the original layers
    h = mx.random.normal((1, 3, 64), key=mx.random.key(0))
    for block, names, fused_name in GROUPS:
        module = getattr(model.model.layers[1], block)
        parts = mx.concatenate([getattr(module, n)(h) for n in names], axis=-1)
        assert mx.allclose(module[fused_name](h), parts, atol=1e-5, rtol=1e-5).item()
        assert sum(op_counts(module[fused_name](h)).get(k, 0) for k in ("Matmul", "AddMM")) == 1
    assert fuse_projections(model) == 4  # idempotent: counts the groups already fused


def decode_matmuls(engine) -> int:
    """Matmul nodes in the graph of the engine's next decode forward (after its prompts prefilled)."""
    from engine.core.types import SamplingParams

    engine.add_request("a", [5, 9, 17, 4], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()  # the prompt
    runner, counts = engine.runner, []
    forward = runner._decode_forward  # the layer loop, or (unfused) mlx-lm's modules

    def counting(tokens, view):
        hidden = forward(tokens, view)
        ops = op_counts(hidden)
        counts.append(ops.get("Matmul", 0) + ops.get("AddMM", 0))
        return hidden

    runner._decode_forward = counting
    engine.step()
    return counts[0]


def test_engine_decode_uses_the_fused_matmuls(make_engine, tiny_parts):
    fused = make_engine()
    assert fused.runner.fused and make_engine().runner.fused  # a second engine on the already fused model
    unfused = make_engine(runner_options=RunnerOptions(fuse_projections=False))
    assert not unfused.runner.fused
    num_layers = fused.memory.shape.num_layers
    assert decode_matmuls(fused) == decode_matmuls(unfused) - 3 * num_layers  # 7 -> 4 per layer
