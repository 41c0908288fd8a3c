"""Cluster-wide admission accounting, pure: no ray, no mlx, no asyncio (deployments/admission/actor.py wraps it).

Each engine replica is modelled as

    weights + sum(reserved KV) + floor transient  <=  memory_limit x headroom - excess

where a request reserves KV for prompt + max_tokens - 1 tokens rounded up to the cache step (exactly what
engine/core/scheduler.py reserves), the floor transient is the memory model's smallest step that makes
progress (the engine sizes every step to the memory its KV leaves free, docs/memory.md; an engine that
reports no floor is modelled with its transient bound), and `excess` is how far the replica's measured
transient peak has gone over the bound (a replica whose model under-predicts is given less). The
reserved KV is also kept within the engine's own KV budget, so the controller never admits what the
engine would make wait. Among replicas with the same room, the one with the most live headroom wins:
memory limit x headroom - weights - its KV (the larger of its pool and the ledger's reservations) - the
transient of its last step, as reported by heartbeat (a replica whose pool has grown takes smaller
steps). The room decides first: a pool never shrinks, so its size says more about the past than about
the KV free in it.

Replicas report (`ReplicaReport`) every heartbeat: their capacity and the requests they hold. A report is
also a registration, so a restarted controller rebuilds its state from the next round of reports:
requests a replica holds that the ledger does not know are adopted with the replica's bytes, requests the
ledger holds that the replica no longer has are dropped once the replica has been seen holding them (it
finished them) or once they are older than the grace period (they never arrived). Releases are keyed by
request id and idempotent; recently released ids are remembered so a report sent before a release does
not bring the request back.

Prefix affinity: a report also carries a bounded summary of the replica's prefix cache (chained block
hashes, engine/core/prefix_hash.py), and a request may come with its prompt's hashes. Among the replicas with
room, the one holding the longest prefix of the prompt wins; without a match, the most room wins.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field, model_validator

from engine.core.prefix_hash import MAX_SUMMARY_HASHES, matched_blocks

from deployments.admission.placement import HOST_DEVICE, DeviceKey, device_key, memory_share_bytes
from deployments.messages import LiveRequest, ReplicaCapacity, ReplicaReport, Reservation


class AdmissionConfig(BaseModel):
    """`admission:` of AppArgs: the cluster-level admission controller."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = Field(True, description="Admit every request against the replicas' memory model before "
                                            "routing it; off: Serve's default routing, engines queue alone.")
    headroom: float = Field(0.95, gt=0.0, le=1.0, description="Fraction of each replica's memory limit the "
                                                              "controller fills (weights + KV + transient).")
    max_queue_len: int = Field(256, ge=0, le=1 << 20, description="Requests waiting for room in the "
                                                                   "controller; more are rejected at once.")
    queue_timeout_s: float = Field(30.0, ge=0.0, le=3600.0, description="Longest wait for room before the "
                                                                        "request is rejected.")
    reject_status: Literal[503, 429] = Field(503, description="HTTP status of a request rejected for lack "
                                                              "of room (with Retry-After).")
    retry_after_s: float = Field(1.0, gt=0.0, le=3600.0, description="Retry-After of a rejected request "
                                 "while no request has finished within drain_window_s (no drain rate to go by).")
    max_retry_after_s: float = Field(60.0, gt=0.0, le=3600.0, description="Largest Retry-After: the one "
                                     "computed from the drain rate (requests ahead / releases per second) is "
                                     "capped here.")
    drain_window_s: float = Field(30.0, gt=0.0, le=3600.0, description="Releases of the last this many "
                                  "seconds give the drain rate behind Retry-After.")
    heartbeat_interval_s: float = Field(1.0, gt=0.0, le=60.0, description="Seconds between the replicas' "
                                                                          "reports to the controller.")
    replica_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="A replica silent this long is "
                                                                         "dropped and its reservations "
                                                                         "reclaimed.")
    idle_shutdown_s: float = Field(600.0, ge=0.0, description="The detached controller exits after this "
                                                              "long without replicas or calls (0: never).")
    max_prefix_hashes: int = Field(256, ge=0, le=MAX_SUMMARY_HASHES, description="Prefix-cache block "
                                   "hashes (64 tokens each) a replica reports per heartbeat, most recently "
                                   "used first; routing prefers the replica holding the longest prefix of a "
                                   "prompt. 0: no prefix affinity, room alone decides.")
    prefix_max_imbalance: int = Field(4, ge=0, description="Prefix affinity applies to a replica holding at "
                                      "most this many more requests than the least busy one with room; "
                                      "busier, room decides (as Ray Serve LLM's prefix-aware router does).")

    @model_validator(mode="after")
    def _timing(self) -> "AdmissionConfig":
        if self.replica_timeout_s <= 2 * self.heartbeat_interval_s:
            raise ValueError(f"replica_timeout_s={self.replica_timeout_s} must be > 2 x "
                             f"heartbeat_interval_s={self.heartbeat_interval_s}")
        if self.retry_after_s > self.max_retry_after_s:
            raise ValueError(f"retry_after_s={self.retry_after_s} must be <= "
                             f"max_retry_after_s={self.max_retry_after_s}")
        return self


@dataclass(frozen=True)
class ReportResult:
    replica_id: str
    registered: bool  # first report of this replica (or first since it was dropped)
    num_adopted: int
    num_dropped: int
    peak_exceeded: bool  # the measured transient went over the modelled bound further than before
    excess_bytes: int
    ignored: bool = False  # an unhealthy replica, or one reported gone (dropped, not registered)
    num_waiting: int = 0  # requests in the controller's queue (the replica's autoscaling metric)


@dataclass
class _Entry:
    reservation: Reservation
    created_at: float
    seen_live: bool = False


@dataclass
class _Replica:
    capacity: ReplicaCapacity
    last_seen: float
    entries: dict[str, _Entry] = field(default_factory=dict)
    excess_bytes: int = 0
    max_measured_transient_bytes: int = 0
    engine_kv_reserved_bytes: int = 0
    engine_kv_used_bytes: int = 0
    kv_allocated_bytes: int = 0
    planned_transient_bytes: int = 0
    num_peak_exceeded: int = 0
    prefix_hashes: frozenset[int] = frozenset()

    @property
    def reserved_bytes(self) -> int:
        return sum(e.reservation.kv_bytes for e in self.entries.values())

    @property
    def queued_tokens(self) -> int:
        return sum(e.reservation.num_tokens for e in self.entries.values())

    def kv_limit_bytes(self, headroom: float, num_on_device: int = 1) -> int:
        """KV this replica may hold in all: the modelled room within its share of the device, never more
        than the engine's budget."""
        c = self.capacity
        share = memory_share_bytes(c.memory_limit_bytes, num_on_device)
        modelled = int(share * headroom) - self.excess_bytes - c.weights_bytes - c.reserved_transient_bytes
        return min(modelled, c.kv_budget_bytes)

    def live_headroom_bytes(self, headroom: float, extra_kv_bytes: int = 0, num_on_device: int = 1) -> int:
        """Memory free beside the KV (the engine's pool, or the ledger's reservations plus
        `extra_kv_bytes` where larger) and the transient of the replica's last step, within its share."""
        c = self.capacity
        kv = max(self.kv_allocated_bytes, self.reserved_bytes + extra_kv_bytes)
        share = memory_share_bytes(c.memory_limit_bytes, num_on_device)
        return int(share * headroom) - self.excess_bytes - c.weights_bytes - kv \
            - max(self.planned_transient_bytes, c.reserved_transient_bytes)


@dataclass(frozen=True)
class ReplicaView:
    """One replica as the controller models it (stats)."""

    replica_id: str
    num_reservations: int
    reserved_kv_bytes: int
    kv_limit_bytes: int
    queued_tokens: int
    memory_limit_bytes: int
    weights_bytes: int
    transient_bound_bytes: int
    max_measured_transient_bytes: int
    excess_bytes: int
    live_headroom_bytes: int
    peak_exceeded: bool
    num_peak_exceeded: int
    engine_kv_reserved_bytes: int
    engine_kv_used_bytes: int
    seconds_since_report: float
    request_ids: tuple[str, ...]
    num_prefix_hashes: int = 0
    node_id: str = ""
    device: str = HOST_DEVICE
    num_on_device: int = 1  # engine replicas on its device (node, GPU) sharing its memory
    memory_share_bytes: int = 0  # its share of the device: memory_limit_bytes / num_on_device
    reserved_transient_bytes: int = 0  # the transient kept beside the KV (the floor step, else the bound)


def _device_of(replica: _Replica) -> DeviceKey:
    c = replica.capacity
    return device_key(c.replica_id, c.node_id, c.device)


class AdmissionLedger:
    """Replicas, their reservations, and the choice of a replica for a new request."""

    def __init__(self, config: AdmissionConfig) -> None:
        self.config = config
        self._replicas: dict[str, _Replica] = {}
        self._owner: dict[str, str] = {}  # request_id -> replica_id
        self._released: dict[str, float] = {}  # request_id -> when; not re-adopted from late reports
        self._gone: dict[str, float] = {}  # replica_id -> until when its reports are ignored
        self._num_on_device: Counter[DeviceKey] = Counter()  # kept with _replicas: a lookup per replica

    # --- requests ---------------------------------------------------------------------------------
    def never_fits(self, num_prompt_tokens: int, max_tokens: int) -> Optional[str]:
        """Why no registered replica could ever hold this request, or None (also None with no replicas:
        they may still be starting)."""
        if not self._replicas:
            return None
        total = num_prompt_tokens + max_tokens
        lens = [r.capacity.max_model_len for r in self._replicas.values()]
        if total > max(lens):
            return (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                    f"max_model_len={max(lens)}")
        fits = [r for r in self._replicas.values() if total <= r.capacity.max_model_len
                and r.capacity.reservation_bytes(num_prompt_tokens, max_tokens)
                <= self._kv_limit(r)]
        if not fits:
            need = max(r.capacity.reservation_bytes(num_prompt_tokens, max_tokens)
                       for r in self._replicas.values())
            room = max(self._kv_limit(r) for r in self._replicas.values())
            return f"request needs {need} bytes of KV, more than any replica can hold ({room} bytes)"
        return None

    def num_on_device(self, key: DeviceKey) -> int:
        """Replicas registered on one device (node and GPU): they split its memory."""
        return self._num_on_device[key]

    def _kv_limit(self, replica: _Replica) -> int:
        return replica.kv_limit_bytes(self.config.headroom, self.num_on_device(_device_of(replica)))

    def _live_headroom(self, replica: _Replica, extra_kv_bytes: int) -> int:
        return replica.live_headroom_bytes(self.config.headroom, extra_kv_bytes,
                                           self.num_on_device(_device_of(replica)))

    def get(self, request_id: str) -> Optional[Reservation]:
        replica_id = self._owner.get(request_id)
        if replica_id is None:
            return None
        return self._replicas[replica_id].entries[request_id].reservation

    def try_reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int, now: float,
                    prefix_hashes: Sequence[int] = ()) -> Optional[Reservation]:
        """Reserve on the replica with room that caches the longest prefix of the prompt (`prefix_hashes`,
        engine/core/prefix_hash.py), else the one with the most room left after it, then fewest queued tokens;
        None when none has room now. An id already reserved gets its reservation back."""
        existing = self.get(request_id)
        if existing is not None:
            return existing
        candidates = []  # (replica_id, room left after it, matched prefix blocks, its bytes there)
        for replica_id, replica in self._replicas.items():
            capacity = replica.capacity
            if num_prompt_tokens + max_tokens > capacity.max_model_len:
                continue
            need = capacity.reservation_bytes(num_prompt_tokens, max_tokens)
            room = self._kv_limit(replica) - replica.reserved_bytes - need
            if room >= 0:
                blocks = matched_blocks(prefix_hashes, replica.prefix_hashes) if prefix_hashes else 0
                candidates.append((replica_id, room, blocks, need))
        if not candidates:
            return None
        # Affinity only among replicas not busier than the least busy by more than prefix_max_imbalance
        # requests, so one hot prefix cannot pile everything on one replica while another idles.
        least = min(len(self._replicas[c[0]].entries) for c in candidates)
        limit = least + self.config.prefix_max_imbalance
        best_id, _, best_blocks, _ = min(candidates, key=lambda c: (
            -c[2] if len(self._replicas[c[0]].entries) <= limit else 0,  # longest cached prefix
            -c[1], -self._live_headroom(self._replicas[c[0]], c[3]),  # then most room,
            self._replicas[c[0]].queued_tokens, c[0]))  # most live headroom, fewest queued tokens
        if len(self._replicas[best_id].entries) > limit:
            best_blocks = 0
        replica = self._replicas[best_id]
        reservation = Reservation(request_id, best_id,
                                  replica.capacity.reservation_bytes(num_prompt_tokens, max_tokens),
                                  num_prompt_tokens + max_tokens, num_prefix_blocks=best_blocks)
        self._add(replica, reservation, now, seen_live=False)
        self._released.pop(request_id, None)
        return reservation

    def release(self, request_id: str, now: float) -> Optional[Reservation]:
        """Give back a reservation; None if it was not held (already released, reclaimed or unknown)."""
        self._released[request_id] = now
        replica_id = self._owner.pop(request_id, None)
        if replica_id is None:
            return None
        return self._replicas[replica_id].entries.pop(request_id).reservation

    # --- replicas ---------------------------------------------------------------------------------
    def report(self, report: ReplicaReport, now: float) -> ReportResult:
        """Register or refresh a replica; reconcile its reservations with what it holds. An unhealthy
        replica is dropped; one reported gone stays out until its tombstone expires."""
        capacity = report.capacity
        if not report.healthy or now < self._gone.get(capacity.replica_id, now):
            self.remove_replica(capacity.replica_id)
            return ReportResult(capacity.replica_id, False, 0, 0, False, 0, ignored=True)
        replica = self._replicas.get(capacity.replica_id)
        registered = replica is None
        if replica is None:
            replica = self._replicas[capacity.replica_id] = _Replica(capacity, now)
        else:
            self._leave_device(replica)  # a report may move it (its node or GPU is known late)
        replica.capacity, replica.last_seen = capacity, now
        self._num_on_device[_device_of(replica)] += 1
        replica.engine_kv_reserved_bytes = report.engine_kv_reserved_bytes
        replica.engine_kv_used_bytes = report.engine_kv_used_bytes
        replica.kv_allocated_bytes = report.kv_allocated_bytes
        replica.planned_transient_bytes = report.planned_transient_bytes
        replica.prefix_hashes = frozenset(report.prefix_hashes[: self.config.max_prefix_hashes])
        adopted = self._adopt(replica, report.live, now)
        dropped = self._drop_gone(replica, {r.request_id for r in report.live}, now)
        exceeded = self._check_peak(replica, report.max_measured_transient_bytes)
        return ReportResult(capacity.replica_id, registered, adopted, dropped, exceeded, replica.excess_bytes)

    def _adopt(self, replica: _Replica, live: tuple[LiveRequest, ...], now: float) -> int:
        adopted = 0
        for request in live:
            entry = replica.entries.get(request.request_id)
            if entry is not None:
                entry.seen_live = True
            elif request.request_id not in self._owner and request.request_id not in self._released:
                reservation = Reservation(request.request_id, replica.capacity.replica_id, request.kv_bytes,
                                          request.num_tokens)
                self._add(replica, reservation, now, seen_live=True)
                adopted += 1
        return adopted

    def _drop_gone(self, replica: _Replica, live_ids: set[str], now: float) -> int:
        """Reservations the replica does not hold: finished there, or never arrived within the grace."""
        gone = [request_id for request_id, entry in replica.entries.items() if request_id not in live_ids
                and (entry.seen_live or now - entry.created_at > self.config.replica_timeout_s)]
        for request_id in gone:
            del replica.entries[request_id]
            del self._owner[request_id]
        return len(gone)

    def _check_peak(self, replica: _Replica, measured: int) -> bool:
        replica.max_measured_transient_bytes = max(replica.max_measured_transient_bytes, measured)
        excess = measured - replica.capacity.transient_bound_bytes
        if excess <= replica.excess_bytes:
            return False
        replica.excess_bytes = excess
        replica.num_peak_exceeded += 1
        return True

    def remove_replica(self, replica_id: str, ignore_until: Optional[float] = None) -> int:
        """Drop a replica (dead or silent) and reclaim its reservations; returns how many. With
        `ignore_until`, its reports are ignored until then (Serve said it is gone: a draining replica
        still reports, and Serve never reuses a replica id)."""
        if ignore_until is not None:
            self._gone[replica_id] = ignore_until
        replica = self._replicas.pop(replica_id, None)
        if replica is None:
            return 0
        self._leave_device(replica)
        for request_id in replica.entries:
            self._owner.pop(request_id, None)
        return len(replica.entries)

    def reclaim(self, now: float) -> dict[str, int]:
        """Drop replicas silent for longer than replica_timeout_s: {replica_id: reservations reclaimed}.
        Also forgets released ids older than that (no report can be that late)."""
        timeout = self.config.replica_timeout_s
        silent = [i for i, r in self._replicas.items() if now - r.last_seen > timeout]
        reclaimed = {replica_id: self.remove_replica(replica_id) for replica_id in silent}
        self._released = {i: t for i, t in self._released.items() if now - t <= timeout}
        self._gone = {i: until for i, until in self._gone.items() if now < until}
        return reclaimed

    def _leave_device(self, replica: _Replica) -> None:
        key = _device_of(replica)
        self._num_on_device[key] -= 1
        if not self._num_on_device[key]:
            del self._num_on_device[key]

    def _add(self, replica: _Replica, reservation: Reservation, now: float, seen_live: bool) -> None:
        replica.entries[reservation.request_id] = _Entry(reservation, now, seen_live)
        self._owner[reservation.request_id] = replica.capacity.replica_id

    # --- views ------------------------------------------------------------------------------------
    @property
    def num_replicas(self) -> int:
        return len(self._replicas)

    @property
    def num_reservations(self) -> int:
        return len(self._owner)

    def views(self, now: float) -> list[ReplicaView]:
        shared = {i: self.num_on_device(_device_of(r)) for i, r in self._replicas.items()}
        headroom = self.config.headroom
        return [ReplicaView(
            replica_id=i, num_reservations=len(r.entries), reserved_kv_bytes=r.reserved_bytes,
            kv_limit_bytes=self._kv_limit(r), queued_tokens=r.queued_tokens,
            memory_limit_bytes=r.capacity.memory_limit_bytes, weights_bytes=r.capacity.weights_bytes,
            transient_bound_bytes=r.capacity.transient_bound_bytes,
            max_measured_transient_bytes=r.max_measured_transient_bytes, excess_bytes=r.excess_bytes,
            live_headroom_bytes=r.live_headroom_bytes(headroom, num_on_device=shared[i]),
            peak_exceeded=r.excess_bytes > 0, num_peak_exceeded=r.num_peak_exceeded,
            engine_kv_reserved_bytes=r.engine_kv_reserved_bytes, engine_kv_used_bytes=r.engine_kv_used_bytes,
            seconds_since_report=now - r.last_seen, request_ids=tuple(sorted(r.entries)),
            num_prefix_hashes=len(r.prefix_hashes), node_id=r.capacity.node_id, device=r.capacity.device,
            num_on_device=shared[i], memory_share_bytes=memory_share_bytes(r.capacity.memory_limit_bytes, shared[i]),
            reserved_transient_bytes=r.capacity.reserved_transient_bytes,
        ) for i, r in sorted(self._replicas.items())]
