"""The wire types: plain frozen records that cross a deployment boundary (pickled by Ray).

    ingress -> replica      GenerateRequest, AbortRequest       replica -> ingress   GenerateOutput,
                                                                                     ReplicaInfo, ReplicaStats
    replica -> admission    ReplicaReport (ReplicaCapacity, LiveRequest)
    admission -> ingress    AdmissionDecision (Reservation)

No logic beyond arithmetic on their own fields, and no imports of Ray or of other deployments modules, so
every layer may import this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from engine import EngineStats, SamplingParams, TokenLogprob

Outcome = Literal["admitted", "rejected", "invalid"]


@dataclass(frozen=True)
class GenerateRequest:
    """What the ingress sends a replica: token ids and sampling, already validated."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    trace_context: Optional[dict[str, str]] = None  # W3C carrier of the ingress's span (telemetry)
    target_replica_id: Optional[str] = None  # the admission controller's choice (deployments/admission/routing.py)


@dataclass(frozen=True)
class AbortRequest:
    """The ingress's explicit cancel of a request on the replica admission chose for it."""

    request_id: str
    target_replica_id: Optional[str] = None  # routes it like the request (deployments/admission/routing.py)


@dataclass(frozen=True)
class GenerateOutput:
    """One increment of a request, as the replica streams it back."""

    request_id: str
    replica_id: str
    new_text: str
    num_new_tokens: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    error: Optional[str] = None
    queue_s: Optional[float] = None  # on the first output: replica arrival -> first engine step
    new_logprobs: tuple[TokenLogprob, ...] = ()  # of the new tokens shown, when the request asked for them


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    model_name: str
    max_model_len: int
    prometheus_url: Optional[str] = None


@dataclass(frozen=True)
class ReplicaStats:
    """A replica's engine stats and how its process runs (EngineReplica.stats, the handle API's stats)."""

    replica_id: str
    engine: EngineStats
    prometheus_url: Optional[str] = None
    cpu_threads: Optional[str] = None  # OPENBLAS_NUM_THREADS of its process (ReplicaArgs.cpu_threads)
    niceness: int = 0  # Ray's worker niceness, as deployments/cluster_env.py sets it
    node_id: str = ""  # the Ray node it runs on ("": outside Ray)
    device: str = "host"  # "host" (CPU, Metal: the host's memory) or "gpu:<ids>"


# ----------------------------------------------------------------------------- admission


@dataclass(frozen=True)
class ReplicaCapacity:
    """What a replica can hold, from its engine's configuration (EngineStats)."""

    replica_id: str
    memory_limit_bytes: int
    weights_bytes: int
    kv_bytes_per_token: int
    kv_cache_step: int
    transient_bound_bytes: int
    kv_budget_bytes: int
    max_model_len: int
    node_id: str = ""  # Ray node id ("": unknown, alone on its device)
    device: str = "host"  # "host" (CPU, Metal) or "gpu:<ids>" (deployments/admission/placement.py)
    # the smallest step that makes progress (the engine sizes every step to the memory KV leaves free, so
    # admission keeps only this beside the KV); 0: an engine that reserves the bound instead
    floor_transient_bytes: int = 0

    @property
    def reserved_transient_bytes(self) -> int:
        """The transient admission keeps beside the KV: the floor step, else the bound."""
        return self.floor_transient_bytes or self.transient_bound_bytes

    def reservation_bytes(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """The engine scheduler's reservation: prompt + max_tokens - 1 tokens, rounded up to the cache step."""
        num_tokens = max(num_prompt_tokens + max_tokens - 1, 1)
        num_steps = -(-num_tokens // self.kv_cache_step)
        return num_steps * self.kv_cache_step * self.kv_bytes_per_token


@dataclass(frozen=True)
class LiveRequest:
    """A request a replica holds, with the KV the controller's model gives it."""

    request_id: str
    kv_bytes: int
    num_tokens: int  # prompt + max_tokens


@dataclass(frozen=True)
class ReplicaReport:
    """A replica's heartbeat, also its registration."""

    capacity: ReplicaCapacity
    live: tuple[LiveRequest, ...] = ()
    engine_kv_reserved_bytes: int = 0
    engine_kv_used_bytes: int = 0
    max_measured_transient_bytes: int = 0
    kv_allocated_bytes: int = 0  # the engine's KV pool now
    planned_transient_bytes: int = 0  # its last step's predicted transient
    healthy: bool = True  # False: the engine is dead or hung; the replica is dropped, nothing goes there
    prefix_hashes: tuple[int, ...] = ()  # its prefix cache, summarised (engine/core/prefix_hash.py)


@dataclass(frozen=True)
class Reservation:
    """Room held for one engine request on one replica; the ingress routes the request there."""

    request_id: str
    replica_id: str
    kv_bytes: int
    num_tokens: int
    num_prefix_blocks: int = 0  # prompt blocks the replica reported caching when it was chosen


@dataclass(frozen=True)
class AdmissionDecision:
    """The controller's answer to a reserve: a reservation, or why not (the HTTP status to answer)."""

    outcome: Outcome
    reason: str
    message: str = ""
    reservation: Optional[Reservation] = None
    status_code: int = 200
    retry_after_s: float = 0.0
    waited_s: float = 0.0  # time in the controller's queue
