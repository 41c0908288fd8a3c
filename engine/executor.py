"""StepExecutor: runs a plan's forwards on the device, one at a time, each built while the previous one
runs; the pipelined decode; the measured transient of every step.

Forwards that write the KV pool never overlap on the device (engine/model/work.py `finish`), so a step's
transient is its largest forward's, which the memory model predicts (docs/memory.md). It owns what
spans steps: the decode in flight, the prompt chunk left running (`_Deferred`), the measured tail that
goes into the next record, the largest predicted / measured transients.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx

from engine.core.memory.model import MemoryModel
from engine.core.memory.plan import pack_groups
from engine.core.scheduler import Scheduler
from engine.core.types import ForwardTiming, NewRow, Request, SchedulerOutput, StepMemory, StepRun
from engine.launch_thread import LaunchThread
from engine.model.runner import ModelRunner
from engine.model.work import DecodeWork, Forward, PrefillWork, finish
from engine.model.sampling import RequestSampler

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Build:
    """One forward of a step, to be built: the request ids whose tokens it samples (in its tokens' order),
    the function that builds it, the request of its one prompt chunk (None: a decode, mixed or packed
    forward) and, for a packed forward, its chunks' own builds (run instead where it cannot be built)."""

    ids: tuple
    build: Callable[[], Forward]
    chunk_of: Optional[str] = None
    apart: tuple = ()


@dataclass(frozen=True)
class _Inflight:
    """A decode built (and then launched) whose sampled tokens have not been read back."""

    plan: SchedulerOutput
    forward: Forward  # its tokens: [B], rows in plan.decodes order
    # a copy of its tokens for the host (`launch_ahead`): reading an array on the host moves its buffer to
    # managed memory, which must not happen to `tokens` while the next decode's encode reads them
    host_tokens: Optional[mx.array] = None


@dataclass(frozen=True)
class _Deferred:
    """A step's last forward, a prompt chunk that samples nothing, left running when the step returned
    (`overlap_steps`): the next step is scheduled and its first forward built meanwhile."""

    forward: Forward
    predicted_bytes: int  # its step's prediction
    base_bytes: int  # what its step's transient was measured over


def _measure_start() -> int:
    """Start measuring a transient: MLX's active bytes now, its peak reset. Synchronized first: MLX's
    worker may still be releasing a finished forward's buffers, which would count in this base and hide
    as much of the transient."""
    mx.synchronize()
    mx.reset_peak_memory()
    return mx.get_active_memory()


class StepExecutor:
    """Runs plans with `runner`; reads the scheduler's requests (inputs, the next pipelined decode)."""

    def __init__(self, runner: ModelRunner, memory: MemoryModel, scheduler: Scheduler, seed: int,
                 async_decode: bool, overlap_steps: bool,
                 make_sampler: Optional[Callable[[Request], RequestSampler]] = None,
                 launch_thread: bool = False, launch_ahead: bool = False):
        """`make_sampler`: a new row's sampler (the engine's gives it its grammar's matcher); else one
        from the request's sampling params and `seed`. `launch_thread`: pipelined decodes are encoded
        on a thread of their own (`LaunchThread`; the caller runs the engine on a stream any thread
        may encode). `launch_ahead` (with the thread; StepOptions'): the next pipelined decode is
        encoded as soon as the one before is, not after it ends: for a runner whose decodes write the
        pool without a donated buffer (`ModelRunner.decode_writes_in_place`)."""
        self.runner = runner
        self.make_sampler = make_sampler or (lambda r: RequestSampler(r.sampling, seed, r.prompt_token_ids))
        self.memory = memory
        self.scheduler = scheduler
        self.async_decode = async_decode
        self.overlap_steps = overlap_steps
        self._inflight: Optional[_Inflight] = None  # a launched decode whose tokens are not read back
        self._deferred: Optional[_Deferred] = None  # the previous step's last prompt chunk, still running
        self._carried: Optional[StepMemory] = None  # its measured tail, for the next step's record
        self._launch_base_bytes = 0  # MLX active memory when the in-flight decode was launched
        self._t0 = time.perf_counter()  # the step's start, for its forwards' timings
        self._timings: list[list] = []  # per forward: ForwardTiming's fields, seconds
        self.num_steps = self.max_predicted_bytes = self.max_measured_bytes = self.last_predicted_bytes = 0
        self._launcher: Optional[LaunchThread] = None
        self.num_thread_launches = 0  # decodes the launch thread encoded
        self._prev_encoded_s: Optional[float] = None  # when it returned from the last, from the step's start
        self.launch_ahead = launch_ahead and launch_thread and async_decode
        self.num_ahead_launches = 0  # decodes launched before the one before them had ended
        if launch_thread and async_decode:
            self._launcher = LaunchThread()
            weakref.finalize(self, self._launcher.close)

    @property
    def goes_ahead(self) -> bool:
        """Whether pipelined decodes are launched ahead (`launch_ahead`): asked of the runner each time,
        as its decode path can change after construction (tests install stand-ins)."""
        return self.launch_ahead and self.runner.decode_writes_in_place

    @property
    def pipelining(self) -> bool:
        return self._inflight is not None

    @property
    def has_deferred(self) -> bool:
        """A prompt chunk of the previous step is still on the device (`overlap_steps`)."""
        return self._deferred is not None

    @property
    def busy(self) -> bool:
        """A forward is still on the device (a pipelined decode, or a deferred prompt chunk)."""
        return self._inflight is not None or self._deferred is not None

    # --- one plan -----------------------------------------------------------------------------------
    def run(self, plan: SchedulerOutput) -> StepRun:
        """Give the plan's new rows their blocks and prefixes, then run its forwards (or start the
        decode pipeline)."""
        self._begin()
        if plan.new_rows or not plan.prefills:  # pool growth, prefix copies, decodes: not while it runs
            self._retire_deferred()
        admitted = self._add_rows(plan.new_rows, plan.num_pool_blocks)
        if plan.is_empty:
            return StepRun(plan)
        slices = self._slice_reads(plan)
        # predicted again with the chunks the runner reads as views (a request's chunks all views, or
        # all counted as gathers): the record's prediction is of what runs
        memory_plan = self.scheduler.memory_plan(plan.decodes, plan.prefills, slices, packs=plan.packs)
        plan = dataclasses.replace(plan, memory_plan=memory_plan, predicted_transient_bytes=self.memory.step_transient_bytes(
            memory_plan, mixed=plan.mixed))
        self.num_steps += 1
        if self._can_pipeline(plan):
            try:
                build_s = time.perf_counter() - self._t0
                self._inflight = self._build_decode(plan, None)
                self._launch(self._inflight, build_s)
            except Exception as exc:
                self._inflight = None
                return StepRun(plan, error=exc, slice_reads=slices)
            return self._advance()
        failed: dict[str, str] = {}
        try:
            sampled, memory = self._execute(plan, failed, admitted)
        except Exception as exc:  # a failed decode forward fails this step's requests, not the engine
            return StepRun(plan, failed=failed, error=exc, slice_reads=slices)
        return StepRun(plan, sampled, failed, memory, slice_reads=slices, forwards=self._forward_timings())

    def _begin(self) -> None:
        self._t0 = time.perf_counter()
        self._timings = []
        self._prev_encoded_s = None
        if self._inflight is None and self._launcher is not None:  # nothing should be running
            self._launcher.settle()

    def _forward_timings(self) -> tuple[ForwardTiming, ...]:
        return tuple(ForwardTiming(*t) for t in self._timings)

    def _slice_reads(self, plan: SchedulerOutput) -> frozenset:
        """Requests whose prompt chunks (a step can hold several of one request, one after another) the
        runner all reads as views of the pool (no gathered copy; engine/model/kv_pool.py `slice_start`).
        Decodes are predicted as the runner reads them: paged or gathered (`MemoryModel.paged_decode`)."""
        before: dict[str, int] = {}  # tokens of the request's earlier chunks in this step
        views, gathers = set(), set()
        for c in plan.prefills:
            done = before.get(c.request_id, 0)
            if c.num_forward_tokens > 1:  # a one-token chunk always gathers (Scheduler.predict counts it so)
                reads_view = self.runner.reads_slice(c.request_id, done + c.num_forward_tokens)
                (views if reads_view else gathers).add(c.request_id)
            before[c.request_id] = done + c.num_tokens
        return frozenset(views - gathers)

    def _add_rows(self, new_rows: tuple[NewRow, ...], num_pool_blocks: int) -> StepMemory:
        """Grow the pool to the plan's size, give admitted requests their rows and copy their prefix-
        cache hits. Growth and copies run between forwards; their transients (one array of the old
        pool, one layer's K or V of the copied prefix) are measured and predicted."""
        predicted = measured = 0
        if num_pool_blocks > self.runner.num_pool_blocks:
            predicted = self.memory.kv_copy_bytes(self.runner.pool_tokens)
            measured = self._measured(lambda: self.runner.grow_pool(num_pool_blocks))
        for row in new_rows:
            request = self.scheduler.requests[row.request_id]
            self.runner.add_row(row.request_id, row.block_ids, self.make_sampler(request),
                                ring=row.ring)
            prefix = row.prefix
            if prefix is not None:
                copied = self._measured(lambda: self.runner.copy_prefix(
                    row.request_id, prefix.source_block_ids, prefix.num_tokens))
                predicted = max(predicted, self.memory.kv_copy_bytes(prefix.num_tokens))
                measured = max(measured, copied)
        return StepMemory(predicted, measured)

    def _measured(self, fn: Callable[[], None]) -> int:
        """Run fn, evaluated, and return its transient: MLX peak over what was live before, less KV
        it allocated (pool growth and prefix copies, which run between forwards)."""
        kv_before = self.runner.kv_allocated_bytes
        active_before = _measure_start()
        fn()
        mx.synchronize()
        new_kv = self.runner.kv_allocated_bytes - kv_before
        return max(0, mx.get_peak_memory() - active_before - new_kv)

    # --- forwards of a step ---------------------------------------------------------------------------
    def _decode_work(self, plan: SchedulerOutput) -> list[DecodeWork]:
        """The plan's decode rows, each with its last token as input."""
        requests = self.scheduler.requests
        return [DecodeWork(i, requests[i].output_token_ids[-1]) for i in plan.decodes]

    def _builds(self, plan: SchedulerOutput) -> list["_Build"]:
        """The plan's forwards to build, in order: the decode (a mixed runner's decode rows ride with the
        first chunk, engine/model/layers/mixed.py), then the prompt chunks, several rows' packed into one
        forward where the plan says (SchedulerOutput.packs)."""
        requests = self.scheduler.requests
        works = [PrefillWork(c.request_id, requests[c.request_id].prompt_token_ids[c.start:c.start + c.num_tokens],
                             c.start, c.completes_prompt, c.num_pad_tokens) for c in plan.prefills]
        groups = pack_groups(tuple(works), plan.packs)
        builds = []
        if plan.mixed:  # if that forward cannot be built, the two run apart: a chunk's error fails its row only
            try:
                mixed = self.runner.mixed_forward(works[0], self._decode_work(plan))
            except Exception:
                logger.exception("forward of %s with %d decode rows failed to build; running them apart",
                                 works[0].request_id, len(plan.decodes))
            else:
                first = groups.pop(0)[0]
                ids = ((first.request_id,) if first.sample else ()) + tuple(plan.decodes)
                builds.append(_Build(ids, lambda: mixed))
        if plan.decodes and not builds:
            builds.append(_Build(plan.decodes, lambda: self._build_decode(plan, None).forward))
        for group in groups:
            singles = [_Build((w.request_id,), lambda w=w: self.runner.prefill(w), w.request_id) for w in group]
            if len(group) > 1:  # if it cannot be built, its chunks run apart (`_execute`)
                builds.append(_Build(tuple(w.request_id for w in group if w.sample),
                                     lambda group=group: self.runner.prefill_packed(list(group)), apart=tuple(singles)))
            else:
                builds += singles
        return builds

    def _execute(self, plan: SchedulerOutput, failed: dict[str, str], admitted: StepMemory):
        """Run the plan's forwards one at a time on the device (work.finish), each built while the
        previous one runs; the first while the previous step's last forward may still run (`_Deferred`).
        A prompt chunk whose graph cannot be built touches its own row only: its request goes into
        `failed` (a packed forward that cannot be built runs its chunks apart). The step's transient is
        MLX's peak over what was alive before its first launch, less KV the step allocated. `admitted`: this step's pool growth and prefix copies (`_add_rows`).
        Returns (sampled tokens, the step's StepMemory)."""
        sampled: dict[str, int] = {}
        running = None  # (request ids, Forward) on the device
        before = None  # (MLX active bytes, KV allocated bytes) once the previous step's forward is done
        builds = self._builds(plan)
        while builds:
            item = builds.pop(0)
            if item.chunk_of in failed:  # a later chunk of a request whose earlier one failed in this step
                continue
            build_s = time.perf_counter() - self._t0
            try:
                forward = item.build()
            except Exception as exc:
                if item.apart:  # a packed forward: its chunks run apart
                    logger.exception("packed forward of %d prompt chunks failed to build; running them apart",
                                     len(item.apart))
                    builds[:0] = item.apart
                    continue
                if item.chunk_of is None:
                    raise  # the decode: the step fails
                logger.exception("prefill of %s failed", item.chunk_of)
                failed[item.chunk_of] = f"{type(exc).__name__}: {exc}"
                continue
            built_s = time.perf_counter() - self._t0
            if running is not None:
                self._retire(running, sampled)
            if before is None:
                before = self._measure_from()
            self._timed_launch(forward, build_s, built_s)
            running = (item.ids, forward)
        if before is None:
            before = self._measure_from()
        deferred = running is not None and running[1].tokens is None and self.overlap_steps
        if running is not None and not deferred:
            self._retire(running, sampled)
        base = before[0] + self.runner.kv_allocated_bytes - before[1]
        memory = self._record_memory(plan.predicted_transient_bytes, admitted.measured_bytes, base,
                                     admitted.predicted_bytes)
        if deferred:
            self._deferred = _Deferred(running[1], plan.predicted_transient_bytes, base)
        return sampled, memory

    def _timed_launch(self, forward: Forward, build_s: Optional[float] = None,
                      built_s: Optional[float] = None) -> None:
        """Launch `forward`, timed (ForwardTiming); `build_s`, `built_s`: its graph build, this step."""
        record = [build_s, time.perf_counter() - self._t0, 0.0, None, None, built_s]
        self._timings.append(record)
        self.runner.launch(forward)
        record[2] = time.perf_counter() - self._t0

    def _retire(self, running, sampled: dict[str, int]) -> None:
        """Wait for a launched forward and keep its sampled tokens."""
        ids, forward = running
        record = self._timings[-1] if self._timings and self._timings[-1][4] is None else None
        if record is not None:
            record[3] = time.perf_counter() - self._t0
        forward.finish()
        if forward.tokens is not None:
            sampled.update(zip(ids, forward.tokens.tolist()))
        if record is not None:
            record[4] = time.perf_counter() - self._t0

    def _measure_from(self) -> tuple[int, int]:
        """Wait for the previous step's deferred forward, then start measuring this step's transient."""
        self._retire_deferred()
        return _measure_start(), self.runner.kv_allocated_bytes

    def _retire_deferred(self) -> None:
        """Wait for the forward the previous step left running (`_Deferred`); its transient since that
        step was recorded goes into the next record (`_record_memory`)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        deferred.forward.finish()
        self._carried = StepMemory(deferred.predicted_bytes, max(0, mx.get_peak_memory() - deferred.base_bytes))

    def _record_memory(self, predicted: int, measured: int, base_bytes: int, predicted_other: int = 0,
                       pipelined: bool = False) -> StepMemory:
        """The step's StepMemory: its measured transient is MLX's peak since the last reset over
        `base_bytes` (what is not the step's), at least `measured` (pool growth / copies before it)."""
        measured = max(measured, mx.get_peak_memory() - base_bytes, 0)
        mx.reset_peak_memory()
        carried, self._carried = self._carried, None
        if carried is not None:  # the tail of the previous step's deferred forward
            predicted_other = max(predicted_other, carried.predicted_bytes)
            measured = max(measured, carried.measured_bytes)
        predicted = max(predicted, predicted_other)
        self.max_measured_bytes = max(self.max_measured_bytes, measured)
        self.max_predicted_bytes = max(self.max_predicted_bytes, predicted)
        self.last_predicted_bytes = predicted
        return StepMemory(predicted, measured, pipelined, predicted_other)

    # --- pipelined decode ---------------------------------------------------------------------------
    def _can_pipeline(self, plan: SchedulerOutput) -> bool:
        return (self.async_decode and bool(plan.decodes) and not plan.prefills and not plan.memory_limited
                and not plan.new_rows and self.scheduler.num_waiting == 0)

    def _build_decode(self, plan: SchedulerOutput, inputs: Optional[mx.array]) -> _Inflight:
        """Build (not run) the decode of `plan`; inputs: the lazy tokens that feed it, else the rows'
        last tokens."""
        work = self._decode_work(plan) if inputs is None else [DecodeWork(i, -1) for i in plan.decodes]
        forward = self.runner.decode(work, inputs, defer_sampling=self._constrained(plan.decodes))
        if not self.goes_ahead or forward.tokens is None:
            return _Inflight(plan, forward)
        host = forward.tokens + 0  # a copy (an astype to their own dtype would be the same array), computed last
        forward.stages.append([host])
        return _Inflight(plan, forward, host)

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

    def _launch(self, decode: _Inflight, build_s: Optional[float] = None,
                built_s: Optional[float] = None, ahead: bool = False) -> None:
        """Start a built decode: the device is idle (its transient is measured from here), or, `ahead`,
        the decode before it may still run (measured from when that one's record is taken). `build_s`,
        `built_s`: when its graph build started and ended (None: not timed)."""
        built_s = time.perf_counter() - self._t0 if built_s is None and build_s is not None else built_s
        if ahead:
            self.num_ahead_launches += 1
        else:
            self._launch_base_bytes = _measure_start()
        if self._launcher is None or decode.forward.sampling is not None:  # a grammar's mask: host work
            self._timed_launch(decode.forward, build_s, built_s)
            return
        # its record's launch ends when the thread has started: the encode itself overlaps the commit
        # of the step before and the build of the next, and ends within the next step's wait
        record = [build_s, time.perf_counter() - self._t0, 0.0, None, None, built_s, self._prev_encoded_s]
        self._timings.append(record)
        forward, runner = decode.forward, self.runner
        self._launcher.submit(lambda: runner.launch(forward))
        self.num_thread_launches += 1
        record[2] = time.perf_counter() - self._t0

    def _join_launch(self) -> None:
        """Wait until the launch thread (if any) has encoded the decode in flight (its error raised)."""
        if self._launcher is not None:
            ended = self._launcher.join()
            self._prev_encoded_s = None if ended is None else ended - self._t0

    def _next_decode(self, prev: _Inflight) -> Optional[_Inflight]:
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
        return self._build_decode(plan, inputs)

    def _goes_ahead(self, prev: _Inflight, nxt: _Inflight) -> bool:
        """Whether `nxt` is launched before `prev` ends (`launch_ahead`): its tokens copied for the host,
        and both decodes' transients within the free memory and the configuration's bound (while the
        device runs prev's last operations the host encodes nxt's first: both hold their arrays)."""
        return (nxt.host_tokens is not None and prev.host_tokens is not None
                and self.scheduler.fits(nxt.plan, beside=prev.plan.predicted_transient_bytes))

    def advance(self) -> StepRun:
        """A step of the decode pipeline (`pipelining`): see `_advance`."""
        self._begin()
        return self._advance()

    def _advance(self) -> StepRun:
        """Build the next decode while the running one computes, wait for it, launch the next; the
        finished one's tokens are returned for the engine to commit (while the next one runs)."""
        prev, self._inflight = self._inflight, None
        build_s = time.perf_counter() - self._t0
        try:
            nxt = self._next_decode(prev)
        except Exception as exc:  # the next forward's rows fail once this one's tokens are committed
            nxt, next_error = None, exc
        else:
            next_error = None
        built_s = time.perf_counter() - self._t0
        if nxt is not None and self._goes_ahead(prev, nxt):
            return self._advance_ahead(prev, nxt, build_s, built_s)
        try:
            self._join_launch()
            finish(prev.forward.tokens)  # prev is done and its buffers released: nxt writes in place
            tokens = prev.forward.tokens.tolist()
        except Exception as exc:
            return StepRun(prev.plan, error=exc)
        memory = self._record_memory(prev.plan.predicted_transient_bytes, 0, self._launch_base_bytes,
                                     pipelined=True)
        if nxt is not None:
            self.num_steps += 1
            try:
                self._accept_ahead(prev.plan, tokens)
                self._launch(nxt, build_s, built_s)
                self._inflight = nxt
            except Exception as exc:
                next_error = exc
        return StepRun(prev.plan, dict(zip(prev.plan.decodes, tokens)), memory=memory, next_error=next_error,
                       forwards=self._forward_timings())

    def _advance_ahead(self, prev: _Inflight, nxt: _Inflight, build_s: float, built_s: float) -> StepRun:
        """`_advance` with nxt launched as soon as prev is encoded, then prev's tokens read (their copy: a
        wait on prev's event, which nothing encodes). nxt's rows and inputs do not depend on prev's tokens
        on the host (no grammar: `_goes_ahead`). prev's record spans from its own measure's start to
        here, where nxt's begins: it is predicted as both decodes (their arrays can be alive together)."""
        try:
            self._join_launch()
        except Exception as exc:
            return StepRun(prev.plan, error=exc)
        self.num_steps += 1
        self._launch(nxt, build_s, built_s, ahead=True)
        self._inflight = nxt
        try:
            tokens = prev.host_tokens.tolist()
        except Exception as exc:
            return StepRun(prev.plan, error=exc)
        prev.forward.stages = []
        both = prev.plan.predicted_transient_bytes + nxt.plan.predicted_transient_bytes
        memory = self._record_memory(both, 0, self._launch_base_bytes,
                                     predicted_other=nxt.plan.predicted_transient_bytes, pipelined=True)
        self._launch_base_bytes = mx.get_active_memory()
        return StepRun(prev.plan, dict(zip(prev.plan.decodes, tokens)), memory=memory,
                       forwards=self._forward_timings())
