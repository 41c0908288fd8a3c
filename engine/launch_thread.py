"""The host thread that encodes the pipelined decodes on CUDA (`StepOptions.launch_thread`), for
engine/decode_pipeline.py's DecodePipeline."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional


class LaunchThread:
    """The host thread that encodes the pipelined decodes (`StepOptions.launch_thread`).

    MLX's `async_eval` releases the GIL while it encodes a forward, and returns only once the device is
    within MLX's window of queued batches (10 of `max_ops_per_buffer` operations) of the forward's end
    (docs/decode.md): on the engine thread the host can do nothing else for most of a decode step, so
    the commit of the step before and the graph build of the step after ran while the device finished
    the window and then idled. Here the engine thread commits and builds while this thread encodes.
    One thread encodes at a time: the engine thread joins this one before it encodes, or waits for the
    device, on a stream of MLX's thread-unsafe kind (one encoder for both threads; the engine makes it
    its default stream); while this one encodes, it may wait for an array already evaluated (a decode
    launched ahead: engine/decode_pipeline.py), which encodes nothing."""

    def __init__(self):
        self._go = threading.Semaphore(0)
        self._started = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._lock = threading.Lock()  # the job, busy and closed, between submit and close
        self._job: Optional[Callable[[], None]] = None
        self._error: Optional[BaseException] = None
        self._ended_s = 0.0  # perf_counter when the last job returned
        self._busy = self._closed = False
        self._thread = threading.Thread(target=self._run, name="mlx-decode-launch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job, self._job = self._job, None
            if job is None:  # closed
                return
            self._started.release()
            try:
                job()
            except BaseException as exc:  # raised by `join`, on the engine thread
                self._error = exc
            job = None  # its forward and runner are not this thread's to keep while it waits
            self._ended_s = time.perf_counter()
            self._done.release()

    def submit(self, job: Callable[[], None]) -> None:
        """Run `job` (an encode) on this thread; returns once it has started. Waiting for the start hands
        this thread the GIL at once: otherwise it would wait for the engine thread's next switch (up to
        Python's switch interval, 5 ms) while the device idles. Once closed, runs `job` here."""
        self.settle()
        with self._lock:
            if not self._closed:
                self._job, self._busy = job, True
                self._go.release()
        if not self._busy:
            job()
            self._ended_s = time.perf_counter()
            return
        self._started.acquire()

    def settle(self) -> None:
        """Join a job no step joined (a step interrupted, by a KeyboardInterrupt, before it did), dropping
        its error: nothing may encode while it runs."""
        if self._busy:
            try:
                self.join()
            except Exception:
                pass

    def join(self) -> Optional[float]:
        """Wait for the running job (if any) to return; re-raise its error. Returns when it returned
        (perf_counter seconds; None: no job was running). The engine thread's alone."""
        if not self._busy:
            return None
        self._done.acquire()
        with self._lock:
            self._busy = False
        error, self._error = self._error, None
        if error is not None:
            raise error
        return self._ended_s

    def close(self) -> None:
        """End the thread (from any thread: the pipeline's finalizer, or at exit). A job running goes on;
        the engine thread still joins it, and encodes later ones itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if not self._busy:
                self._go.release()  # no job: the thread ends
            # busy: the thread finishes the job and then waits for ever (a daemon), its job let go
