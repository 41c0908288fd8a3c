"""AsyncEngine: a background thread drives `Engine.step()`; asyncio streams per request."""

from __future__ import annotations

import asyncio
import atexit
import functools
import logging
import os
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from engine.config import EngineConfig
from engine.core.types import EngineStats, RequestOutput, SamplingParams, StepRecord
from engine.backend import mlx_backend
from engine.engine import Engine
from engine.warmup import warm_up

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    """To the engine thread: start a request, its outputs go to `stream`."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: "_Stream"


@dataclass(frozen=True)
class AbortRequest:
    """To the engine thread: abort a request (its listening stream gets the final output)."""

    request_id: str


class _Stream:
    """Where the engine thread delivers one request's outputs: an asyncio queue on the caller's loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item) -> None:
        _post_to_loop(self.loop, [(self.queue, item)])


def _stop_at_exit(ref: "weakref.ref[AsyncEngine]") -> None:
    engine = ref()
    if engine is not None:
        engine._stop_thread()


def _post_to_loop(loop: asyncio.AbstractEventLoop, items: list) -> None:
    """Put each (queue, item) on its asyncio queue, with one wake-up of `loop` for all of them."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _put_all(items: list) -> None:
    for q, item in items:
        q.put_nowait(item)


class AsyncEngine:
    """Runs `Engine.step()` in a background thread; `generate` is an async iterator per request.

    Cancelling the consumer (task cancel, `aclose`, a dropped client) aborts the request, and its
    KV is freed at once (between two forwards of the engine thread).
    """

    def __init__(self, engine: Union[Engine, Callable[[], Engine]], hang_timeout_s: float = 120.0,
                 warmup: Optional[bool] = None):
        """`engine`: an Engine, or a function that builds one, which then runs in the engine thread
        (`from_config` does so: every MLX array and kernel of the engine is then made by the thread
        that runs it; the constructor waits, and raises what the build raised).
        `warmup`: before serving, the engine thread runs each kind of step once (engine/warmup.py)
        and the constructor waits for it (None: where MLX runs on a GPU and the engine's
        `execution.start_warmup` is on). There the first forwards of a
        thread pay for kernel compilation and, on CUDA, for building the thread's own CUDA graphs (MLX
        keeps a stream and command encoder per thread): a warm-up in any other thread would not help."""
        self._build = None if isinstance(engine, Engine) else engine
        self.engine: Optional[Engine] = engine if self._build is None else None
        self._build_error: Optional[BaseException] = None
        self.hang_timeout_s = hang_timeout_s
        self._inbox: "queue.SimpleQueue[Union[AddRequest, AbortRequest]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._streams: dict[str, _Stream] = {}  # touched by the engine thread only
        self._busy_since: Optional[float] = None
        self._error: Optional[BaseException] = None
        # Called on the engine thread with the StepRecord of each step that ran a forward; must be
        # cheap. Set it before requests arrive (the replica does, at construction). Its errors are
        # logged, never raised.
        self.on_step: Optional[Callable[[StepRecord], None]] = None
        self._on_step_failed = False
        self.warmup_s: Optional[float] = None  # how long the warm-up took (None: none ran)
        self._warmed = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(warmup,), name="mlx-engine", daemon=True)
        self._thread.start()
        # A script that never calls shutdown() still stops the thread before the interpreter finalizes.
        self._atexit = functools.partial(_stop_at_exit, weakref.ref(self))
        atexit.register(self._atexit)
        self._warmed.wait()
        if self._build_error is not None:
            raise self._build_error

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(lambda: Engine.from_config(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def prefix_block_hash_chains(self) -> tuple[tuple[int, ...], ...]:
        return self.engine.prefix_block_hash_chains()

    def is_healthy(self) -> bool:
        busy = self._busy_since
        hung = busy is not None and time.monotonic() - busy > self.hang_timeout_s
        return self._thread.is_alive() and self._error is None and not hung

    async def generate(self, request_id: str, prompt_token_ids: Sequence[int], sampling: SamplingParams):
        self.engine.check_request(prompt_token_ids, sampling)  # bad input fails here, synchronously
        stream = _Stream(asyncio.get_running_loop())
        self._post(AddRequest(request_id, tuple(prompt_token_ids), sampling, stream))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self._post(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        self._post(AbortRequest(request_id))

    def shutdown(self) -> None:
        """Stop the engine thread and wait until it is gone. Idempotent; also runs at interpreter exit."""
        self._stop_thread()
        atexit.unregister(self._atexit)

    def _stop_thread(self, timeout_s: float = 10.0) -> None:
        """Join the thread, then wait for its OS thread to end: after `join` returns, the thread still runs
        MLX's thread-local destructors, which take the GIL; if the interpreter is finalizing by then, that
        aborts the process ("terminate called without an active exception")."""
        self._stopped.set()
        self._wake.set()
        if self._thread is threading.current_thread():
            return
        self._thread.join(timeout=timeout_s)
        if not os.path.isdir("/proc/self/task"):  # no /proc (macOS): give them a moment
            time.sleep(0.05)
        task = f"/proc/self/task/{self._thread.native_id}"
        deadline = time.monotonic() + timeout_s
        while not self._thread.is_alive() and os.path.exists(task) and time.monotonic() < deadline:
            time.sleep(0.005)  # releases the GIL those destructors wait for

    def _post(self, message: Union[AddRequest, AbortRequest]) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine is dead: {self._error!r}")
        self._inbox.put(message)
        self._wake.set()

    # --- engine thread --------------------------------------------------------------------------
    def _warmup(self) -> None:
        """engine/warmup.py's requests (engine thread); a failure is logged and the engine serves anyway."""
        try:
            warmup = warm_up(self.engine)
        except Exception:
            logger.exception("engine warm-up failed")
            return
        self.warmup_s = warmup.seconds
        slowest = max(warmup.steps, key=lambda s: s.seconds, default=None)
        logger.info("engine warm-up: %.2f s in %d steps (the slowest: %s)", self.warmup_s, len(warmup.steps), slowest)

    def _run(self, warmup: Optional[bool] = None) -> None:
        if self._build is not None:
            try:
                self.engine = self._build()
            except BaseException as exc:  # the constructor raises it
                self._build_error = exc
                self._warmed.set()
                return
        try:
            if warmup is None:  # the engine's config decides, on a GPU
                warmup = mlx_backend() != "cpu" and self.engine.config.execution.start_warmup
            if warmup:
                self._warmup()
        except BaseException as exc:  # the constructor raises it (the warm-up's own errors are logged)
            self._build_error = exc
            return
        finally:  # the constructor waits for it
            self._warmed.set()
        try:
            while not self._stopped.is_set():
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._busy_since = time.monotonic()
                record = self.engine.step()
                self._busy_since = None
                self._notify_step(record)  # before delivery: see on_step
                self._deliver(record.outputs)
        except BaseException as exc:  # the loop itself broke: fail everyone, report unhealthy
            logger.exception("engine loop died")
            self._error = exc
            for stream in self._streams.values():
                stream.put(RuntimeError(f"engine loop died: {exc!r}"))

    def _notify_step(self, record: StepRecord) -> None:
        observer = self.on_step
        if observer is None or record.plan is None or record.plan.is_empty:
            return
        try:
            observer(record)
        except Exception:  # an observer must not stop the engine
            if not self._on_step_failed:
                self._on_step_failed = True
                logger.warning("step observer failed; later failures are not logged", exc_info=True)

    def _drain_inbox(self) -> None:
        while True:
            try:
                message = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(message, AddRequest):
                try:
                    self.engine.add_request(message.request_id, message.prompt_token_ids, message.sampling)
                    self._streams[message.request_id] = message.stream
                except ValueError as exc:
                    message.stream.put(exc)
            else:  # abort: a listening stream gets the final "abort" output and ends
                out = self.engine.abort(message.request_id)
                stream = self._streams.pop(message.request_id, None)
                if stream is not None and out is not None:
                    stream.put(out)

    def _deliver(self, outputs: Sequence[RequestOutput]) -> None:
        """A step's outputs, with one wake-up per event loop (not one per request: every wake-up is
        a pipe write here and a turn of the loop, which competes with this thread for the GIL)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            by_loop.setdefault(stream.loop, []).append((stream.queue, out))
            if out.finished:
                del self._streams[out.request_id]
        for loop, items in by_loop.items():
            _post_to_loop(loop, items)
