"""Admission accounting without Ray: reserve, release, reclaim, rebuild, choice by room, never-fits, queue."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from deployments.admission.queue import Admitter
from deployments.admission.state import AdmissionConfig, AdmissionLedger
from deployments.messages import LiveRequest, ReplicaCapacity, ReplicaReport
from engine.core.memory.model import MemoryModel, ModelShape
from engine.core.kv_manager import KVManager
from engine.core.scheduler import Scheduler, SchedulerConfig

KV_TOKEN = 512
STEP = 256
STEP_BYTES = KV_TOKEN * STEP  # 131072
WEIGHTS = 10_000_000
BOUND = 1_000_000


def capacity(replica_id: str, steps: int = 4, max_model_len: int = 4096, budget_slack: int = 0) -> ReplicaCapacity:
    """A replica whose modelled KV room (headroom 1.0) is `steps` cache steps."""
    limit = WEIGHTS + BOUND + steps * STEP_BYTES
    return ReplicaCapacity(replica_id, limit, WEIGHTS, KV_TOKEN, STEP, BOUND,
                           kv_budget_bytes=limit - WEIGHTS - BOUND + budget_slack, max_model_len=max_model_len)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


CONFIG = AdmissionConfig(headroom=1.0, heartbeat_interval_s=1.0, replica_timeout_s=5.0, max_queue_len=2,
                         queue_timeout_s=0.2)


def ledger(*caps: ReplicaCapacity, config: AdmissionConfig = CONFIG) -> AdmissionLedger:
    book = AdmissionLedger(config)
    for cap in caps:
        book.report(ReplicaReport(cap), now=0.0)
    return book


def test_reservation_is_the_engine_schedulers():
    shape = ModelShape(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=1000, dtype_bytes=4)
    memory = MemoryModel(shape, kv_step=STEP)
    scheduler = Scheduler(SchedulerConfig(4, 256, 128, 4096), memory,
                          KVManager(STEP, memory.kv_bytes_per_token, 1 << 30))
    cap = ReplicaCapacity("r", 1 << 31, 0, memory.kv_bytes_per_token, memory.kv_step, 0, 1 << 30, 4096)
    for prompt, max_tokens in [(1, 1), (1, 256), (1, 257), (200, 57), (200, 58), (1000, 3000)]:
        assert cap.reservation_bytes(prompt, max_tokens) == scheduler.reservation_bytes(prompt, max_tokens)


def test_reserve_fills_then_refuses_and_release_is_idempotent():
    book = ledger(capacity("a", steps=4))
    ids = [f"q{i}" for i in range(4)]
    for i in ids:
        assert book.try_reserve(i, 100, 100, now=1.0).kv_bytes == STEP_BYTES  # 199 tokens -> one step
    assert book.try_reserve("q4", 100, 100, now=1.0) is None
    assert book.try_reserve("q0", 100, 100, now=1.0).replica_id == "a"  # same id: same reservation
    assert book.release("q0", now=2.0) is not None
    assert book.release("q0", now=2.0) is None
    assert book.num_reservations == 3
    assert book.try_reserve("q4", 100, 100, now=2.0) is not None


def test_headroom_and_engine_budget_both_bound_the_room():
    cap = capacity("a", steps=10)
    book = ledger(cap, config=AdmissionConfig(headroom=0.9))
    room = int(cap.memory_limit_bytes * 0.9) - WEIGHTS - BOUND
    assert book.views(0.0)[0].kv_limit_bytes == room
    tight = capacity("b", steps=10, budget_slack=-8 * STEP_BYTES)  # the engine's own budget: 2 steps
    book = ledger(tight)
    assert book.try_reserve("x", 1, STEP, 0.0) and book.try_reserve("y", 1, STEP, 0.0)
    assert book.try_reserve("z", 1, STEP, 0.0) is None


def test_choice_by_room_then_queued_tokens():
    book = ledger(capacity("a", steps=8), capacity("b", steps=4))
    assert book.try_reserve("1", 10, 10, 0.0).replica_id == "a"  # a has more room
    book = ledger(capacity("a", steps=4), capacity("b", steps=4))
    first = book.try_reserve("1", 10, 10, 0.0).replica_id
    second = book.try_reserve("2", 10, 10, 0.0).replica_id
    assert {first, second} == {"a", "b"}
    # Equal room on both; b holds more queued tokens (same bytes): the next goes to a.
    book = ledger(capacity("a", steps=4), capacity("b", steps=4))
    book.report(ReplicaReport(capacity("a", 4), live=(LiveRequest("x", STEP_BYTES, 10),)), 0.0)
    book.report(ReplicaReport(capacity("b", 4), live=(LiveRequest("y", STEP_BYTES, 200),)), 0.0)
    assert book.try_reserve("z", 1, 1, 0.0).replica_id == "a"


def test_never_fits():
    book = ledger(capacity("a", steps=2, max_model_len=1024), capacity("b", steps=4, max_model_len=512))
    assert "max_model_len=1024" in book.never_fits(1000, 100)
    assert "more than any replica" in book.never_fits(600, 400)  # 999 tokens: 4 steps, a holds 2
    assert book.never_fits(300, 200) is None  # fits on b
    assert AdmissionLedger(CONFIG).never_fits(10**6, 1) is None  # no replicas yet: they may be starting


def test_reclaim_silent_replica_and_explicit_removal():
    book = ledger(capacity("a"), capacity("b"))
    book.try_reserve("1", 10, 10, 0.0)
    book.try_reserve("2", 10, 10, 0.0)
    book.report(ReplicaReport(capacity("a"), live=tuple(LiveRequest(i, STEP_BYTES, 20) for i in ("1", "2")
                                                        if book.get(i).replica_id == "a")), now=4.0)
    assert book.reclaim(now=5.5) == {"b": 1}
    assert book.num_replicas == 1 and book.num_reservations == 1
    assert book.remove_replica("a") == 1 and book.num_reservations == 0
    assert book.release("1", now=6.0) is None  # the ingress's release after a reclaim is a no-op


def test_unhealthy_and_gone_replicas_stay_out():
    book = ledger(capacity("a"), capacity("b"))
    book.try_reserve("1", 10, 10, 0.0)
    owner = book.get("1").replica_id
    assert book.report(ReplicaReport(capacity(owner), healthy=False), now=1.0).ignored
    assert book.get("1") is None and book.num_replicas == 1  # a hung engine: dropped, reclaimed
    other = "b" if owner == "a" else "a"
    assert book.remove_replica(other, ignore_until=10.0) == 0
    assert book.report(ReplicaReport(capacity(other)), now=2.0).ignored  # Serve said it is gone
    assert book.num_replicas == 0 and book.try_reserve("2", 10, 10, 2.0) is None
    book.reclaim(now=10.5)
    assert book.report(ReplicaReport(capacity(other)), now=10.5).registered  # the tombstone expired


def test_rebuild_from_reports_without_double_counting():
    book = AdmissionLedger(CONFIG)  # a restarted controller: empty
    live = (LiveRequest("1", STEP_BYTES, 20), LiveRequest("2", 2 * STEP_BYTES, 300))
    result = book.report(ReplicaReport(capacity("a"), live=live), now=0.0)
    assert result.registered and result.num_adopted == 2
    assert book.report(ReplicaReport(capacity("a"), live=live), now=1.0).num_adopted == 0
    assert book.views(1.0)[0].reserved_kv_bytes == 3 * STEP_BYTES
    assert book.release("1", now=1.5) is not None
    stale = book.report(ReplicaReport(capacity("a"), live=live), now=1.6)  # sent before the release
    assert stale.num_adopted == 0 and book.views(1.6)[0].reserved_kv_bytes == 2 * STEP_BYTES
    book.report(ReplicaReport(capacity("a"), live=()), now=2.0)  # "2" finished on the replica
    assert book.num_reservations == 0


def test_pending_reservation_survives_reports_until_the_grace():
    book = ledger(capacity("a"))
    book.try_reserve("p", 10, 10, now=0.0)
    book.report(ReplicaReport(capacity("a")), now=1.0)  # not arrived yet
    assert book.get("p") is not None
    book.report(ReplicaReport(capacity("a")), now=5.5)  # older than replica_timeout_s: never arrived
    assert book.get("p") is None


def test_peak_over_the_bound_shrinks_the_limit():
    book = ledger(capacity("a", steps=4))
    result = book.report(ReplicaReport(capacity("a"), max_measured_transient_bytes=BOUND + STEP_BYTES), 1.0)
    assert result.peak_exceeded and result.excess_bytes == STEP_BYTES
    assert not book.report(ReplicaReport(capacity("a"), max_measured_transient_bytes=BOUND + 10), 2.0).peak_exceeded
    view = book.views(2.0)[0]
    assert view.peak_exceeded and view.kv_limit_bytes == 3 * STEP_BYTES and view.num_peak_exceeded == 1


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "release", "report"]), st.integers(0, 9),
                          st.integers(1, 600)), max_size=60))
def test_never_over_the_limit_and_sums_consistent(ops):
    book = ledger(capacity("a", steps=6), capacity("b", steps=3))
    held: dict[str, str] = {}
    for t, (op, n, tokens) in enumerate(ops):
        request_id = f"r{n}"
        if op == "reserve":
            r = book.try_reserve(request_id, tokens, tokens, now=t * 0.01)
            if r is not None:
                held[request_id] = r.replica_id
        elif op == "release":
            book.release(request_id, now=t * 0.01)
            held.pop(request_id, None)
        else:
            live = tuple(LiveRequest(i, book.get(i).kv_bytes, 1) for i, rep in held.items() if rep == "a")
            book.report(ReplicaReport(capacity("a", steps=6), live=live), now=t * 0.01)
        for view in book.views(t * 0.01):
            assert view.reserved_kv_bytes <= view.kv_limit_bytes
        assert book.num_reservations == len(held)


# --- the queue (asyncio, no Ray) -------------------------------------------------------------------

def admitter(*caps: ReplicaCapacity, **overrides) -> Admitter:
    config = CONFIG.model_copy(update=overrides)
    adm = Admitter(config)
    for cap in caps:
        adm.report(ReplicaReport(cap))
    return adm


async def test_queue_waits_for_a_release_in_fifo_order():
    adm = admitter(capacity("a", steps=1), queue_timeout_s=5.0)
    assert (await adm.reserve("1", 10, 10)).outcome == "admitted"
    second = asyncio.create_task(adm.reserve("2", 10, 10))
    third = asyncio.create_task(adm.reserve("3", 10, 10))
    await asyncio.sleep(0.01)
    assert adm.num_waiting == 2 and not second.done()
    adm.release("1")
    decision = await asyncio.wait_for(second, 1)
    assert decision.outcome == "admitted" and decision.reason == "after_wait"
    assert not third.done()
    adm.release("2")
    assert (await asyncio.wait_for(third, 1)).outcome == "admitted"
    assert adm.counters.num_queued == 2 and adm.counters.num_admitted == 3


async def test_queue_timeout_and_queue_bound_reject_with_retry_after():
    adm = admitter(capacity("a", steps=1), reject_status=429, retry_after_s=3.0)
    await adm.reserve("1", 10, 10)
    waiting = [asyncio.create_task(adm.reserve(f"w{i}", 10, 10)) for i in range(2)]
    await asyncio.sleep(0.01)
    full = await adm.reserve("x", 10, 10)  # max_queue_len=2
    assert (full.outcome, full.reason, full.status_code, full.retry_after_s) == ("rejected", "queue_full", 429, 3.0)
    timed_out = await asyncio.gather(*waiting)
    assert [d.reason for d in timed_out] == ["queue_timeout"] * 2 and adm.num_waiting == 0
    assert adm.ledger.num_reservations == 1


async def test_never_fits_is_invalid_at_once_and_cancel_leaves_nothing():
    adm = admitter(capacity("a", steps=1, max_model_len=100), queue_timeout_s=5.0)
    invalid = await adm.reserve("big", 90, 20)
    assert invalid.outcome == "invalid" and invalid.status_code == 400
    await adm.reserve("1", 10, 10)
    task = asyncio.create_task(adm.reserve("2", 10, 10))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert adm.num_waiting == 0
    adm.release("1")
    assert adm.ledger.num_reservations == 0


async def test_reap_and_replica_failure_make_room_for_waiters():
    clock = Clock()
    adm = Admitter(CONFIG.model_copy(update={"queue_timeout_s": 5.0}), clock=clock)
    adm.report(ReplicaReport(capacity("a", steps=1)))
    await adm.reserve("1", 10, 10)
    waiting = asyncio.create_task(adm.reserve("2", 10, 10))
    await asyncio.sleep(0.01)
    clock.now = 1.0
    adm.report(ReplicaReport(capacity("b", steps=1)))  # a new replica registers: the waiter gets it
    assert (await asyncio.wait_for(waiting, 1)).reservation.replica_id == "b"
    clock.now = 6.5  # a and b silent since 0.0 / 1.0: both reclaimed
    assert adm.reap() == 2 and adm.ledger.num_replicas == 0
    adm.report(ReplicaReport(capacity("c", steps=1)))
    await adm.reserve("3", 10, 10)
    assert adm.replica_failed("c") == 1
    assert adm.stats().counters.num_reclaimed == 3


async def test_peak_exceeded_is_counted_and_reported_to_telemetry():
    calls = []

    class Telemetry:
        def record_peak_exceeded(self, replica):
            calls.append(("peak", replica))

        def record_admission(self, outcome, reason):
            calls.append((outcome, reason))

    adm = Admitter(CONFIG, telemetry=Telemetry())
    adm.report(ReplicaReport(capacity("a", steps=2), max_measured_transient_bytes=BOUND + 1))
    await adm.reserve("1", 10, 10)
    assert ("peak", "a") in calls and ("admitted", "room") in calls
    assert adm.stats().counters.num_peak_exceeded == 1
    assert adm.stats().replicas[0].peak_exceeded


def test_config_bounds():
    with pytest.raises(ValueError, match="replica_timeout_s"):
        AdmissionConfig(heartbeat_interval_s=2.0, replica_timeout_s=3.0)
    with pytest.raises(ValueError):
        AdmissionConfig(headroom=1.5)
    with pytest.raises(ValueError):
        AdmissionConfig(reject_status=500)


def test_admission_keeps_the_floor_step_not_the_bound_beside_the_kv():
    """A replica whose engine reports its floor step: KV may take what the weights and the floor leave
    (capped at the engine's budget), not what the bound leaves."""
    floor = BOUND // 4
    limit = WEIGHTS + BOUND + 4 * STEP_BYTES
    cap = ReplicaCapacity("r", limit, WEIGHTS, KV_TOKEN, STEP, BOUND, kv_budget_bytes=1 << 30,
                          max_model_len=4096, floor_transient_bytes=floor)
    book = ledger(cap)
    assert book.views(0.0)[0].kv_limit_bytes == limit - WEIGHTS - floor
    without = ledger(capacity("b"))
    assert without.views(0.0)[0].kv_limit_bytes == 4 * STEP_BYTES  # no floor reported: the bound


def test_routes_by_live_headroom_between_replicas_of_equal_room():
    """Two replicas with the same room in the ledger: the one whose engine reports less KV allocated and a
    smaller last step gets the request; a report that changes that changes the choice."""
    book = ledger(capacity("a", steps=8), capacity("b", steps=8))
    book.report(ReplicaReport(capacity("a", steps=8), kv_allocated_bytes=6 * STEP_BYTES,
                              planned_transient_bytes=BOUND), now=0.0)
    book.report(ReplicaReport(capacity("b", steps=8), kv_allocated_bytes=STEP_BYTES), now=0.0)
    views = {v.replica_id: v for v in book.views(0.0)}
    assert views["b"].live_headroom_bytes > views["a"].live_headroom_bytes
    assert book.try_reserve("x", 10, 10, now=0.0).replica_id == "b"
    book.release("x", now=0.0)
    book.report(ReplicaReport(capacity("b", steps=8), kv_allocated_bytes=8 * STEP_BYTES,
                              planned_transient_bytes=BOUND), now=0.0)
    book.report(ReplicaReport(capacity("a", steps=8)), now=0.0)
    assert book.try_reserve("y", 10, 10, now=0.0).replica_id == "a"
