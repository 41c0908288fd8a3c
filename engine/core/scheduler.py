"""Scheduler: token-budgeted chunked prefill with continuous batching. No mlx import.

Every step:
1. every running request that has finished its prompt decodes one token (decode first);
2. the rest of the `max_num_batched_tokens` budget goes to prompt chunks, first come first served,
   each at most `prefill_chunk_size` tokens: partially prefilled requests first (in arrival order),
   then waiting requests. The oldest prompt always gets its chunk first, so a long prompt at the head
   always progresses; shorter prompts behind it share what is left of the budget. A budget that every
   prompt's one chunk leaves unused goes to further chunks of the same prompts, oldest first (each
   chunk is its own forward, evaluated after the previous one: the memory bound is per chunk).

KV policy: refuse at add time, wait for room, never preempt. A request is admitted to the running
set only when the KV manager (kv_manager.py) can reserve KV for its whole life (prompt + max_tokens
- 1, rounded up to the cache step) beside the requests already running; the plan hands the runner the
block ids it placed, so KV can never fail to grow mid-request and nothing is ever recomputed. A request
that could never fit (longer than max_model_len, or larger than the whole KV budget) is refused by
`add` with a ValueError. Admission is strict FCFS: a head request that does not fit yet blocks the ones
behind it (no starvation).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Collection, Optional, Sequence

from engine.core.kv_manager import KVManager
from engine.core.memory.model import MemoryModel, PrefillChunkPlan, StepPlan
from engine.core.types import (FinishReason, NewRow, Request, RequestStatus, ScheduledChunk,  # noqa: F401
                               SchedulerOutput)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    prefill_chunk_size: int
    max_model_len: int
    mix_beyond_bound: bool = False  # StepOptions.mix_beyond_bound


class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: MemoryModel, kv: KVManager):
        self.config = config
        self.memory = memory
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order
        self.requests: dict[str, Request] = {}
        # Forwards, and the KV pool's growth / prefix copies between them (never at the same time).
        self.transient_bound_bytes = max(
            memory.transient_bound_bytes(config.max_num_seqs, config.prefill_chunk_size,
                                         config.max_model_len),
            memory.kv_growth_bound_bytes(kv.kv_budget_bytes),
        )

    # --- requests in and out ----------------------------------------------------------------------
    def reservation_bytes(self, num_prompt_tokens: int, max_tokens: int) -> int:
        return self.memory.kv_bytes(num_prompt_tokens + max_tokens - 1)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """Raise ValueError if such a request could never run here."""
        total = num_prompt_tokens + max_tokens
        if num_prompt_tokens < 1:
            raise ValueError("prompt must hold at least one token")
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) = {total} exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        need = self.reservation_bytes(num_prompt_tokens, max_tokens)
        if need > self.kv.kv_budget_bytes:
            raise ValueError(
                f"request needs {need} bytes of KV, more than the engine's KV budget "
                f"({self.kv.kv_budget_bytes} bytes)"
            )

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id={request.request_id!r} is already in use")
        self.check_fits(request.num_prompt_tokens, request.sampling.max_tokens)
        self.requests[request.request_id] = request
        self.waiting.append(request)
        # the prompt's first tokens already computed (a prefix-cache hit): start after them
        cached = self.kv.lookup_prefix(request.request_id, request.prompt_token_ids)
        request.num_computed_tokens = request.num_cached_tokens = cached

    def finish(self, request_id: str, reason: FinishReason, num_kv_tokens: int = 0) -> Optional[Request]:
        """Remove a request (finished, aborted or failed); the KV manager frees its KV, or keeps the first
        `num_kv_tokens` tokens' (what its row computed) in the prefix cache unless it failed."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        keep = request.all_token_ids[:num_kv_tokens] if reason != FinishReason.ERROR else ()
        self.kv.free(request_id, keep)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decodes = tuple(r.request_id for r in self.running if not r.is_prefilling)
        budget -= len(decodes)
        prefills: list[ScheduledChunk] = []
        for request in self.running:
            if budget <= 0:
                break
            if request.is_prefilling:
                budget -= self._add_chunk(request, budget, prefills)
        while budget > 0 and self.waiting and self._try_admit(self.waiting[0]):
            budget -= self._add_chunk(self.waiting.popleft(), budget, prefills)
        new_rows = self.kv.place_admitted()
        # What is left goes to further chunks of the same prompts, oldest first, each its own forward
        # after the others: fewer, fuller steps (each step costs the host its scheduling and its first
        # forward's graph before the device has work, docs/benchmarks.md). Not for
        # a sliver: a chunk of at least half `prefill_chunk_size`, or the prompt's end.
        least = max(1, self.config.prefill_chunk_size // 2)
        for request in self.running:
            while budget > 0 and 0 < (left := request.num_prompt_tokens - self._scheduled_end(request, prefills)):
                if min(budget, left, self.config.prefill_chunk_size) < min(least, left):
                    break
                budget -= self._add_chunk(request, budget, prefills)
        # the decode rows ride with the first chunk where the runner can (memory.mixed) and that forward
        # stays within the bound of separate ones
        mixed = self.memory.mixed and bool(decodes) and bool(prefills)
        predicted = self.predict(decodes, prefills, mixed=mixed)
        if mixed and predicted > self.transient_bound_bytes and not self.config.mix_beyond_bound:
            mixed, predicted = False, self.predict(decodes, prefills)
        return SchedulerOutput(decodes=decodes, prefills=tuple(prefills), new_rows=new_rows,
                               predicted_transient_bytes=predicted, mixed=mixed,
                               num_pool_blocks=self.kv.num_pool_blocks)

    def predict(self, decodes: Sequence[str], prefills: Sequence[ScheduledChunk],
                slice_reads: Collection[str] = (), ahead: int = 0, mixed: bool = False) -> int:
        """The memory model's transient of a step. `slice_reads`: requests whose prompt chunk the runner
        reads as a view of the pool (no gathered copy; the engine knows once their blocks are
        allocated, `schedule` assumes none); `ahead`: tokens each decoding row has beyond what
        `update` committed; `mixed`: the decode rows run in the first chunk's forward."""
        requests = self.requests
        plan = StepPlan(
            decode_context_lens=tuple(requests[i].num_tokens + ahead for i in decodes),
            decode_samples=sum(not requests[i].sampling.greedy for i in decodes),
            prefill_chunks=tuple(
                PrefillChunkPlan(c.num_tokens, c.start + c.num_tokens, c.completes_prompt,
                                 c.completes_prompt and not requests[c.request_id].sampling.greedy,
                                 gathers=c.request_id not in slice_reads)
                for c in prefills),
        )
        return self.memory.step_transient_bytes(plan, mixed=mixed)

    def plan_decodes(self, request_ids: Sequence[str], ahead: int = 0) -> SchedulerOutput:
        """A decode-only step of these running requests (the engine's pipelined decode)."""
        return SchedulerOutput(decodes=tuple(request_ids), prefills=(), new_rows=(),
                               predicted_transient_bytes=self.predict(request_ids, (), ahead=ahead),
                               num_pool_blocks=self.kv.num_pool_blocks)

    @staticmethod
    def _scheduled_end(request: Request, chunks: list[ScheduledChunk]) -> int:
        """Prompt position up to which `request`'s KV will exist after `chunks` (this step's so far)."""
        ends = [c.start + c.num_tokens for c in chunks if c.request_id == request.request_id]
        return max(ends, default=request.num_computed_tokens)

    def _add_chunk(self, request: Request, budget: int, out: list[ScheduledChunk]) -> int:
        start = self._scheduled_end(request, out)
        remaining = request.num_prompt_tokens - start
        n = min(remaining, self.config.prefill_chunk_size, budget)
        out.append(ScheduledChunk(request.request_id, start, n, n == remaining))
        return n

    def _try_admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        tokens = self.memory.kv_tokens(request.max_total_tokens)
        if self.kv.allocate(request.request_id, tokens) is None:
            return False
        request.reserved_tokens = tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def update(self, output: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Commit a step: advance progress, append sampled tokens. Returns requests with a new token."""
        for chunk in output.prefills:
            request = self.requests.get(chunk.request_id)
            if request is not None:
                request.num_computed_tokens += chunk.num_tokens
        for request_id in output.decodes:
            request = self.requests.get(request_id)
            if request is not None:
                request.num_computed_tokens += 1
        updated = []
        for request_id, token in sampled.items():
            request = self.requests.get(request_id)
            if request is not None:
                request.output_token_ids.append(token)
                updated.append(request)
        return updated