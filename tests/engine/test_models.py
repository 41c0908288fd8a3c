"""Model provisioning with real MLX: the tiny random llama, the converted SmolLM2, local folders.

The default-model tests share one session cache ($MLX_SERVE_CACHE when set, so the ~4 s conversion
is reused across runs); the tiny model is rebuilt per test in a tmp dir because it takes ~1 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm import generate

from engine.model import loader as models
from engine.model.loader import load_model, resolve_cache_dir, resolve_model_path

ROUND_TRIP_TEXTS = (
    "Hello world",
    "  two  spaces\n\nblank line\ttab and trailing space ",
    "digits 12345, 3.14 and 2024-11-30",
    "unicode: héllo wörld — 日本語 🚀",
    "punctuation spacing: a . b , c ? it's",
)


# ----------------------------------------------------------------------------- tiny model


def test_tiny_folder_loads_and_generates(tmp_path):
    path = resolve_model_path("tiny", cache_dir=tmp_path)

    assert path == tmp_path / "tiny-llama-v2-float32"
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (2, 64, 49152)
    model, tokenizer = load_model(path)
    assert tokenizer.eos_token_id == 2
    text = generate(model, tokenizer, "Hello", max_tokens=5)
    assert isinstance(text, str) and text  # gibberish, but real tokens decoded to text


def test_tiny_is_idempotent_and_deterministic(tmp_path):
    first = resolve_model_path("tiny", cache_dir=tmp_path / "a")
    mtime_ns = (first / "model.safetensors").stat().st_mtime_ns

    assert resolve_model_path("tiny", cache_dir=tmp_path / "a") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime_ns
    other = resolve_model_path("tiny", cache_dir=tmp_path / "b")
    weights_a = mx.load(str(first / "model.safetensors"))
    weights_b = mx.load(str(other / "model.safetensors"))
    assert weights_a.keys() == weights_b.keys()
    assert all(mx.array_equal(weights_a[k], weights_b[k]).item() for k in weights_a)


def test_tiny_dtype_is_stored(tmp_path):
    path = resolve_model_path("tiny", cache_dir=tmp_path, dtype="bfloat16")

    assert path.name == "tiny-llama-v2-bfloat16"
    assert {w.dtype for w in mx.load(str(path / "model.safetensors")).values()} == {mx.bfloat16}


def test_concurrent_processes_share_one_folder(tmp_path):
    # Several replicas starting at once: every CLI process prints the same complete folder.
    command = [sys.executable, "-m", "engine.model.loader", "tiny", "--cache-dir", str(tmp_path), "--no-progress"]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [p.communicate(timeout=120)[0].strip() for p in processes]

    assert [p.returncode for p in processes] == [0, 0]
    assert set(outputs) == {str(tmp_path / "tiny-llama-v2-float32")}
    assert sorted(os.listdir(tmp_path)) == ["tiny-llama-v2-float32"]  # losers removed their temp dirs
    load_model(outputs[0])


def test_losing_the_rename_race_returns_the_winner(tmp_path):
    target = tmp_path / "tiny-llama-v2-float32"

    def build_while_another_process_wins(out):
        resolve_model_path("tiny", cache_dir=tmp_path)  # the "other process" renames first
        (out / "config.json").write_text("{}")

    assert models._provision(target, build_while_another_process_wins) == target
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert sorted(os.listdir(tmp_path)) == ["tiny-llama-v2-float32"]


def test_incomplete_folder_is_reported(tmp_path):
    (tmp_path / "tiny-llama-v2-float32").mkdir()

    with pytest.raises(RuntimeError, match="delete it to rebuild"):
        resolve_model_path("tiny", cache_dir=tmp_path)


# ----------------------------------------------------------------------------- arguments


def test_local_folder_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")

    assert resolve_model_path(str(tmp_path)) == tmp_path


def test_unknown_model_names_the_value(tmp_path):
    missing = str(tmp_path / "nope")

    with pytest.raises(ValueError, match=r"model=.*nope"):
        resolve_model_path(missing)


def test_unknown_dtype_names_the_value(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8'"):
        resolve_model_path("tiny", cache_dir=tmp_path, dtype="int8")


def test_cache_dir_precedence(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_SERVE_CACHE", str(tmp_path / "env"))
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_cache_dir() == tmp_path / "env"
    monkeypatch.delenv("MLX_SERVE_CACHE")
    assert resolve_cache_dir() == resolve_cache_dir("~/.cache/mlx-serve")


# ----------------------------------------------------------------------------- default model


@pytest.fixture(scope="session")
def default_cache_dir(tmp_path_factory):
    return os.environ.get("MLX_SERVE_CACHE") or tmp_path_factory.mktemp("mlx-serve-cache")


@pytest.fixture(scope="session")
def default_path(default_cache_dir):
    return resolve_model_path("default", cache_dir=default_cache_dir, progress=False)


@pytest.fixture(scope="session")
def default_model(default_path):
    return load_model(default_path)


@pytest.mark.slow
def test_default_conversion_is_idempotent(default_cache_dir, default_path):
    mtime_ns = (default_path / "model.safetensors").stat().st_mtime_ns

    assert resolve_model_path("default", cache_dir=default_cache_dir) == default_path
    assert default_path.name == "smollm2-135m-instruct-float32"
    assert (default_path / "model.safetensors").stat().st_mtime_ns == mtime_ns


@pytest.mark.slow
def test_default_config_matches_the_gguf(default_path):
    config = json.loads((default_path / "config.json").read_text())

    assert config["model_type"] == "llama"
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_key_value_heads"]) == (30, 576, 3)
    assert config["max_position_embeddings"] == 8192
    assert config["rope_traditional"] is True and config["tie_word_embeddings"] is True
    assert json.loads((default_path / "generation_config.json").read_text())["eos_token_id"] == 2


@pytest.mark.slow
@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_default_tokenizer_round_trips(default_model, text):
    _, tokenizer = default_model

    assert tokenizer.decode(tokenizer.encode(text)) == text


@pytest.mark.slow
def test_default_tokenizer_special_tokens(default_model):
    _, tokenizer = default_model

    assert tokenizer.eos_token_id == 2 and tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.encode("<|im_start|>user<|im_end|>") == [1, 4093, 2]  # control tokens stay whole
    assert len(tokenizer.encode("12345")) == 5  # SmolLM2 splits numbers into single digits


@pytest.mark.slow
def test_default_chat_template(default_model):
    _, tokenizer = default_model

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    text = tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_default_greedy_answer_is_right(default_model):
    # End-to-end check of dequantization, rope_traditional and the tokenizer together.
    model, tokenizer = default_model
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    answer = generate(model, tokenizer, prompt, max_tokens=20)
    assert "Paris" in answer
