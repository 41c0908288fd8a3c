"""AdmissionRequestRouter: Ray Serve's request router for EngineReplica, honouring the admission choice.

The admission controller picks the replica that has room for a request (preferring the one whose prefix
cache holds the longest prefix of the prompt); the ingress puts that replica's id in
`GenerateRequest.target_replica_id` and calls the deployment handle as usual. Serve's router (this
class, set through `request_router_config` in deployments/app.py) runs in the ingress process with the
request's resolved arguments and offers only that replica; Serve then sends it there with its own
machinery (queue-length probing, `max_ongoing_requests` back-pressure, retries on a dead actor).

Calls without a target (stats, info, admission off) get Serve's default: the less loaded of two random
replicas. A target the router does not know yet (a replica that registered with the controller before
Serve's replica list reached this router) is waited for; one still missing after `route_timeout_s` (it
died) fails the call with ReplicaUnavailableError, which the ingress answers by admitting the request
again, elsewhere.

The router also tells the admission controller when Serve drops a replica from its set (dead, unhealthy,
stopping) or a call finds its actor dead, so its reservations are reclaimed at once rather than after
the heartbeat timeout.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any, List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from deployments.admission.actor import get_or_create_controller
from deployments.admission.state import AdmissionConfig
from deployments.errors import ReplicaUnavailableError
from deployments.messages import AbortRequest, GenerateRequest

logger = logging.getLogger(__name__)


def target_replica_id(pending_request: Optional[PendingRequest]) -> Optional[str]:
    """The replica admission chose for this call: the `target_replica_id` of its GenerateRequest or
    AbortRequest argument."""
    if pending_request is None:
        return None
    for arg in list(pending_request.args) + list(pending_request.kwargs.values()):
        if isinstance(arg, (GenerateRequest, AbortRequest)) and arg.target_replica_id:
            return arg.target_replica_id
    return None


class AdmissionRequestRouter(RequestRouter):
    def initialize_state(self, route_timeout_s: float = 10.0, admission: Optional[dict] = None,
                         **kwargs: Any) -> None:
        """`request_router_kwargs`: how long to wait for an unknown target; the admission config (to
        find the controller)."""
        self._route_timeout_s = route_timeout_s
        self._admission = AdmissionConfig.model_validate(admission) if admission else None
        self._controller: Any = None

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        before = {replica_id.unique_id for replica_id in self.curr_replicas}
        super().update_replicas(replicas)
        for replica_id in before - {r.replica_id.unique_id for r in replicas}:
            self._report_gone(replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._report_gone(replica_id.unique_id)

    def _report_gone(self, replica_id: str) -> None:
        if getattr(self, "_admission", None) is None:
            return
        try:
            if self._controller is None:
                self._controller = get_or_create_controller(self._admission, self.app_name)
            self._controller.replica_failed.remote(replica_id)
        except Exception:  # best effort: the heartbeat timeout reclaims it anyway
            logger.warning("could not report replica %s gone to admission", replica_id, exc_info=True)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None) -> List[List[RunningReplica]]:
        if pending_request is not None:
            # Back off between rounds (the target may be busy or not known yet) instead of spinning.
            pending_request.routing_context.should_backoff = True
        target = target_replica_id(pending_request)
        if target is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        for replica in candidate_replicas:
            if replica.replica_id.unique_id == target:
                return [[replica]]
        waited_s = time.time() - pending_request.created_at
        if waited_s < getattr(self, "_route_timeout_s", 10.0):
            return []
        if not pending_request.future.done():
            logger.warning("replica %s chosen by admission is not routable after %.1f s", target, waited_s)
            pending_request.future.set_exception(ReplicaUnavailableError(
                f"engine replica {target} chosen by admission is gone", code="replica_unavailable"))
        # The routing loop sees the request's future done and stops; this rank is never used.
        return [candidate_replicas]
