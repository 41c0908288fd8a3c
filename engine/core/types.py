"""Plain data exchanged between the engine's layers: requests, sampling parameters, the scheduler's
plan, outputs, step records and engine stats."""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import Optional

from engine.core.memory.plan import StepPlan


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the model forward failed


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class Grammar:
    """A constraint on the output, enforced token by token (engine/model/grammar.py compiles it).
    kind: "json_schema" (source: a JSON schema as text), "lark" (llguidance's Lark dialect, which can
    embed JSON schemas with %json) or "regex"."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        _check(self.kind in ("json_schema", "lark", "regex"), "grammar.kind", self.kind,
               "must be 'json_schema', 'lark' or 'regex'")
        _check(isinstance(self.source, str) and bool(self.source), "grammar.source", self.source[:40],
               "must be a non-empty string")


@dataclass(frozen=True)
class LogitBias:
    token_id: int
    bias: float  # added to the token's logit before sampling


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of a sampled token and of the most likely alternatives (engine/model/sampling.py
    says from which distribution)."""

    token_id: int
    logprob: float
    top: tuple[TopLogprob, ...] = ()


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. `temperature == 0` is greedy."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    seed: Optional[int] = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # subtracted from the logits of tokens already in the output
    frequency_penalty: float = 0.0  # subtracted once per occurrence in the output
    repetition_penalty: float = 1.0  # divides positive / multiplies negative logits of prompt and output tokens
    min_p: float = 0.0  # drop tokens less likely than min_p x the most likely one (after temperature)
    logit_bias: tuple[LogitBias, ...] = ()
    logprobs: Optional[int] = None  # None: none; k: the sampled token's and the k most likely ones
    grammar: Optional[Grammar] = None

    def __post_init__(self) -> None:
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1,
               "max_tokens", self.max_tokens, "must be an integer >= 1")
        _check(_finite(self.temperature) and self.temperature >= 0,
               "temperature", self.temperature, "must be a finite number >= 0")
        _check(_finite(self.top_p) and 0 < self.top_p <= 1,
               "top_p", self.top_p, "must be in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0,
               "top_k", self.top_k, "must be an integer >= 0")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 1 << 64), "seed", self.seed,
               "must be an integer in [0, 2**64)")  # mx.random.key refuses others, on the engine thread
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check(len(self.stop) <= MAX_STOP_STRINGS, "stop", f"{len(self.stop)} strings",
               f"must hold at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            _check(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS, "stop", repr(s)[:40],
                   f"each stop string must be 1..{MAX_STOP_STRING_CHARS} characters")
        for t in self.stop_token_ids:
            _check(isinstance(t, int) and t >= 0, "stop_token_ids", t, "must be non-negative integers")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2 <= value <= 2, name, value, "must be in [-2, 2]")
        _check(_finite(self.repetition_penalty) and 0 < self.repetition_penalty <= 10, "repetition_penalty",
               self.repetition_penalty, "must be in (0, 10]")
        _check(_finite(self.min_p) and 0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]")
        object.__setattr__(self, "logit_bias", tuple(self.logit_bias))
        for b in self.logit_bias:
            _check(isinstance(b, LogitBias) and isinstance(b.token_id, int) and b.token_id >= 0
                   and _finite(b.bias) and abs(b.bias) <= MAX_LOGIT_BIAS, "logit_bias", b,
                   f"must be LogitBias records of token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
               "logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        _check(self.grammar is None or isinstance(self.grammar, Grammar), "grammar", self.grammar,
               "must be None or a Grammar")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def plain(self) -> bool:
        """No logits processing, no logprobs: the batched fast path of the sampler."""
        return not (self.has_penalties or self.logit_bias or self.min_p or self.grammar is not None
                    or self.logprobs is not None)


def processed(params: "SamplingParams") -> bool:
    """Whether the sampler runs its processing path for this row (anything but a plain argmax): what the
    memory model counts as a sampled row."""
    return not (params.greedy and params.plain)


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check(ok: bool, name: str, value, why: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r}: {why}")


@dataclass
class Request:
    """Engine-side state of one request. Progress is `num_computed_tokens` against `num_tokens`."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: Optional[FinishReason] = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        """Tokens whose KV this request can ever hold (the last sampled token is never fed back)."""
        return self.num_prompt_tokens + self.sampling.max_tokens - 1

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class RequestOutput:
    """One incremental update for a request: what is new since the last update, plus totals."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_prompt_tokens: int
    num_output_tokens: int
    finished: bool = False
    finish_reason: Optional[FinishReason] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    new_logprobs: tuple[TokenLogprob, ...] = ()  # of new_token_ids' shown tokens, when asked for


@dataclass(frozen=True)
class CompletionOutput:
    """The whole result of one request, as the sync `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: Optional[FinishReason]
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` tokens of `request_id` starting at position `start`; a prompt's last chunk may also
    compute `num_pad_tokens` positions past the prompt's end (engine/core/chunk_grid.py): their KV lands
    in the row's own slots, which decode overwrites before reading; the sample is the last real one's."""

    request_id: str
    start: int
    num_tokens: int
    completes_prompt: bool  # the chunk ends the prompt: sample the first output token
    num_pad_tokens: int = 0

    @property
    def num_forward_tokens(self) -> int:
        """Positions its forward computes (the shape it runs, what the memory model and budget count)."""
        return self.num_tokens + self.num_pad_tokens


@dataclass(frozen=True)
class PrefixCopy:
    """A prefix-cache hit: copy the KV of the first `num_tokens` positions from `source_block_ids`."""

    source_block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True)
class NewRow:
    """A request admitted this step: the KV pool blocks it owns for its whole life (KVManager)."""

    request_id: str
    block_ids: tuple[int, ...]
    prefix: Optional[PrefixCopy] = None
    ring: Optional[int] = None  # its ring in the sliding-window layers' KV (KVManager num_rings), if any


@dataclass(frozen=True)
class SchedulerOutput:
    """One step's plan: plain data from the scheduler to the executor and runner."""

    decodes: tuple[str, ...]
    prefills: tuple[ScheduledChunk, ...]
    new_rows: tuple[NewRow, ...]
    predicted_transient_bytes: int
    mixed: bool = False  # the decode rows run in the first prompt chunk's forward (engine/model/layers/mixed.py)
    # The prompt chunks' forwards: how many consecutive chunks of `prefills` each one computes (several
    # rows' chunks packed into one forward, ModelRunner.prefill_packed; a mixed forward's chunk alone
    # first). Empty: one forward per chunk.
    packs: tuple[int, ...] = ()
    num_pool_blocks: int = 0  # blocks the KV pool must hold before this step's forwards
    # Memory the step's transient may use: limit - weights - margin - the KV pool after this step's
    # growth (None: no memory limit given to the scheduler). Every step is predicted within it.
    free_transient_bytes: Optional[int] = None
    # The step's token budget: max_num_batched_tokens, or, when the free memory cut a chunk, a
    # decode row or a mixed forward (`memory_limited`), the tokens it scheduled.
    step_budget_tokens: int = 0
    memory_limited: bool = False
    # What the executor's prediction of the step read (the chunks read as views as the runner reads them;
    # None: a plan the executor has not run)
    memory_plan: Optional[StepPlan] = None

    @property
    def num_batched_tokens(self) -> int:
        """Tokens the step computes (what its budget counts): decode rows and chunks, pads included."""
        return len(self.decodes) + sum(c.num_forward_tokens for c in self.prefills)

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills


@dataclass(frozen=True)
class StepMemory:
    """Predicted (memory model) and measured (MLX peak) transient bytes of one step."""

    predicted_bytes: int
    measured_bytes: int
    # a decode launched by the pipeline, measured from its launch to its end (launched ahead,
    # StepOptions.launch_ahead: from the record of the decode before it to the ahead launch of the next)
    pipelined: bool = False
    # the part of predicted_bytes not of this step's forwards (plan.memory_plan): pool growth, prefix
    # copies, the tail of the previous step's deferred forward, the next decode launched ahead
    other_predicted_bytes: int = 0


@dataclass(frozen=True)
class ForwardTiming:
    """One forward of a step, seconds from the step's start: its graph build started (None: built by an
    earlier step), launch called, launch returned, wait started, wait ended (None where the forward was
    left running past the step), its graph build ended (None where build_s is); with a launch thread,
    when the forward before it had been encoded."""

    build_s: Optional[float]
    launch_s: float
    launched_s: float
    wait_s: Optional[float] = None
    waited_s: Optional[float] = None
    built_s: Optional[float] = None
    # with a launch thread (StepOptions.launch_thread): when it had encoded the decode this step read back
    # (the forward before this one), seconds from this step's start (negative: before the step began)
    prev_encoded_s: Optional[float] = None

    @property
    def build_duration_s(self) -> float:
        """Host seconds spent building its graph in this step (0: built by an earlier step)."""
        return self.built_s - self.build_s if self.build_s is not None and self.built_s is not None else 0.0


@dataclass(frozen=True)
class StepRecord:
    """What one `Engine.step()` did: its outputs, its plan and what it cost."""

    outputs: tuple[RequestOutput, ...]
    start_time_ns: int  # wall clock (time.time_ns) when the step began
    duration_s: float
    plan: Optional[SchedulerOutput] = None  # None: nothing was scheduled
    memory: Optional[StepMemory] = None
    slice_reads: frozenset[str] = frozenset()  # requests whose chunks of 2+ tokens read the pool as views
    forwards: tuple[ForwardTiming, ...] = ()
    schedule_s: float = 0.0  # host seconds in the scheduler's plan (0: a pipelined decode, planned before)

    @property
    def prefill_chunks(self) -> tuple[ScheduledChunk, ...]:
        return self.plan.prefills if self.plan is not None else ()

    @property
    def num_decode_tokens(self) -> int:
        return len(self.plan.decodes) if self.plan is not None else 0

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.prefill_chunks)

    @property
    def pipelined(self) -> bool:
        return self.memory is not None and self.memory.pipelined


@dataclass(frozen=True)
class StepOptions:
    """How the engine runs its steps, fixed at construction (`Engine(step_options=...)`). The defaults
    are what measured best; tests and benchmarks pass others to compare."""

    async_decode: bool = True  # pipelined decode steps (engine/executor.py)
    overlap_steps: Optional[bool] = None  # a step's last prompt chunk left running; None: on CUDA only
    # decode rows ride in a prompt chunk's forward even where it exceeds the configuration's transient
    # bound (the memory grid measures such forwards); the memory limit still applies
    mix_beyond_bound: bool = False
    # pipelined decodes encoded by a host thread of their own while the engine thread commits the step
    # before and builds the step after (engine/launch_thread.py); None: on CUDA only
    launch_thread: Optional[bool] = None
    # with the launch thread, the next pipelined decode encoded as soon as the one before is, not once it
    # has ended, where the runner's decodes write the KV pool without a donated buffer (the rope kernel
    # writing it: ModelRunner.decode_writes_in_place) and both decodes' transients fit; None: wherever so
    launch_ahead: Optional[bool] = None


@dataclass(frozen=True)
class ExecutionPaths:
    """Which of its ways of building forwards the engine's runner took (for this model and backend)."""

    paged_attention: bool  # decode attention reads the KV pool in place (the CUDA kernel)
    decode_loop: bool  # decodes run the engine's layer loop (else mlx-lm's modules)
    compiled_decode: bool  # that loop's layers built from compiled traces
    chunk_loop: bool  # prompt chunks run the engine's layer loop
    mixed_batches: bool  # decode rows can ride in a prompt chunk's forward
    fused_rope: bool = False  # decode's q/k norms and RoPE in one CUDA kernel (RunnerOptions.fused_rope)
    fused_residual: bool = False  # decode's residual adds inside o's and down's matmuls (RunnerOptions.fused_residual)
    pack_step_inputs: bool = False  # a paged decode's host-made inputs as views of one array (RunnerOptions.pack_step_inputs)
    rope_writes_kv: bool = False  # a paged decode's KV written into the pool by the rope kernel (RunnerOptions.rope_writes_kv)
    # the paged kernel's first pass (CudaPagedAttention.kind: "mma", "tiled", "span", "short"); "" without it
    attention_kernel: str = ""
    num_warmed_chunk_shapes: int = 0  # prompt-chunk shapes whose attention graphs were built at start
    warmup_s: float = 0.0  # the time that took
    launch_thread: bool = False  # pipelined decodes encoded on a thread of their own (StepOptions.launch_thread)
    launch_ahead: bool = False  # the next pipelined decode encoded before the one before ends (StepOptions.launch_ahead)


@dataclass(frozen=True)
class EngineStats:
    num_waiting: int
    num_running: int
    kv_reserved_bytes: int
    kv_used_bytes: int  # KV blocks held by running requests (= reserved)
    kv_budget_bytes: int
    kv_bytes_per_token: int
    kv_cache_step: int
    weights_bytes: int
    memory_limit_bytes: int
    transient_bound_bytes: int  # the configuration's bound over every step (memory model)
    max_predicted_transient_bytes: int  # largest predicted step transient so far
    max_measured_transient_bytes: int  # largest measured step transient so far (MLX peak)
    max_model_len: int
    num_steps: int
    num_forward_calls: int
    num_tokens_computed: int = 0  # tokens that went through the model (prefix-cache hits skip theirs)
    prefix_cache_bytes: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_evictions: int = 0
    mlx_active_bytes: int = 0  # MLX's allocated arrays (weights, KV, prefix cache, a step's transients)
    mlx_cache_bytes: int = 0  # freed buffers MLX keeps for reuse (part of the process's RSS)
    kv_allocated_bytes: int = 0  # the KV pool's arrays (running rows, prefix cache, free blocks)
    # the smallest step that makes progress (what admission keeps beside a full KV budget)
    floor_transient_bytes: int = 0
    # memory a step's transient may use now: limit - weights - margin - KV pool (None: no limit)
    free_transient_bytes: Optional[int] = None
    planned_transient_bytes: int = 0  # the last step's predicted transient


@dataclass(frozen=True)
class StepRun:
    """What running one plan produced, for the engine to commit."""

    plan: SchedulerOutput
    sampled: dict = field(default_factory=dict)  # request_id -> sampled token id
    failed: dict = field(default_factory=dict)  # request_id -> error of its own prompt chunk
    memory: Optional[StepMemory] = None
    error: Optional[Exception] = None  # the step failed as a whole: every request of the plan fails
    next_error: Optional[Exception] = None  # the next pipelined decode failed: its rows fail
    slice_reads: frozenset = frozenset()
    forwards: tuple[ForwardTiming, ...] = ()
