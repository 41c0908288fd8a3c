"""Serve's autoscaling of the engine replicas on admission demand (running + queued in the controller).

Requests waiting in the admission controller's queue never reach a replica handle, so Serve's default
policy (requests at the handles and replicas) does not see them. Each engine replica reports two
metrics through Serve's `record_autoscaling_stats` (EngineReplica, every heartbeat's answer brings the
queue length):

    mlx_serve_admission_running   requests this replica holds
    mlx_serve_admission_queued    requests in the controller's queue (the same on every replica)

and `admission_demand_policy`, the deployment's `autoscaling_config.policy`, sizes the deployment to
`ceil((running + queued) / target_ongoing_requests)` replicas, at least one more than now while anything
is queued (queued means no replica had room), never fewer than the replicas with requests running
(Serve stops the newest replicas whatever they hold, and kills one still generating after its
graceful_shutdown_timeout_s: a replica running a request is not surplus) and none while nothing runs or
waits (min_replicas bounds it). Serve applies min/max, the delays and the scaling factors around it. At zero replicas no
replica reports anything: Serve's cold start (any request queued at a handle) starts the first one, and
the ingress makes such a request when the controller says no replica is registered
(deployments/admission/actor.py, `wake`).

Serve runs the policy in its controller from a pickled copy of this module: it imports only the standard
library.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

RUNNING_METRIC = "mlx_serve_admission_running"
QUEUED_METRIC = "mlx_serve_admission_queued"


def demand(metrics: Mapping[str, Mapping[Any, float]], total_num_requests: float) -> tuple[float, float]:
    """(running, queued) from the replicas' aggregated metrics; running is never below what Serve's
    handles count (a replica that has not reported yet)."""
    running = sum(metrics.get(RUNNING_METRIC, {}).values())
    queued = max(metrics.get(QUEUED_METRIC, {}).values(), default=0.0)  # one queue, seen by every replica
    return max(running, float(total_num_requests or 0.0)), queued


def busy_replicas(metrics: Mapping[str, Mapping[Any, float]]) -> int:
    """Replicas that held requests in the look-back window (their averaged running count above 0)."""
    return sum(1 for value in metrics.get(RUNNING_METRIC, {}).values() if value > 0)


def desired_replicas(running: float, queued: float, current: int, target_per_replica: float,
                     min_replicas: int, max_replicas: int, busy: int = 0) -> int:
    """Replicas for this demand, within [min_replicas, max_replicas], never below the `busy` ones
    (of the `current`) while the demand would scale down."""
    desired = math.ceil((running + queued) / target_per_replica) if running + queued > 0 else 0
    if queued > 0:  # queued: no replica had room for it, whatever the request count says
        desired = max(desired, current + 1)
    desired = max(desired, min(busy, current))  # a replica generating is not surplus
    return max(min_replicas, min(max_replicas, desired))


def admission_demand_policy(ctx: Any) -> tuple[int, dict[str, Any]]:
    """Serve's custom policy (ray.serve.config.AutoscalingContext -> (replicas, policy state))."""
    metrics = ctx.aggregated_metrics or {}
    running, queued = demand(metrics, ctx.total_num_requests)
    desired = desired_replicas(running, queued, ctx.current_num_replicas,
                               ctx.config.get_target_ongoing_requests(), ctx.capacity_adjusted_min_replicas,
                               ctx.capacity_adjusted_max_replicas, busy=busy_replicas(metrics))
    state = dict(ctx.policy_state or {})
    state.update({"running": running, "queued": queued})
    return desired, state
