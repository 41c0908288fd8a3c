"""The grid's model shapes and the raw term values of engine/core/memory/model.py's formulas at a grid
point (prefill chunk or decode step), which make the fit a linear problem."""

from __future__ import annotations

import dataclasses

from bench_common import LLAMA_8B, LLAMA_TEST

PREFILL_TERMS = ("prefill_scores", "prefill_mask", "prefill_gather", "prefill_mlp", "prefill_hidden",
                 "prefill_logits", "decode_scores", "prefill_layer_rows")
DECODE_TERMS = ("decode_gather", "decode_paged", "decode_scores", "decode_logits", "decode_mlp", "decode_hidden")

# 2-layer variants: each changes some of heads / hidden / MLP / vocabulary against the 8B shape.
VARIANTS = {
    "8b-2layers": dict(LLAMA_8B, num_hidden_layers=2),
    "d2048-h16-i8192-v32k": dict(LLAMA_8B, num_hidden_layers=2, hidden_size=2048, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=128, intermediate_size=8192, vocab_size=32000),
    "d4096-h64-i4096": dict(LLAMA_8B, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=8,
                            head_dim=64, intermediate_size=4096),
}
TEST_VARIANTS = {
    "test-2layers": dict(LLAMA_TEST, num_hidden_layers=2),
    "test-wide-mlp": dict(LLAMA_TEST, num_hidden_layers=2, intermediate_size=2048, vocab_size=32000),
    # the shapes of scripts/calibrate_memory.py and tests/engine/test_memory_measured.py (head_dim 64)
    "d256-h4-i512-v32k": dict(LLAMA_TEST, num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                              num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=32000),
    "d1024-h16-i2816-v16k": dict(LLAMA_TEST, num_hidden_layers=2, hidden_size=1024, num_attention_heads=16,
                                 num_key_value_heads=4, head_dim=64, intermediate_size=2816, vocab_size=16000),
}


def family_variants(spec: str) -> dict:
    """--families: families (model_type, or model_type:bits for mlx-lm's quantized format; all: every one) ->
    the configs of the engine tests' tiny checkpoints of them at hidden size 256
    (tests/engine/test_families.py's memory test; head_dim 64 where the family's config gives it)."""
    from tests.engine.family_checkpoints import FAMILY_CONFIGS, family_config

    names = []
    for name in (n for n in spec.split(",") if n):  # mistral: llama's module and shape
        names += [f for f in FAMILY_CONFIGS if f != "mistral"] if name == "all" else [name]
    out = {}
    for name in names:
        family, _, bits = name.partition(":")
        extra = {} if family in ("llama", "mistral", "qwen2", "phi3") else {"head_dim": 64}
        config = family_config(family, hidden_size=256, intermediate_size=512, **extra)
        if bits:
            config["quantization"] = {"group_size": 32, "bits": int(bits)}
        out[f"{family}{'-q' + bits if bits else ''}-d256"] = config
    return out


def loops_family(config: dict) -> bool:
    """Whether the engine's layer loops run this config's model (the families of
    engine/model/layers/block.py, float weights: engine/model/layers/bound.py)."""
    from engine.core.model_config import SUPPORTED_MODEL_TYPES
    from engine.model.layers.block import LOOP_BLOCKS

    module = SUPPORTED_MODEL_TYPES.get(config.get("model_type", "llama"))
    return (module in LOOP_BLOCKS or module == "gemma3") and not config.get("quantization")


# The families the engine's layer loops ran before they took Qwen3-MoE and Gemma 1-3 (the runs under
# scripts/data that --replay-prefill reads were recorded then: those families ran mlx-lm's modules)
REPLAYED_LOOP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def shape_of(config: dict, dtype_bytes: int, layer_loops: bool = True) -> dict:
    """The shape's dimensions as the grid's terms read them, and `model_shape`: the engine's ModelShape
    of the model (engine/core/memory/shape.py: a family's extra arrays, its windows), which the fit
    predicts with."""
    from engine.core.memory.shape import ModelShape

    shape = ModelShape.from_config(config, dtype_bytes, module_forwards=not (layer_loops and loops_family(config)))
    if shape.layer_windows:  # the engine's pool keeps the sliding layers' KV in rings (engine/model/kv_pool.py)
        shape = dataclasses.replace(shape, num_kv_layers=sum(w is None for w in shape.layer_windows))
    return dict(H=shape.num_heads, Hkv=shape.num_kv_heads, d=shape.head_dim, D=shape.hidden_size,
                I=shape.intermediate_size, V=shape.vocab_size, L=shape.num_layers, s=dtype_bytes,
                model_shape=dataclasses.asdict(shape))


def prefill_terms(sh: dict, c: int, n: int, logits: bool) -> dict:
    return dict(prefill_scores=4 * sh["H"] * c * n if c > 1 else 0, prefill_mask=c * n,
                prefill_gather=n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                prefill_mlp=c * sh["I"] * sh["s"], prefill_hidden=c * sh["D"] * sh["s"],
                prefill_logits=4 * sh["V"] * int(logits), decode_scores=4 * sh["H"] * n if c == 1 else 0,
                prefill_layer_rows=sh["I"] * sh["s"] if c > 1 else 0)


def fixed_bytes(sh: dict, p: dict) -> int:
    """The formula's term with no coefficient at a grid point: the copy of a viewed row's KV that a
    chunk ending its prompt reads with its last position, or (`copies_every_view`: cpu_math's attention)
    every chunk (MemoryModel.prefill_chunk_bytes). 0 for a point of an older grid (no `copies_viewed_kv`):
    its engine made no copy, so its measure holds none, and subtracting one would let the fit
    under-predict today's engine, which makes it."""
    copies = (p["kind"] == "prefill" and p["c"] > 1 and not p.get("gathers", True)
              and (p.get("copies_every_view") or p.get("copies_viewed_kv") and p.get("logits")))
    return p["n"] * sh["Hkv"] * 2 * sh["d"] * sh["s"] if copies else 0


def decode_terms(sh: dict, b: int, n: int, paged: bool = False, block: int = 256) -> dict:
    """`paged`: attention read the pool in place (no gathered copy; the kernel's partials instead, one
    per span of PAGED_PARTIAL_KEYS keys: older grids, measured with one per pool block, keep the terms they
    recorded)."""
    from engine.core.memory.model import PAGED_PARTIAL_KEYS

    spans = -(-n // block) * max(1, block // PAGED_PARTIAL_KEYS)
    return dict(decode_gather=0 if paged else b * n * sh["Hkv"] * (2 * sh["d"] * sh["s"] + 4),
                decode_paged=b * sh["H"] * spans * (sh["d"] + 2) * 4 if paged else 0,
                decode_scores=4 * b * sh["H"] * n, decode_logits=4 * b * sh["V"],
                decode_mlp=b * sh["I"] * sh["s"], decode_hidden=b * sh["D"] * sh["s"])


# MLX's CPU allocator's page (Linux x86): an array of a page or more takes whole pages, which the tiny
# model's odd-sized chunks show (TransientCoefficients.allocation_page_bytes, docs/memory.md)
CPU_PAGE_BYTES = 4096
# MemoryModel.chunk_phases' stages where the runner waits between them (phases_apart), by their index
CHUNK_STAGES = ("projections", "attention", "mlp", "head")
