"""EngineConfig.execution: the execution choices a deployment may make, validated like every field, and
the MLX_MAX_OPS_PER_BUFFER value the engine exports and its memory model reads (no mlx needed)."""

from __future__ import annotations

import logging
import os

import pytest

from engine.config import MAX_OPS_ENV, EngineConfig, ExecutionConfig, export_max_ops_per_buffer
from engine.core.memory.coefficients import CUDA_COEFFICIENTS, CUDA_OPS8_COEFFICIENTS, coefficients_for_backend


@pytest.mark.parametrize("fields, named", [
    (dict(async_decode=False), "async_decode"),  # a toggle that is now code, not a flag
    (dict(decode_kernels=True), "decode_kernels"),
    (dict(paged_attention=False), "paged_attention"),  # misplaced: it lives under execution
    (dict(execution={"max_num_seqs": 3}), "execution.max_num_seqs"),
    (dict(execution={"max_ops_per_buffer": 0}), "execution.max_ops_per_buffer"),
    (dict(execution={"max_ops_per_buffer": 4096}), "execution.max_ops_per_buffer"),
])
def test_unknown_misplaced_and_out_of_bounds_keys_fail_naming_the_field(fields, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.")):
        EngineConfig(**fields)


def test_defaults_and_yaml_shaped_input():
    assert EngineConfig().execution == ExecutionConfig(paged_attention=True, max_ops_per_buffer=None)
    cfg = EngineConfig.model_validate({"execution": {"paged_attention": False, "max_ops_per_buffer": 16}})
    assert not cfg.execution.paged_attention and cfg.execution.max_ops_per_buffer == 16
    with pytest.raises(ValueError):  # frozen
        cfg.execution.paged_attention = True  # type: ignore[misc]


def test_max_ops_per_buffer_resolves_per_backend_and_picks_the_cuda_set():
    default, wide = ExecutionConfig(), ExecutionConfig(max_ops_per_buffer=32)
    assert default.resolved_max_ops_per_buffer("cuda") == 8
    assert default.resolved_max_ops_per_buffer("cpu") is None
    assert default.resolved_max_ops_per_buffer("metal") is None
    assert wide.resolved_max_ops_per_buffer("metal") == 32
    assert coefficients_for_backend("cuda", default.resolved_max_ops_per_buffer("cuda")) is CUDA_OPS8_COEFFICIENTS
    assert coefficients_for_backend("cuda", wide.resolved_max_ops_per_buffer("cuda")) is CUDA_COEFFICIENTS


def test_export_sets_the_environment_and_warns_when_it_replaces_another_value(monkeypatch, caplog):
    monkeypatch.setenv(MAX_OPS_ENV, "0")  # so that monkeypatch restores the variable's state afterwards
    monkeypatch.delenv(MAX_OPS_ENV)
    export_max_ops_per_buffer(None)  # MLX's default: the environment is left alone
    assert MAX_OPS_ENV not in os.environ
    with caplog.at_level(logging.WARNING, logger="engine.config"):
        export_max_ops_per_buffer(8)
        assert not caplog.records
        export_max_ops_per_buffer(8)  # the same value: nothing to say
        assert not caplog.records
        monkeypatch.setenv(MAX_OPS_ENV, "20")
        export_max_ops_per_buffer(8)
    assert os.environ[MAX_OPS_ENV] == "8"
    assert "MLX_MAX_OPS_PER_BUFFER=20" in caplog.text and "max_ops_per_buffer=8" in caplog.text


@pytest.mark.parametrize("backend, budget", [("cuda", 16384), ("metal", 8192), ("cpu", 2048)])
def test_step_budget_defaults_per_device_and_an_explicit_value_wins(backend, budget):
    cfg = EngineConfig()
    assert cfg.max_num_batched_tokens is None  # unresolved until an engine knows its device
    assert cfg.resolved_max_num_batched_tokens(backend) == budget
    resolved = cfg.for_backend(backend)
    assert resolved.max_num_batched_tokens == budget and resolved.max_num_seqs == cfg.max_num_seqs
    assert cfg.max_num_batched_tokens is None  # a new object: the configuration is never written into
    explicit = EngineConfig(max_num_batched_tokens=1024, execution=ExecutionConfig(pad_last_chunk=False,
                                                                                   max_packed_tokens=0))
    assert explicit.resolved_max_num_batched_tokens(backend) == 1024
    assert explicit.for_backend(backend) is explicit
    # the packing bound too: resolved into the configuration the engine runs with, an explicit one kept
    assert resolved.execution.max_packed_tokens == (16384 if backend == "cuda" else 0)
    assert cfg.execution.max_packed_tokens is None
    assert EngineConfig(max_num_batched_tokens=1024).for_backend(backend).max_num_batched_tokens == 1024


@pytest.mark.parametrize("backend", ["cuda", "metal", "cpu"])
def test_last_chunk_padding_is_opt_in(backend):
    """Padding a prompt's last chunk to the grid is off unless set (its GPU effect is not yet measured),
    on every backend; an explicit value is kept in the configuration the engine runs with."""
    assert EngineConfig().for_backend(backend).execution.pad_last_chunk is False
    for value in (True, False):
        explicit = EngineConfig(execution={"pad_last_chunk": value})  # as serve.yaml gives it
        assert explicit.for_backend(backend).execution.pad_last_chunk is value
    with pytest.raises(ValueError, match="pad_last_chunk"):
        EngineConfig(execution={"pad_last_chunk": "sometimes"})


def test_chunk_granule_is_a_power_of_two():
    assert ExecutionConfig().chunk_granule == 128
    assert EngineConfig(execution={"chunk_granule": 512}).for_backend("cuda").execution.chunk_granule == 512
    for bad in (384, 100, 0, -128, 1 << 17):
        with pytest.raises(ValueError, match="chunk_granule"):
            ExecutionConfig(chunk_granule=bad)
    with pytest.raises(ValueError, match="chunk_granule=384"):
        EngineConfig(execution={"chunk_granule": 384})


def test_default_step_budget_rises_to_what_the_other_fields_need():
    assert EngineConfig(max_num_seqs=4096).resolved_max_num_batched_tokens("cpu") == 4096
    assert EngineConfig(prefill_chunk_size=32768).resolved_max_num_batched_tokens("cuda") == 32768
    # an explicit budget still has to hold them (the error names both values)
    with pytest.raises(ValueError, match="max_num_seqs=4096.*max_num_batched_tokens=2048"):
        EngineConfig(max_num_seqs=4096, max_num_batched_tokens=2048)
    with pytest.raises(ValueError, match="prefill_chunk_size=1024.*max_num_batched_tokens=512"):
        EngineConfig(prefill_chunk_size=1024, max_num_batched_tokens=512)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(max_num_batched_tokens=0)


def test_the_engine_package_sets_mlxs_cuda_cache_defaults_unless_the_environment_does():
    """Set when `engine` loads, before its own MLX work (MLX reads them when it builds a thread's cache)."""
    import subprocess
    import sys

    code = ("import os, engine; print(os.environ['MLX_CUDA_SDPA_CACHE_SIZE'], "
            "os.environ['MLX_ENABLE_CACHE_THRASHING_CHECK'], engine.MLX_LOADED_FIRST)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLX_")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1024", "0", "False"]
    out = subprocess.run([sys.executable, "-c", "import mlx.core; " + code], capture_output=True, text=True,
                         env={**env, "MLX_CUDA_SDPA_CACHE_SIZE": "64"}, check=True)
    assert out.stdout.split() == ["64", "0", "True"]  # the operator's value; mlx loaded first


def test_the_warm_up_trusts_mlxs_graph_cache_size_only_where_the_engine_set_it_first(monkeypatch):
    """MLX sizes the loading thread's cache when mlx loads: set after that, the size is unknown there."""
    import threading

    import engine
    from engine.backend import sdpa_graph_cache_size

    monkeypatch.setenv("MLX_CUDA_SDPA_CACHE_SIZE", "1024")
    monkeypatch.setattr(engine, "MLX_LOADED_FIRST", False)
    assert sdpa_graph_cache_size() == 1024
    monkeypatch.setattr(engine, "MLX_LOADED_FIRST", True)
    assert sdpa_graph_cache_size() == 0  # this (main) thread's cache may hold MLX's default
    seen = []
    thread = threading.Thread(target=lambda: seen.append(sdpa_graph_cache_size()))
    thread.start()
    thread.join()
    assert seen == [1024]  # another thread builds its own cache when it first uses it


def test_prompt_packing_is_on_for_cuda_only_and_an_explicit_value_wins():
    """max_packed_tokens None: PACKED_TOKENS_CUDA on MLX's CUDA backend (where one forward of many rows'
    tokens runs its matmuls faster), 0 elsewhere; whole prompts only unless pack_long_prompts."""
    from engine.config import PACKED_TOKENS_CUDA

    default = ExecutionConfig()
    assert default.max_packed_tokens is None and not default.pack_long_prompts
    assert default.resolved_max_packed_tokens("cuda") == PACKED_TOKENS_CUDA == 16384
    assert default.resolved_max_packed_tokens("cpu") == 0 == default.resolved_max_packed_tokens("metal")
    assert ExecutionConfig(max_packed_tokens=0).resolved_max_packed_tokens("cuda") == 0
    assert ExecutionConfig(max_packed_tokens=2048).resolved_max_packed_tokens("cpu") == 2048
    with pytest.raises(ValueError, match="max_packed_tokens"):
        EngineConfig(execution={"max_packed_tokens": -1})
    with pytest.raises(ValueError, match="pack_long_prompts"):
        EngineConfig(execution={"pack_long_prompts": "sometimes"})
