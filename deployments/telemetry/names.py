"""Names of the telemetry: GenAI semantic-convention attributes, instruments, units, buckets.

Constants only (no mutable state); deployments/telemetry/metrics.py builds the instruments from `_SPECS`.
"""

from __future__ import annotations

import dataclasses
from typing import Literal, Optional

# GenAI semantic-convention attribute names (span and metric attributes).
GEN_AI_OPERATION_NAME = "gen_ai.operation.name"
GEN_AI_PROVIDER_NAME = "gen_ai.provider.name"
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_RESPONSE_FINISH_REASONS = "gen_ai.response.finish_reasons"
GEN_AI_TOKEN_TYPE = "gen_ai.token.type"
GEN_AI_USAGE_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_USAGE_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ERROR_TYPE = "error.type"
REPLICA = "replica"
PROVIDER = "mlx"

# Bucket bounds: the GenAI semconv advice, widened for long CPU prefills and fast GPU decode.
DURATION_BUCKETS_S = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24, 20.48, 40.96, 60.0,
                      120.0)
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 60.0)
TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                  1.0, 2.5)
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0)
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
TOKEN_BUCKETS = tuple(float(1 << i) for i in range(17))  # 1 .. 65536

Operation = Literal["chat", "text_completion"]
AdmissionOutcome = Literal["admitted", "queued", "rejected"]
ExporterKind = Literal["none", "prometheus", "otlp_http", "otlp_grpc"]


@dataclasses.dataclass(frozen=True)
class InstrumentSpec:
    """One instrument: its OTel name, kind, UCUM unit, description and histogram bucket bounds."""

    name: str
    kind: Literal["histogram", "counter", "gauge"]
    unit: str
    description: str
    buckets: Optional[tuple[float, ...]] = None


_S, _TOK = "s", "{token}"
TIME_TO_FIRST_TOKEN = InstrumentSpec("gen_ai.server.time_to_first_token", "histogram", _S,
                                     "Time to the first output token.", TTFT_BUCKETS_S)
TIME_PER_OUTPUT_TOKEN = InstrumentSpec("gen_ai.server.time_per_output_token", "histogram", _S,
                                       "Time per output token after the first.", TPOT_BUCKETS_S)
REQUEST_DURATION = InstrumentSpec("gen_ai.server.request.duration", "histogram", _S,
                                  "Arrival to last token.", DURATION_BUCKETS_S)
TOKEN_USAGE = InstrumentSpec("gen_ai.client.token.usage", "histogram", _TOK,
                             "Input and output tokens per request.", TOKEN_BUCKETS)
QUEUE_TIME = InstrumentSpec("mlx_serve.queue.time", "histogram", _S, "Arrival to first step.",
                            QUEUE_BUCKETS_S)
STEP_PREFILL_TOKENS = InstrumentSpec("mlx_serve.step.prefill_tokens", "histogram", _TOK,
                                     "Prompt tokens computed per step.", TOKEN_BUCKETS)
STEP_DECODE_TOKENS = InstrumentSpec("mlx_serve.step.decode_tokens", "histogram", _TOK,
                                    "Decode tokens computed per step.", TOKEN_BUCKETS)
STEP_DURATION = InstrumentSpec("mlx_serve.step.duration", "histogram", _S, "One engine step.", STEP_BUCKETS_S)
REQUESTS_WAITING = InstrumentSpec("mlx_serve.requests.waiting", "gauge", "{request}", "Requests not started.")
REQUESTS_RUNNING = InstrumentSpec("mlx_serve.requests.running", "gauge", "{request}", "Requests holding KV.")
KV_RESERVED_BYTES = InstrumentSpec("mlx_serve.kv_cache.reserved_bytes", "gauge", "By",
                                   "KV bytes reserved for admitted requests.")
KV_USED_BYTES = InstrumentSpec("mlx_serve.kv_cache.used_bytes", "gauge", "By", "KV bytes of computed tokens.")
PREDICTED_PEAK_BYTES = InstrumentSpec("mlx_serve.prefill.predicted_peak_bytes", "gauge", "By",
                                      "Predicted transient peak of the last prefill step.")
MEASURED_PEAK_BYTES = InstrumentSpec("mlx_serve.prefill.measured_peak_bytes", "gauge", "By",
                                     "Measured transient peak of the last prefill step.")
MEMORY_LIMIT_BYTES = InstrumentSpec("mlx_serve.memory.limit_bytes", "gauge", "By", "Engine memory limit.")
ADMISSION_DECISIONS = InstrumentSpec("mlx_serve.admission.decisions", "counter", "{decision}",
                                     "Admission decisions by outcome and reason.")
PREFIX_CACHE_QUERIES = InstrumentSpec("mlx_serve.prefix_cache.queries", "counter", "{query}", "Lookups.")
PREFIX_CACHE_HITS = InstrumentSpec("mlx_serve.prefix_cache.hits", "counter", "{hit}", "Lookups that hit.")
PREFIX_CACHE_HIT_TOKENS = InstrumentSpec("mlx_serve.prefix_cache.hit_tokens", "counter", _TOK,
                                         "Prompt tokens served from the prefix cache.")
PREFIX_CACHE_EVICTIONS = InstrumentSpec("mlx_serve.prefix_cache.evictions", "counter", "{entry}", "Evicted.")
PREFIX_CACHE_BYTES = InstrumentSpec("mlx_serve.prefix_cache.bytes", "gauge", "By", "Prefix cache bytes.")
STEP_BUDGET_TOKENS = InstrumentSpec("mlx_serve.step.budget_tokens", "gauge", _TOK,
                                    "Token budget of the last step: max_num_batched_tokens, or what "
                                    "it scheduled when the free memory cut it.")
STEP_FREE_BYTES = InstrumentSpec("mlx_serve.step.free_transient_bytes", "gauge", "By",
                                 "Memory the last step's transient could use: limit - weights - margin "
                                 "- the KV pool.")
PEAK_EXCEEDED = InstrumentSpec("mlx_serve.replica.peak_exceeded", "counter", "{event}",
                               "Steps whose measured peak exceeded the prediction.")
_SPECS = (TIME_TO_FIRST_TOKEN, TIME_PER_OUTPUT_TOKEN, REQUEST_DURATION, TOKEN_USAGE, QUEUE_TIME,
          STEP_PREFILL_TOKENS, STEP_DECODE_TOKENS, STEP_DURATION, REQUESTS_WAITING, REQUESTS_RUNNING,
          KV_RESERVED_BYTES, KV_USED_BYTES, PREDICTED_PEAK_BYTES, MEASURED_PEAK_BYTES, MEMORY_LIMIT_BYTES,
          ADMISSION_DECISIONS, PREFIX_CACHE_QUERIES, PREFIX_CACHE_HITS, PREFIX_CACHE_HIT_TOKENS,
          PREFIX_CACHE_EVICTIONS, PREFIX_CACHE_BYTES, PEAK_EXCEEDED, STEP_BUDGET_TOKENS, STEP_FREE_BYTES)
