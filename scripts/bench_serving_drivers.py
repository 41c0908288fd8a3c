"""bench_serving.py's in-process drivers (--engine-only): a synchronous serving loop (`LoopDriver`) over
this engine's bare Engine.step (`run_engine_sync`, alone, in a thread, beside an event loop) or mlx-lm's
BatchGenerator (`run_mlx_lm`), and AsyncEngine as the replica runs it (`run_engine_async`)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Callable

from bench_common import MLX_LM_SERVER_DEFAULTS, MemoryWindow, memory_model_for, mlx_lm_generator, mlx_lm_step
from bench_engine import admitting_limit_bytes, max_model_len_for, model_max_len, runner_options
from bench_serving_stats import RequestRecord, summarize


class LoopDriver:
    """A synchronous serving loop (as a server's engine thread runs): admit arrived requests while fewer
    than `concurrency` are in flight, run one step, time-stamp every token."""

    def __init__(self, prompts: list[list[int]], arrivals: list[float], concurrency: int):
        self.prompts, self.arrivals, self.concurrency = prompts, arrivals, concurrency

    def run(self, add: Callable[[int, list[int]], None], step: Callable[[], list[tuple[int, bool]]]) -> tuple:
        n = len(self.prompts)
        records = [RequestRecord(i, 0.0) for i in range(n)]
        pending, in_flight, done = 0, 0, 0
        t0 = time.perf_counter()
        while done < n:
            now = time.perf_counter() - t0
            while pending < n and in_flight < self.concurrency and self.arrivals[pending] <= now:
                records[pending].sent_s = now
                add(pending, self.prompts[pending])
                pending += 1
                in_flight += 1
            if in_flight == 0:
                time.sleep(max(0.0, self.arrivals[pending] - now))
                continue
            events = step()
            now = time.perf_counter() - t0
            for index, finished in events:
                rec = records[index]
                rec.token_times_s.append(now)
                rec.num_output_tokens += 1
                if finished:
                    in_flight -= 1
                    done += 1
        return records, time.perf_counter() - t0


def run_engine_sync(lm, prompts, arrivals, args, breakdown: bool = True, sampling_for=None, **overrides) -> dict:
    """The bare Engine.step loop; with a per-step time breakdown (schedule / forwards / the rest).
    `overrides`: `make_engine`'s (engine_sync_nopipe: async_decode=False; engine_sync_gather:
    execution={"paged_attention": False}; engine_sync_unfused, engine_sync_modules, engine_sync_uncompiled:
    options=RunnerOptions(fuse_projections / layer_loops / compiled_decode=False))."""
    from engine.core.types import SamplingParams

    engine = make_engine(lm, prompts, args, **overrides)
    tracer = StepTracer(args.trace_steps) if args.trace_steps and breakdown else None
    times = SyncStepTimes()
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)

    def add(i, prompt):  # sampling_for(i): request i's SamplingParams (bench_constrained.py)
        engine.add_request(str(i), prompt, sampling_for(i) if sampling_for else sampling)

    def step():
        t = time.perf_counter()
        record = engine.step()
        outs = record.outputs
        dt = time.perf_counter() - t
        if tracer is not None:
            tracer.observe(record)
        times.observe(record, t, dt)
        return [(int(o.request_id), o.finished) for o in outs if o.new_token_ids]

    with MemoryWindow() as mem:
        records, wall = LoopDriver(prompts, arrivals, args.concurrency_now).run(add, step)
    result = summarize(records, wall)
    result.update(mem.result())
    result["num_steps"] = engine.stats().num_steps
    result["max_num_batched_tokens"] = engine.config.max_num_batched_tokens  # resolved for the device
    result["execution_paths"] = dataclasses.asdict(engine.execution_paths())  # what the run really took
    result["first_steps"] = times.first_steps_from_start()
    result["first_token_s"] = sorted(round(r.ttft_s, 4) for r in records if r.ttft_s is not None)
    result["tpot_by_request_s"] = [r.tpot_s for r in records]
    if tracer is not None:
        result["step_trace_ms"] = tracer.steps
    if breakdown and times.decode_steps:
        result["breakdown"] = times.breakdown()
    return result


class SyncStepTimes:
    """Where the bare loop's steps spend host time, from their records (`run_engine_sync`): seconds in
    the scheduler's plans, the graph builds of steps without prompt chunks ("decode") and with
    ("prefill"), the host's time before each step's first launch; each decode-only step's; the first steps."""

    def __init__(self):
        self.timers = {"schedule": 0.0, "decode": 0.0, "prefill": 0.0, "forward_build": 0.0}
        # (rows, step_s, decode graph build_s, host time before the step's first launch, schedule_s)
        self.decode_steps: list[tuple] = []
        self.first_steps: list[dict] = []  # the first steps: when each ran and what it computed

    def observe(self, record, start: float, duration_s: float) -> None:
        """One step's record, the step started at `start` (perf_counter) and took `duration_s`."""
        # the host's time before the device had work: scheduling and the graph build
        first_launch_s = record.forwards[0].launch_s if record.forwards else 0.0
        build_s = sum(f.build_duration_s for f in record.forwards)
        self.timers["forward_build"] += first_launch_s
        self.timers["schedule"] += record.schedule_s
        self.timers["prefill" if record.prefill_chunks else "decode"] += build_s
        if len(self.first_steps) < 8 and record.plan is not None:
            self.first_steps.append({"start_s": start, "duration_s": round(duration_s, 4),
                                     "prefill_chunks": len(record.prefill_chunks),
                                     "decode_rows": record.num_decode_tokens})
        if not record.prefill_chunks and record.outputs:
            self.decode_steps.append((len(record.outputs), duration_s, build_s, first_launch_s, record.schedule_s))

    def first_steps_from_start(self) -> list[dict]:
        """The first steps, each one's start from the first's."""
        first_start = self.first_steps[0]["start_s"] if self.first_steps else 0.0
        for record in self.first_steps:
            record["start_s"] = round(record["start_s"] - first_start, 4)
        return self.first_steps

    def breakdown(self) -> dict:
        """The decode-only steps' mean times."""
        n = len(self.decode_steps)

        def mean(i):
            return sum(s[i] for s in self.decode_steps) / n

        # A decode-only step = schedule + the decode's graph build (runner_decode, its record's forwards)
        # + launch, evaluation and sampling + the rest (scheduler update, output processing).
        # "graph_build" is the host's time before the step's first launch, which includes its schedule.
        return dict(
            timers_s=self.timers, num_decode_only_steps=n, decode_rows_mean=mean(0),
            decode_step_mean_s=mean(1), runner_decode_mean_s=mean(2), graph_build_mean_s=mean(3),
            schedule_mean_s=mean(4), eval_and_sample_mean_s=mean(2) - mean(3),
            outside_runner_mean_s=mean(1) - mean(2),
        )


class StepTracer:
    """Where the first steps' host time goes, step by step (--trace-steps), from each step's record:
    milliseconds in the scheduler's plan, building the forwards' graphs, launching them, waiting for
    them, and the whole step."""

    def __init__(self, num_steps: int):
        self.num_steps, self.steps = num_steps, []

    def observe(self, record) -> None:
        if len(self.steps) >= self.num_steps:
            return
        forwards = record.forwards
        spent = {"schedule": record.schedule_s, "build": sum(f.build_duration_s for f in forwards),
                 "launch": sum(f.launched_s - f.launch_s for f in forwards),
                 "wait": sum(f.waited_s - f.wait_s for f in forwards if f.wait_s is not None and f.waited_s is not None)}
        encoded = [f.prev_encoded_s for f in forwards if f.prev_encoded_s is not None]
        if encoded:  # a launch thread had encoded the decode this step read back (from the step's start)
            spent["prev_encoded_at"] = encoded[0]
        spent = {k: v for k, v in spent.items() if v}
        spent["step"] = record.duration_s
        self.steps.append({k: round(v * 1000, 2) for k, v in spent.items()})


def run_engine_sync_thread(lm, prompts, arrivals, args, breakdown: bool = True) -> dict:
    """engine_sync in a thread of its own, warmed there by the same load first (to tell what a thread
    costs from what AsyncEngine costs)."""
    import threading

    result: dict = {}
    vocab = lm.config["vocab_size"]

    def body():
        run_engine_sync(lm, [[(t + 1) % vocab for t in p] for p in prompts], arrivals, args, False)
        result.update(run_engine_sync(lm, prompts, arrivals, args, breakdown))

    thread = threading.Thread(target=body, name="bench-engine")
    thread.start()
    thread.join()
    return result


def run_engine_sync_asyncio(lm, prompts, arrivals, args, breakdown: bool = True) -> dict:
    """engine_sync_thread while the main thread runs an asyncio event loop that waits for it (what
    AsyncEngine's caller does), to tell the loop's cost from AsyncEngine's own."""
    return asyncio.run(asyncio.to_thread(run_engine_sync_thread, lm, prompts, arrivals, args, breakdown))


def run_engine_async(lm, prompts, arrivals, args, **overrides) -> dict:
    """AsyncEngine (what the replica runs): one asyncio task per request, tokens time-stamped as
    the consumer receives them. The same load (other tokens) runs untimed first through the same
    AsyncEngine, then its prefix-cache entries are evicted, so the timed pass finds the KV pool at the
    size this load needs (`pool_grew_in_timed_pass` says whether it still grew). Why: MLX keeps a
    stream, command encoder, CUDA graphs and cuDNN attention graphs per thread, so a warm-up in another
    thread (the bench's own warm-up runs, or another AsyncEngine's) does not warm this one's; and
    cuDNN's attention graphs are keyed by the K/V strides, which for a prompt chunk read as a view of
    the head-major pool included the pool's size, so a pool growth made the next prompt chunks build
    theirs again (docs/tight_burst.md; the token-major pool's do not). The bare-loop backends build a fresh engine per pass in the same thread,
    whose pool grows to the same sizes every pass."""
    from engine.async_engine import AsyncEngine
    from engine.core.types import SamplingParams

    # Built in its thread, as the replica's; no built-in warm-up (the same-shape pass below replaces it)
    aengine = AsyncEngine(lambda: make_engine(lm, prompts, args, **overrides), warmup=args.async_warmup)
    engine = aengine.engine
    tracer = StepTracer(args.trace_steps) if args.trace_steps else None
    sampling = SamplingParams(max_tokens=args.output_tokens, ignore_eos=True)
    observer = AsyncStepObserver(tracer)
    aengine.on_step = observer

    def load(prompts):
        return stream_requests(aengine, prompts, arrivals, sampling, args.concurrency_now, observer)

    try:
        vocab = lm.config["vocab_size"]
        asyncio.run(load([[(t + 1) % vocab for t in p] for p in prompts]))  # warm this engine's thread
        # The prefix cache keeps the warm pass's blocks; let them go (the engine thread is idle), so the
        # timed pass finds the pool at the size this load needs instead of growing it.
        engine.reset_prefix_cache()
        pool_before = engine.stats().kv_allocated_bytes
        warm_steps = list(observer.steps)
        observer.steps.clear()
        observer.memory.clear()
        if tracer is not None:
            warm_trace, tracer.steps = tracer.steps, []
        with MemoryWindow() as mem:
            records, wall = asyncio.run(load(prompts))
        result = summarize(records, wall)
        result.update(mem.result())
        result["first_steps"] = observer.steps
        result["step_memory"] = observer.memory_summary()
        result["warm_pass_first_steps"] = warm_steps
        result["pool_grew_in_timed_pass"] = engine.stats().kv_allocated_bytes != pool_before
        result["max_num_batched_tokens"] = engine.config.max_num_batched_tokens  # resolved for the device
        result["execution_paths"] = dataclasses.asdict(engine.execution_paths())  # its start's warm-up too
        if tracer is not None:
            result["step_trace_ms"], result["warm_pass_step_trace_ms"] = tracer.steps, warm_trace
        result["first_token_s"] = sorted(round(r.ttft_s, 4) for r in records if r.ttft_s is not None)
    finally:
        aengine.shutdown()
    return result


class AsyncStepObserver:
    """AsyncEngine.on_step of `run_engine_async`: the first steps (when each ran, from the run's start
    `t0_ns`, and what it computed), and the step tracer's records (--trace-steps)."""

    def __init__(self, tracer):
        self.tracer, self.steps, self.t0_ns = tracer, [], time.time_ns()
        # (predicted, measured bytes, largest pack, chunks, decode rows, pipelined) per step with a record
        self.memory: list[tuple] = []

    def __call__(self, record) -> None:
        if self.tracer is not None:
            self.tracer.observe(record)
        if record.memory is not None and record.plan is not None:
            self.memory.append((record.memory.predicted_bytes, record.memory.measured_bytes,
                                max(record.plan.packs, default=1 if record.prefill_chunks else 0),
                                len(record.prefill_chunks), record.num_decode_tokens, record.memory.pipelined))
        if len(self.steps) < 8:
            self.steps.append({"start_s": round((record.start_time_ns - self.t0_ns) / 1e9, 4),
                               "duration_s": round(record.duration_s, 4),
                               "prefill_chunks": len(record.prefill_chunks), "decode_rows": record.num_decode_tokens,
                               "packs": list(record.plan.packs) if record.plan is not None else []})

    def memory_summary(self) -> dict:
        """The steps' predicted and measured transients (the memory model's check on this load): how
        many were under-predicted, the least prediction / measurement among steps with prompt chunks and
        among steps with a packed forward, the largest of each."""
        def least(rows):
            ratios = [r[0] / r[1] for r in rows if r[1] > 0]
            return round(min(ratios), 3) if ratios else None

        chunks = [r for r in self.memory if r[2] >= 1]
        packed = [r for r in self.memory if r[2] > 1]
        under = [dict(zip(("predicted", "measured", "largest_pack", "chunks", "decode_rows", "pipelined"), r))
                 for r in self.memory if r[1] > r[0]]
        return {"steps": len(self.memory), "under_predicted": len(under), "under_predicted_steps": under[:8],
                "least_ratio_prefill_steps": least(chunks), "least_ratio_packed_steps": least(packed),
                "packed_steps": len(packed), "largest_pack": max((r[2] for r in packed), default=0),
                "max_predicted_gb": round(max((r[0] for r in self.memory), default=0) / 1e9, 3),
                "max_measured_gb": round(max((r[1] for r in self.memory), default=0) / 1e9, 3)}


async def stream_requests(aengine, prompts, arrivals, sampling, concurrency: int, observer: AsyncStepObserver) -> tuple:
    """Every prompt through AsyncEngine.generate, one task each, from its arrival time and at most
    `concurrency` at once, each token time-stamped as received: (RequestRecords, wall seconds). The run's
    start is the observer's `t0_ns`."""
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    observer.t0_ns = time.time_ns()
    records = [RequestRecord(i, 0.0) for i in range(len(prompts))]

    async def one(i):
        await asyncio.sleep(arrivals[i])
        async with sem:
            rec = records[i]
            rec.sent_s = time.perf_counter() - t0
            try:
                async for out in aengine.generate(str(i), prompts[i], sampling):
                    if out.error:
                        rec.error = out.error
                    if out.new_token_ids:
                        now = time.perf_counter() - t0
                        rec.token_times_s.extend([now] * len(out.new_token_ids))
                        rec.num_output_tokens += len(out.new_token_ids)
            except Exception as exc:  # noqa: BLE001 - reported per request
                rec.error = f"{type(exc).__name__}: {exc}"

    await asyncio.gather(*(one(i) for i in range(len(prompts))))
    return records, time.perf_counter() - t0


def run_mlx_lm(lm, prompts, arrivals, args, settings: dict = MLX_LM_SERVER_DEFAULTS) -> dict:
    """mlx-lm's BatchGenerator with mlx_lm.server's defaults, driven as the server's loop drives it."""
    gen = mlx_lm_generator(lm.model, args.output_tokens, settings)
    uid_to_index: dict[int, int] = {}

    def add(i, prompt):
        (uid,) = gen.insert([prompt], max_tokens=[args.output_tokens])
        uid_to_index[uid] = i

    def step():
        return [(uid_to_index[r.uid], r.finish_reason is not None) for r in mlx_lm_step(gen)]

    with MemoryWindow() as mem:
        records, wall = LoopDriver(prompts, arrivals, args.concurrency_now).run(add, step)
    result = summarize(records, wall)
    result.update(mem.result())
    result["settings"] = settings
    c = gen._counters if hasattr(gen, "_counters") else None
    if c is not None and getattr(c, "generation_steps", 0):
        result["decode_step_mean_s"] = c.decode_time / c.generation_steps
        result["prompt_time_s"] = c.prompt_time
    gen.close()
    return result


def make_engine(lm, prompts, args, options=None, async_decode: bool = True, grammar_compiler=None,
                launch_thread=None, launch_ahead=None, **overrides):
    """This engine at its default config (max_num_seqs raised to the concurrency if that is larger),
    with a memory limit that admits every request. `options`: a RunnerOptions (None: the defaults);
    `async_decode`: False runs decode steps one after another; `launch_thread`, `launch_ahead`:
    StepOptions' (None: the engine's choice); `overrides`: EngineConfig fields."""
    from engine.config import EngineConfig
    from engine.core.types import StepOptions
    from engine.engine import Engine
    options = options or runner_options()
    memory = memory_model_for(lm)
    need = max(len(p) for p in prompts) + args.output_tokens
    model_max = model_max_len(lm)
    seqs = max(16, args.concurrency_now)
    limit = admitting_limit_bytes(lm, memory, [len(p) + args.output_tokens for p in prompts], seqs, 512,
                                  min(model_max, max(need, model_max)))
    fields = dict(model=lm.name, dtype=lm.dtype, memory_limit_bytes=limit, max_model_len=max_model_len_for(lm, need))
    if seqs > 16:  # the step budget stays the engine's default for the device (raised to seqs if smaller)
        fields.update(max_num_seqs=seqs)
    if args.engine_config:
        fields.update(json.loads(args.engine_config))
    fields.update(overrides)
    return Engine(lm.model, lm.tokenizer, EngineConfig(**fields), lm.config, runner_options=options,
                  step_options=StepOptions(async_decode=async_decode, launch_thread=launch_thread,
                                           launch_ahead=launch_ahead),
                  grammar_compiler=grammar_compiler)


def backend_runners() -> dict:
    """--backends: each backend's driver, called (lm, prompts, arrivals, args)."""

    def with_options(run, **fields):  # the driver with RunnerOptions differing from the benchmarks' in `fields`
        return lambda *a, **k: run(*a, **k, options=runner_options(**fields))

    return {"engine": run_engine_async, "engine_sync": run_engine_sync, "mlx_lm": run_mlx_lm,
            "mlx_lm_wide": (lambda lm, prompts, arrivals, args: run_mlx_lm(lm, prompts, arrivals, args, dict(
                MLX_LM_SERVER_DEFAULTS, completion_batch_size=max(args.concurrency_now,
                                                                  MLX_LM_SERVER_DEFAULTS["completion_batch_size"])))),
            "engine_sync_nopipe": (lambda *a, **k: run_engine_sync(*a, **k, async_decode=False)),
            "engine_sync_gather": (lambda *a, **k: run_engine_sync(*a, **k, execution={"paged_attention": False})),
            "engine_sync_unfused": with_options(run_engine_sync, fuse_projections=False),
            "engine_sync_modules": with_options(run_engine_sync, layer_loops=False),
            "engine_sync_span": with_options(run_engine_sync, tiled_attention=False, mma_attention=False),
            "engine_tiled": with_options(run_engine_async, mma_attention=False),
            # pipelined decodes encoded on the engine thread (StepOptions.launch_thread off; on CUDA's default)
            "engine_no_launch_thread": (lambda *a, **k: run_engine_async(*a, **k, launch_thread=False)),
            # each pipelined decode launched once the one before has ended (StepOptions.launch_ahead off)
            "engine_no_launch_ahead": (lambda *a, **k: run_engine_async(*a, **k, launch_ahead=False)),
            "engine_sync_fused_rope": with_options(run_engine_sync, fused_rope=True),
            "engine_fused_rope": with_options(run_engine_async, fused_rope=True),
            # the decode's q/k norms and RoPE as separate kernels (RunnerOptions.fused_rope off; on CUDA's default)
            "engine_no_fused_rope": with_options(run_engine_async, fused_rope=False),
            # the decode's residual adds as kernels of their own (RunnerOptions.fused_residual off; on CUDA's default)
            "engine_no_fused_residual": with_options(run_engine_async, fused_residual=False),
            # a paged decode's host-made inputs as arrays of their own (RunnerOptions.pack_step_inputs off)
            "engine_unpacked_step_inputs": with_options(run_engine_async, pack_step_inputs=False),
            # a paged decode's KV scattered into the pool (RunnerOptions.rope_writes_kv off; on CUDA's default)
            "engine_scatter_kv": with_options(run_engine_async, rope_writes_kv=False),
            "engine_sync_uncompiled": with_options(run_engine_sync, compiled_decode=False),
            "engine_uncompiled": with_options(run_engine_async, compiled_decode=False),
            "engine_sync_thread": run_engine_sync_thread, "engine_sync_asyncio": run_engine_sync_asyncio,
            # several rows' prompt chunks in one forward (ExecutionConfig.max_packed_tokens)
            # (long prompts' chunks included, as at 50bde34: the default packs whole short prompts only)
            "engine_packed": (lambda *a, **k: run_engine_async(*a, **k, execution={"max_packed_tokens": 8192,
                                                                                    "pack_long_prompts": True})),
            "engine_packed2048": (lambda *a, **k: run_engine_async(*a, **k, execution={"max_packed_tokens": 2048,
                                                                                        "pack_long_prompts": True})),
            "engine_unpacked": (lambda *a, **k: run_engine_async(*a, **k, execution={"max_packed_tokens": 0}))}
