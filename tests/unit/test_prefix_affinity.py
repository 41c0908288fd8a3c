"""Prefix affinity without Ray or MLX: the block hashes, the cache's summary of them, the controller's choice."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from deployments.admission.queue import Admitter
from deployments.admission.state import AdmissionConfig, AdmissionLedger
from deployments.messages import LiveRequest, ReplicaCapacity, ReplicaReport
from engine.core.prefix_cache import PrefixCache
from engine.core.prefix_hash import BLOCK_TOKENS, block_hashes, matched_blocks, summarize

B = BLOCK_TOKENS
STEP = 256
KV_TOKEN = 512
STEP_BYTES = STEP * KV_TOKEN
CONFIG = AdmissionConfig(headroom=1.0, max_prefix_hashes=64)
SYSTEM = list(range(1000, 1000 + 4 * B + 10))  # a shared system prompt: 4 full blocks and a bit


def capacity(replica_id: str, steps: int = 8) -> ReplicaCapacity:
    limit = 10_000_000 + steps * STEP_BYTES
    return ReplicaCapacity(replica_id, limit, 10_000_000, KV_TOKEN, STEP, 0, steps * STEP_BYTES, 4096)


def report(replica_id: str, cached: list[list[int]] = (), steps: int = 8, live=()) -> ReplicaReport:
    """A replica whose prefix cache holds `cached` (most recently used first)."""
    hashes = summarize((block_hashes(tokens) for tokens in cached), 4096)
    return ReplicaReport(capacity(replica_id, steps), live=tuple(live), prefix_hashes=hashes)


def prompt(suffix: int, system=SYSTEM) -> list[int]:
    return list(system) + list(range(50_000 + 100 * suffix, 50_000 + 100 * suffix + 30))


# --- the hashes ------------------------------------------------------------------------------------

def test_block_hashes_cover_full_blocks_and_chain_the_whole_prefix():
    tokens = list(range(3 * B + 5))
    hashes = block_hashes(tokens)
    assert len(hashes) == 3 and block_hashes(tokens[: 3 * B]) == hashes
    assert block_hashes(tokens[: B - 1]) == () and block_hashes(tokens, max_blocks=2) == hashes[:2]
    changed = [7] + tokens[1:]  # the first token differs: every later hash differs too (chained)
    assert all(a != b for a, b in zip(block_hashes(changed), hashes))
    later = tokens[: 2 * B] + [7] + tokens[2 * B + 1:]
    assert block_hashes(later)[:2] == hashes[:2] and block_hashes(later)[2] != hashes[2]
    assert block_hashes(list(range(B, 2 * B)))[0] != hashes[1]  # a block alone is not the chained hash


def test_hashes_are_the_same_in_another_process():
    """Never Python's hash(): the ingress, the controller and each replica are different processes."""
    tokens = list(range(5, 5 + 2 * B))
    code = "from engine.core.prefix_hash import block_hashes; print(block_hashes(list(range(5, 5 + 2 * %d))))" % B
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(block_hashes(tokens))


def test_matched_blocks_is_the_longest_held_prefix():
    hashes = block_hashes(prompt(0))
    assert matched_blocks(hashes, set(block_hashes(prompt(1)))) == 4  # the system prompt's 4 blocks
    assert matched_blocks(hashes, set(block_hashes(SYSTEM[: 2 * B]))) == 2
    assert matched_blocks(hashes, set()) == 0 and matched_blocks((), {1, 2}) == 0


def test_summarize_dedupes_keeps_order_and_the_bound():
    a, b = block_hashes(prompt(1)), block_hashes(prompt(2))  # the same 4 system blocks, then their own
    summary = summarize([a, b], 100)
    assert summary == a + b[4:] and len(set(summary)) == len(summary)
    assert summarize([a, b], 3) == a[:3]
    assert summarize([a, b], 0) == ()


def test_engine_cache_and_ingress_agree():
    """The engine hashes what it caches; the ingress hashes the prompt; both with one module."""
    cache = PrefixCache(max_bytes=1000)
    first, second = prompt(1), prompt(2)
    cache.insert(first + [9, 9, 9], (0,), 100)  # a finished request: prompt + outputs
    assert cache.block_hash_chains == (block_hashes(first + [9, 9, 9]),)
    cache.insert(list(range(7, 7 + 2 * B)), (0,), 100)
    held = set(summarize(cache.block_hash_chains, 4096))
    assert matched_blocks(block_hashes(second), held) == 4
    hit = cache.lookup(second)
    assert hit.num_tokens == len(SYSTEM)
    cache.unpin(hit)


def test_cache_chains_are_most_recently_used_first_and_follow_evictions():
    cache = PrefixCache(max_bytes=250)
    old, new = list(range(B)), list(range(100, 100 + B))
    cache.insert(old, (0,), 100)
    cache.insert(new, (0,), 100)
    assert cache.block_hash_chains == (block_hashes(new), block_hashes(old))
    cache.unpin(cache.lookup(old + [1]))  # a hit makes it the most recent
    assert cache.block_hash_chains[0] == block_hashes(old)
    cache.insert(list(range(300, 300 + B)), (0,), 100)  # evicts the least recently used: `new`
    assert block_hashes(new) not in cache.block_hash_chains and len(cache.block_hash_chains) == 2


# --- the controller's choice -----------------------------------------------------------------------

def ledger(*reports: ReplicaReport, config: AdmissionConfig = CONFIG) -> AdmissionLedger:
    book = AdmissionLedger(config)
    for r in reports:
        book.report(r, now=0.0)
    return book


def test_longest_cached_prefix_wins_over_more_room():
    book = ledger(report("a", [SYSTEM[: 2 * B]], steps=16), report("b", [prompt(1)], steps=4),
                  report("c", steps=32))
    reservation = book.try_reserve("q", len(prompt(2)), 10, 0.0, block_hashes(prompt(2)))
    assert reservation.replica_id == "b" and reservation.num_prefix_blocks == 4
    # Without hashes, or with a prompt nobody caches, the most room wins.
    assert book.try_reserve("r", 10, 10, 0.0).replica_id == "c"
    other = book.try_reserve("s", 300, 10, 0.0, block_hashes(list(range(7, 307))))
    assert other.replica_id == "c" and other.num_prefix_blocks == 0


def test_full_replica_falls_back_to_headroom():
    book = ledger(report("a", [prompt(1)], steps=2), report("b", steps=4), report("c", steps=8))
    hashes = block_hashes(prompt(2))
    first = book.try_reserve("1", len(prompt(2)), 200, 0.0, hashes)  # 2 steps: fills a
    assert first.replica_id == "a" and first.num_prefix_blocks == 4
    second = book.try_reserve("2", len(prompt(3)), 200, 0.0, block_hashes(prompt(3)))
    assert second.replica_id == "c" and second.num_prefix_blocks == 0  # a is full: most room
    book.release("1", now=1.0)
    assert book.try_reserve("3", len(prompt(4)), 200, 1.0, block_hashes(prompt(4))).replica_id == "a"


def test_a_busy_prefix_holder_loses_to_an_idle_replica():
    """Affinity yields to load: the holder may have at most prefix_max_imbalance more requests."""
    config = CONFIG.model_copy(update={"prefix_max_imbalance": 2})
    book = AdmissionLedger(config)
    for r in (report("a", [prompt(1)], steps=64), report("b", steps=64)):
        book.report(r, 0.0)
    placed = [book.try_reserve(f"q{i}", len(prompt(i + 2)), 10, 0.0, block_hashes(prompt(i + 2)))
              for i in range(6)]
    # a takes the hits while it holds at most 2 more than b; then b gets one, and a the next hit again.
    assert [r.replica_id for r in placed] == ["a", "a", "a", "b", "a", "b"]
    assert [r.num_prefix_blocks for r in placed] == [4, 4, 4, 0, 4, 0]


def test_reported_hashes_are_bounded_and_refreshed():
    many = [list(range(10_000 * i, 10_000 * i + 8 * B)) for i in range(20)]  # 160 distinct hashes
    book = ledger(report("a", many), config=AdmissionConfig(headroom=1.0, max_prefix_hashes=50))
    assert book.views(0.0)[0].num_prefix_hashes == 50
    # The newest entries are the ones kept: a prompt of the first (most recent) entry still matches.
    assert book.try_reserve("x", 8 * B, 1, 0.0, block_hashes(many[0])).num_prefix_blocks == 8
    assert book.try_reserve("y", 8 * B, 1, 0.0, block_hashes(many[-1])).num_prefix_blocks == 0
    book.report(report("a", []), now=1.0)  # its cache was evicted: nothing matches any more
    assert book.views(1.0)[0].num_prefix_hashes == 0


def test_zero_max_prefix_hashes_turns_affinity_off():
    book = ledger(report("a", [prompt(1)], steps=4), report("b", steps=8),
                  config=AdmissionConfig(max_prefix_hashes=0))
    assert book.try_reserve("q", len(prompt(2)), 10, 0.0, block_hashes(prompt(2))).replica_id == "b"


def test_config_bound_names_the_field():
    with pytest.raises(ValueError, match="max_prefix_hashes"):
        AdmissionConfig(max_prefix_hashes=10**6)
    with pytest.raises(ValueError, match="max_prefix_hashes"):
        AdmissionConfig(max_prefix_hashes=-1)


async def test_admitter_counts_affinity_and_waiters_keep_their_hashes():
    decisions = []

    class Telemetry:
        def record_admission(self, outcome, reason):
            decisions.append((outcome, reason))

    adm = Admitter(CONFIG.model_copy(update={"queue_timeout_s": 5.0}), telemetry=Telemetry())
    adm.report(report("a", [prompt(1)], steps=2))  # room for one prompt (2 steps) on each
    adm.report(report("b", steps=2, live=[LiveRequest("held", 2 * STEP_BYTES, 10)]))  # b is full
    first = await adm.reserve("1", len(prompt(2)), 10, block_hashes(prompt(2)))
    assert first.reason == "prefix_affinity" and first.reservation.replica_id == "a"
    waiting = asyncio.create_task(adm.reserve("2", len(prompt(3)), 10, block_hashes(prompt(3))))
    await asyncio.sleep(0.01)
    assert not waiting.done()  # a (which caches the prompt) and b are both full: it waits
    adm.release("held")  # b has room first: the waiter does not wait for a (fallback to room)
    granted = await asyncio.wait_for(waiting, 1)
    assert granted.reason == "after_wait" and granted.reservation.replica_id == "b"
    assert granted.reservation.num_prefix_blocks == 0
    counters = adm.stats().counters
    assert counters.num_admitted_by_prefix == 1 and counters.num_prefix_blocks_matched == 4
    assert decisions == [("admitted", "prefix_affinity"), ("queued", "no_room"), ("admitted", "after_wait")]
