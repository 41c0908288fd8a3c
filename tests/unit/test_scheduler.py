"""Scheduler unit tests: pure Python, no mlx, fake model shape."""

import pytest
from hypothesis import given, settings, strategies as st

from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.types import FinishReason, Request, SamplingParams
from engine.core.kv_manager import KVManager
from engine.core.chunk_grid import DEFAULT_CHUNK_GRANULE as CHUNK_GRANULE, aligned_chunk
from engine.core.scheduler import Scheduler, SchedulerConfig

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=1000, dtype_bytes=4)
STEP = 16


def make(max_num_seqs=8, budget=32, chunk=8, max_model_len=512, kv_tokens=4096, pad=False,
         granule=CHUNK_GRANULE) -> Scheduler:
    memory = MemoryModel(SHAPE, kv_step=STEP)
    cfg = SchedulerConfig(max_num_seqs, budget, chunk, max_model_len, pad_last_chunk=pad, chunk_granule=granule)
    kv = KVManager(STEP, memory.kv_bytes_per_token, kv_tokens * memory.kv_bytes_per_token)
    return Scheduler(cfg, memory, kv)


def req(rid, n_prompt, max_tokens=4):
    return Request(str(rid), list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens))


def run_step(s: Scheduler, token=7):
    """One step with a fake model: every completed prompt / decode samples `token`."""
    out = s.schedule()
    sampled = {c.request_id: token for c in out.prefills if c.completes_prompt}
    sampled.update({rid: token for rid in out.decodes})
    for r in s.update(out, sampled):
        if r.num_output_tokens >= r.sampling.max_tokens:
            s.finish(r.request_id, FinishReason.LENGTH)
    return out


def test_budget_and_chunk_respected():
    s = make(budget=20, chunk=8)
    for i in range(4):
        s.add(req(i, 30))
    out = s.schedule()
    assert out.num_batched_tokens <= 20
    assert all(c.num_tokens <= 8 for c in out.prefills)
    assert [c.request_id for c in out.prefills] == ["0", "1", "2"]  # FCFS: 8 + 8 + 4
    assert [c.num_tokens for c in out.prefills] == [8, 8, 4]


def test_decode_first_then_prefill():
    s = make(budget=10, chunk=8)
    s.add(req("a", 4, max_tokens=10))
    run_step(s)  # a prefilled in one chunk, sampled its first token
    s.add(req("b", 30))
    out = s.schedule()
    assert out.decodes == ("a",)
    # one chunk of b, then what the budget leaves (1 token) is less than half a chunk: not scheduled
    assert [(c.request_id, c.num_tokens) for c in out.prefills] == [("b", 8)]
    assert out.num_batched_tokens == 9


def test_long_head_prompt_always_progresses_and_short_ones_share_budget():
    s = make(budget=12, chunk=8)
    s.add(req("long", 100))
    s.add(req("short", 3))
    out = s.schedule()
    assert [(c.request_id, c.num_tokens) for c in out.prefills] == [("long", 8), ("short", 3)]
    progress = []
    for _ in range(5):
        run_step(s)
        progress.append(s.requests["long"].num_computed_tokens)
    assert progress == sorted(progress) and len(set(progress)) == len(progress)


def test_chunks_cover_prompt_exactly():
    s = make(budget=16, chunk=5)
    s.add(req("a", 23, max_tokens=1))
    steps = []
    while s.has_unfinished():
        out = run_step(s)
        steps.append([(c.start, c.num_tokens, c.completes_prompt) for c in out.prefills])
    # the budget left after a's first chunk goes to its next ones (one forward each, in order), down to
    # half a chunk: 5 + 5 + 5 (1 left), then the rest
    assert steps == [[(0, 5, False), (5, 5, False), (10, 5, False)], [(15, 5, False), (20, 3, True)]]


def test_unused_budget_goes_to_further_chunks_oldest_first():
    s = make(budget=32, chunk=8)
    s.add(req("old", 40))
    s.add(req("new", 12))
    out = s.schedule()
    # one chunk each first (new gets its whole prompt's first 8), then old's next chunks, then new's end
    assert [(c.request_id, c.start, c.num_tokens) for c in out.prefills] == [
        ("old", 0, 8), ("new", 0, 8), ("old", 8, 8), ("old", 16, 8)]
    assert out.num_batched_tokens == 32
    run_step_with(s, out)
    out = s.schedule()
    assert [(c.request_id, c.start, c.num_tokens, c.completes_prompt) for c in out.prefills] == [
        ("old", 24, 8, False), ("new", 8, 4, True), ("old", 32, 8, True)]
    # each chunk is its own forward: the step's transient is the largest one's, not their sum
    assert out.predicted_transient_bytes == max(s.predict((), [c]) for c in out.prefills)


def run_step_with(s: Scheduler, out, token=7):
    sampled = {c.request_id: token for c in out.prefills if c.completes_prompt}
    sampled.update({rid: token for rid in out.decodes})
    s.update(out, sampled)


def test_abort_releases_reservation():
    s = make()
    s.add(req("a", 10, max_tokens=5))
    run_step(s)
    assert s.kv.reserved_bytes > 0 and s.num_running == 1
    s.finish("a", FinishReason.ABORT)
    assert s.kv.reserved_bytes == 0 and s.num_running == 0 and not s.has_unfinished()
    assert s.schedule().is_empty


def test_abort_waiting_request():
    s = make(max_num_seqs=1)
    s.add(req("a", 10))
    s.add(req("b", 10))
    s.schedule()
    s.finish("b", FinishReason.ABORT)
    assert s.num_waiting == 0 and "b" not in s.requests


def test_refused_at_add_when_it_can_never_fit():
    s = make(max_model_len=64, kv_tokens=48)
    with pytest.raises(ValueError, match="max_model_len=64"):
        s.add(req("a", 60, max_tokens=10))
    with pytest.raises(ValueError, match="KV budget"):
        s.add(req("b", 40, max_tokens=20))  # 59 tokens -> 64 with the cache step > 48
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("c", 4))
        s.add(req("c", 4))


def test_waits_for_kv_then_runs_fcfs():
    s = make(kv_tokens=64, budget=64, chunk=64)
    s.add(req("a", 40, max_tokens=9))  # reserves 48 tokens
    s.add(req("b", 20, max_tokens=9))  # needs 32: does not fit beside a
    s.add(req("c", 2, max_tokens=2))  # would fit, but FCFS keeps it behind b
    out = s.schedule()
    assert [c.request_id for c in out.prefills] == ["a"]
    assert s.num_waiting == 2
    s.update(out, {"a": 1})
    s.finish("a", FinishReason.STOP)
    out = s.schedule()
    assert [c.request_id for c in out.prefills] == ["b", "c"]


def test_max_num_seqs_limits_running():
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add(req(i, 3))
    s.schedule()
    assert s.num_running == 2 and s.num_waiting == 2


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 120), st.integers(1, 12)),
                      min_size=1, max_size=25),
    aborts=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 24)), max_size=5),
    budget=st.integers(8, 64), chunk=st.integers(1, 32), max_num_seqs=st.integers(1, 8),
)
def test_property_every_request_finishes_and_budget_holds(arrivals, aborts, budget, chunk, max_num_seqs):
    chunk = min(chunk, budget)
    max_num_seqs = min(max_num_seqs, budget)
    s = make(max_num_seqs=max_num_seqs, budget=budget, chunk=chunk, max_model_len=256, kv_tokens=512)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    done, aborted = set(), set()
    for step in range(2000):
        for i, (t, n, m) in [p for p in pending if p[1][0] <= step]:
            s.add(req(i, n, m))
        pending = [p for p in pending if p[1][0] > step]
        for t, idx in aborts:
            if t == step and str(idx) in s.requests:
                s.finish(str(idx), FinishReason.ABORT)
                aborted.add(str(idx))
        before = set(s.requests)
        out = run_step(s)
        assert out.num_batched_tokens <= budget
        assert out.predicted_transient_bytes <= s.transient_bound_bytes
        assert len(s.running) <= max_num_seqs
        assert 0 <= s.kv.reserved_bytes <= s.kv.kv_budget_bytes
        done |= before - set(s.requests)
        if not pending and not s.has_unfinished():
            break
    assert not s.has_unfinished() and not pending
    assert done | aborted == {str(i) for i in range(len(arrivals))}
    assert s.kv.reserved_bytes == 0


class _CostlyMixes(MemoryModel):
    """A memory model whose mixed forwards exceed any bound (pure logic of the option below)."""

    def step_transient_bytes(self, plan, mixed=False):
        return 1 << 50 if mixed else super().step_transient_bytes(plan)


def test_mix_beyond_bound_mixes_a_step_the_bound_would_split():
    for beyond in (False, True):
        memory = _CostlyMixes(SHAPE, kv_step=STEP, mixed=True)
        kv = KVManager(STEP, memory.kv_bytes_per_token, 4096 * memory.kv_bytes_per_token)
        s = Scheduler(SchedulerConfig(8, 32, 8, 512, mix_beyond_bound=beyond), memory, kv)
        s.add(req("a", 4, max_tokens=8))
        run_step(s)  # a's prompt: it decodes from now on
        s.add(req("b", 8))
        out = s.schedule()
        assert out.decodes == ("a",) and [c.request_id for c in out.prefills] == ["b"]
        assert out.mixed == beyond
        assert (out.predicted_transient_bytes > s.transient_bound_bytes) == beyond


def make_tight(free_bytes: int, max_num_seqs=8, budget=64, chunk=32, max_model_len=256, view_reads=False,
               pad=False):
    """A scheduler whose memory beside the KV pool is the floor step + `free_bytes`: the KV budget
    is what the engine gives it (MemoryModel.kv_budget_bytes against the floor)."""
    memory = MemoryModel(SHAPE, kv_step=STEP)
    floor = memory.floor_transient_bytes(chunk, max_model_len)
    max_memory = 64 * max_model_len * memory.kv_bytes_per_token // 8 + floor + free_bytes
    kv = KVManager(STEP, memory.kv_bytes_per_token, memory.kv_budget_bytes(max_memory, floor))
    cfg = SchedulerConfig(max_num_seqs, budget, chunk, max_model_len, max_memory_bytes=max_memory,
                          pad_last_chunk=pad)
    return Scheduler(cfg, memory, kv, view_reads=view_reads)


def test_floor_step_fits_beside_a_full_pool():
    s = make_tight(0)
    assert s.config.max_memory_bytes - s.kv.kv_budget_bytes >= s.floor_transient_bytes
    assert s.floor_transient_bytes < s.transient_bound_bytes


def test_chunks_cut_to_the_free_memory_and_the_record_says_so():
    # a 2000-token chunk is predicted above what the pool leaves free beside it: it must be cut
    s = make_tight(0, max_model_len=2048, chunk=2048, budget=2048)
    s.add(req("a", 2000, max_tokens=2))
    out = s.schedule()
    free = out.free_transient_bytes
    assert free is not None and out.predicted_transient_bytes <= free
    assert s.memory.prefill_chunk_bytes(2000, 2000, True) > free
    assert out.memory_limited and out.prefills[0].num_tokens < 2000
    assert out.step_budget_tokens == out.num_batched_tokens


def test_aligned_chunk_ends_on_the_coarsest_grid_that_keeps_three_quarters():
    assert CHUNK_GRANULE == 128
    assert aligned_chunk(0, 300) == 256 and aligned_chunk(0, 466) == 384 and aligned_chunk(0, 128) == 128
    assert aligned_chunk(512, 188) == 160  # ends at 672: 640 would keep 128 of 188, under three quarters
    assert aligned_chunk(100, 50) == 44  # ends at 144, a multiple of 16
    assert aligned_chunk(5, 3) == 3 and aligned_chunk(7, 1) == 1  # never 0


def test_aligned_chunk_on_a_coarser_granule():
    """ExecutionConfig.chunk_granule 512: the same rule, on multiples of 512 where they keep three quarters."""
    assert aligned_chunk(0, 1100, 512) == 1024 and aligned_chunk(0, 700, 512) == 640  # 512 < 3/4 of 700
    assert aligned_chunk(512, 700, 512) == 640  # ends at 1152: 1024 (on 512 or 256) keeps 512 of 700
    assert aligned_chunk(0, 300, 512) == 256 and aligned_chunk(100, 50, 512) == 44  # as with 128
    assert aligned_chunk(0, 1000, 128) == 896 and aligned_chunk(0, 1000, 512) == 768  # the granule decides


def ends_on_grid(chunk) -> bool:
    """What aligned_chunk guarantees of a chunk it returned: its end is a multiple of the largest power of
    two <= min(CHUNK_GRANULE, a quarter of its tokens)."""
    step = 1 << (max(1, min(CHUNK_GRANULE, chunk.num_tokens // 4)).bit_length() - 1)
    return (chunk.start + chunk.num_tokens) % step == 0


def test_a_chunk_cut_by_the_budget_ends_on_the_grid():
    s = make(max_num_seqs=8, budget=900, chunk=512, max_model_len=2048, kv_tokens=8192)
    s.add(req("a", 1000))
    s.add(req("b", 1000))
    out = s.schedule()
    # b gets what a's chunk leaves (388 tokens), back to the grid: 384 (the same shape for every prompt)
    assert [(c.request_id, c.num_tokens) for c in out.prefills] == [("a", 512), ("b", 384)]
    assert not out.memory_limited and out.step_budget_tokens == 900


def test_a_new_prompt_does_not_start_with_a_sliver_beside_other_work():
    """A waiting prompt is admitted only if the budget leaves it half a chunk (or its whole rest) beside
    the step's other work: 188 tokens after a's chunk is a sliver of b's 512; b starts in the next step.
    Alone in a step a prompt starts with whatever the budget gives."""
    s = make(max_num_seqs=8, budget=700, chunk=512, max_model_len=2048, kv_tokens=8192)
    s.add(req("a", 1000))
    s.add(req("b", 1000))
    s.add(req("c", 100))
    steps = []
    for _ in range(3):
        out = s.schedule()
        steps.append([(c.request_id, c.num_tokens) for c in out.prefills])
        s.update(out, {})
    # 188 and then 212 tokens left beside a's chunks: slivers of b's first 512; c waits behind b (FCFS)
    # until b's whole chunk leaves c room for its whole prompt
    assert steps == [[("a", 512)], [("a", 488)], [("b", 512), ("c", 100)]]
    alone = make(max_num_seqs=8, budget=100, chunk=512, max_model_len=2048, kv_tokens=8192)
    alone.add(req("d", 1000))
    assert [(c.request_id, c.num_tokens) for c in alone.schedule().prefills] == [("d", 96)]
    whole = make(max_num_seqs=8, budget=620, chunk=512, max_model_len=2048, kv_tokens=8192)
    whole.add(req("e", 512))
    whole.add(req("f", 100))  # its whole prompt fits what e leaves: no sliver
    assert [(c.request_id, c.num_tokens) for c in whole.schedule().prefills] == [("e", 512), ("f", 100)]
    # a budget that leaves less than half a chunk beside a full batch of decode rows: the least is what
    # it leaves (300 - 250 + 1 = 51 tokens), else a waiting prompt would wait while the rows decode
    small = make(max_num_seqs=250, budget=300, chunk=256, max_model_len=2048, kv_tokens=1 << 20)
    for i in range(200):
        small.add(req(f"r{i}", 1, max_tokens=50))
    small.update(small.schedule(), {f"r{i}": 7 for i in range(200)})
    small.add(req("g", 1000))
    out = small.schedule()
    assert len(out.decodes) == 200 and [(c.request_id, c.num_tokens) for c in out.prefills] == [("g", 96)]


def test_a_prompt_cut_by_memory_ends_on_the_grid_and_takes_more_such_chunks_in_its_step():
    # the pool, once it holds the one request's KV, leaves little more than the floor step
    memory = MemoryModel(SHAPE, kv_step=STEP)
    floor = memory.floor_transient_bytes(1024, 1024)
    max_memory = memory.kv_bytes(1024) * 5 // 4 + floor
    kv = KVManager(STEP, memory.kv_bytes_per_token, memory.kv_budget_bytes(max_memory, floor))
    s = Scheduler(SchedulerConfig(4, 2048, 1024, 1024, max_memory_bytes=max_memory), memory, kv)
    s.add(req("a", 1000, max_tokens=2))
    out = s.schedule()
    assert out.memory_limited and out.predicted_transient_bytes <= out.free_transient_bytes
    chunks = out.prefills
    assert chunks[0].num_tokens < 512  # cut below half a chunk by the memory ...
    assert len(chunks) > 2 and all(c.request_id == "a" for c in chunks)  # ... yet the prompt goes on
    assert all(ends_on_grid(c) for c in chunks if not c.completes_prompt)
    assert [c.start for c in chunks] == [0] + [c.start + c.num_tokens for c in chunks[:-1]]


def test_decode_rows_ride_in_a_chunk_only_when_the_memory_cut_nothing():
    def first_mixed_step(free_bytes):
        memory = MemoryModel(SHAPE, kv_step=STEP, mixed=True)
        floor = memory.floor_transient_bytes(512, 1024)
        max_memory = memory.kv_bytes(2048) * 5 // 4 + floor + free_bytes
        kv = KVManager(STEP, memory.kv_bytes_per_token, memory.kv_budget_bytes(max_memory, floor))
        s = Scheduler(SchedulerConfig(4, 1024, 512, 1024, max_memory_bytes=max_memory), memory, kv)
        s.add(req("a", 8, max_tokens=50))
        run_step(s)  # a decodes from now on
        s.add(req("b", 1000, max_tokens=2))
        return s.schedule()

    roomy = first_mixed_step(1 << 30)
    assert not roomy.memory_limited and roomy.mixed
    tight = first_mixed_step(0)
    assert tight.memory_limited and tight.decodes == ("a",) and tight.prefills and not tight.mixed


def test_decode_rows_that_do_not_fit_wait_and_catch_up():
    s = make_tight(0, max_num_seqs=8, budget=64, chunk=32, max_model_len=256)
    for i in range(8):
        s.add(req(i, 200, max_tokens=30))
    decoded: dict[str, int] = {}
    num_cut = 0
    for _ in range(400):
        if not s.has_unfinished():
            break
        decoding = [r for r in s.running if not r.is_prefilling]
        out = run_step(s)
        assert out.predicted_transient_bytes <= out.free_transient_bytes
        num_cut += 0 < len(out.decodes) < len(decoding)
        for rid in out.decodes:
            decoded[rid] = decoded.get(rid, 0) + 1
    assert not s.has_unfinished() and len(decoded) == 8
    assert num_cut > 0  # the decode of all eight rows did not fit beside the full pool


def tight_workloads(test):
    """Random arrivals (step, prompt tokens, new tokens) under tight memory, for the property tests of
    the scheduler here and of padded chunks (tests/unit/test_chunk_grid.py)."""
    return settings(max_examples=60, deadline=None)(given(
        arrivals=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 240), st.integers(1, 12)),
                          min_size=1, max_size=20),
        free=st.integers(0, 200_000), budget=st.integers(8, 64), chunk=st.integers(1, 32),
        max_num_seqs=st.integers(1, 8), view_reads=st.booleans(),
    )(test))


@tight_workloads
def test_property_tight_memory_every_step_fits_and_every_request_finishes(arrivals, free, budget, chunk,
                                                                           max_num_seqs, view_reads):
    chunk = min(chunk, budget)
    max_num_seqs = min(max_num_seqs, budget)
    s = make_tight(free, max_num_seqs=max_num_seqs, budget=budget, chunk=chunk, view_reads=view_reads)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    for step in range(5000):
        for i, (t, n, m) in [p for p in pending if p[1][0] <= step]:
            s.add(req(i, min(n, 256 - m), m))
        pending = [p for p in pending if p[1][0] > step]
        out = run_step(s)
        # the pool after this step's growth + the step's transient (+ a growth copy) within the memory
        assert s.kv.pool_bytes + out.predicted_transient_bytes <= s.config.max_memory_bytes
        assert s.kv.pool_bytes + s.memory.kv_growth_bound_bytes(s.kv.kv_budget_bytes) <= s.config.max_memory_bytes
        assert out.predicted_transient_bytes <= s.transient_bound_bytes
        assert out.num_batched_tokens <= budget
        # a chunk stopping short of its prompt and of a whole chunk ends on the grid
        assert all(ends_on_grid(c) for c in out.prefills if not c.completes_prompt and c.num_tokens < chunk)
        if not pending and not s.has_unfinished():
            break
    assert not s.has_unfinished() and not pending
