"""Steps sized to the free memory, on the tiny model (real MLX): under a memory limit a little above the
weights, every step's measured transient stays within its prediction and its prediction within the
memory the KV pool leaves free; every request finishes; KV gets most of what the weights leave.

Random mixes (hypothesis) of prompt lengths, decode rows and arrival order, kept few and short so the
test runs in seconds on a loaded 2-core machine; derandomized, so a run checks the same examples each
time (MLX_SERVE_HYPOTHESIS_EXAMPLES raises their number). Every step: measured <= predicted <= 1.5x
measured; every example of ten steps or more: the median step's prediction within 1.27x; the median
step of all examples together, and of a fixed burst, within 1.2x. On the CPU the runner waits between a forward's stages (ModelRunner.stage_waits: a decode's layers
and its head; a chunk's projections, attention blocks, MLP norm and MLP per layer), so a step's peak does
not depend on how far MLX's worker is behind the host and the prediction can be tight.
"""

from __future__ import annotations

import gc
import os
import statistics

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from engine.core.types import SamplingParams

MAX_MODEL_LEN = 1024
# Every step's prediction within this of its measurement: the tiny model's smallest steps (a few hundred
# KB) are where the CPU set, fitted over larger shapes too, is loosest, most of all a mixed forward of one
# decode row beside a short chunk read as a view, predicted with the pool's copy of the chunk's row
# (KVPool.copy_views) while its peak is the row's logits (docs/memory.md): close to this bound
MAX_STEP_RATIO = 1.5
# ... and the median step's of a random example: the tiny model's 64-token chunks and one-row decodes are
# predicted above 1.2x (the set's 24 KB per-forward margin is a sixth of such a step), so an example of
# mostly those can land above 1.2; a burst of larger chunks and decodes (below) within 1.2x
MEDIAN_STEP_RATIO = 1.27
EXAMPLES = int(os.environ.get("MLX_SERVE_HYPOTHESIS_EXAMPLES", "6"))


def run_burst(make_engine, headroom: int, requests, chunk: int = 128, max_num_seqs: int = 8,
              pad: bool = False) -> tuple[list, object]:
    """`requests`: (prompt length, max_tokens, arrival step); `pad`: prompts' last chunks padded up to
    the grid (ExecutionConfig.pad_last_chunk). Returns (step records, engine)."""
    engine = make_engine(memory_limit_bytes=1 << 30)  # the model's weights, as the engine counts them
    weights = engine.memory.shape.weights_bytes
    del engine
    engine = make_engine(memory_limit_bytes=weights + headroom, max_model_len=MAX_MODEL_LEN, prefill_chunk_size=chunk,
                         max_num_batched_tokens=4 * chunk, max_num_seqs=max_num_seqs,
                         execution={"pad_last_chunk": pad})
    gc.collect()  # earlier engines freed now, not mid-step (their pool would hide the step's transient)
    pending = sorted(enumerate(requests), key=lambda r: r[1][2])
    records, step = [], 0
    while pending or engine.has_unfinished():
        while pending and pending[0][1][2] <= step:
            i, (n, m, _) = pending.pop(0)
            engine.add_request(f"r{i}", [3 + (i * 7 + k) % 900 for k in range(n)],
                               SamplingParams(max_tokens=m, ignore_eos=True))
        # on a fresh buffer cache, as the grid measured: a buffer MLX serves from its cache may be up to two
        # pages larger than asked and counts whole, which the tiny model's steps of a few hundred KB show
        # (docs/memory.md, "Measured peaks in a long-running process")
        mx.clear_cache()
        records.append(engine.step())
        step += 1
        assert step < 5000
    return records, engine


def check_steps(records, engine) -> list[float]:
    """Every step: measured <= predicted, the plan within the free memory. Returns predicted/measured."""
    ratios = []
    for record in records:
        assert all(o.error is None for o in record.outputs)
        plan, memory = record.plan, record.memory
        if plan is None or memory is None:
            continue
        assert memory.measured_bytes <= memory.predicted_bytes, (plan, memory)
        assert plan.free_transient_bytes is not None
        assert plan.predicted_transient_bytes <= plan.free_transient_bytes, plan
        if memory.measured_bytes:
            ratios.append(memory.predicted_bytes / memory.measured_bytes)
    stats = engine.stats()
    assert stats.kv_allocated_bytes <= stats.kv_budget_bytes
    return ratios


@pytest.fixture(scope="module")
def all_examples_ratios():
    """Every step's predicted / measured over all the property test's examples: once they ran, their
    median step within 1.2x (what issue 24 asks of the property test; an example's own median may reach
    MEDIAN_STEP_RATIO)."""
    ratios: list[float] = []
    yield ratios
    if ratios:
        print(f"median step over the {len(ratios)} steps of every example: {statistics.median(ratios):.3f}")
        assert statistics.median(ratios) <= 1.2, sorted(ratios)


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.integers(2, 700), st.integers(1, 6), st.integers(0, 4)),
                         min_size=1, max_size=6),
       headroom=st.sampled_from([6 << 20, 12 << 20, 64 << 20]), chunk=st.sampled_from([64, 128, 256]),
       pad=st.booleans())
def test_property_every_step_within_prediction_and_free_memory(make_engine, all_examples_ratios, requests,
                                                                headroom, chunk, pad):
    records, engine = run_burst(make_engine, headroom, requests, chunk, pad=pad)
    ratios = check_steps(records, engine)
    all_examples_ratios.extend(ratios)
    assert not engine.has_unfinished()
    assert max(ratios) <= MAX_STEP_RATIO, sorted(ratios)
    if len(ratios) >= 10:  # the median of a few steps is one of them
        assert statistics.median(ratios) <= MEDIAN_STEP_RATIO, sorted(ratios)


def test_tight_burst_kv_share_and_tightness(make_engine):
    """A burst that fills the KV pool: KV gets >= 75% of what the weights leave, some steps are cut to
    the free memory, and the prediction stays within 1.2x at the median step."""
    requests = [(300 + (i * 137) % 700, 4 + (i * 5) % 20, 0) for i in range(24)]
    records, engine = run_burst(make_engine, 12 << 20, requests, chunk=256, max_num_seqs=16)
    ratios = sorted(check_steps(records, engine))
    stats = engine.stats()
    assert stats.kv_budget_bytes >= 0.75 * (stats.memory_limit_bytes - stats.weights_bytes)
    assert any(r.plan is not None and r.plan.memory_limited for r in records)
    assert max(r.plan.num_batched_tokens for r in records if r.plan is not None) > 256  # not the floor only
    assert statistics.median(ratios) <= 1.2, ratios


def test_default_step_budget_is_resolved_for_the_device(make_engine):
    """No max_num_batched_tokens given: the engine on the CPU runs with 2048 (EngineConfig's CPU default),
    and its config, scheduler and plans all read that value."""
    engine = make_engine(prefill_chunk_size=512, max_num_seqs=8)
    assert engine.config.max_num_batched_tokens == 2048 == engine.scheduler.config.max_num_batched_tokens
    for i in range(8):
        engine.add_request(f"r{i}", [3 + (i * 11 + k) % 900 for k in range(700)],
                           SamplingParams(max_tokens=2, ignore_eos=True))
    plans = []
    while engine.has_unfinished():
        record = engine.step()
        if record.plan is not None:
            plans.append(record.plan)
    assert max(p.num_batched_tokens for p in plans) == 2048  # a full step, and never more
    assert all(p.step_budget_tokens <= 2048 for p in plans)
