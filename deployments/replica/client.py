"""How callers reach the EngineReplica deployment: the `ReplicaClient` contract and its Ray handle client.

The ingress holds a ReplicaClient; with admission on it is deployments/admission/actor.py's
AdmittedReplicaClient, which wraps a HandleReplicaClient. Both import this module, which imports neither.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
from collections.abc import AsyncGenerator
from typing import Any, Protocol

from deployments.errors import APIError, EngineError, ReplicaUnavailableError, ServiceUnavailableError, unwrap
from deployments.messages import AbortRequest, GenerateOutput, GenerateRequest, ReplicaInfo, ReplicaStats

logger = logging.getLogger(__name__)


class ReplicaClient(Protocol):
    """What the ingress calls on the engine replicas."""

    def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]: ...

    async def info(self, timeout_s: float) -> ReplicaInfo:
        """The model of one replica; raises ServiceUnavailableError when none answers in time."""
        ...

    async def stats(self, timeout_s: float) -> ReplicaStats: ...


class HandleReplicaClient:
    """Calls EngineReplica through a Ray Serve DeploymentHandle; maps Ray errors to API errors."""

    def __init__(self, handle: Any, max_attempts: int = 3) -> None:
        self._handle = handle
        self._max_attempts = max_attempts

    async def generate(self, request: GenerateRequest) -> AsyncGenerator[GenerateOutput, None]:
        """Stream from one replica. A replica that dies before its first output is retried on another
        (nothing was produced yet); after that, its death is the request's error."""
        for attempt in range(1, self._max_attempts + 1):
            gen = child_call(self._handle.options(stream=True).generate, request)
            done = started = False
            try:
                async for out in gen:
                    started = True
                    yield out
                done = True
                return
            except Exception as e:
                if started or attempt == self._max_attempts or not _replica_died(e):
                    raise replica_error(e) from None
                logger.warning("replica died before output (attempt %d): %r; retrying", attempt, e)
            finally:
                if not done:  # client went away or failed: cancel the replica call, which aborts the engine
                    gen.cancel()
                    self._abort_on_target(request)

    def _abort_on_target(self, request: GenerateRequest) -> None:
        """Serve's cancel is best effort: a call cancelled while Serve dispatches it still reaches the
        replica and runs to its end, keeping the engine busy with a prompt nobody waits for. When
        admission chose the replica, tell it directly; it drops the request whether the call is already
        there or arrives later. Fire and forget: the caller is being cancelled."""
        if request.target_replica_id is None:
            return
        try:
            child_call(self._handle.abort, AbortRequest(request.request_id, request.target_replica_id))
        except Exception:  # the replica is gone: nothing runs there any more
            logger.debug("abort of %s not sent", request.request_id, exc_info=True)

    async def info(self, timeout_s: float) -> ReplicaInfo:
        return await self._call(self._handle.info, timeout_s)

    async def stats(self, timeout_s: float) -> ReplicaStats:
        return await self._call(self._handle.stats, timeout_s)

    async def _call(self, method: Any, timeout_s: float) -> Any:
        response = child_call(method)

        async def result() -> Any:
            return await response

        try:
            return await asyncio.wait_for(result(), timeout_s)
        except asyncio.TimeoutError:
            response.cancel()
            raise ServiceUnavailableError(f"no engine replica answered within {timeout_s:g} s",
                                          retry_after_s=timeout_s) from None
        except Exception as e:
            raise replica_error(e) from None


def child_call(method: Any, *args: Any) -> Any:
    """`method.remote(*args)` under a Serve request id of its own.

    Serve gives every call made while handling a request the caller's internal request id. Two calls of
    one request in flight at once (the n choices of a request, each streamed from a replica) then share
    it, and Serve loses one of them: it never reaches a replica and its stream never ends (Ray 2.60;
    tests/serve/test_serve_e2e.py::test_n_choices_never_hang). Each call gets its own id in a copy of
    the context, so the caller's own context is untouched.
    """
    return contextvars.copy_context().run(_call_with_own_request_id, method, args)


def _call_with_own_request_id(method: Any, args: tuple) -> Any:
    from ray.serve import context as serve_context
    from ray.serve._private.utils import generate_request_id

    current = serve_context._serve_request_context.get()
    if current is not None:
        serve_context._serve_request_context.set(
            dataclasses.replace(current, _internal_request_id=generate_request_id()))
    return method.remote(*args)


def _replica_died(exc: BaseException) -> bool:
    from ray import exceptions as ray_exceptions

    return isinstance(unwrap(exc), (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError))


def replica_error(exc: BaseException) -> APIError:
    """An API error for whatever a replica call raised."""
    from ray import exceptions as ray_exceptions
    from ray.serve import exceptions as serve_exceptions

    cause = unwrap(exc)
    if isinstance(cause, APIError):
        return cause
    if isinstance(cause, serve_exceptions.BackPressureError):
        return ServiceUnavailableError("engine replicas are at capacity", retry_after_s=1.0)
    if isinstance(cause, serve_exceptions.DeploymentUnavailableError):
        return ServiceUnavailableError("the engine deployment is unavailable", retry_after_s=5.0)
    if isinstance(cause, (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)):
        return ReplicaUnavailableError(f"the engine replica failed: {type(cause).__name__}")
    logger.error("replica call failed: %r", exc)
    return EngineError(f"the engine replica failed: {type(cause).__name__}: {cause}")
