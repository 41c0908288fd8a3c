"""StepExecutor: runs a plan's forwards on the device, one at a time, each built while the previous one
runs, or starts the decode pipeline (engine/decode_pipeline.py); records every step's measured transient
(engine/step_meter.py).

Forwards that write the KV pool never overlap on the device (engine/model/work.py `finish`), so a step's
transient is its largest forward's, which the memory model predicts (docs/memory.md); a pipelined decode
that writes its KV without a donated buffer is queued while the one before still runs (`launch_ahead`),
both decodes then predicted. It owns what spans steps: the pipeline, the prompt chunk left running
(`_Deferred`), the meter's measured tail for the next record.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Callable, Optional

from engine.core.memory.model import MemoryModel
from engine.core.memory.plan import pack_groups
from engine.core.scheduler import Scheduler
from engine.core.types import NewRow, Request, SchedulerOutput, StepMemory, StepRun
from engine.model.runner import ModelRunner
from engine.decode_pipeline import DecodePipeline, StepClock
from engine.model.work import Forward, PrefillWork
from engine.model.sampling import RequestSampler
from engine.step_meter import StepMeter

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
class _Deferred:
    """A step's last forward, a prompt chunk that samples nothing, left running when the step returned
    (`overlap_steps`): the next step is scheduled and its first forward built meanwhile."""

    forward: Forward
    predicted_bytes: int  # its step's prediction
    base_bytes: int  # what its step's transient was measured over


class StepExecutor:
    """Runs plans with `runner`; reads the scheduler's requests (inputs, the next pipelined decode)."""

    def __init__(self, runner: ModelRunner, memory: MemoryModel, scheduler: Scheduler, seed: int,
                 async_decode: bool, overlap_steps: bool,
                 make_sampler: Optional[Callable[[Request], RequestSampler]] = None,
                 launch_thread: bool = False, launch_ahead: bool = False):
        """`make_sampler`: a new row's sampler (the engine's gives it its grammar's matcher); else one
        from the request's sampling params and `seed`. `async_decode`: decode-only steps run as a
        pipeline (`DecodePipeline`, with `launch_thread` and `launch_ahead`: StepOptions')."""
        self.runner = runner
        self.make_sampler = make_sampler or (lambda r: RequestSampler(r.sampling, seed, r.prompt_token_ids))
        self.memory = memory
        self.scheduler = scheduler
        self.async_decode = async_decode
        self.overlap_steps = overlap_steps
        self._deferred: Optional[_Deferred] = None  # the previous step's last prompt chunk, still running
        self._num_steps = 0  # steps run, less the pipeline's later decodes
        self.meter = StepMeter()  # each step's measured transient and prediction
        self.clock = StepClock()  # the step's start, its forwards' timings
        self.pipeline = DecodePipeline(runner, scheduler, self.meter, self.clock, launch_thread and async_decode,
                                       launch_ahead)

    @property
    def num_steps(self) -> int:
        return self._num_steps + self.pipeline.num_launches

    @property
    def pipelining(self) -> bool:
        return self.pipeline.running

    @property
    def has_deferred(self) -> bool:
        """A prompt chunk of the previous step is still on the device (`overlap_steps`)."""
        return self._deferred is not None

    @property
    def busy(self) -> bool:
        """A forward is still on the device (a pipelined decode, or a deferred prompt chunk)."""
        return self.pipeline.running or self._deferred is not None

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
        self._num_steps += 1
        if (self.async_decode and plan.decodes and not plan.prefills and not plan.memory_limited
                and not plan.new_rows and self.scheduler.num_waiting == 0):
            return dataclasses.replace(self.pipeline.start(plan), slice_reads=slices)
        failed: dict[str, str] = {}
        try:
            sampled, memory = self._execute(plan, failed, admitted)
        except Exception as exc:  # a failed decode forward fails this step's requests, not the engine
            return StepRun(plan, failed=failed, error=exc, slice_reads=slices)
        return StepRun(plan, sampled, failed, memory, slice_reads=slices, forwards=self.clock.forwards())

    def _begin(self) -> None:
        self.clock.begin()
        self.pipeline.settle()  # nothing should be running

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
            measured = self.meter.measured(lambda: self.runner.grow_pool(num_pool_blocks), self._kv_allocated)
        for row in new_rows:
            request = self.scheduler.requests[row.request_id]
            self.runner.add_row(row.request_id, row.block_ids, self.make_sampler(request),
                                ring=row.ring)
            prefix = row.prefix
            if prefix is not None:
                copied = self.meter.measured(lambda: self.runner.copy_prefix(
                    row.request_id, prefix.source_block_ids, prefix.num_tokens), self._kv_allocated)
                predicted = max(predicted, self.memory.kv_copy_bytes(prefix.num_tokens))
                measured = max(measured, copied)
        return StepMemory(predicted, measured)

    def _kv_allocated(self) -> int:
        return self.runner.kv_allocated_bytes

    # --- forwards of a step ---------------------------------------------------------------------------
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
                mixed = self.runner.mixed_forward(works[0], self.pipeline.decode_work(plan.decodes))
            except Exception:
                logger.exception("forward of %s with %d decode rows failed to build; running them apart",
                                 works[0].request_id, len(plan.decodes))
            else:
                first = groups.pop(0)[0]
                ids = ((first.request_id,) if first.sample else ()) + tuple(plan.decodes)
                builds.append(_Build(ids, lambda: mixed))
        if plan.decodes and not builds:
            builds.append(_Build(plan.decodes, lambda: self.pipeline.build(plan, pipelined=False).forward))
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
            build_s = self.clock.now()
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
            built_s = self.clock.now()
            if running is not None:
                self._retire(running, sampled)
            if before is None:
                before = self._measure_from()
            self.clock.timed_launch(lambda: self.runner.launch(forward), build_s, built_s)
            running = (item.ids, forward)
        if before is None:
            before = self._measure_from()
        deferred = running is not None and running[1].tokens is None and self.overlap_steps
        if running is not None and not deferred:
            self._retire(running, sampled)
        base = before[0] + self.runner.kv_allocated_bytes - before[1]
        memory = self.meter.record(plan.predicted_transient_bytes, admitted.measured_bytes, base,
                                     admitted.predicted_bytes)
        if deferred:
            self._deferred = _Deferred(running[1], plan.predicted_transient_bytes, base)
        return sampled, memory

    def _retire(self, running, sampled: dict[str, int]) -> None:
        """Wait for a launched forward and keep its sampled tokens."""
        ids, forward = running
        timings = self.clock.timings
        record = timings[-1] if timings and timings[-1][4] is None else None
        if record is not None:
            record[3] = self.clock.now()
        forward.finish()
        if forward.tokens is not None:
            sampled.update(zip(ids, forward.tokens.tolist()))
        if record is not None:
            record[4] = self.clock.now()

    def _measure_from(self) -> tuple[int, int]:
        """Wait for the previous step's deferred forward, then start measuring this step's transient."""
        self._retire_deferred()
        return self.meter.start(), self.runner.kv_allocated_bytes

    def _retire_deferred(self) -> None:
        """Wait for the forward the previous step left running (`_Deferred`); its transient since that
        step was recorded goes into the next record (StepMeter.record)."""
        deferred, self._deferred = self._deferred, None
        if deferred is None:
            return
        deferred.forward.finish()
        self.meter.carry(deferred.predicted_bytes, deferred.base_bytes)

    # --- pipelined decode ---------------------------------------------------------------------------
    def advance(self) -> StepRun:
        """A step of the decode pipeline (`pipelining`): DecodePipeline.advance."""
        self.clock.begin()
        return self.pipeline.advance()
