"""Admitter: the AdmissionLedger plus a bounded FIFO queue of requests waiting for room. asyncio, no ray.

`reserve` answers at once when a replica has room and nobody waits; otherwise the request waits (FIFO:
a request never overtakes an older one, as in the engine's scheduler) until a release, a report or a
reclaim makes room, or until `queue_timeout_s`. Past `max_queue_len` waiters, or on timeout, it is
rejected with the configured status and Retry-After; a request no replica could ever hold is invalid
(400) at once. Every state change drains the queue head first. The Ray actor in deployments/admission/actor.py
is a thin shell around this class, so all of it is unit-tested without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from deployments.admission.state import AdmissionConfig, AdmissionLedger, ReplicaView, ReportResult
from deployments.messages import AdmissionDecision, ReplicaReport, Reservation
from deployments.telemetry.metrics import Telemetry

logger = logging.getLogger(__name__)

GONE_TTL_FACTOR = 6  # a replica reported gone is ignored for this many replica_timeout_s


@dataclass
class _Waiter:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    future: asyncio.Future
    prefix_hashes: tuple[int, ...] = ()


@dataclass
class AdmissionCounters:
    """Monotonic counts since the controller (re)started, for stats() and telemetry."""

    num_admitted: int = 0
    num_admitted_after_wait: int = 0
    num_queued: int = 0
    num_rejected: dict[str, int] = field(default_factory=dict)  # reason -> count
    num_invalid: int = 0
    num_released: int = 0
    num_reclaimed: int = 0  # reservations dropped with a dead / silent replica
    num_adopted: int = 0  # reservations rebuilt from replica reports
    num_peak_exceeded: int = 0
    num_admitted_by_prefix: int = 0  # sent to a replica that reported caching a prefix of the prompt
    num_prefix_blocks_matched: int = 0  # over those, prompt blocks (engine/core/prefix_hash.py) it held


@dataclass(frozen=True)
class AdmissionStats:
    """The controller's state (AdmissionController.stats): counters, queue, each replica as modelled."""

    num_replicas: int
    num_reservations: int
    num_waiting: int
    reserved_kv_bytes: int
    counters: AdmissionCounters
    replicas: tuple[ReplicaView, ...]
    config: AdmissionConfig
    prometheus_url: Optional[str] = None  # where the controller's process serves /metrics (None: nowhere)


class Admitter:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic,
                 telemetry: Optional[Telemetry] = None) -> None:
        self.config = config
        self.ledger = AdmissionLedger(config)
        self.counters = AdmissionCounters()
        self._clock = clock
        self._telemetry = telemetry
        self._waiters: deque[_Waiter] = deque()

    # --- requests ---------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      prefix_hashes: Sequence[int] = ()) -> AdmissionDecision:
        """`prefix_hashes`: the prompt's block hashes, for prefix affinity (AdmissionLedger.try_reserve)."""
        prefix_hashes = tuple(prefix_hashes)
        why = self.ledger.never_fits(num_prompt_tokens, max_tokens)
        if why is not None:
            self.counters.num_invalid += 1
            self._record("rejected", "never_fits")
            return AdmissionDecision("invalid", "never_fits", why, status_code=400)
        if not self._waiters:
            reservation = self.ledger.try_reserve(request_id, num_prompt_tokens, max_tokens, self._clock(),
                                                  prefix_hashes)
            if reservation is not None:
                return self._admitted(reservation, waited=False)
        if len(self._waiters) >= self.config.max_queue_len:
            return self._rejected("queue_full", f"{len(self._waiters)} requests already wait for room")
        return await self._wait(_Waiter(request_id, num_prompt_tokens, max_tokens,
                                        asyncio.get_running_loop().create_future(), prefix_hashes))

    async def _wait(self, waiter: _Waiter) -> AdmissionDecision:
        self._waiters.append(waiter)
        self.counters.num_queued += 1
        self._record("queued", "no_room")
        try:
            reservation = await asyncio.wait_for(asyncio.shield(waiter.future), self.config.queue_timeout_s)
        except asyncio.TimeoutError:
            if not waiter.future.done():
                waiter.future.cancel()
                self._remove(waiter)
                self.drain()  # the head may have changed
                return self._rejected("queue_timeout", f"no replica had room within "
                                                       f"{self.config.queue_timeout_s:g} s")
            reservation = waiter.future.result()
        except asyncio.CancelledError:  # the caller went away: give back what it may have been granted
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.request_id)
            else:
                waiter.future.cancel()
                self._remove(waiter)
                self.drain()
            raise
        if isinstance(reservation, AdmissionDecision):  # the request became impossible while waiting
            return reservation
        return self._admitted(reservation, waited=True)

    def release(self, request_id: str) -> bool:
        """Idempotent: True if a reservation was held."""
        released = self.ledger.release(request_id, self._clock()) is not None
        if released:
            self.counters.num_released += 1
            self.drain()
        return released

    # --- replicas ---------------------------------------------------------------------------------
    def report(self, report: ReplicaReport) -> ReportResult:
        result = self.ledger.report(report, self._clock())
        if result.ignored:
            logger.debug("report of replica %s ignored (unhealthy or reported gone)", result.replica_id)
        self.counters.num_adopted += result.num_adopted
        if result.registered:
            logger.info("replica %s registered (%d requests adopted)", result.replica_id, result.num_adopted)
        if result.peak_exceeded:
            self.counters.num_peak_exceeded += 1
            logger.warning("replica %s measured a transient peak %d bytes over its modelled bound; its "
                           "limit is reduced by that much", result.replica_id, result.excess_bytes)
            if self._telemetry is not None:
                self._telemetry.record_peak_exceeded(result.replica_id)
        self.drain()
        return result

    def replica_failed(self, replica_id: str) -> int:
        """A caller saw the replica die, or Serve's router dropped it: reclaim now instead of waiting for
        its heartbeat to time out, and ignore its reports for a while (a draining replica still reports)."""
        until = self._clock() + GONE_TTL_FACTOR * self.config.replica_timeout_s
        return self._reclaim({replica_id: self.ledger.remove_replica(replica_id, ignore_until=until)})

    def reap(self) -> int:
        """Reclaim silent replicas; call every heartbeat interval. Returns reservations reclaimed."""
        return self._reclaim(self.ledger.reclaim(self._clock()))

    def _reclaim(self, reclaimed: dict[str, int]) -> int:
        for replica_id, count in reclaimed.items():
            logger.warning("replica %s dropped; %d reservations reclaimed", replica_id, count)
        total = sum(reclaimed.values())
        self.counters.num_reclaimed += total
        if reclaimed:
            self.drain()
        return total

    # --- the queue --------------------------------------------------------------------------------
    def drain(self) -> None:
        """Grant waiters in order while the head fits; fail those that can no longer ever fit."""
        while self._waiters:
            head = self._waiters[0]
            if head.future.done():
                self._waiters.popleft()
                continue
            why = self.ledger.never_fits(head.num_prompt_tokens, head.max_tokens)
            if why is not None:  # e.g. a replica's limit shrank after a peak: fail it, do not block
                self._waiters.popleft()
                self.counters.num_invalid += 1
                head.future.set_result(AdmissionDecision("invalid", "never_fits", why, status_code=400))
                continue
            reservation = self.ledger.try_reserve(head.request_id, head.num_prompt_tokens, head.max_tokens,
                                                  self._clock(), head.prefix_hashes)
            if reservation is None:
                return
            self._waiters.popleft()
            head.future.set_result(reservation)

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    # --- decisions --------------------------------------------------------------------------------
    def _admitted(self, reservation: Reservation, waited: bool) -> AdmissionDecision:
        self.counters.num_admitted += 1
        self.counters.num_admitted_after_wait += waited
        if reservation.num_prefix_blocks:
            self.counters.num_admitted_by_prefix += 1
            self.counters.num_prefix_blocks_matched += reservation.num_prefix_blocks
        reason = "after_wait" if waited else "prefix_affinity" if reservation.num_prefix_blocks else "room"
        self._record("admitted", reason)
        return AdmissionDecision("admitted", reason, reservation=reservation)

    def _rejected(self, reason: str, message: str) -> AdmissionDecision:
        self.counters.num_rejected[reason] = self.counters.num_rejected.get(reason, 0) + 1
        self._record("rejected", reason)
        return AdmissionDecision("rejected", reason, f"no engine replica has room: {message}",
                                 status_code=self.config.reject_status, retry_after_s=self.config.retry_after_s)

    def _record(self, outcome: str, reason: str) -> None:
        if self._telemetry is not None:
            self._telemetry.record_admission(outcome, reason)

    def stats(self, prometheus_url: Optional[str] = None) -> AdmissionStats:
        """A snapshot: counters, queue, and each replica as the model sees it."""
        replicas = tuple(self.ledger.views(self._clock()))
        return AdmissionStats(
            num_replicas=self.ledger.num_replicas, num_reservations=self.ledger.num_reservations,
            num_waiting=self.num_waiting, reserved_kv_bytes=sum(r.reserved_kv_bytes for r in replicas),
            counters=replace(self.counters, num_rejected=dict(self.counters.num_rejected)),
            replicas=replicas, config=self.config, prometheus_url=prometheus_url)
