"""The start's warm-up (engine/warmup.py) on the tiny model: it runs the kinds of step a server meets
(a prompt crossing a chunk boundary, chunks beside 1..R-1 decode rows, decodes of R..1 rows, sampled
and greedy rows) through the engine's own steps, and leaves the engine empty."""

from __future__ import annotations

import pytest

from engine.core.types import SamplingParams
from engine.warmup import warm_up, warmup_requests


def test_requests_join_one_per_step_and_leave_one_per_step():
    reqs = warmup_requests(rows=4, chunk_tokens=64, max_model_len=512)
    assert len(reqs[0][0]) == 64 + 40  # crosses a chunk boundary
    # request k joins at step k + 1 and samples its last token at step k + max_tokens: all distinct
    finish = [k + s.max_tokens for k, (_, s) in enumerate(reqs)]
    assert len(set(finish)) == 4 and min(finish) > 4  # all four decode together before any leaves
    assert {s.temperature > 0 for _, s in reqs} == {True, False}
    short = warmup_requests(rows=2, chunk_tokens=512, max_model_len=64)
    assert all(len(p) + s.max_tokens < 64 for p, s in short)


def test_warm_up_runs_mixed_and_decode_steps_of_each_row_count(make_engine):
    rows = 4
    engine = make_engine(prefill_chunk_size=64, max_num_batched_tokens=256, max_num_seqs=8)
    records = []
    step = engine.step

    def recording_step():
        records.append(step())
        return records[-1]

    engine.step = recording_step
    warmup = warm_up(engine, rows=rows)
    assert warmup.seconds > 0 and len(warmup.steps) == len([r for r in records if r.plan is not None])
    plans = [r.plan for r in records if r.plan is not None]
    with_chunks = {len(p.decodes) for p in plans if p.prefills}
    decode_only = {len(p.decodes) for p in plans if not p.prefills}
    assert set(range(1, rows)) <= with_chunks  # a prompt chunk beside each count of decode rows
    assert any(p.mixed for p in plans)  # in one forward
    assert decode_only >= set(range(1, rows + 1))
    assert len([c for p in plans for c in p.prefills if c.request_id == "warmup-0"]) >= 2  # two chunks
    errors = [o.error for r in records for o in r.outputs if o.error]
    assert not errors
    assert not engine.has_unfinished() and engine.kv.used_bytes == 0 and engine.stats().prefix_cache_bytes == 0
    out = engine.generate([[9] * 12], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("most", [0, 256])
def test_warm_up_runs_a_packed_forward_where_the_engine_packs(make_engine, most):
    engine = make_engine(prefill_chunk_size=64, max_num_batched_tokens=256, max_num_seqs=8,
                         execution={"max_packed_tokens": most})
    warmup = warm_up(engine, rows=2)
    assert (max(s.largest_pack for s in warmup.steps) > 1) == bool(most)
    assert not engine.has_unfinished() and engine.kv.used_bytes == 0


def test_a_refused_warm_up_leaves_the_engine_serving(make_engine, caplog):
    engine = make_engine(max_model_len=256)
    calls = []

    def refuse(request_id, prompt, sampling):
        calls.append(request_id)
        raise ValueError("no room")

    add = engine.add_request
    engine.add_request = refuse
    warm_up(engine, rows=3)
    assert calls == ["warmup-0"] and "request 0 refused" in caplog.text
    engine.add_request = add
    assert not engine.has_unfinished() and engine.kv.used_bytes == 0


def test_a_short_model_still_warms_up():
    reqs = warmup_requests(rows=8, chunk_tokens=512, max_model_len=16)
    assert all(len(p) >= 1 and len(p) + s.max_tokens < 16 for p, s in reqs)


async def test_a_failing_warm_up_neither_hangs_nor_stops_the_async_engine(make_engine, caplog):
    from engine.async_engine import AsyncEngine

    engine = make_engine()

    def broken():
        raise RuntimeError("broken after the warm-up's steps")

    engine.reset_prefix_cache = broken
    aengine = AsyncEngine(engine, warmup=True)  # returns: the thread set its event anyway
    try:
        assert aengine.warmup_s is None and "engine warm-up failed" in caplog.text
        outs = [o async for o in aengine.generate("a", [9] * 12, SamplingParams(max_tokens=3, ignore_eos=True))]
        assert sum(len(o.new_token_ids) for o in outs) == 3
    finally:
        aengine.shutdown()
