"""StepMeter: a step's measured transient, MLX's peak over what was alive before the step, beside the
memory model's prediction of it, and the largest of both so far: what engine/executor.py's StepExecutor
records in every step (StepMemory) and the engine's stats report."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx

from engine.core.types import StepMemory


class StepMeter:
    def __init__(self):
        self.carried: Optional[StepMemory] = None  # a deferred forward's measured tail, for the next record
        self.max_predicted_bytes = self.max_measured_bytes = self.last_predicted_bytes = 0

    @staticmethod
    def start() -> int:
        """Start measuring a transient: MLX's active bytes now, its peak reset. Synchronized first: MLX's
        worker may still be releasing a finished forward's buffers, which would count in this base and
        hide as much of the transient."""
        mx.synchronize()
        mx.reset_peak_memory()
        return mx.get_active_memory()

    def measured(self, fn: Callable[[], None], kv_allocated: Callable[[], int]) -> int:
        """Run fn, evaluated, and return its transient: MLX peak over what was live before, less the KV
        it allocated (`kv_allocated()` before and after: pool growth and prefix copies, which run between
        forwards)."""
        kv_before = kv_allocated()
        active_before = self.start()
        fn()
        mx.synchronize()
        return max(0, mx.get_peak_memory() - active_before - (kv_allocated() - kv_before))

    def carry(self, predicted_bytes: int, base_bytes: int) -> None:
        """A forward left running past its step's record has ended: its transient since that record, over
        its step's `base_bytes`, goes into the next record (predicted as its step was)."""
        self.carried = StepMemory(predicted_bytes, max(0, mx.get_peak_memory() - base_bytes))

    def record(self, predicted: int, measured: int, base_bytes: int, predicted_other: int = 0,
               pipelined: bool = False) -> StepMemory:
        """The step's StepMemory: its measured transient is MLX's peak since the last reset over
        `base_bytes` (what is not the step's), at least `measured` (pool growth / copies before it); the
        peak is reset for the next."""
        measured = max(measured, mx.get_peak_memory() - base_bytes, 0)
        mx.reset_peak_memory()
        carried, self.carried = self.carried, None
        if carried is not None:  # the tail of the previous step's deferred forward
            predicted_other = max(predicted_other, carried.predicted_bytes)
            measured = max(measured, carried.measured_bytes)
        predicted = max(predicted, predicted_other)
        self.max_measured_bytes = max(self.max_measured_bytes, measured)
        self.max_predicted_bytes = max(self.max_predicted_bytes, predicted)
        self.last_predicted_bytes = predicted
        return StepMemory(predicted, measured, pipelined, predicted_other)
