"""AsyncEngine: streaming increments from the engine thread, cancellation aborts and frees KV."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from engine.core.types import SamplingParams


@pytest.fixture(params=[None, True], ids=["engine-thread-launch", "launch-thread"])
def async_engine(make_engine, request):
    """An AsyncEngine whose engine (built in this thread, stepped in the engine thread) encodes its
    pipelined decodes on the engine thread (the CPU's default) or on a launch thread (CUDA's)."""
    eng = AsyncEngine(make_engine(launch_thread=request.param))
    yield eng
    eng.shutdown()


async def test_stream_matches_sync_generate(async_engine, make_engine):
    prompt = list(range(5, 40))
    sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = [o async for o in async_engine.generate("a", prompt, sampling)]
    assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 10
    expected = make_engine().generate([prompt], sampling)[0]
    assert [t for o in outs for t in o.new_token_ids] == expected.token_ids
    assert "".join(o.new_text for o in outs) == expected.text
    engine = async_engine.engine
    assert (engine.executor.pipeline.num_thread_launches > 0) == engine.execution_paths().launch_thread


async def test_concurrent_streams(async_engine):
    async def one(i):
        return [o async for o in async_engine.generate(str(i), [7 + i] * (3 + i), SamplingParams(max_tokens=6))]

    results = await asyncio.gather(*(one(i) for i in range(6)))
    assert all(r[-1].finished for r in results)


async def test_cancel_aborts_and_frees_kv(async_engine):
    async def consume():
        async for _ in async_engine.generate("long", [9] * 20, SamplingParams(max_tokens=1500, ignore_eos=True)):
            pass

    task = asyncio.create_task(consume())
    for _ in range(200):
        await asyncio.sleep(0.01)
        if async_engine.stats().num_running == 1:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    deadline = time.monotonic() + 1.0
    while async_engine.stats().num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    stats = async_engine.stats()
    assert stats.num_running == 0 and stats.kv_used_bytes == 0 and stats.kv_reserved_bytes == 0
    assert async_engine.is_healthy()


async def test_abort_ends_a_listening_stream(async_engine):
    """An abort from elsewhere (the replica's explicit abort) ends the stream with an "abort" output."""
    outs = []

    async def consume():
        async for out in async_engine.generate("x", [9] * 20, SamplingParams(max_tokens=1500, ignore_eos=True)):
            outs.append(out)
            if len(outs) == 2:
                await async_engine.abort("x")

    await asyncio.wait_for(consume(), 30)
    assert outs[-1].finished and outs[-1].finish_reason.value == "abort"
    assert async_engine.stats().kv_reserved_bytes == 0


async def test_bad_request_raises_value_error(async_engine):
    with pytest.raises(ValueError, match="max_model_len"):
        async for _ in async_engine.generate("x", [1] * 10, SamplingParams(max_tokens=10**6)):
            pass


async def test_warmup_runs_in_the_engine_thread_before_serving(make_engine, monkeypatch):
    import threading

    engine = make_engine()
    threads = []
    step = engine.step

    def recording_step():
        threads.append(threading.current_thread().name)
        return step()

    monkeypatch.setattr(engine, "step", recording_step)
    aengine = AsyncEngine(engine, warmup=True)
    try:
        assert aengine.warmup_s is not None and threads  # done when the constructor returns
        assert set(threads) == {"mlx-engine"}
        assert not engine.has_unfinished() and engine.kv.used_bytes == 0
        outs = [o async for o in aengine.generate("a", [9] * 12, SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 3
    finally:
        aengine.shutdown()
    default = AsyncEngine(make_engine())
    default.shutdown()
    assert default.warmup_s is None  # on the CPU: none by default


async def test_the_config_turns_the_gpu_warm_up_off(make_engine, monkeypatch):
    from engine import async_engine as module

    monkeypatch.setattr(module, "mlx_backend", lambda: "cuda")  # the choice only; MLX still runs on the CPU
    ran = []
    monkeypatch.setattr(AsyncEngine, "_warmup", lambda self: ran.append(self))
    on = AsyncEngine(make_engine())
    on.shutdown()
    off = AsyncEngine(make_engine(execution={"start_warmup": False}))
    off.shutdown()
    assert ran == [on]


async def test_an_error_deciding_the_warm_up_is_raised_by_the_constructor(make_engine, monkeypatch):
    from engine import async_engine as module

    def no_backend():
        raise RuntimeError("no backend")

    monkeypatch.setattr(module, "mlx_backend", no_backend)
    with pytest.raises(RuntimeError, match="no backend"):  # not a constructor waiting forever
        AsyncEngine(make_engine())


async def test_engine_built_by_a_factory_in_the_engine_thread(make_engine):
    import threading

    built_in = []

    def build():
        built_in.append(threading.current_thread().name)
        return make_engine()

    aengine = AsyncEngine(build)
    try:
        assert built_in == ["mlx-engine"] and aengine.engine is not None
        outs = [o async for o in aengine.generate("a", [9] * 12, SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 3
    finally:
        aengine.shutdown()

    def broken():
        raise ValueError("memory_limit_bytes=1 is too small")

    with pytest.raises(ValueError, match="memory_limit_bytes=1"):
        AsyncEngine(broken)


async def test_on_step_gets_the_step_records_of_the_engine_thread(make_engine):
    """The observer gets the StepRecord that step() returned: the outputs the stream then delivers,
    the prompt chunks that covered the prompt, and the step's predicted and measured transient."""
    aengine = AsyncEngine(make_engine(prefill_chunk_size=16, max_num_batched_tokens=16))
    records = []
    aengine.on_step = records.append
    try:
        prompt = list(range(5, 45))
        outs = [o async for o in aengine.generate("a", prompt, SamplingParams(max_tokens=5, ignore_eos=True))]
    finally:
        aengine.shutdown()
    assert [(c.start, c.num_tokens) for r in records for c in r.prefill_chunks] == [(0, 16), (16, 16), (32, 8)]
    assert sum(r.num_prefill_tokens for r in records) == len(prompt)
    assert sum(r.num_decode_tokens for r in records) == 4  # the first token came with the prompt
    delivered = [t for r in records for o in r.outputs for t in o.new_token_ids]
    assert delivered == [t for o in outs for t in o.new_token_ids]
    assert all(r.plan is not None and not r.plan.is_empty and r.duration_s >= 0 for r in records)
    memories = [r.memory for r in records if r.memory is not None]
    assert memories and all(m.measured_bytes <= m.predicted_bytes for m in memories)
    for r in records:  # a step that scheduled its forwards built them: times in order
        for f in r.forwards if not r.pipelined else ():
            assert f.build_s is not None and f.build_s <= f.launch_s <= f.launched_s


EXIT_SCRIPT = """
import asyncio, sys
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.core.types import SamplingParams

engine = AsyncEngine.from_config(EngineConfig(model="tiny", max_model_len=512, cache_dir=sys.argv[2]))

async def main():
    async for out in engine.generate("r0", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)):
        pass
    if sys.argv[1] == "busy":  # leave a request running: the interpreter exits mid-generation
        stream = engine.generate("r1", [1, 2, 3], SamplingParams(max_tokens=400, ignore_eos=True))
        await stream.__anext__()

asyncio.run(main())
print("end of script", flush=True)
"""


def test_a_script_exits_cleanly_without_calling_shutdown(tmp_path, model_cache_dir):
    """The engine thread is stopped at exit and its OS thread waited for: before, a script that ran the
    engine often ended with "terminate called without an active exception" (SIGABRT, status 134) or a
    segfault, as MLX's thread-local destructors took the GIL during interpreter finalization."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "exit_script.py"
    script.write_text(EXIT_SCRIPT)
    root = Path(__file__).resolve().parents[2]
    runs = [subprocess.Popen([sys.executable, str(script), mode, model_cache_dir], cwd=root, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for mode in ("idle", "busy", "idle", "busy")]
    for run in runs:
        out, _ = run.communicate(timeout=240)
        assert run.returncode == 0 and "end of script" in out and "terminate called" not in out, out[-2000:]
