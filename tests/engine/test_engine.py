"""Engine on the tiny random llama: greedy equality with mlx-lm, batching, sampling, stops, abort."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.core.types import FinishReason, SamplingParams


def random_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def test_batched_chunked_greedy_equals_mlx_lm_generate(make_engine, tiny_parts, reference_greedy):
    engine = make_engine(prefill_chunk_size=8, max_num_batched_tokens=20, max_num_seqs=8)
    prompts = random_prompts([1, 5, 13, 29, 40, 64, 97], vocab=engine.memory.shape.vocab_size)
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    outs = engine.generate(prompts, sampling)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == reference_greedy(tiny_parts[0], prompt, 16)
        assert out.finish_reason == FinishReason.LENGTH
    assert len({tuple(o.token_ids) for o in outs}) == len(prompts)  # the outputs really differ


@pytest.mark.parametrize("async_decode", [False, True])
def test_decode_of_all_running_rows_is_one_forward(make_engine, async_decode):
    engine = make_engine(max_num_seqs=6, async_decode=async_decode)
    for i, p in enumerate(random_prompts([3, 9, 17, 4, 30, 12], 49152, seed=1)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()  # all six prompts prefill (one forward each)
    assert engine.scheduler.num_running == 6
    forwards = []
    for _ in range(4):
        before = engine.runner.num_forward_calls
        outputs = engine.step().outputs
        assert len(outputs) == 6 and {o.request_id for o in outputs} == {str(i) for i in range(6)}
        forwards.append(engine.runner.num_forward_calls - before)
    # Pipelined: the first decode step dispatches two forwards (its own and the next), then one each.
    assert forwards == ([2, 1, 1, 1] if async_decode else [1, 1, 1, 1])


def test_pipelined_decode_equals_synchronous_with_stops_and_aborts(make_engine):
    """Rows that stop on EOS / stop tokens (their extra token is dropped), reach max_tokens at
    different steps, or are aborted mid-pipeline: the same outputs as the synchronous engine, with the
    pipelined decodes encoded on the engine's thread or on a launch thread of their own."""
    prompts = random_prompts([5, 11, 7, 19, 3], 49152, seed=4)
    results = {}
    for async_decode, launch_thread in ((False, False), (True, False), (True, True)):
        engine = make_engine(max_num_seqs=5, async_decode=async_decode, launch_thread=launch_thread)
        reference = engine.generate(prompts[:1], SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
        params = [SamplingParams(max_tokens=12, stop_token_ids=(reference[4],)),  # stops at its 5th token
                  SamplingParams(max_tokens=3, ignore_eos=True),
                  SamplingParams(max_tokens=9, ignore_eos=True),
                  SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
                  SamplingParams(max_tokens=12, ignore_eos=True)]
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(str(i), p, sp)
        tokens = {str(i): [] for i in range(5)}
        finish = {}
        steps = 0
        while engine.has_unfinished():
            for out in engine.step().outputs:
                tokens[out.request_id].extend(out.new_token_ids)
                if out.finished:
                    finish[out.request_id] = out.finish_reason
            steps += 1
            if steps == 4:
                out = engine.abort("4")
                finish["4"] = out.finish_reason if out else None
        assert engine.kv.reserved_bytes == 0 and not engine.runner.rows
        assert (engine.executor.pipeline.num_thread_launches > 0) == launch_thread
        results[async_decode, launch_thread] = (tokens, finish)
    assert results[True, False] == results[False, False] == results[True, True]
    tokens, finish = results[True, True]
    assert finish["0"] == FinishReason.STOP and tokens["0"] == reference[:5]
    assert len(tokens["1"]) == 3 and len(tokens["2"]) == 9 and len(tokens["3"]) == 12
    assert finish["4"] == FinishReason.ABORT


def test_several_prompts_prefill_in_one_step_within_budget(make_engine):
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=40)
    for i, p in enumerate(random_prompts([50, 10, 10, 10], 49152, seed=2)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=2))
    plan = engine.scheduler.schedule()
    # the 4 tokens left would be a sliver of "3" (scheduler._admit): it starts in the next step
    assert [(c.request_id, c.num_tokens) for c in plan.prefills] == [("0", 16), ("1", 10), ("2", 10)]
    engine.scheduler.update(plan, {})
    plan = engine.scheduler.schedule()
    assert [(c.request_id, c.num_tokens) for c in plan.prefills][:2] == [("0", 16), ("3", 10)]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(make_engine):
    engine = make_engine()
    prompt = random_prompts([12], 49152, seed=3)
    hot = SamplingParams(max_tokens=12, temperature=1.5, seed=7, ignore_eos=True)
    a, b = engine.generate(prompt, hot), engine.generate(prompt, hot)
    assert a[0].token_ids == b[0].token_ids
    other = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=1.5, seed=8, ignore_eos=True))
    assert other[0].token_ids != a[0].token_ids
    greedy = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    top1 = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=2.0, top_k=1, seed=1,
                                                  ignore_eos=True))
    assert top1[0].token_ids == greedy[0].token_ids
    nucleus = engine.generate(prompt, SamplingParams(max_tokens=12, temperature=2.0, top_p=1e-6, seed=1,
                                                     ignore_eos=True))
    assert nucleus[0].token_ids == greedy[0].token_ids


def test_stop_token_ids_and_stop_strings(make_engine):
    engine = make_engine()
    prompt = random_prompts([10], 49152, seed=4)
    free = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    out = engine.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=(stop_id,), ignore_eos=True))[0]
    assert out.token_ids == free.token_ids[: first + 1] and out.finish_reason == FinishReason.STOP
    word = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    out = engine.generate(prompt, SamplingParams(max_tokens=12, stop=(word,), ignore_eos=True))[0]
    assert out.finish_reason == FinishReason.STOP
    assert out.text == free.text[: free.text.index(word)]


def test_max_model_len_and_bad_input_are_refused(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len=64"):
        engine.add_request("a", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request("b", [5, 10**9], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    assert not engine.has_unfinished()


def test_abort_frees_the_request_kv(make_engine):
    engine = make_engine()
    engine.add_request("a", random_prompts([30], 49152)[0], SamplingParams(max_tokens=50))
    engine.add_request("b", random_prompts([8], 49152, seed=9)[0], SamplingParams(max_tokens=50))
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.num_running == 2 and stats.kv_used_bytes > 0
    out = engine.abort("a")
    assert out.finish_reason == FinishReason.ABORT
    stats = engine.stats()
    assert stats.num_running == 1
    assert stats.kv_reserved_bytes == stats.kv_used_bytes == engine.memory.kv_bytes(8 + 50 - 1)
    engine.abort("b")
    assert engine.stats().kv_used_bytes == 0 and engine.stats().kv_reserved_bytes == 0


def test_chat_messages_use_the_chat_template(make_engine):
    engine = make_engine()
    ids = engine.encode([{"role": "user", "content": "hi"}])
    text = engine.tokenizer.decode(ids)
    assert "<|im_start|>user" in text and text.rstrip().endswith("assistant")
    assert engine.encode("hi") == list(engine.tokenizer.encode("hi"))
    assert engine.encode([1, 2, 3]) == [1, 2, 3]


def test_overlapped_steps_keep_tokens_memory_records_and_aborts(make_engine, tiny_parts, reference_greedy):
    """overlap_steps (on by default where MLX runs on CUDA, forced on here): a step whose last forward is
    a prompt chunk that samples nothing returns with it still running, and the next step retires it
    after building its own first forward. Greedy tokens stay mlx-lm's, every step's measured transient
    stays within its prediction (the deferred tail is counted in the next record, with the next forward's
    inputs), and an abort while a forward is deferred leaves the engine with one step to retire it."""
    engine = make_engine(prefill_chunk_size=32, max_num_batched_tokens=64, prefix_cache_fraction=0.0,
                         overlap_steps=True)
    rng = np.random.default_rng(5)
    vocab = engine.memory.shape.vocab_size
    prompts = [rng.integers(3, vocab, n).tolist() for n in (150, 70, 9)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, sampling)
    tokens: dict = {}
    deferred_steps = 0
    while engine.has_unfinished():
        record = engine.step()
        for out in record.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        deferred_steps += engine.executor.has_deferred
        step = record.memory
        if step is None:  # nothing was scheduled
            continue
        # a deferred forward's tail is measured over what was alive when its step returned, and the
        # next step's first forward is built meanwhile: its inputs (token ids, KV slots: a few KB) count
        assert step.measured_bytes <= step.predicted_bytes + (64 << 10), step
    assert deferred_steps >= 2
    for i, p in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], p, 6)

    engine.add_request("a", prompts[0], sampling)
    engine.step()
    assert engine.executor.has_deferred
    assert engine.abort("a").finished
    assert engine.has_unfinished()  # the deferred forward is retired by one more step
    assert engine.step().outputs == () and not engine.has_unfinished()
    assert engine.kv.allocator.num_free == engine.kv.allocator.num_blocks


def test_launch_thread_runs_jobs_raises_their_errors_and_runs_them_inline_once_closed():
    import threading

    from engine.launch_thread import LaunchThread

    launcher = LaunchThread()
    where = []
    assert launcher.join() is None  # nothing ran
    launcher.submit(lambda: where.append(threading.current_thread().name))
    assert launcher.join() > 0 and where == ["mlx-decode-launch"]
    launcher.submit(lambda: None)
    launcher.submit(lambda: None)  # the last one never joined (an interrupted step): joined first
    assert launcher.join() > 0

    def fail():
        raise RuntimeError("encode failed")

    launcher.submit(fail)
    with pytest.raises(RuntimeError, match="encode failed"):
        launcher.join()
    launcher.join()  # nothing running: returns at once
    launcher.close()
    launcher._thread.join(timeout=5)
    assert not launcher._thread.is_alive()
    launcher.submit(lambda: where.append(threading.current_thread().name))  # closed: on the caller's thread
    launcher.join()
    assert where[-1] == threading.current_thread().name


def test_a_dropped_engine_ends_its_launch_thread(make_engine):
    import gc
    import threading

    def launch_threads():
        return [t for t in threading.enumerate() if t.name == "mlx-decode-launch"]

    before = set(launch_threads())
    engine = make_engine(launch_thread=True)
    engine.generate(random_prompts([6], 49152, seed=5), SamplingParams(max_tokens=4, ignore_eos=True))
    ours = set(launch_threads()) - before
    assert engine.executor.pipeline.num_thread_launches > 0 and len(ours) == 1
    del engine
    gc.collect()
    thread = ours.pop()
    thread.join(timeout=5)
    assert not thread.is_alive()
