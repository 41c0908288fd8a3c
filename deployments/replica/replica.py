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
import dataclasses
import logging
import os
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Optional, Union

from engine.config import EngineConfig
from engine.core.prefix_hash import MAX_SUMMARY_HASHES, summarize
from engine.core.types import RequestOutput, SamplingParams
from deployments.telemetry.metrics import TelemetryConfig

from deployments.admission.state import ReplicaReport, build_report
from deployments.errors import BadRequestError, EngineError, ServiceUnavailableError
from deployments.telemetry.observability import TelemetryFactory, process_telemetry
from deployments.replica.telemetry import ReplicaObserver

logger = logging.getLogger(__name__)

MAX_ABORTED_IDS = 10_000  # ids of requests aborted before they arrived, kept...
ABORTED_TTL_S = 600.0  # ...this long at most

EngineFactory = Callable[[EngineConfig], Any]
ReporterFactory = Callable[[Callable[[], Optional["ReplicaReport"]]], Any]  # report_fn -> started reporter


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


@dataclass(frozen=True)
class ReplicaInfo:
    replica_id: str
    model_name: str
    max_model_len: int
    prometheus_url: Optional[str] = None


def default_engine_factory(config: EngineConfig) -> Any:
    """Build the real engine; imported lazily so this module loads without a model."""
    from engine.async_engine import AsyncEngine

    return AsyncEngine.from_config(config)


def default_replica_id() -> str:
    """The Ray Serve replica id when running in Serve, else a random one."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # not inside a Serve replica (unit tests)
        return uuid.uuid4().hex[:8]


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
        self._replica_id = replica_id or default_replica_id()
        self._engine = (engine_factory or default_engine_factory)(config)
        telemetry_config = TelemetryConfig.model_validate(telemetry or {"exporter": "none"})
        self._telemetry = (telemetry_factory or process_telemetry)(telemetry_config, "replica")
        self._observer = ReplicaObserver(self._telemetry, self._replica_id, self._engine,
                                         prefix_cache=config.prefix_cache_fraction > 0)
        self._live: dict[str, tuple[int, int]] = {}  # request_id -> (prompt tokens, max_tokens)
        self._aborted: "OrderedDict[str, float]" = OrderedDict()  # aborted before they arrived -> when
        # Admission heartbeat (deployments/admission/actor.py): a started reporter calling admission_report().
        self._reporter = reporter_factory(self.admission_report) if reporter_factory else None
        logger.info("replica %s serving %s", self._replica_id, self._engine.model_name)

    async def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateOutput]:
        """Stream the increments of one request; abort it in the engine if the caller goes away."""
        if self._aborted.pop(request.request_id, None) is not None:
            return  # its caller went away while Serve was still dispatching it: never reaches the engine
        trace = self._observer.start(request)
        self._live[request.request_id] = (len(request.prompt_token_ids), request.sampling.max_tokens)
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
        )

    def info(self) -> ReplicaInfo:
        if not self._engine.is_healthy():
            raise ServiceUnavailableError(f"engine replica {self._replica_id} is not healthy")
        return ReplicaInfo(self._replica_id, self._engine.model_name, int(self._engine.max_model_len),
                           self._telemetry.prometheus_url)

    def stats(self) -> dict[str, Any]:
        """The engine's stats as a plain dict, plus this replica's id."""
        stats = self._engine.stats()
        data = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
        data["replica_id"] = self._replica_id
        data["prometheus_url"] = self._telemetry.prometheus_url
        data["cpu_threads"] = os.environ.get("OPENBLAS_NUM_THREADS")  # ReplicaArgs.cpu_threads, as set
        data["niceness"] = os.nice(0)  # Ray's worker niceness (deployments/cluster_env.py)
        return data

    def admission_report(self) -> Optional[ReplicaReport]:
        """Capacity, live requests and the prefix cache's block hashes (most recently used first; the
        reporter keeps the first max_prefix_hashes) for the admission controller (None: the engine reports
        no capacity)."""
        stats = self._engine.stats()
        data = dataclasses.asdict(stats) if dataclasses.is_dataclass(stats) else dict(stats)
        chains = getattr(self._engine, "prefix_block_hash_chains", None)  # absent: no prefix cache to report
        prefix_hashes = summarize(chains(), MAX_SUMMARY_HASHES) if chains is not None else ()
        return build_report(self._replica_id, data, dict(self._live), healthy=self._engine.is_healthy(),
                            prefix_hashes=prefix_hashes)

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


async def _close_quietly(stream: Any) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is None:
        return
    try:
        await asyncio.shield(aclose())
    except (asyncio.CancelledError, Exception):
        pass
