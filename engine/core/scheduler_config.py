"""The scheduler's configuration (engine/core/scheduler.py), resolved from EngineConfig by the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from engine.core.chunk_grid import DEFAULT_CHUNK_GRANULE


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    max_model_len: int
    mix_beyond_bound: bool = False  # StepOptions.mix_beyond_bound
    # Memory for the KV pool and one step's transient (memory limit - weights - margin); None: steps
    # are not sized to free memory (the transient bound alone).
    max_memory_bytes: Optional[int] = None
    # A prompt's last chunk computes up to the grid past the prompt's end (chunk_grid.py;
    # ExecutionConfig.pad_last_chunk), within the chunk size, the step's budget, the row's blocks,
    # max_model_len and the free memory.
    pad_last_chunk: bool = False
    # The power of two cut and padded chunks end on (chunk_grid.py; ExecutionConfig.chunk_granule).
    chunk_granule: int = DEFAULT_CHUNK_GRANULE
    # Packs take the chunks of prompts longer than one chunk too (ExecutionConfig.pack_long_prompts);
    # else only chunks that are a whole prompt (after its cached prefix).
    pack_long_prompts: bool = False
