"""A prompt's last chunk padded up to the grid (SchedulerConfig.pad_last_chunk): pure planning logic, a
fake model shape, no mlx. The engine's outputs with padding: tests/engine/test_chunk_padding.py."""


from engine.core.chunk_grid import DEFAULT_CHUNK_GRANULE as CHUNK_GRANULE, padded_ends
from engine.core.types import FinishReason
from tests.unit.test_scheduler import make, make_tight, req, run_step, tight_workloads


def test_padded_ends_coarsest_grid_first_within_the_limit():
    assert CHUNK_GRANULE == 128
    assert padded_ends(300, 1000) == [384, 320, 304, 300]
    assert padded_ends(300, 330) == [320, 304, 300]  # 384 would pass the limit
    assert padded_ends(300, 300) == [300]  # no room: no pad
    assert padded_ends(256, 1000) == [256]  # on the grid already
    assert padded_ends(5, 8) == [8, 6, 5]


def test_padded_ends_on_a_coarser_granule():
    """ExecutionConfig.chunk_granule 512: the pad may reach the next multiple of 512 first."""
    assert padded_ends(300, 1000, 512) == [512, 384, 320, 304, 300]
    assert padded_ends(600, 2000, 512) == [1024, 768, 640, 608, 600]
    assert padded_ends(600, 1000, 512) == [768, 640, 608, 600]  # 1024 would pass the limit
    assert padded_ends(600, 700, 512) == [640, 608, 600]
    assert padded_ends(1024, 2048, 512) == [1024]


def test_scheduler_pads_to_its_configured_granule():
    s = make(budget=1024, chunk=512, max_model_len=2048, kv_tokens=8192, pad=True, granule=512)
    s.add(req("a", 300, max_tokens=300))
    a = last_chunk(s.schedule(), "a")
    assert (a.num_tokens, a.num_pad_tokens, a.num_forward_tokens) == (300, 212, 512)


def last_chunk(out, request_id):
    (chunk,) = [c for c in out.prefills if c.request_id == request_id and c.completes_prompt]
    return chunk


def test_last_chunk_padded_to_the_grid_and_counted_by_the_budget():
    s = make(budget=1024, chunk=256, max_model_len=2048, kv_tokens=8192, pad=True)
    s.add(req("a", 300, max_tokens=200))
    s.add(req("b", 70, max_tokens=200))
    out = s.schedule()
    a, b = last_chunk(out, "a"), last_chunk(out, "b")
    # a: [256, 300) computes up to 384: 128 tokens over 384 keys, both on the grid
    assert (a.start, a.num_tokens, a.num_pad_tokens, a.num_forward_tokens) == (256, 44, 84, 128)
    assert (b.start, b.num_tokens, b.num_pad_tokens) == (0, 70, 58)
    assert out.num_batched_tokens == 256 + 128 + 128  # the budget counts what the forwards compute
    # progress counts the prompt's real tokens only
    run_step(s)
    assert s.requests["a"].num_computed_tokens == 300 and s.requests["b"].num_computed_tokens == 70


def test_the_pad_stays_within_the_blocks_the_budget_and_max_model_len():
    s = make(budget=1024, chunk=256, max_model_len=2048, kv_tokens=8192, pad=True)
    s.add(req("c", 300, max_tokens=1))  # its blocks hold 304 positions (16-token blocks)
    c = last_chunk(s.schedule(), "c")
    assert s.kv.num_slots("c") == 304 and c.start + c.num_forward_tokens == 304  # a 16 grid
    s = make(budget=316, chunk=256, max_model_len=2048, kv_tokens=8192, pad=True)
    s.add(req("d", 300, max_tokens=200))
    out = s.schedule()
    assert last_chunk(out, "d").num_pad_tokens == 4 and out.num_batched_tokens == 304  # 60 left: 304
    s = make(budget=1024, chunk=256, max_model_len=310, kv_tokens=8192, pad=True)
    s.add(req("e", 300, max_tokens=10))
    assert last_chunk(s.schedule(), "e").num_pad_tokens == 4  # 320 would pass max_model_len
    s = make(budget=1024, chunk=256, max_model_len=2048, kv_tokens=8192)  # padding off
    s.add(req("f", 300, max_tokens=200))
    assert all(c.num_pad_tokens == 0 for c in s.schedule().prefills)


@tight_workloads
def test_property_padded_steps_fit_and_every_block_comes_back(arrivals, free, budget, chunk, max_num_seqs,
                                                              view_reads):
    """Under tight memory with padding on: every step fits the free memory and the budget with its pads;
    a pad follows only a prompt's end, ends on a power-of-two grid coarser than itself, within the chunk
    size, the row's blocks and max_model_len; every request finishes and every block goes back."""
    chunk = min(chunk, budget)
    max_num_seqs = min(max_num_seqs, budget)
    s = make_tight(free, max_num_seqs=max_num_seqs, budget=budget, chunk=chunk, view_reads=view_reads, pad=True)
    pending = sorted(enumerate(arrivals), key=lambda x: x[1][0])
    for step in range(5000):
        for i, (t, n, m) in [p for p in pending if p[1][0] <= step]:
            s.add(req(i, min(n, 256 - m), m))
        pending = [p for p in pending if p[1][0] > step]
        out = s.schedule()
        assert s.kv.pool_bytes + out.predicted_transient_bytes <= s.config.max_memory_bytes
        assert out.predicted_transient_bytes <= s.transient_bound_bytes
        assert out.num_batched_tokens <= budget
        assert s.kv.used_bytes == s.kv.reserved_bytes  # the pad took no block
        for c in out.prefills:
            end = c.start + c.num_forward_tokens
            assert c.num_forward_tokens <= chunk
            if c.num_pad_tokens:
                assert c.completes_prompt and end <= min(s.kv.num_slots(c.request_id), s.config.max_model_len)
                assert c.num_pad_tokens < CHUNK_GRANULE and end % (1 << c.num_pad_tokens.bit_length()) == 0
        sampled = {c.request_id: 7 for c in out.prefills if c.completes_prompt} | {r: 7 for r in out.decodes}
        for r in s.update(out, sampled):
            if r.num_output_tokens >= r.sampling.max_tokens:
                s.finish(r.request_id, FinishReason.LENGTH)
        if not pending and not s.has_unfinished():
            break
    assert not s.has_unfinished() and not pending
    assert s.kv.reserved_bytes == 0 and s.kv.allocator.num_free == s.kv.allocator.num_blocks



def test_grid_shapes_shortest_context_first_on_the_grid():
    from engine.core.chunk_grid import grid_shapes

    shapes = grid_shapes(128, 512, 1024, 100)
    assert shapes[:4] == [(128, 128), (128, 256), (256, 256), (128, 384)]
    assert len(shapes) == 1 + 2 + 3 + 4 * 5 == len(set(shapes))  # contexts 128 ... 1024
    assert all(t % 128 == 0 and n % 128 == 0 and t <= min(n, 512) and n <= 1024 for t, n in shapes)
    assert grid_shapes(128, 512, 1024, 5) == shapes[:5]
    assert grid_shapes(128, 512, 100, 5) == [] and grid_shapes(128, 512, 1024, 0) == []
