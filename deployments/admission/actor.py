"""The cluster's admission controller (a Ray actor) and the two clients of it: the ingress and the replicas.

One `AdmissionController` per application: a named async actor in namespace `mlx-serve`, called
`mlx-admission.<app>.<hash of the admission config>`, created by whichever of the ingress or a replica
asks first (`get_if_exists=True`). It is **detached** and restarts on failure (`max_restarts=-1`,
`max_task_retries=-1`: a call in flight when it dies is retried on the new instance; every method is
idempotent by request id). Detached, because its owner would otherwise be the ingress replica that happened
to create it, and that replica's death would take the controller with it. It removes itself after
`idle_shutdown_s` without replicas or calls (the application was deleted). A restarted controller starts
empty and rebuilds from the replicas' next heartbeats (deployments/admission/state.py says how).

    ingress:  AdmittedReplicaClient.generate(request)
                  reserve(prompt's block hashes: prefix affinity) -> Reservation(replica_id)
                                                    | 400 never fits | 503/429 + Retry-After
                                                    | no replica registered: wake one (a call waiting at
                                                      the deployment handle: Serve's cold start), reserve again
                  stream from exactly that replica (target_replica_id, deployments/admission/routing.py)
                  finally: release (idempotent, fire and forget)
    replica:  ReplicaReporter: every heartbeat_interval_s, report(capacity, live requests, peaks,
                  prefix-cache block hashes: at most max_prefix_hashes)
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any, Optional, Union

import ray

from engine.core.prefix_hash import block_hashes

from deployments.admission.queue import Admitter, AdmissionStats
from deployments.admission.state import AdmissionConfig, ReportResult
from deployments.errors import (BadRequestError, ReplicaUnavailableError, ServiceUnavailableError,
                                TooManyRequestsError)
from deployments.messages import AdmissionDecision, GenerateOutput, GenerateRequest, ReplicaInfo, ReplicaReport, \
    ReplicaStats, Reservation
from deployments.replica.client import HandleReplicaClient, ReplicaClient
from deployments.serve_context import current_app_name, current_replica_id
from deployments.telemetry.metrics import Telemetry
from deployments.telemetry.observability import admission_span

ControllerTelemetryFactory = Callable[[], Telemetry]  # the controller's own Telemetry, built in its process

logger = logging.getLogger(__name__)

NAMESPACE = "mlx-serve"
CALL_TIMEOUT_S = 30.0  # a controller call (besides the wait in the queue) that takes longer is a failure


def controller_name(config: AdmissionConfig, app_name: str) -> str:
    """Per application and per admission config (a redeploy with another config gets a fresh one)."""
    digest = hashlib.sha1(config.model_dump_json().encode()).hexdigest()[:8]
    return f"mlx-admission.{app_name}.{digest}"


def get_or_create_controller(config: AdmissionConfig, app_name: Optional[str] = None,
                             telemetry_factory: Optional[ControllerTelemetryFactory] = None) -> Any:
    """The app's controller; whoever creates it first gives it its telemetry (a picklable factory)."""
    actor_cls = ray.remote(AdmissionController)
    return actor_cls.options(
        name=controller_name(config, app_name or current_app_name()), namespace=NAMESPACE,
        lifetime="detached", get_if_exists=True, max_restarts=-1, max_task_retries=-1, num_cpus=0,
    ).remote(config.model_dump(), telemetry_factory)


class AdmissionController:
    """The actor: an Admitter, a reaper of silent replicas, and an idle exit. Plain class (Ray applies
    `ray.remote` in `get_or_create_controller`); every method is async, so waits never block the actor."""

    def __init__(self, config: Union[AdmissionConfig, dict],
                 telemetry_factory: Optional[ControllerTelemetryFactory] = None,
                 exit_fn: Optional[Callable[[], None]] = None) -> None:
        self.config = AdmissionConfig.model_validate(config)
        self._telemetry = telemetry_factory() if telemetry_factory else None
        self._admitter = Admitter(self.config, telemetry=self._telemetry)
        self._exit_fn = exit_fn or _exit_this_actor
        self._last_activity = time.monotonic()
        self._reaper: Optional[asyncio.Task] = None

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      prefix_hashes: tuple[int, ...] = (), client_id: str = "", wait_for_replicas: bool = True,
                      trace_context: Optional[dict[str, str]] = None) -> AdmissionDecision:
        """Admit (Admitter.reserve), traced as a "mlx_serve.admission" span under the request's span
        (`trace_context`): the decision, its reason, the chosen replica and the wait in the queue."""
        self._touch()
        with admission_span(self._telemetry, trace_context) as record:
            decision = await self._admitter.reserve(request_id, num_prompt_tokens, max_tokens, prefix_hashes,
                                                    client_id, wait_for_replicas)
            replica_id = decision.reservation.replica_id if decision.reservation is not None else None
            record(decision.outcome, decision.reason, replica_id, decision.waited_s, decision.message)
        return decision

    async def release(self, request_id: str) -> bool:
        self._touch()
        return self._admitter.release(request_id)

    async def report(self, report: ReplicaReport) -> ReportResult:
        self._touch()
        return self._admitter.report(report)

    async def replica_failed(self, replica_id: str) -> int:
        self._touch()
        return self._admitter.replica_failed(replica_id)

    async def stats(self) -> AdmissionStats:
        """The Admitter's stats, with where this process serves its metrics (None: not served)."""
        self._touch()
        return self._admitter.stats(self._telemetry.prometheus_url if self._telemetry is not None else None)

    def _touch(self) -> None:
        self._last_activity = time.monotonic()
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.heartbeat_interval_s)
            self._admitter.reap()
            idle = time.monotonic() - self._last_activity
            if (self.config.idle_shutdown_s and self._admitter.ledger.num_replicas == 0
                    and idle > self.config.idle_shutdown_s):
                logger.info("admission controller idle for %.0f s with no replicas: exiting", idle)
                self._exit_fn()
                return


def _exit_this_actor() -> None:
    ray.kill(ray.get_runtime_context().current_actor, no_restart=True)


class AdmissionClient:
    """What the ingress calls; maps decisions to the typed API errors."""

    def __init__(self, config: AdmissionConfig, controller_factory: Optional[ControllerTelemetryFactory] = None,
                 telemetry_factory: Optional[ControllerTelemetryFactory] = None,
                 client_id: Optional[str] = None) -> None:
        self.config = config
        self._factory = controller_factory or (lambda: get_or_create_controller(config, None, telemetry_factory))
        self._handle: Any = None
        self.client_id = current_replica_id() if client_id is None else client_id  # this ingress replica

    def _controller(self) -> Any:
        if self._handle is None:
            self._handle = self._factory()
        return self._handle

    async def reserve(self, request_id: str, num_prompt_tokens: int, max_tokens: int,
                      prefix_hashes: tuple[int, ...] = (), trace_context: Optional[dict[str, str]] = None,
                      wait_for_replicas: bool = True) -> Reservation:
        timeout_s = self.config.queue_timeout_s + CALL_TIMEOUT_S
        ref = self._controller().reserve.remote(request_id, num_prompt_tokens, max_tokens, prefix_hashes,
                                                self.client_id, wait_for_replicas, trace_context)
        try:
            # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation that lands as the result
            # arrives, and the abandoned request then runs to its end.
            async with asyncio.timeout(timeout_s):
                decision = await ref
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # cancelled as the decision came: do not run it
                raise asyncio.CancelledError()
        except asyncio.CancelledError:  # the client went away while queued: leave the queue, free any grant
            ray.cancel(ref)
            self.release(request_id)
            raise
        except TimeoutError:
            ray.cancel(ref)
            self.release(request_id)
            raise ServiceUnavailableError("the admission controller did not answer", retry_after_s=
                                          self.config.retry_after_s) from None
        except ray.exceptions.RayError as e:  # e.g. it exited idle just now: find or create it again
            self._handle = None
            raise ServiceUnavailableError(f"the admission controller failed: {type(e).__name__}",
                                          retry_after_s=self.config.retry_after_s) from None
        return decision_to_reservation(decision)

    def release(self, request_id: str) -> None:
        """Fire and forget (never blocks a cancelled caller); retried across controller restarts, and a
        lost release is undone by the replica's next heartbeat."""
        _submit(self._controller().release, request_id)

    def replica_failed(self, replica_id: str) -> None:
        _submit(self._controller().replica_failed, replica_id)

    async def stats(self) -> AdmissionStats:
        return await asyncio.wait_for(_awaitable(self._controller().stats.remote()), CALL_TIMEOUT_S)


def decision_to_reservation(decision: AdmissionDecision) -> Reservation:
    if decision.outcome == "admitted" and decision.reservation is not None:
        return decision.reservation
    if decision.outcome == "invalid":
        raise BadRequestError(decision.message, code=decision.reason)
    error = TooManyRequestsError if decision.status_code == 429 else ServiceUnavailableError
    raise error(decision.message, code=decision.reason, retry_after_s=decision.retry_after_s)


async def _awaitable(ref: Any) -> Any:
    return await ref


def _submit(method: Any, *args: Any) -> None:
    try:
        method.remote(*args)
    except Exception:  # the controller is unreachable: heartbeats reconcile later
        logger.warning("admission call %s%r failed", getattr(method, "_method_name", "?"), args,
                       exc_info=True)


class AdmittedReplicaClient:
    """The ingress's replica client with admission in front: a ReplicaClient wrapping a
    HandleReplicaClient (built with max_attempts=1: a retry needs a new reservation)."""

    def __init__(self, inner: ReplicaClient, admission: AdmissionClient, max_attempts: int = 3) -> None:
        self._inner = inner
        self._admission = admission
        self._max_attempts = max_attempts

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """Reserve, stream from the chosen replica, release exactly once whatever happens. A replica that
        is gone before the first output is reported and the request admitted again."""
        for attempt in range(1, self._max_attempts + 1):
            reservation = await self._reserve(request)
            started = False
            try:
                targeted = dataclasses.replace(request, target_replica_id=reservation.replica_id)
                async with aclosing(self._inner.generate(targeted)) as stream:
                    async for out in stream:
                        started = True
                        yield out
                return
            except ReplicaUnavailableError:
                self._admission.replica_failed(reservation.replica_id)
                if started or attempt == self._max_attempts:
                    raise
                logger.warning("replica %s gone before output (attempt %d); admitting %s again",
                               reservation.replica_id, attempt, request.request_id)
            finally:
                self._admission.release(request.request_id)

    async def _reserve(self, request: GenerateRequest) -> Reservation:
        """Reserve. With no engine replica registered (scaled to zero, or all starting), make Serve start
        one first: a call waiting at the deployment handle is the demand Serve's autoscaler sees (a request
        waiting in the controller is not), and it returns once a replica runs."""
        # For prefix affinity: the controller prefers the replica whose cache holds most of these blocks.
        hashes = block_hashes(request.prompt_token_ids) if self._admission.config.max_prefix_hashes else ()
        args = (request.request_id, len(request.prompt_token_ids), request.sampling.max_tokens, hashes,
                request.trace_context)
        try:
            return await self._admission.reserve(*args, wait_for_replicas=False)
        except ServiceUnavailableError as e:
            if e.code != "no_replicas":
                raise
        await self.wake()
        return await self._admission.reserve(*args, wait_for_replicas=True)

    async def wake(self) -> None:
        """Wait (at most queue_timeout_s) for an engine replica to run; Serve starts one if none does."""
        timeout_s = self._admission.config.queue_timeout_s
        try:
            await self._inner.info(timeout_s)
        except ServiceUnavailableError:
            raise ServiceUnavailableError(f"no engine replica started within {timeout_s:g} s", code="no_replicas",
                                          retry_after_s=self._admission.config.retry_after_s) from None

    async def info(self, timeout_s: float) -> ReplicaInfo:
        return await self._inner.info(timeout_s)

    async def stats(self, timeout_s: float) -> ReplicaStats:
        return await self._inner.stats(timeout_s)


def admitted_client_factory(config: AdmissionConfig, telemetry_factory: Optional[ControllerTelemetryFactory] = None
                            ) -> Callable[[Any], AdmittedReplicaClient]:
    """The ingress's `client_factory` when admission is on (a picklable callable, for `bind`)."""
    return _AdmittedClientFactory(config, telemetry_factory)


@dataclasses.dataclass(frozen=True)
class _AdmittedClientFactory:
    config: AdmissionConfig
    telemetry_factory: Optional[ControllerTelemetryFactory] = None  # the controller's, if this ingress creates it

    def __call__(self, handle: Any) -> AdmittedReplicaClient:
        admission = AdmissionClient(self.config, telemetry_factory=self.telemetry_factory)
        return AdmittedReplicaClient(HandleReplicaClient(handle, max_attempts=1), admission)


class ReplicaReporter:
    """The replica's heartbeat: a background asyncio task that sends `report_fn()` every interval. The
    first report registers the replica; a restarted controller is re-registered by the next one."""

    def __init__(self, config: AdmissionConfig, report_fn: Callable[[], ReplicaReport],
                 controller_factory: Optional[ControllerTelemetryFactory] = None,
                 telemetry_factory: Optional[ControllerTelemetryFactory] = None) -> None:
        self.config = config
        self._report_fn = report_fn
        self._factory = controller_factory or (lambda: get_or_create_controller(config, None, telemetry_factory))
        self._handle: Any = None
        self._task: Optional[asyncio.Task] = None
        self.num_reports = 0
        self.num_waiting = 0  # the controller's queue at the last report (an autoscaling metric)

    def ensure_started(self) -> None:
        """Start the loop if it is not running (needs a running event loop; Serve runs `__init__` in one)."""
        if self._task is not None and not self._task.done():
            return
        try:
            self._task = asyncio.get_running_loop().create_task(self._run())
        except RuntimeError:  # no loop yet: the next async call of the replica starts it
            self._task = None

    async def _run(self) -> None:
        while True:
            await self.send_once()
            await asyncio.sleep(self.config.heartbeat_interval_s)

    async def send_once(self) -> bool:
        try:
            report = self._report_fn()
            bound = self.config.max_prefix_hashes
            if len(report.prefix_hashes) > bound:  # the summary is most recent first: keep its head
                report = dataclasses.replace(report, prefix_hashes=report.prefix_hashes[:bound])
            if self._handle is None:
                self._handle = self._factory()
            result = await asyncio.wait_for(_awaitable(self._handle.report.remote(report)), CALL_TIMEOUT_S)
            self.num_reports += 1
            self.num_waiting = int(getattr(result, "num_waiting", 0) or 0)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:  # never let the heartbeat die; a dead controller is re-resolved
            if isinstance(e, ray.exceptions.RayActorError):
                self._handle = None
            logger.warning("admission heartbeat failed: %r", e)
            return False

    def stop(self, replica_id: Optional[str] = None) -> None:
        """Stop reporting; with a replica id, tell the controller this replica is leaving."""
        if self._task is not None:
            self._task.cancel()
        if replica_id is not None and self._handle is not None:
            _submit(self._handle.replica_failed, replica_id)


@dataclasses.dataclass(frozen=True)
class ReporterFactory:
    """EngineReplica's `reporter_factory` (picklable, for `bind`): report_fn -> started ReplicaReporter."""

    config: AdmissionConfig
    telemetry_factory: Optional[ControllerTelemetryFactory] = None  # the controller's, if this replica creates it

    def __call__(self, report_fn: Callable[[], ReplicaReport]) -> ReplicaReporter:
        reporter = ReplicaReporter(self.config, report_fn, telemetry_factory=self.telemetry_factory)
        reporter.ensure_started()
        return reporter
