"""How the engine runs a step's forwards on the device: one at a time, each built while the previous
one runs; pipelined decode; the measured transient of every step. A mixin of `Engine` (engine.py),
which owns the state it uses (scheduler, runner, memory model).

Forwards that write the KV pool never overlap on the device (runner.finish says why), so a step's
transient is its largest forward's, which the memory model predicts (docs/memory.md).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from engine.core.types import RequestOutput
from engine.model.runner import DecodeWork, Forward, PrefillWork, finish
from engine.core.scheduler import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepMemory:
    """Predicted (memory model) and measured (MLX peak) transient bytes of one step."""

    predicted_bytes: int
    measured_bytes: int
    pipelined: bool = False  # a decode launched by the pipeline (measured from its launch to its end)


@dataclass(frozen=True)
class _Inflight:
    """A decode built (and then launched) whose sampled tokens have not been read back."""

    plan: SchedulerOutput
    forward: Forward  # its tokens: [B], rows in plan.decodes order


@dataclass(frozen=True)
class _Deferred:
    """A step's last forward, a prompt chunk that samples nothing, left running when the step returned
    (`Engine._overlap_steps`): the next step is scheduled and its first forward built meanwhile."""

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


class ForwardsMixin:
    """Step execution for `Engine` (see the module docstring)."""

    def _slice_reads(self, prefills) -> set[str]:
        """Requests whose prompt chunks (a step can hold several of one request, one after another) the
        runner all reads as views of the pool (no gathered copy; engine/model/kv_pool.py `slice_start`). Decodes are
        predicted by the memory model as the runner reads them: paged or gathered
        (`MemoryModel.paged_decode`)."""
        before: dict[str, int] = {}  # tokens of the request's earlier chunks in this step
        views, gathers = set(), set()
        for c in prefills:
            done = before.get(c.request_id, 0)
            reads_view = c.num_tokens > 1 and self.runner.reads_slice(c.request_id, done + c.num_tokens)
            (views if reads_view else gathers).add(c.request_id)
            before[c.request_id] = done + c.num_tokens
        return views - gathers

    def _refine_prediction(self, plan: SchedulerOutput) -> SchedulerOutput:
        """The scheduler predicted before the rows had blocks (every read a gather); now that they do,
        chunks read as views need no gathered copy."""
        slices = self._slice_reads(plan.prefills)
        if not slices:
            return plan
        return dataclasses.replace(plan, predicted_transient_bytes=self.scheduler.predict(
            plan.decodes, plan.prefills, slices, mixed=plan.mixed))

    # --- pipelined decode -----------------------------------------------------------------------

    def _can_pipeline(self, plan: SchedulerOutput) -> bool:
        return (self._async_decode and bool(plan.decodes) and not plan.prefills
                and not plan.new_rows and self.scheduler.num_waiting == 0)

    def _build_decode(self, plan: SchedulerOutput, inputs: Optional[mx.array]) -> _Inflight:
        """Build (not run) the decode of `plan`; inputs: the lazy tokens that feed it, else the rows'
        last tokens."""
        work = self._decode_work(plan) if inputs is None else [DecodeWork(i, -1) for i in plan.decodes]
        return _Inflight(plan, self.runner.decode(work, inputs))

    def _decode_work(self, plan: SchedulerOutput) -> list[DecodeWork]:
        """The plan's decode rows, each with its last token as input."""
        requests = self.scheduler.requests
        return [DecodeWork(i, requests[i].output_token_ids[-1]) for i in plan.decodes]

    def _launch(self, decode: _Inflight) -> None:
        """Start a built decode; the device is idle (its transient is measured from here)."""
        self._launch_base_bytes = _measure_start()
        self.runner.launch(decode.forward)

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
        return self._build_decode(s.plan_decodes(rows, ahead=1), inputs)

    def _advance_pipeline(self) -> list[RequestOutput]:
        """Build the next decode while the running one computes, wait for it, launch the next, then
        read back and commit the finished one."""
        prev, self._inflight = self._inflight, None
        self.last_plan = prev.plan
        try:
            nxt = self._next_decode(prev)
        except Exception as exc:  # the next forward's rows fail once this one's tokens are committed
            nxt, next_error = None, exc
        else:
            next_error = None
        try:
            finish(prev.forward.tokens)  # prev is done and its buffers released: nxt writes in place
            tokens = prev.forward.tokens.tolist()
        except Exception as exc:
            return self._fail_step(prev.plan, exc)
        self._record_memory(prev.plan.predicted_transient_bytes, 0, self._launch_base_bytes, pipelined=True)
        if nxt is not None:
            self.num_steps += 1
            try:
                self._launch(nxt)
                self._inflight = nxt
            except Exception as exc:
                nxt, next_error = None, exc
        outputs = self._commit(prev.plan, dict(zip(prev.plan.decodes, tokens)))
        if next_error is not None:
            rows = [r.request_id for r in self.scheduler.running if not r.is_prefilling]
            outputs += self._fail_step(self.scheduler.plan_decodes(rows), next_error)
        return outputs

    def _execute(self, plan: SchedulerOutput, failed: dict[str, str], admitted: StepMemory) -> dict[str, int]:
        """Run the decode forward, then each prefill chunk, one at a time on the device (runner.finish)
        but each built while the previous one runs (a mixed runner's decode rows run with the first
        chunk); the first while the previous step's last forward may still run (`_Deferred`). A
        prefill chunk whose graph cannot be built touches its own row only: its request goes into
        `failed`, the others go on. The step's transient is MLX's peak over what was alive before its
        first launch, less KV the step allocated. `admitted`: this step's pool growth and prefix copies
        (`_add_rows`)."""
        requests = self.scheduler.requests
        builds = []  # (request ids whose tokens the forward samples, a function that builds it)
        works = []
        for chunk in plan.prefills:
            ids = requests[chunk.request_id].prompt_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            works.append(PrefillWork(chunk.request_id, ids, chunk.start, chunk.completes_prompt))
        if plan.mixed:  # decode rows and chunks, and a runner that mixes (MemoryModel.mixed)
            # the decode rows ride with the first chunk (engine/model/layers/mixed.py); if that forward cannot be
            # built, the two run apart, so that a chunk's error still fails its own row only
            try:
                mixed = self.runner.mixed_forward(works[0], self._decode_work(plan))
            except Exception:
                logger.exception("forward of %s with %d decode rows failed to build; running them apart",
                                 works[0].request_id, len(plan.decodes))
            else:
                first = works.pop(0)
                ids = ((first.request_id,) if first.sample else ()) + tuple(plan.decodes)
                builds.append((ids, None, lambda: mixed))
        if plan.decodes and not builds:
            builds.append((plan.decodes, None, lambda: self._build_decode(plan, None).forward))
        for work in works:
            builds.append(((work.request_id,), work.request_id, lambda work=work: self.runner.prefill(work)))
        sampled: dict[str, int] = {}
        running = None  # (request ids, Forward) on the device
        before = None  # (MLX active bytes, KV allocated bytes) once the previous step's forward is done
        for ids, chunk_id, build in builds:
            if chunk_id in failed:  # a later chunk of a request whose earlier one failed in this step
                continue
            try:
                forward = build()
            except Exception as exc:
                if chunk_id is None:
                    raise  # the decode: the step fails
                logger.exception("prefill of %s failed", chunk_id)
                failed[chunk_id] = f"{type(exc).__name__}: {exc}"
                continue
            if running is not None:
                self._retire(running, sampled)
            if before is None:
                before = self._measure_from()
            self.runner.launch(forward)
            running = (ids, forward)
        if before is None:
            before = self._measure_from()
        deferred = running is not None and running[1].tokens is None and self._overlap_steps
        if running is not None and not deferred:
            self._retire(running, sampled)
        base = before[0] + self.runner.kv_allocated_bytes - before[1]
        self._record_memory(plan.predicted_transient_bytes, admitted.measured_bytes, base, admitted.predicted_bytes)
        if deferred:
            self._deferred = _Deferred(running[1], plan.predicted_transient_bytes, base)
        return sampled

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

    @staticmethod
    def _retire(running, sampled: dict[str, int]) -> None:
        """Wait for a launched forward and keep its sampled tokens."""
        ids, forward = running
        forward.finish()
        if forward.tokens is not None:
            sampled.update(zip(ids, forward.tokens.tolist()))

    def _record_memory(self, predicted: int, measured: int, base_bytes: int, predicted_other: int = 0,
                       pipelined: bool = False) -> None:
        """The step's StepMemory: its measured transient is MLX's peak since the last reset over
        `base_bytes` (what is not the step's), at least `measured` (pool growth / copies before it)."""
        measured = max(measured, mx.get_peak_memory() - base_bytes, 0)
        mx.reset_peak_memory()
        predicted = max(predicted, predicted_other)
        carried, self._carried = self._carried, None
        if carried is not None:  # the tail of the previous step's deferred forward
            predicted = max(predicted, carried.predicted_bytes)
            measured = max(measured, carried.measured_bytes)
        self.last_step_memory = StepMemory(predicted, measured, pipelined)
        self._max_measured = max(self._max_measured, measured)
        self._max_predicted = max(self._max_predicted, predicted)

    def _measured(self, fn, work):
        """fn(work), evaluated, and its transient: MLX peak over what was live before, less KV it
        allocated (pool growth and prefix copies, which run between forwards)."""
        kv_before = self.runner.kv_allocated_bytes
        active_before = _measure_start()
        result = fn(work)
        mx.synchronize()
        new_kv = self.runner.kv_allocated_bytes - kv_before
        return result, max(0, mx.get_peak_memory() - active_before - new_kv)
