"""EngineReplica: one AsyncEngine per host / accelerator, streaming plain-data increments.

A plain class: `build_app` applies `serve.deployment` to it, tests construct it directly with a fake
engine factory. The ingress talks to it through a DeploymentHandle with `stream=True`:

    gen = handle.options(stream=True).generate.remote(GenerateRequest(...))
    async for out in gen: ...          # GenerateOutput increments

When the caller goes away (client disconnect, `gen.cancel()`), Ray Serve cancels the user-code task or
throws `CancelledError` into this generator; the `finally` of `generate` aborts the engine request so
its KV is freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Optional, Protocol, Union

from engine import EngineConfig, EngineStats, RequestOutput
from engine.core.prefix_hash import MAX_SUMMARY_HASHES, summarize

from deployments.admission.autoscaling import QUEUED_METRIC, RUNNING_METRIC
from deployments.admission.placement import HOST_DEVICE, device_label
from deployments.engine_client import EngineClient, EngineFactory, default_engine_factory
from deployments.errors import BadRequestError, EngineError, ServiceUnavailableError
from deployments.messages import (AbortRequest, GenerateOutput, GenerateRequest, LiveRequest, ReplicaCapacity,
                                  ReplicaInfo, ReplicaReport, ReplicaStats)
from deployments.replica.telemetry import ReplicaObserver
from deployments.serve_context import current_replica_id
from deployments.telemetry.metrics import TelemetryConfig
from deployments.telemetry.observability import TelemetryFactory, process_telemetry

logger = logging.getLogger(__name__)

MAX_ABORTED_IDS = 10_000  # ids of requests aborted before they arrived, kept...
ABORTED_TTL_S = 600.0  # ...this long at most


class Reporter(Protocol):
    """The replica's admission heartbeat (deployments/admission/actor.py's ReplicaReporter)."""

    def ensure_started(self) -> None: ...

    def stop(self, replica_id: Optional[str] = None) -> None: ...

    @property
    def num_waiting(self) -> int: ...  # the controller's queue at the last heartbeat (autoscaling)


ReporterFactory = Callable[[Callable[[], ReplicaReport]], Reporter]  # report_fn -> started reporter


def current_placement() -> tuple[str, str]:
    """(Ray node id, device) of this process: `gpu:<ids>` with GPUs assigned by Ray, else `host`;
    ("", "host") outside Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return "", HOST_DEVICE
        context = ray.get_runtime_context()
        return context.get_node_id(), device_label(context.get_accelerator_ids().get("GPU", []))
    except Exception:  # not in a Ray worker
        return "", HOST_DEVICE


class EngineReplica:
    """Owns one AsyncEngine; streams increments, reports stats and health."""

    def __init__(
        self,
        engine_config: Union[EngineConfig, dict],
        engine_factory: Optional[EngineFactory] = None,
        replica_id: Optional[str] = None,
        telemetry: Union[TelemetryConfig, dict, None] = None,
        telemetry_factory: Optional[TelemetryFactory] = None,
        reporter_factory: Optional[ReporterFactory] = None,
    ) -> None:
        config = EngineConfig.model_validate(engine_config)
        self._replica_id = replica_id or current_replica_id() or uuid.uuid4().hex[:8]  # outside Serve: any
        self._node_id, self._device = current_placement()  # reported: admission splits a shared device
        self._engine: EngineClient = (engine_factory or default_engine_factory)(config)
        telemetry_config = TelemetryConfig.model_validate(telemetry or {"exporter": "none"})
        self._telemetry = (telemetry_factory or process_telemetry)(telemetry_config, "replica")
        self._observer = ReplicaObserver(self._telemetry, self._replica_id, self._engine,
                                         prefix_cache=config.prefix_cache_fraction > 0)
        self._live: dict[str, GenerateRequest] = {}  # the requests in the engine now
        self._aborted: "OrderedDict[str, float]" = OrderedDict()  # aborted before they arrived -> when
        # Admission heartbeat (deployments/admission/actor.py): a started reporter calling admission_report().
        self._reporter = reporter_factory(self.admission_report) if reporter_factory else None
        logger.info("replica %s serving %s", self._replica_id, self._engine.model_name)

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """Stream the increments of one request; abort it in the engine if the caller goes away."""
        if self._aborted.pop(request.request_id, None) is not None:
            return  # its caller went away while Serve was still dispatching it: never reaches the engine
        trace = self._observer.start(request)
        self._live[request.request_id] = request
        if self._reporter is not None:
            self._reporter.ensure_started()
        stream = self._engine.generate(request.request_id, list(request.prompt_token_ids), request.sampling)
        finished = False
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except ValueError as e:  # the engine refuses a request that can never fit
                    finished = True
                    trace.fail(e)
                    raise BadRequestError(str(e), code="invalid_request") from None
                finished = out.finished
                yield trace.on_output(self._to_output(out))
                if finished:
                    break
        finally:
            trace.finish(finished)
            if not finished:
                await self._abort(request.request_id)
            self._live.pop(request.request_id, None)
            await _close_quietly(stream)

    async def abort(self, request: AbortRequest) -> bool:
        """Cancel a request whose caller went away. Serve's own cancellation is best effort: a call
        cancelled while Serve is dispatching it still arrives and runs to the end, so the ingress also
        sends this. A request not here yet is remembered and refused when it arrives. True: it was live."""
        if request.request_id in self._live:
            await self._abort(request.request_id)
            return True
        now = time.monotonic()
        self._aborted[request.request_id] = now
        while self._aborted and (len(self._aborted) > MAX_ABORTED_IDS
                                 or now - next(iter(self._aborted.values())) > ABORTED_TTL_S):
            self._aborted.popitem(last=False)
        return False

    async def _abort(self, request_id: str) -> None:
        # Shielded: runs while this task is being cancelled; the abort must still reach the engine.
        try:
            await asyncio.shield(self._engine.abort(request_id))
        except asyncio.CancelledError:
            pass
        except Exception:  # the engine may already have dropped it
            logger.exception("abort of %s failed", request_id)

    def _to_output(self, out: RequestOutput) -> GenerateOutput:
        reason = out.finish_reason.value if out.finish_reason is not None else None
        return GenerateOutput(
            request_id=out.request_id,
            replica_id=self._replica_id,
            new_text=out.new_text,
            num_new_tokens=len(out.new_token_ids),
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            finished=out.finished,
            finish_reason=reason,
            error=out.error,
            new_logprobs=out.new_logprobs,
        )

    def info(self) -> ReplicaInfo:
        if not self._engine.is_healthy():
            raise ServiceUnavailableError(f"engine replica {self._replica_id} is not healthy")
        return ReplicaInfo(self._replica_id, self._engine.model_name, int(self._engine.max_model_len),
                           self._telemetry.prometheus_url)

    def stats(self) -> ReplicaStats:
        return ReplicaStats(
            replica_id=self._replica_id, engine=self._engine.stats(), prometheus_url=self._telemetry.prometheus_url,
            node_id=self._node_id, device=self._device,
            cpu_threads=os.environ.get("OPENBLAS_NUM_THREADS"),  # ReplicaArgs.cpu_threads, as set
            niceness=os.nice(0))  # Ray's worker niceness (deployments/cluster_env.py)

    def admission_report(self) -> ReplicaReport:
        """Capacity, live requests and the prefix cache's block hashes (most recently used first; the
        reporter keeps the first max_prefix_hashes) for the admission controller."""
        prefix_hashes = summarize(self._engine.prefix_block_hash_chains(), MAX_SUMMARY_HASHES)
        return build_report(self._replica_id, self._engine.stats(), self._live, self._engine.is_healthy(),
                            prefix_hashes, self._node_id, self._device)

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's replica-reported autoscaling metrics: the admission demand this replica sees
        (deployments/admission/autoscaling.py): requests it holds, and the controller's queue."""
        queued = self._reporter.num_waiting if self._reporter is not None else 0
        return {RUNNING_METRIC: float(len(self._live)), QUEUED_METRIC: float(queued)}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it restart the replica."""
        if not self._engine.is_healthy():
            raise EngineError(f"engine of replica {self._replica_id} is not healthy")

    def shutdown(self) -> None:
        if self._reporter is not None:
            self._reporter.stop(self._replica_id)
        self._engine.shutdown()
        self._observer.close()

    def __del__(self) -> None:
        reporter = getattr(self, "_reporter", None)
        if reporter is not None:  # Serve's graceful shutdown: leave the admission controller at once
            reporter.stop(getattr(self, "_replica_id", None))
        observer = getattr(self, "_observer", None)
        if observer is not None:
            observer.close()
        engine = getattr(self, "_engine", None)
        if engine is not None:
            try:
                engine.shutdown()
            except Exception:
                pass


def build_report(replica_id: str, stats: EngineStats, live: Mapping[str, GenerateRequest], healthy: bool,
                 prefix_hashes: tuple[int, ...], node_id: str = "", device: str = HOST_DEVICE) -> ReplicaReport:
    """A replica's report: its engine's capacity, where it runs (node, device: admission splits a device's
    memory between the replicas on it), the requests it holds and its prefix-cache summary."""
    capacity = ReplicaCapacity(
        replica_id, memory_limit_bytes=stats.memory_limit_bytes, weights_bytes=stats.weights_bytes,
        kv_bytes_per_token=stats.kv_bytes_per_token, kv_cache_step=stats.kv_cache_step,
        transient_bound_bytes=stats.transient_bound_bytes, kv_budget_bytes=stats.kv_budget_bytes,
        max_model_len=stats.max_model_len, floor_transient_bytes=stats.floor_transient_bytes, node_id=node_id,
        device=device)
    requests = []
    for request_id, request in live.items():
        num_prompt, max_tokens = len(request.prompt_token_ids), request.sampling.max_tokens
        requests.append(LiveRequest(request_id, capacity.reservation_bytes(num_prompt, max_tokens),
                                    num_prompt + max_tokens))
    return ReplicaReport(capacity, tuple(requests), engine_kv_reserved_bytes=stats.kv_reserved_bytes,
                         engine_kv_used_bytes=stats.kv_used_bytes,
                         max_measured_transient_bytes=stats.max_measured_transient_bytes,
                         kv_allocated_bytes=stats.kv_allocated_bytes,
                         planned_transient_bytes=stats.planned_transient_bytes, healthy=healthy,
                         prefix_hashes=tuple(prefix_hashes))


async def _close_quietly(stream: AsyncGenerator[RequestOutput, None]) -> None:
    try:
        await asyncio.shield(stream.aclose())
    except (asyncio.CancelledError, Exception):
        pass
