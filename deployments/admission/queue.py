"""Admitter: the AdmissionLedger plus a bounded FIFO queue of requests waiting for room. asyncio, no ray.

`reserve` answers at once when a replica has room and nobody waits; otherwise the request waits (FIFO:
a request never overtakes an older one, as in the engine's scheduler) until a release, a report or a
reclaim makes room, or until `queue_timeout_s`. Past `max_queue_len` waiters, or on timeout, it is
rejected with the configured status and a Retry-After computed from the observed drain rate
(deployments/admission/drain.py); a request no replica could ever hold is invalid (400) at once. With no
replica registered at all, a caller that asks (`wait_for_replicas=False`) is told so at once
("no_replicas"), so it can make Serve start one (scale from zero) instead of waiting unseen. Every state
change drains the queue head first. The Ray actor in deployments/admission/actor.py is a thin shell around
this class, so all of it is unit-tested without Ray.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Callable, Optional, Sequence

from deployments.admission.drain import DrainRate, retry_after_s
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
    enqueued_at: float = 0.0


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
    num_no_replicas: int = 0  # told "no replica registered" (the caller starts one: scale from zero)
    num_reserved_by_client: dict[str, int] = field(default_factory=dict)  # ingress replica id -> reserve calls


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
    drain_rate_per_s: Optional[float] = None  # releases per second over drain_window_s (None: none)


class Admitter:
    def __init__(self, config: AdmissionConfig, clock: Callable[[], float] = time.monotonic,
                 telemetry: Optional[Telemetry] = None) -> None:
        self.config = config
        self.ledger = AdmissionLedger(config)
        self.counters = AdmissionCounters()
        self._clock = clock
        self._telemetry = telemetry
        self._waiters: deque[_Waiter] = deque()
        self._drain = DrainRate(config.drain_window_s, clock())

    # --- requests ---------------------------------------------------------------------------------
    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      prefix_hashes: Sequence[int] = (), client_id: str = "",
                      wait_for_replicas: bool = True) -> AdmissionDecision:
        """`prefix_hashes`: the prompt's block hashes, for prefix affinity (AdmissionLedger.try_reserve);
        `client_id`: the calling ingress replica (counted); `wait_for_replicas=False`: with no replica
        registered, answer "no_replicas" at once instead of queueing."""
        prefix_hashes = tuple(prefix_hashes)
        by_client = self.counters.num_reserved_by_client
        by_client[client_id] = by_client.get(client_id, 0) + 1
        if not wait_for_replicas and self.ledger.num_replicas == 0:
            self.counters.num_no_replicas += 1
            self._record("rejected", "no_replicas")
            return AdmissionDecision("rejected", "no_replicas", "no engine replica is running",
                                     status_code=503, retry_after_s=self.config.retry_after_s)
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
            return self._rejected("queue_full", f"{len(self._waiters)} requests already wait for room",
                                  num_ahead=len(self._waiters) + 1)
        return await self._wait(_Waiter(request_id, num_prompt_tokens, max_tokens,
                                        asyncio.get_running_loop().create_future(), prefix_hashes,
                                        enqueued_at=self._clock()))

    async def _wait(self, waiter: _Waiter) -> AdmissionDecision:
        self._waiters.append(waiter)
        self.counters.num_queued += 1
        self._record("queued", "no_room")
        try:
            reservation = await asyncio.wait_for(asyncio.shield(waiter.future), self.config.queue_timeout_s)
        except asyncio.TimeoutError:
            if not waiter.future.done():
                position = self._position(waiter)
                waiter.future.cancel()
                self._remove(waiter)
                self.drain()  # the head may have changed
                return self._rejected("queue_timeout", f"no replica had room within "
                                                       f"{self.config.queue_timeout_s:g} s", num_ahead=position,
                                      waited_s=self._clock() - waiter.enqueued_at)
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
        return self._admitted(reservation, waited=True, waited_s=self._clock() - waiter.enqueued_at)

    def release(self, request_id: str) -> bool:
        """Idempotent: True if a reservation was held."""
        now = self._clock()
        released = self.ledger.release(request_id, now) is not None
        if released:
            self.counters.num_released += 1
            self._drain.record(now)
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
        return replace(result, num_waiting=self.num_waiting)

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

    def _position(self, waiter: _Waiter) -> int:
        """1 for the head of the queue, counting only live waiters."""
        live = [w for w in self._waiters if not w.future.done()]
        return live.index(waiter) + 1 if waiter in live else len(live) + 1

    def _remove(self, waiter: _Waiter) -> None:
        try:
            self._waiters.remove(waiter)
        except ValueError:
            pass

    @property
    def num_waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    # --- decisions --------------------------------------------------------------------------------
    def _admitted(self, reservation: Reservation, waited: bool, waited_s: float = 0.0) -> AdmissionDecision:
        self.counters.num_admitted += 1
        self.counters.num_admitted_after_wait += waited
        if reservation.num_prefix_blocks:
            self.counters.num_admitted_by_prefix += 1
            self.counters.num_prefix_blocks_matched += reservation.num_prefix_blocks
        reason = "after_wait" if waited else "prefix_affinity" if reservation.num_prefix_blocks else "room"
        self._record("admitted", reason)
        return AdmissionDecision("admitted", reason, reservation=reservation, waited_s=waited_s)

    def _rejected(self, reason: str, message: str, num_ahead: int, waited_s: float = 0.0) -> AdmissionDecision:
        self.counters.num_rejected[reason] = self.counters.num_rejected.get(reason, 0) + 1
        self._record("rejected", reason)
        return AdmissionDecision("rejected", reason, f"no engine replica has room: {message}",
                                 status_code=self.config.reject_status, retry_after_s=self.retry_after_s(num_ahead),
                                 waited_s=waited_s)

    def retry_after_s(self, num_ahead: int) -> float:
        """When `num_ahead` requests (the queue ahead, and this one) will have drained at the observed rate."""
        config = self.config
        return retry_after_s(num_ahead, self._drain.per_s(self._clock()), config.retry_after_s,
                             config.max_retry_after_s)

    def _record(self, outcome: str, reason: str) -> None:
        if self._telemetry is not None:
            self._telemetry.record_admission(outcome, reason)

    def stats(self, prometheus_url: Optional[str] = None) -> AdmissionStats:
        """A snapshot: counters, queue, the drain rate, and each replica as the model sees it."""
        now = self._clock()
        replicas = tuple(self.ledger.views(now))
        counters = replace(self.counters, num_rejected=dict(self.counters.num_rejected),
                           num_reserved_by_client=dict(self.counters.num_reserved_by_client))
        return AdmissionStats(
            num_replicas=self.ledger.num_replicas, num_reservations=self.ledger.num_reservations,
            num_waiting=self.num_waiting, reserved_kv_bytes=sum(r.reserved_kv_bytes for r in replicas),
            counters=counters, replicas=replicas, config=self.config, prometheus_url=prometheus_url,
            drain_rate_per_s=self._drain.per_s(now))
