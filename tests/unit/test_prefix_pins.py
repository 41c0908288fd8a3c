"""Prefix-cache hits pin their entries; a waiting request must never wait for ever on pinned entries
(its own hit, or the hits of requests behind it) when evicting them would give it room."""

from __future__ import annotations

from engine.core.kv_manager import KVManager
from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.scheduler import Scheduler, SchedulerConfig
from engine.core.types import FinishReason, Request, SamplingParams

SHAPE = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=1000, dtype_bytes=4)
STEP = 16


def scheduler(cache_fraction: float) -> tuple[Scheduler, KVManager]:
    memory = MemoryModel(SHAPE, kv_step=STEP)
    budget = 160 * memory.kv_bytes_per_token  # 10 blocks
    kv = KVManager(STEP, memory.kv_bytes_per_token, budget, int(cache_fraction * budget))
    return Scheduler(SchedulerConfig(8, 256, 256, 512), memory, kv), kv


def cache_prompt(s: Scheduler, tokens: list[int]) -> None:
    s.add(Request("a", tokens, SamplingParams(max_tokens=1)))
    out = s.schedule()
    s.update(out, {"a": 5})
    s.finish("a", FinishReason.LENGTH, num_kv_tokens=len(tokens))


def test_a_request_pinning_its_own_hit_is_admitted_once_the_pin_goes():
    s, kv = scheduler(0.25)
    prefix = list(range(1, 33))
    cache_prompt(s, prefix)
    assert kv.cached_bytes > 0
    # 132 prompt tokens + 10: 9 of the 10 blocks, which fit only with the cached (pinned) entry evicted
    request = Request("c", prefix + list(range(100, 200)), SamplingParams(max_tokens=10))
    s.add(request)
    assert request.num_cached_tokens == 32
    out = s.schedule()
    assert [c.request_id for c in out.prefills] == ["c"]
    assert request.num_cached_tokens == 0 and out.prefills[0].start == 0  # the prefix is recomputed
    assert kv.cached_bytes == 0


def test_a_head_is_not_kept_waiting_by_a_later_requests_pin():
    s, kv = scheduler(0.5)
    prefix = list(range(1, 81))
    cache_prompt(s, prefix)
    s.add(Request("b", list(range(500, 600)), SamplingParams(max_tokens=1)))  # 7 blocks, no hit
    s.add(Request("c", prefix + [999], SamplingParams(max_tokens=1)))  # pins a's entry
    out = s.schedule()
    assert "b" in [c.request_id for c in out.prefills]


def test_a_hit_is_kept_while_the_head_fits_beside_it():
    s, kv = scheduler(0.25)
    prefix = list(range(1, 33))
    cache_prompt(s, prefix)
    request = Request("c", prefix + [7, 8], SamplingParams(max_tokens=4))
    s.add(request)
    out = s.schedule()
    assert out.prefills[0].start == 32 and request.num_cached_tokens == 32


def test_a_row_with_logprobs_or_penalties_is_predicted_as_sampled():
    """The sampler sends the whole batch through its processing path for one such row."""
    s, _ = scheduler(0.0)
    for i, params in enumerate([SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, logprobs=1),
                                SamplingParams(max_tokens=4, temperature=1.0)]):
        s.add(Request(f"r{i}", [1, 2, 3], params))
    s.update(s.schedule(), {"r0": 1, "r1": 1, "r2": 1})
    plain = s.predict(("r0",), ())
    with_logprobs = s.predict(("r0", "r1"), ())
    sampled = s.predict(("r0", "r2"), ())
    assert with_logprobs == sampled > plain
