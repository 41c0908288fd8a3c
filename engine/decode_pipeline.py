"""DecodePipeline: the engine's pipelined decode steps, for engine/executor.py's StepExecutor.

Decode k+1 is built from decode k's lazy tokens while k runs and launched once k has ended, or, where the
decode writes its KV without a donated buffer, as soon as k is encoded (`launch_ahead`); k's tokens are
returned for the engine to commit while k+1 runs. On CUDA a launch thread encodes them
(engine/launch_thread.py) while the engine thread commits and builds. Also StepClock, the timings of a
step's forwards that both record.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from engine.core.scheduler import Scheduler
from engine.core.types import ForwardTiming, SchedulerOutput, StepMemory, StepRun
from engine.launch_thread import LaunchThread
from engine.model.runner import ModelRunner
from engine.model.work import DecodeWork, Forward, finish
from engine.step_meter import StepMeter

logger = logging.getLogger(__name__)


class StepClock:
    """A step's start and its forwards' timings (ForwardTiming's fields, seconds from the start)."""

    def __init__(self):
        self.begin()

    def begin(self) -> None:
        self.t0 = time.perf_counter()
        self.timings: list[list] = []
        self.prev_encoded_s: Optional[float] = None  # when the launch thread returned from the last encode

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def forwards(self) -> tuple[ForwardTiming, ...]:
        return tuple(ForwardTiming(*t) for t in self.timings)

    def timed_launch(self, launch: Callable[[], None], build_s: Optional[float] = None,
                     built_s: Optional[float] = None) -> None:
        """Run `launch`, timed; `build_s`, `built_s`: its forward's graph build, this step."""
        record = [build_s, self.now(), 0.0, None, None, built_s]
        self.timings.append(record)
        launch()
        record[2] = self.now()


@dataclass(frozen=True)
class Inflight:
    """A decode built (and then launched) whose sampled tokens have not been read back."""

    plan: SchedulerOutput
    forward: Forward  # its tokens: [B], rows in plan.decodes order
    # a copy of its tokens for the host (`launch_ahead`): reading an array on the host moves its buffer to
    # managed memory, which must not happen to `tokens` while the next decode's encode reads them
    host_tokens: Optional[mx.array] = None


class DecodePipeline:
    """Runs decode-only steps as a pipeline: `start` one, then `advance` while `running`."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, meter: StepMeter, clock: StepClock,
                 launch_thread: bool, launch_ahead: bool):
        """`launch_thread`: decodes are encoded on a thread of their own (`LaunchThread`; the caller runs
        the engine on a stream any thread may encode); `launch_ahead` (with the thread): the next decode
        is encoded as soon as the one before is, for a runner whose decodes write the pool without a
        donated buffer (`ModelRunner.decode_writes_in_place`)."""
        self.runner, self.scheduler, self.meter, self.clock = runner, scheduler, meter, clock
        self._inflight: Optional[Inflight] = None  # a launched decode whose tokens are not read back
        self._base_bytes = 0  # MLX active memory where the in-flight decode's measure started
        self._launcher: Optional[LaunchThread] = None
        if launch_thread:
            self._launcher = LaunchThread()
            weakref.finalize(self, self._launcher.close)
        self.launch_ahead = launch_ahead and launch_thread
        self.num_launches = 0  # decodes launched after the first of a pipeline
        self.num_thread_launches = 0  # decodes the launch thread encoded
        self.num_ahead_launches = 0  # decodes launched before the one before them had ended

    @property
    def running(self) -> bool:
        return self._inflight is not None

    @property
    def goes_ahead(self) -> bool:
        """Whether decodes are launched ahead (`launch_ahead`): asked of the runner each time, as its
        decode path can change after construction (tests install stand-ins)."""
        return self.launch_ahead and self.runner.decode_writes_in_place

    def settle(self) -> None:
        """At a step's start with no decode in flight: join an encode no step joined (interrupted)."""
        if self._inflight is None and self._launcher is not None:
            self._launcher.settle()

    def start(self, plan: SchedulerOutput) -> StepRun:
        """Build and launch the decode of `plan` (the device idle), then `advance`."""
        try:
            build_s = self.clock.now()
            self._inflight = self.build(plan)
            self._launch(self._inflight, build_s)
        except Exception as exc:
            self._inflight = None
            return StepRun(plan, error=exc)
        return self.advance()

    def build(self, plan: SchedulerOutput, inputs: Optional[mx.array] = None, pipelined: bool = True) -> Inflight:
        """Build (not run) the decode of `plan`; inputs: the lazy tokens that feed it, else the rows'
        last tokens; `pipelined`: False for a decode the executor runs as a step's forward."""
        work = self.decode_work(plan.decodes) if inputs is None else [DecodeWork(i, -1) for i in plan.decodes]
        forward = self.runner.decode(work, inputs, defer_sampling=self._constrained(plan.decodes))
        if not pipelined or not self.goes_ahead or forward.tokens is None:
            return Inflight(plan, forward)
        host = forward.tokens + 0  # a copy (an astype to their own dtype would be the same array), computed last
        forward.stages.append([host])
        return Inflight(plan, forward, host)

    def decode_work(self, request_ids) -> list[DecodeWork]:
        """These rows' decode, each with its last token as input."""
        requests = self.scheduler.requests
        return [DecodeWork(i, requests[i].output_token_ids[-1]) for i in request_ids]

    def _constrained(self, request_ids) -> bool:
        """Whether a row has a grammar: its mask needs its previous token on the host, so its decode's
        sampling is built at launch (runner.decode's defer_sampling), the mask computed while the
        forward runs."""
        requests = self.scheduler.requests
        return any(r.sampling.grammar is not None for r in map(requests.get, request_ids) if r is not None)

    def _accept_ahead(self, plan: SchedulerOutput, tokens: list[int]) -> None:
        """Give the constrained rows' tokens of a finished decode to their grammars before the next
        decode, built already, is launched: its masks need them (the commit does not give them again)."""
        requests, samplers = self.scheduler.requests, self.runner.samplers
        for request_id, token in zip(plan.decodes, tokens):
            request, sampler = requests.get(request_id), samplers.get(request_id)
            if request is not None and sampler is not None and sampler.matcher is not None:
                sampler.accept(token, request.num_output_tokens)

    def _launch(self, decode: Inflight, build_s: Optional[float] = None,
                built_s: Optional[float] = None, ahead: bool = False) -> None:
        """Start a built decode: the device is idle (its transient is measured from here), or, `ahead`,
        the decode before it may still run (measured from when that one's record is taken). `build_s`,
        `built_s`: when its graph build started and ended (None: not timed)."""
        clock = self.clock
        built_s = clock.now() if built_s is None and build_s is not None else built_s
        if ahead:
            self.num_ahead_launches += 1
        else:
            self._base_bytes = self.meter.start()
        forward, runner = decode.forward, self.runner
        if self._launcher is None or forward.sampling is not None:  # a grammar's mask: host work
            clock.timed_launch(lambda: runner.launch(forward), build_s, built_s)
            return
        # its record's launch ends when the thread has started: the encode itself overlaps the commit
        # of the step before and the build of the next, and ends within the next step's wait
        record = [build_s, clock.now(), 0.0, None, None, built_s, clock.prev_encoded_s]
        clock.timings.append(record)
        self._launcher.submit(lambda: runner.launch(forward))
        self.num_thread_launches += 1
        record[2] = clock.now()

    def _join_launch(self) -> None:
        """Wait until the launch thread (if any) has encoded the decode in flight (its error raised)."""
        if self._launcher is not None:
            ended = self._launcher.join()
            self.clock.prev_encoded_s = None if ended is None else ended - self.clock.t0

    def _next(self, prev: Inflight) -> Optional[Inflight]:
        """The decode that follows `prev`, built before `prev`'s tokens are known: its rows that are
        still running and will not reach max_tokens with `prev`'s token; None if the scheduler has
        other work (a waiting request, a prompt chunk) or no row goes on."""
        s = self.scheduler
        if s.num_waiting or any(r.is_prefilling for r in s.running):
            return None
        index = {rid: i for i, rid in enumerate(prev.plan.decodes)}
        rows = [r.request_id for r in s.running if r.request_id in index
                and r.num_output_tokens + 1 < r.sampling.max_tokens]
        if not rows:
            return None
        tokens = prev.forward.tokens
        inputs = tokens if len(rows) == len(index) else tokens[mx.array([index[r] for r in rows])]
        plan = s.plan_decodes(rows, ahead=1)
        if not s.fits(plan):  # the rows' contexts grew past the free memory: schedule() takes fewer
            return None
        return self.build(plan, inputs)

    def _goes_ahead(self, prev: Inflight, nxt: Inflight) -> bool:
        """Whether `nxt` is launched before `prev` ends (`launch_ahead`): its tokens copied for the host,
        and both decodes' transients within the free memory and the configuration's bound (while the
        device runs prev's last operations the host encodes nxt's first: both hold their arrays)."""
        return (nxt.host_tokens is not None and prev.host_tokens is not None
                and self.scheduler.fits(nxt.plan, beside=prev.plan.predicted_transient_bytes))

    def advance(self) -> StepRun:
        """Build the next decode while the running one computes, wait for it, launch the next; the
        finished one's tokens are returned for the engine to commit (while the next one runs)."""
        prev, self._inflight = self._inflight, None
        build_s = self.clock.now()
        try:
            nxt = self._next(prev)
        except Exception as exc:  # the next forward's rows fail once this one's tokens are committed
            nxt, next_error = None, exc
        else:
            next_error = None
        built_s = self.clock.now()
        if nxt is not None and self._goes_ahead(prev, nxt):
            return self._advance_ahead(prev, nxt, build_s, built_s)
        try:
            tokens, memory = self._wait(prev)
        except Exception as exc:
            return StepRun(prev.plan, error=exc)
        if nxt is not None:
            self.num_launches += 1
            try:
                self._accept_ahead(prev.plan, tokens)
                self._launch(nxt, build_s, built_s)
                self._inflight = nxt
            except Exception as exc:
                next_error = exc
        return StepRun(prev.plan, dict(zip(prev.plan.decodes, tokens)), memory=memory, next_error=next_error,
                       forwards=self.clock.forwards())

    def _wait(self, prev: Inflight) -> tuple[list[int], StepMemory]:
        """Wait for prev (the device idle after it: the next decode may write the pool in place) and read
        its tokens -> (tokens, prev's record)."""
        self._join_launch()
        finish(prev.forward.tokens)
        tokens = prev.forward.tokens.tolist()
        return tokens, self.meter.record(prev.plan.predicted_transient_bytes, 0, self._base_bytes, pipelined=True)

    def _advance_ahead(self, prev: Inflight, nxt: Inflight, build_s: float, built_s: float) -> StepRun:
        """`advance` with nxt launched as soon as prev is encoded, then prev's tokens read (their copy: a
        wait on prev's event, which nothing encodes). nxt's rows and inputs do not depend on prev's tokens
        on the host (no grammar: `_goes_ahead`). prev's record spans from the previous record to here and
        is predicted as both decodes (their arrays can be alive together), over the base measured when the
        device was last idle at a launch (a decode-only step keeps nothing: the base stays)."""
        try:
            self._join_launch()
        except Exception as exc:
            return StepRun(prev.plan, error=exc)
        self.num_launches += 1
        try:
            self._launch(nxt, build_s, built_s, ahead=True)
        except Exception as exc:  # nothing but prev runs (a closed launch thread encodes on this one)
            try:
                tokens, memory = self._wait(prev)
            except Exception as wait_exc:
                return StepRun(prev.plan, error=wait_exc)
            return StepRun(prev.plan, dict(zip(prev.plan.decodes, tokens)), memory=memory, next_error=exc,
                           forwards=self.clock.forwards())
        self._inflight = nxt
        try:
            tokens = prev.host_tokens.tolist()
        except Exception as exc:  # prev's rows fail, and nxt's are among them: let nxt end, unread
            self._drop_inflight()
            return StepRun(prev.plan, error=exc)
        prev.forward.stages = []
        both = prev.plan.predicted_transient_bytes + nxt.plan.predicted_transient_bytes
        memory = self.meter.record(both, 0, self._base_bytes, predicted_other=nxt.plan.predicted_transient_bytes,
                                   pipelined=True)
        return StepRun(prev.plan, dict(zip(prev.plan.decodes, tokens)), memory=memory, forwards=self.clock.forwards())

    def _drop_inflight(self) -> None:
        """Wait for the decode in flight and let it go unread; the next measure starts after it."""
        inflight, self._inflight = self._inflight, None
        try:
            self._join_launch()
            finish(inflight.forward.tokens)
        except Exception:
            logger.exception("the decode launched ahead of a failed one failed too")
        self._base_bytes = self.meter.start()
