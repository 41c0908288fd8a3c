"""Shared pieces of the benchmark scripts: models (embedded, local, random llama shapes), memory
readings (peaks across the engine's own resets), prompt generation, mlx-lm's BatchGenerator as its server
drives it, the memory-model helpers and the JSON output convention.

Not part of the engine: the benchmarks import the engine like any user would.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python scripts/x.py` from anywhere
    sys.path.insert(0, str(ROOT))

import engine  # noqa: E402,F401  (MLX's CUDA cache settings, before mlx loads: engine/__init__.py)
import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}

# Llama-3.1-8B's shape (Llama-3-8B with a 128K position range, so 8K prompts plus output fit).
LLAMA_8B = dict(
    model_type="llama", hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, vocab_size=128256,
    rope_theta=500000.0, max_position_embeddings=131072, tie_word_embeddings=False,
)
# The same code path at a size a 2-core CPU runs in seconds (the 8B vocabulary is kept).
LLAMA_TEST = dict(LLAMA_8B, hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=32)
# Qwen3-8B's shape (q/k head norms; head_dim 128 = hidden / heads here, set explicitly as its config does).
QWEN3_8B = dict(
    model_type="qwen3", hidden_size=4096, num_hidden_layers=36, intermediate_size=12288,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, vocab_size=151936,
    rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
)
# Gemma-3-12B's text model: 5 sliding-window layers (1024 tokens) to 1 global, head_dim 256.
GEMMA3_12B = dict(
    model_type="gemma3_text", hidden_size=3840, num_hidden_layers=48, intermediate_size=15360,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, vocab_size=262208,
    rope_theta=1000000.0, rope_local_base_freq=10000.0, query_pre_attn_scalar=256, sliding_window=1024,
    sliding_window_pattern=6, max_position_embeddings=131072, rope_scaling={"factor": 8.0, "rope_type": "linear"},
)
# Qwen3-30B-A3B: 128 experts, 8 a token, of 768 (Qwen3-MoE through the engine's layer loops)
QWEN3_30B_A3B = dict(
    model_type="qwen3_moe", hidden_size=2048, num_hidden_layers=48, intermediate_size=6144,
    num_attention_heads=32, num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, vocab_size=151936,
    rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, decoder_sparse_step=1, mlp_only_layers=[],
    norm_topk_prob=True,
)
# Gemma-2-9B: soft-capped attention and final logits, head_dim 256 (the paged kernel refuses it: no softcap)
GEMMA2_9B = dict(
    model_type="gemma2", hidden_size=3584, num_hidden_layers=42, intermediate_size=14336,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, rms_norm_eps=1e-6, vocab_size=256000,
    rope_theta=10000.0, query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
    max_position_embeddings=8192,
)
RANDOM_SHAPES = {"llama-8b": LLAMA_8B, "llama-test": LLAMA_TEST, "qwen3-8b": QWEN3_8B, "gemma3-12b": GEMMA3_12B,
                 "qwen3-30b-a3b": QWEN3_30B_A3B, "gemma2-9b": GEMMA2_9B,
                 "qwen3-moe-test": dict(QWEN3_30B_A3B, hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                                        num_key_value_heads=2, head_dim=64, num_experts=16, moe_intermediate_size=128),
                 "gemma2-test": dict(GEMMA2_9B, hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64),
                 "qwen3-test": dict(QWEN3_8B, hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                                    num_attention_heads=8, num_key_value_heads=2, head_dim=64),
                 "gemma-test": dict(model_type="gemma", hidden_size=256, num_hidden_layers=4, intermediate_size=768,
                                    num_attention_heads=4, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6,
                                    vocab_size=49152, rope_theta=10000.0),
                 "gemma3-test": dict(GEMMA3_12B, hidden_size=256, num_hidden_layers=6, intermediate_size=768,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=64, sliding_window=128)}


# --------------------------------------------------------------------------- tokenizer stand-in
class _NullDetokenizer:
    """Detokenizer protocol of mlx-lm (add_token / finalize / last_segment) producing no text."""

    last_segment = ""

    def add_token(self, token_id: int) -> None:
        pass

    def finalize(self) -> None:
        pass


class RandomModelTokenizer:
    """What the engine needs of a tokenizer, for random-weight models that have none: no EOS (so a
    request runs to max_tokens) and no text."""

    eos_token_ids: list[int] = []

    @property
    def detokenizer(self) -> _NullDetokenizer:
        return _NullDetokenizer()

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 1000 for c in text] or [0]


# --------------------------------------------------------------------------- models
@dataclass
class LoadedModel:
    name: str
    model: nn.Module
    tokenizer: Any
    config: dict  # config.json-style dict (llama field names)
    dtype: str
    path: Optional[str]  # mlx-lm folder, None for random shapes
    weights_bytes: int
    num_params: int
    build_s: float


def _random_weights(model: nn.Module, dtype: mx.Dtype, init: str, seed: int) -> None:
    """Replace the (still lazy, never evaluated) float32 init with small normals or zeros in `dtype`,
    evaluated a few tensors at a time so no float32 copy of the model ever exists."""
    mx.random.seed(seed)
    flat = tree_flatten(model.parameters())
    new = []
    for name, p in flat:
        if p.ndim == 1:  # norm weights
            arr = mx.ones(p.shape, dtype=dtype)
        elif init == "zeros":
            arr = mx.zeros(p.shape, dtype=dtype)
        else:
            arr = (mx.random.normal(p.shape, dtype=dtype) * 0.02).astype(dtype)
        mx.eval(arr)
        new.append((name, arr))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())


def build_random_model(config: dict, dtype: str, init: str = "normal", seed: int = 0) -> nn.Module:
    """A random-weight model of `config`'s shape, built by the mlx-lm module of its model_type."""
    import importlib

    from engine.core.model_config import SUPPORTED_MODEL_TYPES, model_type

    module = importlib.import_module(f"mlx_lm.models.{SUPPORTED_MODEL_TYPES[model_type(config)]}")
    model = module.Model(module.ModelArgs.from_dict(config))
    _random_weights(model, DTYPES[dtype], init, seed)
    return model


def load_bench_model(name: str, dtype: str = "auto", layers: Optional[int] = None, init: str = "normal",
                     seed: int = 0) -> LoadedModel:
    """`name`: default | tiny | a RANDOM_SHAPES name (llama-8b, qwen3-8b, gemma3-12b, ...) | an mlx-lm
    folder or cached Hugging Face repo id. `layers` truncates a random
    shape (the per-layer transient does not depend on the number of layers)."""
    from engine.config import MAX_OPS_ENV, ExecutionConfig, export_max_ops_per_buffer
    from engine.backend import mlx_backend, resolve_dtype

    # Benchmarks build engines around this model, not with Engine.from_config: the engine's default
    # batching (what its memory model assumes) is set here, before any GPU work. An explicit
    # MLX_MAX_OPS_PER_BUFFER (an experiment on MLX's batching) is kept.
    if MAX_OPS_ENV not in os.environ:
        export_max_ops_per_buffer(ExecutionConfig().resolved_max_ops_per_buffer(mlx_backend()))
    dtype = resolve_dtype(dtype)
    t0 = time.perf_counter()
    if name in RANDOM_SHAPES:
        config = dict(RANDOM_SHAPES[name])
        if layers:
            config["num_hidden_layers"] = layers
        model = build_random_model(config, dtype, init, seed)
        tokenizer, path = RandomModelTokenizer(), None
    else:
        from engine.model.loader import load_model, resolve_model_path

        path = Path(resolve_model_path(name, dtype=dtype))
        model, tokenizer = load_model(path)
        model.set_dtype(DTYPES[dtype])
        mx.eval(model.parameters())
        config = json.loads((path / "config.json").read_text())
        path = str(path)
    params = tree_flatten(model.parameters())
    return LoadedModel(
        name=name, model=model, tokenizer=tokenizer, config=config, dtype=dtype, path=path,
        weights_bytes=sum(p.nbytes for _, p in params), num_params=sum(p.size for _, p in params),
        build_s=time.perf_counter() - t0,
    )


def matmul_params(config: dict) -> int:
    """Parameters a prompt token multiplies by (every layer's projections, no embedding, no LM head)."""
    d, i = config["hidden_size"], config["intermediate_size"]
    h = config["num_attention_heads"]
    kvh = config.get("num_key_value_heads") or h
    hd = config.get("head_dim") or d // h
    per_layer = d * h * hd * 2 + d * kvh * hd * 2 + 3 * d * i
    return per_layer * config["num_hidden_layers"]


def prefill_flops(config: dict, lengths: list[int]) -> float:
    """Model FLOPs of prefilling `lengths` (each prompt causal from 0): 2 * params * tokens, the
    attention's QK^T and PV (2 * 2 * layers * heads * head_dim per query-key pair, causal half), and
    the LM head for each prompt's last position."""
    d, h = config["hidden_size"], config["num_attention_heads"]
    hd = config.get("head_dim") or d // h
    layers = config["num_hidden_layers"]
    dense = 2.0 * matmul_params(config) * sum(lengths)
    attention = sum(4.0 * layers * h * hd * n * (n + 1) / 2 for n in lengths)
    head = 2.0 * d * config["vocab_size"] * len(lengths)
    return dense + attention + head


# --------------------------------------------------------------------------- memory
def free_memory() -> None:
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


class PeakTracker:
    """MLX's peak since `start()`, even across the engine's own `mx.reset_peak_memory()` calls (it
    resets before every forward): the reset is wrapped to fold the peak so far in first."""

    def __init__(self):
        self._orig_reset = mx.reset_peak_memory
        self._folded = 0

    def __enter__(self) -> "PeakTracker":
        mx.reset_peak_memory = self._reset
        return self

    def __exit__(self, *exc) -> None:
        mx.reset_peak_memory = self._orig_reset

    def _reset(self) -> None:
        self._folded = max(self._folded, mx.get_peak_memory())
        self._orig_reset()

    def start(self) -> None:
        self._folded = 0
        self._orig_reset()

    def read(self) -> int:
        return max(self._folded, mx.get_peak_memory())


class MemoryWindow:
    """Peak over what was alive on entry (the weights), across resets by the engine."""

    def __enter__(self) -> "MemoryWindow":
        free_memory()
        self.baseline = mx.get_active_memory()
        self._tracker = PeakTracker().__enter__()
        self._tracker.start()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = self._tracker.read()
        self._tracker.__exit__(*exc)

    def result(self) -> dict:
        return {"peak_over_weights_bytes": self.peak - self.baseline}


def random_prompts(lengths: list[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    # Skip the lowest ids (special tokens of real tokenizers); never an id outside the vocabulary.
    lo = min(16, vocab_size - 1)
    return [[rng.randrange(lo, vocab_size) for _ in range(n)] for n in lengths]


def chunk_bytes(memory, num_tokens: int, context_len: int, computes_logits: bool) -> int:
    """MemoryModel.prefill_chunk_bytes, with or without the `computes_logits` argument (older engine)."""
    try:
        return memory.prefill_chunk_bytes(num_tokens, context_len, computes_logits)
    except TypeError:
        return memory.prefill_chunk_bytes(num_tokens, context_len)


def memory_model_for(loaded: LoadedModel, overrides: Optional[dict] = None, cpu_math: bool = True):
    """The engine's memory model for this model on this MLX backend (as Engine builds it);
    `overrides`: EngineConfig.memory_coefficients; `cpu_math`: False for forwards through mlx-lm's
    modules (MLX's attention: the set the CPU engine uses with RunnerOptions.cpu_math off)."""
    from engine.backend import backend_coefficients
    from engine.core.memory.model import MemoryModel, ModelShape
    from engine.core.memory.coefficients import with_overrides

    dtype_bytes = DTYPES[loaded.dtype].size
    shape = ModelShape.from_config(loaded.config, dtype_bytes, loaded.weights_bytes)
    return MemoryModel(shape, coefficients=with_overrides(backend_coefficients(shape, cpu_math)[0], overrides))


# --------------------------------------------------------------------------- mlx-lm's BatchGenerator
# mlx_lm.server's BatchGenerator settings (decode_concurrency 32, prompt_concurrency 8, prefill_step_size 2048)
MLX_LM_SERVER_DEFAULTS = dict(completion_batch_size=32, prefill_batch_size=8, prefill_step_size=2048)


def mlx_lm_generator(model: nn.Module, max_tokens: int, settings: dict = MLX_LM_SERVER_DEFAULTS):
    """mlx-lm's BatchGenerator as mlx_lm.server builds it: `settings` on the default stream."""
    from mlx_lm.generate import BatchGenerator

    return BatchGenerator(model, max_tokens=max_tokens, stream=mx.default_stream(mx.default_device()), **settings)


def mlx_lm_step(gen) -> list:
    """One step of the server's loop: the generation responses (uid, token, finish_reason) it gave."""
    _, generated = gen.next()
    return generated


@dataclass(frozen=True)
class BurstRun:
    """Prompts inserted into a BatchGenerator at once, stepped until each had its first token or finished."""

    uids: list[int]
    first_token_s: dict[int, float]  # uid -> when its first token came, on the caller's clock
    num_steps: int


def run_mlx_lm_burst(gen, prompts: list[list[int]], max_tokens: Sequence[int],
                     until: Literal["first_token", "finished"], clock: Callable[[], float],
                     before_step: Callable[[], None] = lambda: None,
                     after_step: Callable[[], None] = lambda: None) -> BurstRun:
    """Insert every prompt, then step as the server's loop does until every one has its first token
    (`until="first_token"`) or has finished; `before_step` / `after_step` frame each step (a meter)."""
    uids = list(gen.insert(prompts, max_tokens=list(max_tokens)))
    first: dict[int, float] = {}
    finished: set[int] = set()
    num_steps = 0
    while len(first if until == "first_token" else finished) < len(uids):
        before_step()
        generated = mlx_lm_step(gen)
        after_step()
        num_steps += 1
        now = clock()
        for r in generated:
            first.setdefault(r.uid, now)
            if r.finish_reason is not None:
                finished.add(r.uid)
    return BurstRun(uids, first, num_steps)


# --------------------------------------------------------------------------- output
def per_call_us(make: Callable[[int], mx.array], calls: int = 50) -> float:
    """Microseconds a call of `make(i)` (a lazy array for call i): `calls` of them evaluated together after
    a warm-up of 3, best of 3 timings."""
    mx.eval([make(i) for i in range(3)])
    best = float("inf")
    for _ in range(3):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([make(i) for i in range(calls)])
        best = min(best, time.perf_counter() - t0)
    return round(best * 1e6 / calls, 2)


def environment() -> dict:
    import importlib.metadata as md

    def version(pkg: str) -> Optional[str]:
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None

    info = {}
    try:
        info = {k: v for k, v in mx.device_info().items() if isinstance(v, (int, float, str))}
    except Exception:  # older mlx
        pass
    return {
        "device": str(mx.default_device()), "device_info": info, "python": platform.python_version(),
        "mlx": version("mlx"), "mlx_cuda_13": version("mlx-cuda-13"), "mlx_lm": version("mlx-lm"),
        "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "ld_preload": os.environ.get("LD_PRELOAD"),
        "load_average_at_start": list(os.getloadavg()),  # a shared 2-core box: other work skews times
        "mlx_env": {k: v for k, v in os.environ.items() if k.startswith("MLX_")},
    }


def emit(result: dict, as_json: bool, out_path: Optional[str] = None) -> None:
    """Write the result file (if asked) and print; with --json the last stdout line is the object."""
    text = json.dumps(result, default=_json_default)
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=1, default=_json_default) + "\n")
    if as_json:
        print(text, flush=True)
    else:
        print(json.dumps(result, indent=1, default=_json_default), flush=True)


def _json_default(o):
    if hasattr(o, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(o)
    return str(o)


def log(*parts) -> None:
    """A progress line on stderr (stdout carries the result)."""
    print(*parts, file=sys.stderr, flush=True)
