"""Admission without Ray: replicas grouped by device (a shared device's memory is split), Retry-After from
the observed drain rate, the "no replicas" answer, and the placement options build_app gives Serve."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from hypothesis import given, settings, strategies as st

from deployments.admission.drain import DrainRate, retry_after_s
from deployments.admission.placement import HOST_DEVICE, DeviceKey, device_key, device_label, memory_share_bytes
from deployments.admission.queue import Admitter
from deployments.admission.state import AdmissionConfig, AdmissionLedger
from deployments.app import AppArgs
from deployments.messages import ReplicaCapacity, ReplicaReport
from deployments.replica.replica import build_report

KV_TOKEN = 512
STEP = 256
STEP_BYTES = KV_TOKEN * STEP
WEIGHTS = 10_000_000
BOUND = 1_000_000
CONFIG = AdmissionConfig(headroom=1.0, heartbeat_interval_s=1.0, replica_timeout_s=5.0, max_queue_len=4,
                         queue_timeout_s=5.0, retry_after_s=2.0, max_retry_after_s=30.0, drain_window_s=10.0)


def capacity(replica_id: str, node_id: str = "", device: str = HOST_DEVICE, steps: int = 200) -> ReplicaCapacity:
    """Alone on its device, `steps` cache steps of KV room (headroom 1.0); the engine's budget is as large.
    The default is large enough that half of the limit still holds the weights and bound."""
    limit = WEIGHTS + BOUND + steps * STEP_BYTES
    return ReplicaCapacity(replica_id, limit, WEIGHTS, KV_TOKEN, STEP, BOUND, kv_budget_bytes=limit,
                           max_model_len=1 << 16, node_id=node_id, device=device)


def ledger(*caps: ReplicaCapacity) -> AdmissionLedger:
    book = AdmissionLedger(CONFIG)
    for cap in caps:
        book.report(ReplicaReport(cap), now=0.0)
    return book


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# --- placement ---------------------------------------------------------------------------------------

def test_device_labels_and_share():
    assert device_label([]) == HOST_DEVICE and device_label(["1", "0"]) == "gpu:0,1"
    assert memory_share_bytes(10, 3) == 3 and memory_share_bytes(10, 0) == 10
    assert device_key("a", "n1", HOST_DEVICE) == DeviceKey("n1", HOST_DEVICE)
    assert device_key("a", "", HOST_DEVICE) != device_key("b", "", HOST_DEVICE)  # unknown node: alone
    assert [v.num_on_device for v in ledger(capacity("a"), capacity("b")).views(0.0)] == [1, 1]


def test_two_replicas_on_one_host_split_its_memory():
    alone = capacity("a", "n1")
    full = alone.memory_limit_bytes - WEIGHTS - BOUND
    half = alone.memory_limit_bytes // 2 - WEIGHTS - BOUND
    book = ledger(alone, capacity("b", "n2"))  # one per node: each may use its whole limit
    assert [v.kv_limit_bytes for v in book.views(0.0)] == [full, full]
    assert [v.num_on_device for v in book.views(0.0)] == [1, 1]
    book = ledger(alone, capacity("b", "n1"))  # an override put two on n1: each gets half
    views = book.views(0.0)
    assert [v.kv_limit_bytes for v in views] == [half, half]
    assert [(v.node_id, v.device, v.num_on_device) for v in views] == [("n1", HOST_DEVICE, 2)] * 2
    assert views[0].memory_share_bytes == alone.memory_limit_bytes // 2
    book.remove_replica("b")
    assert book.views(0.0)[0].kv_limit_bytes == full  # alone again: the whole host


def test_replicas_on_different_gpus_of_one_node_each_have_their_own():
    book = ledger(capacity("a", "n1", "gpu:0"), capacity("b", "n1", "gpu:1"), capacity("c", "n1", "gpu:1"))
    shares = {v.replica_id: v.num_on_device for v in book.views(0.0)}
    assert shares == {"a": 1, "b": 2, "c": 2}


def test_a_report_that_moves_a_replica_moves_its_share():
    book = ledger(capacity("a"), capacity("b", "n1"))  # "a" has not said where it runs: alone
    assert [v.num_on_device for v in book.views(0.0)] == [1, 1]
    book.report(ReplicaReport(capacity("a", "n1")), now=0.0)
    assert [v.num_on_device for v in book.views(0.0)] == [2, 2]
    book.report(ReplicaReport(capacity("a", "n1", "gpu:0")), now=0.0)
    assert [v.num_on_device for v in book.views(0.0)] == [1, 1]
    book.remove_replica("a")
    book.report(ReplicaReport(capacity("c", "n1")), now=0.0)
    assert [v.num_on_device for v in book.views(0.0)] == [2, 2]


def test_a_request_that_fits_the_host_but_not_a_share_never_fits_while_shared():
    book = ledger(capacity("a", "n1"), capacity("b", "n1"))
    half_steps = (capacity("a").memory_limit_bytes // 2 - WEIGHTS - BOUND) // STEP_BYTES
    assert 0 < half_steps < 200
    assert book.never_fits(1, (half_steps + 1) * STEP) is not None
    assert book.try_reserve("x", 1, half_steps * STEP, 0.0) is not None


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["n1", "n2"]), st.integers(1, 2000)), min_size=1, max_size=40))
def test_replicas_of_one_host_never_promise_more_than_the_host(requests):
    """Three replicas, two on n1: whatever arrives, the weights, bound and KV of n1's replicas fit n1's limit."""
    caps = [capacity("a", "n1"), capacity("b", "n1"), capacity("c", "n2")]
    book = ledger(*caps)
    for i, (_, tokens) in enumerate(requests):
        book.try_reserve(f"r{i}", tokens, tokens, 0.0)
    used = sum(WEIGHTS + BOUND + v.reserved_kv_bytes for v in book.views(0.0) if v.node_id == "n1")
    assert used <= caps[0].memory_limit_bytes


def test_report_carries_node_and_device():
    from engine import EngineStats

    stats = EngineStats(num_waiting=0, num_running=0, kv_reserved_bytes=0, kv_used_bytes=0, kv_budget_bytes=1 << 29,
                        kv_bytes_per_token=8, kv_cache_step=256, weights_bytes=0, memory_limit_bytes=1 << 30,
                        transient_bound_bytes=0, max_predicted_transient_bytes=0, max_measured_transient_bytes=0,
                        max_model_len=128, num_steps=0, num_forward_calls=0)
    report = build_report("r0", stats, {}, True, (), node_id="abc", device="gpu:0")
    assert (report.capacity.node_id, report.capacity.device) == ("abc", "gpu:0")


def test_placement_options():
    cpu = AppArgs().replica_deployment_options()
    assert cpu["max_replicas_per_node"] == 1
    gpu = AppArgs(replica={"num_gpus": 1}).replica_deployment_options()
    assert "max_replicas_per_node" not in gpu and gpu["ray_actor_options"]["num_gpus"] == 1
    two = AppArgs(replica={"max_replicas_per_node": 2}).replica_deployment_options()
    assert two["max_replicas_per_node"] == 2
    with pytest.raises(ValueError, match="max_replicas_per_node"):
        AppArgs(replica={"max_replicas_per_node": 0})


# --- Retry-After from the drain rate --------------------------------------------------------------------

def test_drain_rate_and_retry_after():
    rate = DrainRate(window_s=10.0, started_at=0.0)
    assert rate.per_s(5.0) is None
    for t in (1.0, 2.0, 3.0, 4.0):
        rate.record(t)
    assert rate.per_s(4.0) == pytest.approx(1.0)  # 4 releases in the 4 s since the start
    assert rate.per_s(12.0) == pytest.approx(0.3)  # the release at 1.0 left the window: 3 in 10 s
    assert rate.per_s(15.0) is None  # every release older than the window
    assert retry_after_s(5, 0.5, 2.0, 60.0) == 10.0
    assert retry_after_s(1, 100.0, 2.0, 60.0) == 1.0  # never below a second
    assert retry_after_s(1000, 1.0, 2.0, 60.0) == 60.0  # capped
    assert retry_after_s(3, None, 2.0, 60.0) == 2.0  # nothing drained: the configured constant


async def test_queue_full_retry_after_is_ahead_over_rate():
    clock = Clock()
    adm = Admitter(CONFIG.model_copy(update={"max_queue_len": 3}), clock=clock)
    adm.report(ReplicaReport(capacity("a", steps=1)))
    for i, t in enumerate((0.0, 2.0, 4.0, 6.0)):  # four requests served one after another: 4 releases in 8 s
        clock.now = t
        assert (await adm.reserve(f"done{i}", 10, 10)).outcome == "admitted"
        clock.now = t + 2.0
        adm.release(f"done{i}")
    clock.now = 8.0
    assert adm.stats().drain_rate_per_s == pytest.approx(0.5)
    await adm.reserve("busy", 10, 10)
    waiting = [asyncio.create_task(adm.reserve(f"w{i}", 10, 10)) for i in range(3)]
    await asyncio.sleep(0.01)
    full = await adm.reserve("x", 10, 10)
    assert full.reason == "queue_full" and full.retry_after_s == 8.0  # (3 waiting + itself) / 0.5 per s
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)


async def test_queue_timeout_retry_after_counts_its_position():
    clock = Clock()
    config = CONFIG.model_copy(update={"queue_timeout_s": 0.05})
    adm = Admitter(config, clock=clock)
    adm.report(ReplicaReport(capacity("a", steps=1)))
    for i in range(5):  # 5 releases in the 10 s window: 0.5 per s
        clock.now = 2.0 * i
        await adm.reserve(f"d{i}", 10, 10)
        adm.release(f"d{i}")
    await adm.reserve("busy", 10, 10)
    late = await asyncio.gather(*(adm.reserve(f"w{i}", 10, 10) for i in range(2)))
    assert [d.reason for d in late] == ["queue_timeout"] * 2
    # Each was first in line when it timed out (the one ahead had just left): 1 / 0.5 per s.
    assert [d.retry_after_s for d in late] == [2.0, 2.0]
    assert all(d.waited_s >= 0 for d in late)


async def test_no_replicas_is_answered_at_once_when_asked():
    adm = Admitter(CONFIG)
    decision = await adm.reserve("a", 10, 10, client_id="ingress-1", wait_for_replicas=False)
    assert (decision.outcome, decision.reason, decision.status_code) == ("rejected", "no_replicas", 503)
    queued = asyncio.create_task(adm.reserve("a", 10, 10, client_id="ingress-2"))  # waits for a replica
    await asyncio.sleep(0.01)
    assert not queued.done() and adm.num_waiting == 1
    adm.report(ReplicaReport(capacity("r")))
    granted = await asyncio.wait_for(queued, 1)
    assert granted.outcome == "admitted" and granted.reservation.replica_id == "r" and granted.waited_s >= 0
    counters = adm.stats().counters
    assert counters.num_no_replicas == 1
    assert counters.num_reserved_by_client == {"ingress-1": 1, "ingress-2": 1}


def test_report_answer_carries_the_queue():
    adm = Admitter(CONFIG)
    result = adm.report(ReplicaReport(capacity("r")))
    assert dataclasses.asdict(result)["num_waiting"] == 0


def test_retry_after_config_bounds():
    with pytest.raises(ValueError, match="max_retry_after_s"):
        AdmissionConfig(retry_after_s=10.0, max_retry_after_s=5.0)
