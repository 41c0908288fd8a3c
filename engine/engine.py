"""Engine: the synchronous step loop (scheduler -> runner -> outputs).

The engine composes the scheduler (what runs), the KV manager (the one owner of KV) and the step
executor (how a step's forwards run on the device: executor.py). AsyncEngine: async_engine.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
import time
from pathlib import Path
from typing import Optional, Sequence, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from engine import backend as device_backend  # one place to read (and, in tests, to stand in for) the backend
from engine.config import EngineConfig, export_max_ops_per_buffer
from engine.core.chunk_grid import grid_shapes
from engine.core.kv_manager import KVManager
from engine.core.memory.coefficients import with_overrides
from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.memory.workspace import MatmulWorkspace
from engine.core.model_config import ConfigShape
from engine.core.output import TextStream, process_token
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.types import (CompletionOutput, EngineStats, ExecutionPaths, FinishReason, Request,  # noqa: F401
                               RequestOutput, SamplingParams, SchedulerOutput, StepOptions, StepRecord, StepRun)
from engine.executor import StepExecutor
from engine.model.families import GPU_LOOP_FAMILIES, family_of
from engine.model import matmul_workspace
from engine.model.grammar import GrammarCompiler, GrammarMatcher, check_grammar
from engine.model.runner import ModelRunner, RunnerOptions
from engine.model.sampling import RequestSampler

logger = logging.getLogger(__name__)

Prompt = Union[str, Sequence[int], Sequence[dict]]
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


# Tokens per KV pool block: the unit of a request's reservation (MemoryModel.kv_step) and of the paged
# kernel's block table.
KV_BLOCK_TOKENS = 256


class Engine:
    """One model on one MLX device; `step()` runs one scheduler step and returns its StepRecord."""

    def __init__(self, model: nn.Module, tokenizer, config: EngineConfig, model_config: dict,
                 runner_options: RunnerOptions = RunnerOptions(), step_options: StepOptions = StepOptions(),
                 grammar_compiler: Optional[GrammarCompiler] = None):
        """`runner_options`: the runner's ways of building forwards; `step_options`: how steps run
        (tests and benchmarks compare them; the defaults are what measured best). `grammar_compiler`:
        one made for this tokenizer already (else made on the first constrained request: ~0.5 s)."""
        backend = device_backend.mlx_backend()
        # the device's defaults resolved (max_num_batched_tokens): what the scheduler, stats and callers read
        self.config = config = config.for_backend(backend)
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = config.model
        launch_thread = step_options.launch_thread
        launch_thread = backend == "cuda" if launch_thread is None else launch_thread
        # With a launch thread (engine/launch_thread.py) two threads encode this engine's forwards,
        # one at a time: on a stream of MLX's thread-unsafe kind (any thread may encode on it; MLX's usual
        # streams belong to the thread that made them), made before any array or trace of the engine is.
        self._stream = (mx.new_thread_unsafe_stream(mx.default_device())
                        if launch_thread and step_options.async_decode else None)
        self._stream_set = threading.local()  # .done in each thread whose default it is
        self._use_stream()
        # The runner first: whether its decodes read the pool in place (the CUDA kernel, if it passes its
        # self-check) changes the memory model's decode term, and so the floor step and KV budget.
        self.runner = self._build_runner(model, config, runner_options, backend)
        pool = self.runner.pool
        # sliding-window layers' rings: a fixed allocation, counted with the weights (engine/model/kv_pool.py),
        # as are what the layer loops bound beyond views of the weights (Gemma's 1 + weight norms)
        bound_bytes = self.runner.bound.extra_bytes if self.runner.bound is not None else 0
        weights_bytes = sum(p.nbytes for _, p in tree_flatten(model.parameters())) + pool.ring_bytes + bound_bytes
        # what a decode's matmuls allocate beside their products, measured on GPU backends (cuBLASLt's
        # workspace on CUDA); the CPU's allocate none
        workspace = (matmul_workspace.of_runner(self.runner, config.max_num_seqs) if backend != "cpu"
                     else MatmulWorkspace())
        self.memory = self._build_memory_model(config, model_config, weights_bytes, backend, workspace)
        model_max = ConfigShape.from_config(model_config).max_position_embeddings or 4096
        self.max_model_len = min(config.max_model_len or model_max, model_max)
        self.memory_limit_bytes = (
            int(config.memory_utilization * device_backend.device_memory_bytes())
            if config.memory_limit_bytes == "auto" else config.memory_limit_bytes
        )
        max_memory, kv_budget = self._kv_budget(config, weights_bytes)
        prefix_fraction = 0.0 if pool.ring_rows else config.prefix_cache_fraction
        if pool.ring_rows and config.prefix_cache_fraction:
            logger.info("no prefix cache: the sliding-window layers' rings keep no prompt's KV")
        self.kv = KVManager(KV_BLOCK_TOKENS, self.memory.kv_bytes_per_token, kv_budget,
                            int(prefix_fraction * kv_budget), num_rings=pool.ring_rows)
        self.scheduler = Scheduler(
            SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                            config.prefill_chunk_size, self.max_model_len,
                            mix_beyond_bound=step_options.mix_beyond_bound, max_memory_bytes=max_memory,
                            pad_last_chunk=config.execution.pad_last_chunk,
                            chunk_granule=config.execution.chunk_granule,
                            pack_long_prompts=config.execution.pack_long_prompts),
            self.memory, self.kv, view_reads=self.runner.pool.read_slices)
        # pipelined decodes, on CUDA chunks that sample nothing run into the next step (StepOptions' defaults)
        overlap = step_options.overlap_steps
        self.executor = StepExecutor(self.runner, self.memory, self.scheduler, config.seed,
                                     async_decode=step_options.async_decode,
                                     overlap_steps=backend == "cuda" if overlap is None else overlap,
                                     make_sampler=self._make_sampler, launch_thread=self._stream is not None,
                                     launch_ahead=step_options.launch_ahead is not False)
        self.eos_token_ids = set(tokenizer.eos_token_ids)
        self._streams: dict[str, TextStream] = {}
        self._warmed = self._warm_chunk_shapes(config) if backend == "cuda" else (0, 0.0)  # (shapes, seconds)
        self._grammar_compiler = grammar_compiler
        self._grammar_lock = threading.Lock()
        self._matchers: dict[str, GrammarMatcher] = {}  # compiled grammars of requests without a row yet

    def _warm_chunk_shapes(self, config: EngineConfig) -> tuple[int, float]:
        """ExecutionConfig.max_warmup_chunk_shapes' graphs, at most half of what MLX's graph cache keeps
        (room for the shapes off the grid): (shapes built, seconds)."""
        num = min(config.execution.max_warmup_chunk_shapes, device_backend.sdpa_graph_cache_size() // 2)
        if config.execution.max_warmup_chunk_shapes and not num:
            logger.warning("no attention warm-up: mlx loaded before the engine set its graph cache size")
        warmed = self.runner.warm_chunk_shapes(
            grid_shapes(config.execution.chunk_granule, config.prefill_chunk_size, self.max_model_len, num))
        if warmed[0]:
            logger.info("built the attention graphs of %d prompt-chunk shapes in %.1f s", *warmed)
        return warmed

    @staticmethod
    def _build_runner(model: nn.Module, config: EngineConfig, options: RunnerOptions, backend: str) -> ModelRunner:
        family = family_of(model)
        if backend != "cpu" and family not in GPU_LOOP_FAMILIES and options.layer_loops \
                and not options.gpu_unvalidated_loops:
            logger.info("%s: its layer loops are not yet validated on a GPU: mlx-lm's modules run it", family)
            options = dataclasses.replace(options, layer_loops=False, fuse_projections=False, mixed_batches=False)
        return ModelRunner(model, seed=config.seed, block_size=KV_BLOCK_TOKENS,
                           paged_attention=config.execution.paged_attention and backend == "cuda",
                           fuse=options.fuse_projections, mixed=options.mixed_batches,
                           layer_loops=options.layer_loops,
                           compiled_decode=options.compiled_decode and backend == "cuda",
                           cpu_math=options.cpu_math and backend == "cpu",
                           read_slices=options.read_slices, max_rows=config.max_num_seqs,
                           max_forward_tokens=config.prefill_chunk_size, stage_waits=backend == "cpu",
                           tiled_attention=options.tiled_attention, mma_attention=options.mma_attention,
                           fused_rope=backend == "cuda" and options.fused_rope is not False, backend=backend,
                           fused_residual=backend == "cuda" and options.fused_residual is not False,
                           pack_step_inputs=backend == "cuda" and options.pack_step_inputs is not False,
                           rope_writes_kv=backend == "cuda" and options.rope_writes_kv is not False)

    def _build_memory_model(self, config: EngineConfig, model_config: dict, weights_bytes: int,
                            backend: str, workspace: MatmulWorkspace) -> MemoryModel:
        """The memory model of this model as the runner computes it (KV heads, size and dtype from the
        loaded model; rings counted with the weights) and the coefficient set for this backend; several
        rows' prompt chunks packed into forwards of up to ExecutionConfig.max_packed_tokens (the runner's
        chunk loop only)."""
        runner, layout, pool = self.runner, self.runner.layout, self.runner.pool
        shape = dataclasses.replace(ModelShape.from_config(model_config, layout.kv_dtype.size, weights_bytes,
                                                           module_forwards=runner.chunk_path is None),
                                    num_kv_heads=layout.num_kv_heads, head_dim=layout.head_dim,
                                    num_kv_layers=pool.num_layers - len(pool.ring_layers),
                                    layer_windows=layout.layer_windows if pool.window is not None else ())
        # a shape's calibration was fitted on the engine's loops: mlx-lm's modules take the backend's set
        loops = runner.chunk_path is not None
        coefficients, self.memory_coefficients_source = device_backend.backend_coefficients(
            shape if loops else None, cpu_math=loops and runner.ops.cpu_math,
            max_ops_per_buffer=config.execution.resolved_max_ops_per_buffer(backend),
            prefill_chunk_size=config.prefill_chunk_size)
        if config.memory_coefficients:
            self.memory_coefficients_source += " with EngineConfig.memory_coefficients"
        logger.info("memory model: %s", self.memory_coefficients_source)
        # the engine's chunk loop copies a viewed row's KV for a chunk's last query (ReferenceOps.attend);
        # the pool copies it for every layer where the attention cannot read the view's strides
        return MemoryModel(shape, kv_step=KV_BLOCK_TOKENS,
                           coefficients=with_overrides(coefficients, config.memory_coefficients),
                           paged_decode=runner.paged_attention, mixed=runner.mixed is not None,
                           copies_viewed_kv=runner.chunk_path is not None and not runner.ops.cpu_math,
                           copies_every_view=pool.copy_views,
                           max_packed_tokens=config.execution.max_packed_tokens if runner.chunk_path is not None else 0,
                           matmul_workspace=workspace,
                           fused_decode=runner.ops.qk_rope is not None or runner.ops.residual_matmul)

    def _kv_budget(self, config: EngineConfig, weights_bytes: int) -> tuple[int, int]:
        """(the memory KV and a step may use together, the KV budget). KV is reserved against what is
        left after the weights, a margin and the floor step (the smallest step that makes progress); each
        step is then sized to the memory KV leaves free. ValueError if no KV fits."""
        pool = self.runner.pool
        available = self.memory_limit_bytes - weights_bytes
        max_memory = available - int(config.memory_margin_fraction * max(available, 0))
        floor = self.memory.floor_transient_bytes(config.prefill_chunk_size, self.max_model_len)
        kv_budget = self.memory.kv_budget_bytes(max_memory, floor)
        if kv_budget < self.memory.kv_bytes(1):
            raise ValueError(
                f"memory_limit_bytes={self.memory_limit_bytes} leaves no room for KV: weights "
                f"{weights_bytes} + memory_margin_fraction={config.memory_margin_fraction} of the rest + "
                f"floor step transient {floor} bytes"
                + (f" (the weights include max_num_seqs={config.max_num_seqs} sliding-window rings of "
                   f"{pool.ring_bytes} bytes)" if pool.ring_rows else "")
            )
        logger.info("memory: limit %d bytes, weights %d, KV budget %d (%.1f%% of the rest), floor step %d, "
                    "margin %d", self.memory_limit_bytes, weights_bytes, kv_budget,
                    100.0 * kv_budget / max(available, 1), floor, available - max_memory)
        return max_memory, kv_budget

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Engine":
        from engine.model.families import dequantize_on_cpu
        from engine.model.loader import load_model, resolve_model_path

        # Before any GPU work: MLX reads it once per process, at its GPU backend's first commit.
        export_max_ops_per_buffer(config.execution.resolved_max_ops_per_buffer(device_backend.mlx_backend()))
        dtype = device_backend.resolve_dtype(config.dtype)
        path = Path(resolve_model_path(config.model, cache_dir=config.cache_dir, dtype=dtype))
        model, tokenizer = load_model(path)
        if config.dtype == "auto" and mx.default_device() == mx.cpu:
            dequantize_on_cpu(model)
        model.set_dtype(_DTYPES[dtype])
        mx.eval(model.parameters())
        model_config = json.loads((path / "config.json").read_text())
        return cls(model, tokenizer, config, model_config)

    # --- prompts --------------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> list[int]:
        """Text, token ids, or chat messages (through the tokenizer's chat template) -> token ids."""
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt))
        items = list(prompt)
        if items and isinstance(items[0], dict):
            ids = self.tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return [int(t) for t in items]

    # --- requests -------------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: Sequence[int], sampling: SamplingParams,
                      grammar: bool = True) -> None:
        """Raise ValueError if the request can never run (thread-safe: reads configuration only).
        `grammar`: also compile its grammar once to check it (add_request's matcher reports the same
        errors, so the step thread skips it)."""
        self.scheduler.check_fits(len(prompt_token_ids), sampling.max_tokens)
        vocab = self.memory.shape.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        bad = [b.token_id for b in sampling.logit_bias if b.token_id >= vocab]
        if bad:
            raise ValueError(f"logit_bias token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if grammar and sampling.grammar is not None:
            check_grammar(sampling.grammar)
            self._grammars()  # wrapping the tokenizer takes ~0.5 s: here, not on the engine's step thread

    def _grammars(self) -> GrammarCompiler:
        """The grammar compiler, made on the first constrained request (thread-safe: check_request)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer._tokenizer, self.memory.shape.vocab_size,
                                                         sorted(self.eos_token_ids))
            return self._grammar_compiler

    def _make_sampler(self, request: Request) -> RequestSampler:
        """A new row's sampler, with the matcher its grammar was compiled into at add_request."""
        return RequestSampler(request.sampling, self.config.seed, request.prompt_token_ids,
                              self._matchers.pop(request.request_id, None))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams) -> None:
        self.check_request(prompt_token_ids, sampling, grammar=False)
        request = Request(request_id, list(prompt_token_ids), sampling)
        if sampling.grammar is not None:
            self._matchers[request_id] = self._grammars().matcher(sampling.grammar)
        self.scheduler.add(request)  # a prefix-cache hit: the request starts after its cached tokens
        self._streams[request_id] = TextStream(self.tokenizer.detokenizer, sampling.stop)

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        return self._finish(request_id, FinishReason.ABORT)

    def _finish(self, request_id: str, reason: FinishReason, error: Optional[str] = None):
        """Between forwards: the request's KV goes at once (into the prefix cache when worth keeping)."""
        self._streams.pop(request_id, None)
        self._matchers.pop(request_id, None)
        num_kv_tokens = self.runner.drop_row(request_id)
        request = self.scheduler.finish(request_id, reason, num_kv_tokens)
        if request is None:
            return None
        return RequestOutput(request_id, [], "", request.num_prompt_tokens, request.num_output_tokens,
                             finished=True, finish_reason=reason, error=error)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.executor.busy

    # --- the step -------------------------------------------------------------------------------
    def step(self) -> StepRecord:
        """One step: schedule, run the forwards, read back their tokens; returns its record, whose
        `outputs` are the requests' increments.

        Forwards that write the KV pool never overlap on the device (engine/model/work.py finish says why). Decode-
        only steps are pipelined on the host (`StepOptions.async_decode`), like mlx-lm's
        BatchGenerator but without overlapping two forwards: while decode k runs, the engine builds
        decode k+1's graph (fed with k's tokens as a lazy array); once k is done (on CUDA, where the
        decode writes its KV in place, once k is encoded: `StepOptions.launch_ahead`) it launches k+1
        and, while k+1 runs, reads back and commits k (scheduler update, detokenizing, stops). So
        outputs come one step after their forward was launched. A row that stops on EOS or a stop
        string has had one more token computed, which is dropped; rows reaching max_tokens are left
        out of the next decode. Anything new for the scheduler (a waiting request, a prompt chunk)
        ends the pipeline for one step. On CUDA a step whose last forward is a prompt chunk that
        samples nothing returns without waiting for it (`StepOptions.overlap_steps`): the next step is
        scheduled and its first forward built while it runs, and waits for it before launching."""
        start_ns, started = time.time_ns(), time.perf_counter()
        schedule_s = 0.0
        self._use_stream()
        if self.executor.pipelining:
            run = self.executor.advance()
        else:
            plan = self.scheduler.schedule()
            schedule_s = time.perf_counter() - started
            run = self.executor.run(plan)
        outputs = self._commit_run(run)
        if run.memory is not None and logger.isEnabledFor(logging.DEBUG):
            plan = run.plan
            logger.debug("step: %d tokens (budget %d%s), transient predicted %d measured %d bytes, %s bytes "
                         "free beside the KV pool", plan.num_batched_tokens, plan.step_budget_tokens,
                         ", cut by memory" if plan.memory_limited else "", run.memory.predicted_bytes,
                         run.memory.measured_bytes, plan.free_transient_bytes)
        return StepRecord(tuple(outputs), start_ns, time.perf_counter() - started, plan=run.plan,
                          memory=run.memory, slice_reads=run.slice_reads, forwards=run.forwards,
                          schedule_s=schedule_s)

    def _use_stream(self) -> None:
        """Make the engine's own stream (if it has one) the default of the calling thread (MLX's default
        stream is per thread; an engine built in one thread may be stepped in another)."""
        if self._stream is not None and not getattr(self._stream_set, "done", False):
            mx.set_default_stream(self._stream)
            self._stream_set.done = True

    def _commit_run(self, run: StepRun) -> list[RequestOutput]:
        if run.error is not None:
            return self._fail_step(run.plan, run.error)
        # Failed chunks finish before update(), which then skips them; the other rows of the step go on.
        outputs = [o for o in (self._finish(i, FinishReason.ERROR, e) for i, e in run.failed.items())
                   if o is not None]
        outputs += self._commit(run.plan, run.sampled)
        if run.next_error is not None:  # the next pipelined decode failed: its rows fail
            rows = [r.request_id for r in self.scheduler.running if not r.is_prefilling]
            outputs += self._fail_step(self.scheduler.plan_decodes(rows), run.next_error)
        return outputs

    def _fail_step(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        logger.error("engine step failed", exc_info=exc)
        ids = list(plan.decodes) + [c.request_id for c in plan.prefills]
        return [o for o in (self._finish(i, FinishReason.ERROR, f"{type(exc).__name__}: {exc}")
                            for i in dict.fromkeys(ids)) if o is not None]

    def _commit(self, plan: SchedulerOutput, sampled: dict[str, int]) -> list[RequestOutput]:
        outputs = []
        for request in self.scheduler.update(plan, sampled):
            sampler = self.runner.samplers[request.request_id]
            token_id = request.output_token_ids[-1]
            try:
                done = sampler.accept(token_id, request.num_output_tokens - 1)
            except RuntimeError as exc:  # a token the grammar refused: a bug, this request's alone
                outputs += [o for o in [self._finish(request.request_id, FinishReason.ERROR, str(exc))] if o]
                continue
            out = process_token(request, self._streams[request.request_id], self.eos_token_ids,
                                grammar_done=done, logprob=sampler.pop_logprobs(token_id))
            if out.finished:
                self._finish(request.request_id, out.finish_reason)
            outputs.append(out)
        return outputs

    # --- sync API -------------------------------------------------------------------------------
    def generate(self, prompts: Sequence[Prompt], sampling: Union[SamplingParams, Sequence[SamplingParams]]
                 = SamplingParams()) -> list[CompletionOutput]:
        params = [sampling] * len(prompts) if isinstance(sampling, SamplingParams) else list(sampling)
        ids = [f"gen-{time.monotonic_ns()}-{i}" for i in range(len(prompts))]
        token_ids = [self.encode(p) for p in prompts]
        for request_id, tokens, p in zip(ids, token_ids, params):
            self.add_request(request_id, tokens, p)
        tokens = {i: [] for i in ids}
        texts = {i: [] for i in ids}
        finals: dict[str, RequestOutput] = {}
        while len(finals) < len(ids):
            for out in self.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                texts[out.request_id].append(out.new_text)
                if out.finished:
                    finals[out.request_id] = out
        return [CompletionOutput(i, t, tokens[i], "".join(texts[i]), finals[i].finish_reason,
                                 finals[i].num_cached_tokens) for i, t in zip(ids, token_ids)]

    def prefix_block_hash_chains(self) -> tuple[tuple[int, ...], ...]:
        """The prefix cache's block hashes per entry, most recently used first (a snapshot: safe to read
        from another thread; the replica summarises it for the admission controller)."""
        return self.kv.prefix_cache.block_hash_chains

    def reset_prefix_cache(self) -> int:
        """Drop every prefix-cache entry no waiting request holds (their blocks return to the pool's free
        list); returns the bytes freed. Benchmarks call it between passes so that a pass finds no hits."""
        return self.kv.prefix_cache.evict(self.kv.cached_bytes)

    def execution_paths(self) -> ExecutionPaths:
        """Which ways of building forwards the runner took for this model and backend (read-only)."""
        runner = self.runner
        decode = runner.decode_path
        return ExecutionPaths(paged_attention=runner.paged_attention, decode_loop=decode is not None,
                              compiled_decode=decode is not None and decode.compiled is not None,
                              chunk_loop=runner.chunk_path is not None, mixed_batches=runner.mixed is not None,
                              fused_rope=runner.ops.qk_rope is not None,
                              fused_residual=runner.ops.residual_matmul,
                              pack_step_inputs=runner.pool.pack_step_inputs and runner.paged_attention,
                              rope_writes_kv=runner.decode_writes_in_place,
                              attention_kernel=runner.attention_kernel,
                              num_warmed_chunk_shapes=self._warmed[0], warmup_s=self._warmed[1],
                              launch_thread=self._stream is not None, launch_ahead=self.executor.pipeline.goes_ahead)

    def stats(self) -> EngineStats:
        s, kv, ex = self.scheduler, self.kv, self.executor
        return EngineStats(
            num_waiting=s.num_waiting, num_running=s.num_running, kv_reserved_bytes=kv.reserved_bytes,
            kv_used_bytes=kv.used_bytes, kv_budget_bytes=kv.kv_budget_bytes,
            kv_bytes_per_token=self.memory.kv_bytes_per_token, kv_cache_step=self.memory.kv_step,
            weights_bytes=self.memory.shape.weights_bytes, memory_limit_bytes=self.memory_limit_bytes,
            transient_bound_bytes=s.transient_bound_bytes,
            max_predicted_transient_bytes=ex.meter.max_predicted_bytes,
            max_measured_transient_bytes=ex.meter.max_measured_bytes, max_model_len=self.max_model_len,
            num_steps=ex.num_steps, num_forward_calls=self.runner.num_forward_calls,
            num_tokens_computed=self.runner.num_tokens_computed, prefix_cache_bytes=kv.cached_bytes,
            prefix_cache_hits=kv.prefix_cache.stats.num_hits,
            prefix_cache_hit_tokens=kv.prefix_cache.stats.num_hit_tokens,
            prefix_cache_evictions=kv.prefix_cache.stats.num_evictions,
            mlx_active_bytes=mx.get_active_memory(), mlx_cache_bytes=mx.get_cache_memory(),
            kv_allocated_bytes=self.runner.kv_allocated_bytes,
            floor_transient_bytes=s.floor_transient_bytes,
            free_transient_bytes=s.free_transient_bytes,
            planned_transient_bytes=ex.meter.last_predicted_bytes,
        )
