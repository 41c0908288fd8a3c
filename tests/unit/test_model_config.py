"""engine/core/model_config.py: config shapes per family, from configs as Hugging Face ships them (the
fields the engine reads), and the refusal of unsupported model types. No mlx."""

from __future__ import annotations

import pytest

from engine.core.memory.model import ModelShape
from engine.core.model_config import ConfigShape, model_type, text_config

# google/gemma-3-12b-it: the text model nested under text_config (model_type gemma3)
GEMMA3_12B = {
    "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
    "text_config": {"model_type": "gemma3_text", "hidden_size": 3840, "intermediate_size": 15360,
                    "num_attention_heads": 16, "num_hidden_layers": 48, "num_key_value_heads": 8,
                    "head_dim": 256, "sliding_window": 1024, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}},
    "vision_config": {"hidden_size": 1152},
}
# Qwen/Qwen3-30B-A3B
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
    "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "max_position_embeddings": 40960,
}
# microsoft/Phi-3-mini-4k-instruct
PHI3 = {"model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064, "max_position_embeddings": 4096}


def test_gemma3_nested_text_config_and_windows():
    shape = ConfigShape.from_config(GEMMA3_12B)
    assert (shape.num_layers, shape.hidden_size, shape.num_heads, shape.num_kv_heads, shape.head_dim) == (
        48, 3840, 16, 8, 256)
    assert shape.vocab_size == 262208  # mlx-lm's gemma3 default vocabulary, given to the text model
    assert shape.max_position_embeddings == 32768  # mlx-lm's gemma3_text default when the config has none
    assert shape.layer_windows[:6] == (1024,) * 5 + (None,) and shape.layer_windows.count(None) == 8
    assert text_config(GEMMA3_12B)["sliding_window_pattern"] == 6


def test_qwen3_moe_mlp_width_is_its_experts_per_token():
    shape = ConfigShape.from_config(QWEN3_MOE)
    assert shape.intermediate_size == 8 * 768 and shape.num_experts_per_tok == 8
    assert shape.extra_mlp_rows == 2 * 8  # per expert a token runs
    assert shape.extra_attention_rows == 36 * 128 / 2048  # the q/k head norms' outputs
    narrow = ConfigShape.from_config({**QWEN3_MOE, "mlp_only_layers": [0], "intermediate_size": 4096})
    assert narrow.intermediate_size == 8 * 768  # a dense layer narrower than 8 experts together
    wide = ConfigShape.from_config({**QWEN3_MOE, "mlp_only_layers": [0], "intermediate_size": 8192})
    assert wide.intermediate_size == 8192


def test_head_dim_per_family():
    assert ConfigShape.from_config(PHI3).head_dim == 96
    # phi3 and qwen2 derive it from hidden / heads whatever head_dim says (as mlx-lm builds them)
    assert ConfigShape.from_config({**PHI3, "head_dim": 64}).head_dim == 96
    qwen3 = {**QWEN3_MOE, "model_type": "qwen3", "num_experts": 0, "hidden_size": 1024, "num_attention_heads": 16}
    assert ConfigShape.from_config(qwen3).head_dim == 128  # explicit, not 1024 / 16


def test_model_shape_reads_the_family_shape():
    shape = ModelShape.from_config(GEMMA3_12B, dtype_bytes=2)
    assert shape.head_dim == 256 and shape.num_layers == 48 and shape.extra_score_copies == 0
    # its sliding layers (five in six, 1024 tokens) hold an explicit mask's score copy over their window
    assert shape.sliding_score_copies == 1 and shape.sliding_window == 1024 and shape.global_layers(6) == (1, 1)
    assert ModelShape.from_config(PHI3, 2).extra_hidden_rows == 3 + 1  # its fused q/k/v product (mlx-lm's module)
    assert ModelShape.from_config(PHI3, 2, module_forwards=False).extra_hidden_rows == 0  # the engine's chunk loop


def test_loop_terms_of_moe_and_gemma_blocks():
    """Through the engine's layer loops a MoE layer holds its tokens' k copies in its MLP stage and, in a
    stage of their own, the k outputs beside their unsorted copy; Gemma 2/3's MLP output norm adds two
    rows (Gemma 3 two and a half), and their attention stage holds the output's norm's rows once its scores
    are gone; through mlx-lm's modules the fitted extra rows stay."""
    from engine.core.memory.coefficients import CPU_COEFFICIENTS
    from engine.core.memory.model import MemoryModel

    loops = ModelShape.from_config(QWEN3_MOE, 4, module_forwards=False)
    modules = ModelShape.from_config(QWEN3_MOE, 4)
    assert (loops.moe_experts_per_token, loops.extra_mlp_rows) == (8, 0) and modules.extra_mlp_rows == 16
    assert loops.qk_norms and modules.moe_experts_per_token == 0
    model = MemoryModel(loops, coefficients=CPU_COEFFICIENTS)
    projections, attention, mlp, unsorted, head = model.chunk_phases(256, 1024)
    row = 256 * 2048 * 4
    assert unsorted.fixed_bytes == 16 * row and mlp.fixed_bytes == 8 * row
    assert model.prefill_chunk_bytes(256, 1024) >= unsorted.bytes(CPU_COEFFICIENTS)
    gemma3 = ModelShape.from_config(GEMMA3_12B, 4, module_forwards=False)
    assert gemma3.mlp_out_norm_rows == 2.5 and ModelShape.from_config(GEMMA3_12B, 4).mlp_out_norm_rows == 0
    assert gemma3.attention_output_rows > 7 and ModelShape.from_config(GEMMA3_12B, 4).attention_output_rows == 0
    out = MemoryModel(gemma3, coefficients=CPU_COEFFICIENTS).chunk_phases(256, 256, gathers=False)[1]
    assert out.bytes(CPU_COEFFICIENTS) >= gemma3.attention_output_rows * 256 * 3840 * 4
    assert ModelShape.from_config(PHI3, 4, module_forwards=False).mlp_out_norm_rows == 0


def test_sliding_layers_in_rings_gather_their_window_when_the_row_is_a_view():
    """A chunk that reads its row as a view of the pool still gathers its sliding layers' windows from
    their rings (num_kv_layers below num_layers), and a paged decode its sliding layers' windows. Where
    the runner waits for each layer's attention apart (the CPU set), the stage is the larger of a global
    layer's (its row's KV copied) and a sliding one's (its window gathered), not both."""
    import dataclasses

    from engine.core.memory.coefficients import CPU_COEFFICIENTS
    from engine.core.memory.model import MemoryModel

    together = dataclasses.replace(CPU_COEFFICIENTS, phases_apart=False)
    shape = ModelShape.from_config(GEMMA3_12B, 4, module_forwards=False)
    rings = dataclasses.replace(shape, num_kv_layers=8)
    view = MemoryModel(shape, coefficients=together).chunk_phases(128, 4096, gathers=False)[0]
    ringed = MemoryModel(rings, coefficients=together).chunk_phases(128, 4096, gathers=False)[0]
    keys = 1024 - 1 + 128
    assert view.prefill_gather == 0
    assert ringed.prefill_gather >= keys * 8 * (2 * 256 * 4 + 4)
    apart = MemoryModel(rings, coefficients=CPU_COEFFICIENTS)
    rows, overheads = 128 * 3840 * 4, dict(step_overhead_bytes=1)
    kinds = [apart._layer_attention(128, 4096, rows, False, False, 0, overheads, sliding) for sliding in (False, True)]
    assert kinds[1].prefill_window_gather >= keys * 8 * (2 * 256 * 4 + 4) and kinds[0].prefill_window_gather == 0
    stage = apart.chunk_phases(128, 4096, gathers=False)[1]
    assert stage.bytes(CPU_COEFFICIENTS) >= max(k.bytes(CPU_COEFFICIENTS) for k in kinds) - rows * shape.extra_attention_rows * CPU_COEFFICIENTS.family_rows
    paged = MemoryModel(shape, coefficients=dataclasses.replace(CPU_COEFFICIENTS, decode_paged=1.0), paged_decode=True)
    assert paged.decode_attention_terms([4096] * 2).decode_gather >= 2 * 1024 * 8 * (2 * 256 * 4 + 4)


@pytest.mark.parametrize("config", [{"model_type": "mamba"}, {"architectures": ["X"]}])
def test_unsupported_model_type_names_it_and_the_supported(config):
    with pytest.raises(ValueError, match=r"model_type=.* is not supported; supported model types: gemma, "):
        model_type(config)
