"""Graceful shutdown of the ingresses: new requests get 503, requests in flight finish or end with an error.

The process that deployed the app (deployments/supervisor.py, what scripts/serve runs) creates one named
`DrainSignal` actor before the app. Every ingress replica finds it by name (`find_drain`), registers, and
leaves one call waiting on it (`wait`), so a drain reaches every ingress at once and costs nothing before.
On SIGTERM the supervisor calls `start(timeout_s)`: each ingress then refuses new requests and /health
with 503 + Retry-After, ends the requests still running at the deadline with an error (a stream with an
error event), and reports its count of requests in flight until it is 0; the supervisor waits for every
registered ingress to reach 0 (or the deadline), then shuts Serve down. An app deployed without the
supervisor (`serve deploy`) finds no signal and never drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, Optional

from deployments.errors import ServiceUnavailableError
from deployments.serve_context import current_replica_id

logger = logging.getLogger(__name__)

DRAIN_ACTOR_NAME = "mlx-serve-drain"
DRAIN_NAMESPACE = "serve"  # Serve's own namespace: the supervisor's driver runs in it, as `serve run` does


class DrainSignal:
    """The named actor (created by the supervisor with `ray.remote`): the drain's start and deadline, and
    the latest count of requests in flight of every registered ingress."""

    def __init__(self) -> None:
        self._started = asyncio.Event()
        self._timeout_s = 0.0
        self._in_flight: dict[str, tuple[int, int]] = {}  # ingress id -> (report sequence, count)

    def register(self, ingress_id: str) -> None:
        self._in_flight.setdefault(ingress_id, (-1, 0))

    async def wait(self) -> float:
        """Returns, with the drain's timeout, once the drain starts."""
        await self._started.wait()
        return self._timeout_s

    def start(self, timeout_s: float) -> None:
        self._timeout_s = timeout_s
        self._started.set()

    def report(self, ingress_id: str, sequence: int, num_in_flight: int) -> None:
        """An ingress's count; reports arrive from two threads of it, so the latest sequence wins."""
        if sequence > self._in_flight.get(ingress_id, (-1, 0))[0]:
            self._in_flight[ingress_id] = (sequence, num_in_flight)

    def pending(self) -> dict[str, int]:
        """Ingresses not drained yet: no report since the start (-1), or requests still in flight."""
        return {k: (n if seq >= 0 else -1) for k, (seq, n) in self._in_flight.items() if seq < 0 or n > 0}


class IngressDrain:
    """One ingress's side: refuses requests once draining, counts those in flight, reports the count."""

    def __init__(self, signal: Any = None, ingress_id: str = "", retry_after_s: float = 5.0) -> None:
        self._signal = signal
        self._id = ingress_id
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()  # the count changes on the event loop, the drain starts on a Ray thread
        self._sequence = 0
        self.num_in_flight = 0
        self.deadline: Optional[float] = None  # time.monotonic() after which running requests are ended
        if signal is not None:
            signal.register.remote(ingress_id)
            signal.wait.remote().future().add_done_callback(self._on_start)

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def check_open(self) -> None:
        """Raises 503 + Retry-After while draining (new requests, /health)."""
        if self.deadline is not None:
            raise ServiceUnavailableError("the server is shutting down", retry_after_s=self._retry_after_s)

    def check_deadline(self) -> None:
        """Raises 503 for a request still running at the drain's deadline (a stream: an error event)."""
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise ServiceUnavailableError("the server shut down before this request finished",
                                          retry_after_s=self._retry_after_s)

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """A request's whole life (a stream: until its last event is sent): refused with 503 while draining,
        else counted in flight."""
        self.check_open()
        self._change(+1)
        try:
            yield
        finally:
            self._change(-1)

    def _change(self, delta: int) -> None:
        with self._lock:
            self.num_in_flight += delta
            if self.deadline is not None:
                self._report()

    def _on_start(self, future: Any) -> None:
        try:
            timeout_s = float(future.result())
        except Exception:  # the supervisor (owner of the signal) is gone: nobody asks for a drain
            logger.debug("drain signal lost", exc_info=True)
            return
        with self._lock:
            self.deadline = time.monotonic() + timeout_s
            logger.warning("ingress %s draining: %d requests in flight, %.0f s to finish", self._id,
                           self.num_in_flight, timeout_s)
            self._report()

    def _report(self) -> None:  # under self._lock: reports leave in the order of their sequence
        self._sequence += 1
        try:
            self._signal.report.remote(self._id, self._sequence, self.num_in_flight)
        except Exception:  # the supervisor is gone: nothing waits for this count
            logger.debug("drain report not sent", exc_info=True)


def find_drain() -> IngressDrain:
    """This ingress's IngressDrain, on the supervisor's signal when there is one (else never draining)."""
    try:
        import ray

        if not ray.is_initialized():
            return IngressDrain()
        signal = ray.get_actor(DRAIN_ACTOR_NAME, namespace=DRAIN_NAMESPACE)
    except Exception:  # no supervisor (serve deploy, tests without Ray): nothing will ask for a drain
        return IngressDrain()
    ingress_id = current_replica_id()
    return IngressDrain(signal, ingress_id) if ingress_id else IngressDrain()
