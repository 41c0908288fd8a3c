"""Scheduler: token-budgeted chunked prefill with continuous batching. No mlx import.

Every step:
1. every running request that has finished its prompt decodes one token (decode first);
2. the rest of the `max_num_batched_tokens` budget goes to prompt chunks, first come first served,
   each at most `prefill_chunk_size` tokens: partially prefilled requests first (in arrival order),
   then waiting requests. The oldest prompt always gets its chunk first, so a long prompt at the head
   always progresses; shorter prompts behind it share what is left of the budget. A budget that every
   prompt's one chunk leaves unused goes to further chunks of the same prompts, oldest first (each
   chunk is its own forward, evaluated after the previous one: the memory bound is per chunk; with
   ExecutionConfig.max_packed_tokens one forward a step packs several rows' whole prompts, `_packs`). A
   chunk cut short of a whole one (by the budget or the memory) ends on a grid, and with
   `pad_last_chunk` a prompt's last chunk computes up to it past the prompt's end (chunk_grid.py).

Memory policy (docs/memory.md): each step is sized to the memory free now. With
`SchedulerConfig.max_memory_bytes` (memory limit - weights - a safety margin), a step's predicted
transient must fit in that less the KV pool as it will be after the step's growth
(`SchedulerOutput.free_transient_bytes`): the decode takes the rows that fit (those with the fewest
output tokens first, so rows left out catch up), each prompt chunk is cut to the largest size that fits
(then back to the grid), a prompt so cut may take several such chunks in a step, and the decode rows
ride in a chunk's forward only if that fits too. The KV budget leaves the floor step
(MemoryModel.floor_transient_bytes) beside a full pool, so some step always fits.

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
from typing import Collection, Optional, Sequence

from engine.core.chunk_grid import aligned_chunk, padded_ends
from engine.core.kv_manager import KVManager
from engine.core.scheduler_config import SchedulerConfig  # noqa: F401 (the scheduler's API)
from engine.core.memory.model import MemoryModel, PrefillChunkPlan, StepPlan, pack_groups
from engine.core.types import (FinishReason, Request, RequestStatus, ScheduledChunk, SchedulerOutput,
                               processed)

class Scheduler:
    def __init__(self, config: SchedulerConfig, memory: MemoryModel, kv: KVManager, view_reads: bool = False):
        """`view_reads`: the runner reads a prompt chunk of 2 tokens or more of a row in consecutive
        blocks as a view of the pool (no gathered copy), so the plan predicts such chunks without it."""
        self.config = config
        self.memory = memory
        self.kv = kv
        self.view_reads = view_reads
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # arrival order
        self.requests: dict[str, Request] = {}
        # Forwards, and the KV pool's growth / prefix copies between them (never at the same time).
        self.transient_bound_bytes = max(
            memory.transient_bound_bytes(config.max_num_seqs, config.prefill_chunk_size,
                                         config.max_model_len),
            memory.kv_growth_bound_bytes(kv.kv_budget_bytes),
        )
        self.floor_transient_bytes = memory.floor_transient_bytes(config.prefill_chunk_size,
                                                                  config.max_model_len)

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
    @property
    def free_transient_bytes(self) -> Optional[int]:
        """Memory a step's transient may use with the pool as it is now (None: no memory limit)."""
        if self.config.max_memory_bytes is None:
            return None
        return self.config.max_memory_bytes - self.kv.pool_bytes

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        decoding = [r for r in self.running if not r.is_prefilling]
        prefilling = [r for r in self.running if r.is_prefilling]
        admitted = self._admit(cfg.max_num_batched_tokens - len(decoding) - sum(
            min(r.num_prompt_tokens - r.num_computed_tokens, cfg.prefill_chunk_size) for r in prefilling),
            busy=bool(decoding or prefilling))
        new_rows = self.kv.place_admitted()  # the pool grows before the forwards: they get what is left
        room = self.free_transient_bytes
        decodes = self._fit_decodes(decoding, room)
        limited = len(decodes) < len(decoding)
        budget = cfg.max_num_batched_tokens - len(decodes)
        prefills: list[ScheduledChunk] = []
        for request in prefilling + admitted:
            if budget <= 0:
                break
            n, cut = self._add_chunk(request, budget, prefills, room)
            budget, limited = budget - n, limited or cut
        # What is left goes to further chunks of the same prompts, oldest first, each its own forward
        # after the others: fewer, fuller steps (each step costs the host its scheduling and its first
        # forward's graph before the device has work, docs/benchmarks.md). Not for a sliver: a chunk of
        # at least half `prefill_chunk_size`, the prompt's end, or the most the free memory allows it.
        least = max(1, cfg.prefill_chunk_size // 2)
        for request in self.running:
            while budget > 0 and 0 < (left := request.num_prompt_tokens - (start := self._scheduled_end(request, prefills))):
                largest = self._chunk_tokens(request, start, min(left, cfg.prefill_chunk_size), room)
                at_least = min(least, left, largest)
                if not largest or min(budget, left, cfg.prefill_chunk_size) < at_least:
                    break
                n, cut = self._add_chunk(request, budget, prefills, room, at_least=at_least)
                budget, limited = budget - n, limited or cut
                if not n:
                    break
        return self._output(tuple(decodes), prefills, new_rows, room, limited)

    def _output(self, decodes: tuple[str, ...], prefills: list[ScheduledChunk], new_rows, room: Optional[int],
                limited: bool) -> SchedulerOutput:
        """The plan, with the decode rows riding in the first chunk's forward where the runner can
        (memory.mixed) and that forward stays within the bound of separate ones and the free memory, and
        the other chunks packed into as few forwards as stay so too (`_packs`). Neither in a step the free
        memory cut: a cut chunk's forward takes the room it leaves, and a mixed forward's prediction is the
        one with the least slack over what it measures (docs/memory.md)."""
        mixed = self.memory.mixed and bool(decodes) and bool(prefills) and not limited
        predicted = self.predict(decodes, prefills, mixed=mixed)
        beyond = predicted > self.transient_bound_bytes and not self.config.mix_beyond_bound
        if mixed and (beyond or not self._fits(predicted, room)):
            limited = limited or not beyond
            mixed, predicted = False, self.predict(decodes, prefills)
        packs = () if limited else self._packs(decodes, prefills, mixed, room)
        if packs:
            predicted = self.predict(decodes, prefills, mixed=mixed, packs=packs)
        tokens = len(decodes) + sum(c.num_forward_tokens for c in prefills)
        return SchedulerOutput(decodes=decodes, prefills=tuple(prefills), new_rows=new_rows,
                               predicted_transient_bytes=predicted, mixed=mixed, packs=packs,
                               num_pool_blocks=self.kv.num_pool_blocks, free_transient_bytes=room,
                               step_budget_tokens=tokens if limited else self.config.max_num_batched_tokens,
                               memory_limited=limited)

    def _packs(self, decodes: Sequence[str], prefills: list[ScheduledChunk], mixed: bool,
               room: Optional[int]) -> tuple[int, ...]:
        """The step's prompt chunks (after a mixed forward's, which stays alone) in forwards, in order
        (SchedulerOutput.packs): one pack of consecutive chunks, each a whole prompt (unless
        `pack_long_prompts`) of a row not yet in it, while its tokens stay within
        ExecutionConfig.max_packed_tokens and the memory model's prediction of it
        (MemoryModel.packed_bytes) within the configuration's transient bound and the free memory; the
        chunks after it alone. On a GPU one forward of many rows' tokens runs its matmuls faster than one
        per chunk (docs/decode.md). () where nothing packs."""
        first = 1 if mixed else 0
        if not self.memory.packed or len(prefills) - first < 2:
            return ()
        memory = self.memory
        limit = self.transient_bound_bytes if room is None else min(self.transient_bound_bytes, room)
        chunks = self.memory_plan(decodes, prefills, packs=(len(prefills),)).prefill_chunks
        packable = [self.config.pack_long_prompts or self._whole_prompt(c) for c in prefills]
        # the pack: chunks [start, start + size); one a step, the chunks after it alone (on an H200 four
        # packs back to back measured above each one's prediction, docs/memory.md)
        start, size, summed, tokens, rows = first, 0, (), 0, set()
        for j in range(first, len(prefills)):
            chunk, plan = prefills[j], chunks[j]
            phases = memory.chunk_plan_phases(plan)
            if not packable[j]:
                if size > 1:
                    break
                size = 0
                continue
            if size and chunk.request_id not in rows and tokens + plan.num_tokens <= memory.max_packed_tokens:
                trial = tuple(a + b for a, b in zip(summed, phases))
                if memory.summed_pack_bytes(trial, tokens + plan.num_tokens) <= limit:
                    summed, tokens, size = trial, tokens + plan.num_tokens, size + 1
                    rows.add(chunk.request_id)
                    continue
            if size > 1:
                break
            start, size, summed, tokens, rows = j, 1, phases, plan.num_tokens, {chunk.request_id}
        if size < 2:
            return ()
        return (1,) * start + (size,) + (1,) * (len(prefills) - start - size)

    def _whole_prompt(self, chunk: ScheduledChunk) -> bool:
        """Whether `chunk` computes its prompt whole: it ends the prompt and starts where the row's
        prefill began (after a cached prefix)."""
        request = self.requests.get(chunk.request_id)
        return chunk.completes_prompt and request is not None and chunk.start == request.num_cached_tokens

    @staticmethod
    def _fits(predicted: int, room: Optional[int]) -> bool:
        return room is None or predicted <= room

    def fits(self, plan: SchedulerOutput, beside: int = 0) -> bool:
        """Whether a plan's predicted transient fits the memory free now (the pipelined decode's next);
        `beside`: with that many more bytes of a forward still in flight, also within the configuration's
        transient bound (the largest step it allows: MemoryModel.transient_bound_bytes)."""
        predicted = plan.predicted_transient_bytes + beside
        return (not beside or predicted <= self.transient_bound_bytes) and self._fits(predicted, self.free_transient_bytes)

    def _admit(self, budget: int, busy: bool) -> list[Request]:
        """Admit waiting requests, first come first served, while the token budget leaves each a chunk
        and the KV manager can reserve their KV. Not for a sliver beside other work (`busy`: decode
        rows or prompt chunks in the step, or a request admitted before it): a first chunk of at least
        half `prefill_chunk_size` or the prompt's whole rest. A sliver would cost a forward of its own
        now and leave the prompt's rest to cost another in the next step (the first in the step with
        the decode rows riding in it) for no earlier first token; the head waits one step instead.
        Never more than the budget leaves beside every other slot decoding (a small budget with many
        slots would otherwise keep a prompt waiting for as long as they decode)."""
        admitted, cfg = [], self.config
        least = max(1, min(cfg.prefill_chunk_size // 2, cfg.max_num_batched_tokens - cfg.max_num_seqs + 1))
        while budget > 0 and self.waiting:
            head = self.waiting[0]
            if (busy or admitted) and budget < min(least, self._first_chunk(head)):
                break
            if not self._try_admit(head):
                break
            admitted.append(self.waiting.popleft())
            budget -= self._first_chunk(head)  # after _try_admit, which may have dropped its prefix hit
        return admitted

    def _first_chunk(self, request: Request) -> int:
        return min(request.num_prompt_tokens - request.num_computed_tokens, self.config.prefill_chunk_size)

    def _fit_decodes(self, decoding: list[Request], room: Optional[int]) -> list[str]:
        """The decode rows of this step: all of them when their forward fits `room`, else the most that
        do, rows with the fewest output tokens first (a row left out is first the next time)."""
        ids = [r.request_id for r in decoding]
        if not ids or self._fits(self.predict(ids, ()), room):
            return ids
        order = [r.request_id for r in sorted(decoding, key=lambda r: r.num_output_tokens)]
        lo, hi = 0, len(order) - 1  # the longest prefix that fits: more rows never need less memory
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._fits(self.predict(order[:mid], ()), room):
                lo = mid
            else:
                hi = mid - 1
        chosen = set(order[:lo])
        return [i for i in ids if i in chosen]  # arrival order, as the runner's rows

    def predict(self, decodes: Sequence[str], prefills: Sequence[ScheduledChunk],
                slice_reads: Optional[Collection[str]] = None, ahead: int = 0, mixed: bool = False,
                packs: tuple[int, ...] = ()) -> int:
        """The memory model's transient of a step (`memory_plan`); `mixed`: the decode rows run in the
        first chunk's forward; `packs`: the chunks' forwards (SchedulerOutput.packs)."""
        return self.memory.step_transient_bytes(self.memory_plan(decodes, prefills, slice_reads, ahead, packs),
                                                mixed=mixed)

    def memory_plan(self, decodes: Sequence[str], prefills: Sequence[ScheduledChunk],
                    slice_reads: Optional[Collection[str]] = None, ahead: int = 0,
                    packs: tuple[int, ...] = ()) -> StepPlan:
        """A step as the memory model reads it. `slice_reads`: requests whose prompt chunks the runner
        reads as views of the pool (the executor asks the runner); None: the chunks the scheduler
        expects to be read so (`_reads_view`); `ahead`: tokens each decoding row has beyond what
        `update` committed; `packs`: the chunks' forwards (SchedulerOutput.packs)."""
        requests = self.requests
        # as for decode rows: one processed row of a pack sends all its sampled rows through the sampler's
        # processing path (`_packs` asks with every chunk in one pack: an upper bound while it forms them)
        processed_ids = {c.request_id for c in prefills
                         if c.completes_prompt and processed(requests[c.request_id].sampling)}
        groups = pack_groups(tuple(prefills), packs)
        processes = {c.request_id for g in groups if any(c.request_id in processed_ids for c in g) for c in g}
        return StepPlan(
            decode_context_lens=tuple(requests[i].num_tokens + ahead for i in decodes),
            # one row that is not a plain argmax sends the whole batch through the sampler's processing
            # path ([B, V] float32 arrays), so every row is then counted as sampled
            decode_samples=len(decodes) if any(processed(requests[i].sampling) for i in decodes) else 0,
            prefill_chunks=tuple(  # the tokens a chunk computes, a padded last chunk's pad included
                PrefillChunkPlan(c.num_forward_tokens, c.start + c.num_forward_tokens, c.completes_prompt,
                                 c.completes_prompt and c.request_id in processes,
                                 gathers=(c.request_id not in slice_reads or c.num_forward_tokens < 2)
                                 if slice_reads is not None
                                 else not self._reads_view(c.request_id, c.start + c.num_forward_tokens,
                                                           c.num_forward_tokens))
                for c in prefills),
            packs=packs,
        )

    def _reads_view(self, request_id: str, end: int, num_tokens: int) -> bool:
        """Whether the runner reads this prompt chunk's KV as a view (engine/model/kv_pool.py
        `slice_start`): views on, 2 tokens or more, positions [0, end) in consecutive blocks."""
        return self.view_reads and num_tokens >= 2 and self.kv.consecutive(request_id, end)

    def plan_decodes(self, request_ids: Sequence[str], ahead: int = 0) -> SchedulerOutput:
        """A decode-only step of these running requests (the engine's pipelined decode)."""
        memory_plan = self.memory_plan(request_ids, (), ahead=ahead)
        return SchedulerOutput(decodes=tuple(request_ids), prefills=(), new_rows=(),
                               predicted_transient_bytes=self.memory.step_transient_bytes(memory_plan),
                               memory_plan=memory_plan,
                               num_pool_blocks=self.kv.num_pool_blocks, free_transient_bytes=self.free_transient_bytes,
                               step_budget_tokens=self.config.max_num_batched_tokens)

    @staticmethod
    def _scheduled_end(request: Request, chunks: list[ScheduledChunk]) -> int:
        """Prompt position up to which `request`'s KV will exist after `chunks` (this step's so far)."""
        ends = [c.start + c.num_tokens for c in chunks if c.request_id == request.request_id]
        return max(ends, default=request.num_computed_tokens)

    def _add_chunk(self, request: Request, budget: int, out: list[ScheduledChunk], room: Optional[int],
                   at_least: int = 1) -> tuple[int, bool]:
        """Schedule the request's next prompt chunk: as long as the chunk size, the budget and the free
        memory `room` allow, and at least `at_least` tokens (else none). Returns (its tokens, whether the
        free memory cut it)."""
        start = self._scheduled_end(request, out)
        remaining = request.num_prompt_tokens - start
        n = min(remaining, self.config.prefill_chunk_size, budget)
        fitted = self._fit_chunk(request, start, n, room)
        cut = fitted < n
        if 0 < fitted < min(remaining, self.config.prefill_chunk_size):
            fitted = aligned_chunk(start, fitted, self.config.chunk_granule)
        if fitted < at_least:
            return 0, cut
        pad = self._pad_tokens(request, start, fitted, budget, room) if fitted == remaining else 0
        out.append(ScheduledChunk(request.request_id, start, fitted, fitted == remaining, pad))
        return fitted + pad, cut

    def _pad_tokens(self, request: Request, start: int, num_tokens: int, budget: int, room: Optional[int]) -> int:
        """Positions past the prompt's end its last chunk [start, start + num_tokens) computes (0: none):
        up to the coarsest grid (chunk_grid.padded_ends) within `prefill_chunk_size` (a sliding-window
        ring holds window - 1 + that: a pad never overwrites a key a real position reads), the step's
        `budget`, the row's own blocks (never more KV than its reservation), max_model_len, and whose
        chunk fits the free memory `room`."""
        if not self.config.pad_last_chunk:
            return 0
        end = start + num_tokens
        max_end = min(start + min(self.config.prefill_chunk_size, budget), self.config.max_model_len,
                      self.kv.num_slots(request.request_id))
        for padded in padded_ends(end, max_end, self.config.chunk_granule):
            if room is None or padded == end or self._chunk_bytes(request, start, padded - start, end) <= room:
                return padded - end
        return 0

    def _chunk_tokens(self, request: Request, start: int, num_tokens: int, room: Optional[int]) -> int:
        """The chunk `_add_chunk` would schedule from `start` with no budget limit: the largest of at
        most `num_tokens` tokens that fits `room`, ending on the grid unless it ends the prompt."""
        fitted = self._fit_chunk(request, start, num_tokens, room)
        if 0 < fitted < min(request.num_prompt_tokens - start, self.config.prefill_chunk_size):
            return aligned_chunk(start, fitted, self.config.chunk_granule)
        return fitted

    def _chunk_bytes(self, request: Request, start: int, num_tokens: int, real_end: Optional[int] = None) -> int:
        """A prompt chunk's predicted transient (read as a view where `_reads_view`): `num_tokens` computed
        from `start`, the prompt's real ones ending at `real_end` (default: all of them)."""
        end = start + num_tokens
        ends = (end if real_end is None else real_end) == request.num_prompt_tokens
        return self.memory.prefill_chunk_bytes(num_tokens, end, ends, ends and processed(request.sampling),
                                               gathers=not self._reads_view(request.request_id, end, num_tokens))

    def _fit_chunk(self, request: Request, start: int, num_tokens: int, room: Optional[int]) -> int:
        """The largest chunk of at most `num_tokens` tokens from `start` whose transient fits `room` (0:
        none). Chunks of 2 tokens or more grow with their size (so a binary search); one token is a
        forward of another kind, tried last."""
        if room is None or self._chunk_bytes(request, start, num_tokens) <= room:
            return num_tokens
        lo, hi = 1, num_tokens - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._chunk_bytes(request, start, mid) <= room:
                lo = mid
            else:
                hi = mid - 1
        if lo >= 2:
            return lo
        return 1 if self._chunk_bytes(request, start, 1) <= room else 0

    def _try_admit(self, request: Request) -> bool:
        if len(self.running) >= self.config.max_num_seqs:
            return False
        tokens = self.memory.kv_tokens(request.max_total_tokens)
        if self.kv.allocate(request.request_id, tokens) is None:
            if not self.kv.fits_if_cache_evicted(tokens):
                return False
            # Room exists once the prefix cache's pinned entries go: waiting requests' hits pin them, and
            # strict FCFS would keep the head waiting on them for ever. They recompute their prefixes.
            for waiting in self.waiting:
                if self.kv.drop_prefix_hit(waiting.request_id):
                    waiting.num_computed_tokens = waiting.num_cached_tokens = 0
            if self.kv.allocate(request.request_id, tokens) is None:
                return False
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