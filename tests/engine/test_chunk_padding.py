"""A prompt's last chunk padded up to the grid (ExecutionConfig.pad_last_chunk), on the tiny model with real
MLX forwards: greedy tokens equal mlx-lm's generate for prompts whose lengths are off the grid, with
several requests batched, mixed forwards and each way of running a chunk; the forwards really ran
padded, and every step's measured transient stays within its prediction."""

from __future__ import annotations

import random

import pytest

from engine.core.types import SamplingParams
from engine.model.runner import RunnerOptions

OPTIONS = {
    "loops": RunnerOptions(),  # the engine's layer loops, mixed forwards, cpu_math, views
    "loops-gather-mlx-ops": RunnerOptions(read_slices=False, cpu_math=False),
    "modules": RunnerOptions(layer_loops=False, mixed_batches=False),  # mlx-lm's modules
}


def watch_pads(engine) -> list:
    """Per prompt chunk the runner builds: (its pad, whether decode rows ride in its forward)."""
    runner, seen = engine.runner, []
    prefill, mixed, packed = runner.prefill, runner.mixed_forward, runner.prefill_packed

    def watched_prefill(work):
        seen.append((work.num_pad_tokens, False))
        return prefill(work)

    def watched_packed(works):
        seen.extend((work.num_pad_tokens, False) for work in works)
        return packed(works)

    def watched_mixed(work, decodes):
        seen.append((work.num_pad_tokens, True))
        return mixed(work, decodes)

    runner.prefill, runner.mixed_forward, runner.prefill_packed = watched_prefill, watched_mixed, watched_packed
    return seen


@pytest.mark.parametrize("chunk, lengths", [(16, (5, 70, 33, 1, 47, 97)), (256, (130, 300, 77, 90))],
                         ids=["chunk16", "chunk256"])
@pytest.mark.parametrize("way", list(OPTIONS))
def test_padded_last_chunks_give_mlx_lm_greedy_tokens(make_engine, tiny_parts, reference_greedy, way, chunk,
                                                      lengths):
    engine = make_engine(prefill_chunk_size=chunk, max_num_batched_tokens=3 * chunk // 2, max_num_seqs=4,
                         prefix_cache_fraction=0.0, runner_options=OPTIONS[way],
                         execution={"pad_last_chunk": True})
    assert engine.scheduler.config.pad_last_chunk and engine.config.execution.pad_last_chunk
    assert engine.scheduler.config.chunk_granule == engine.config.execution.chunk_granule == 128
    seen = watch_pads(engine)
    rng = random.Random(chunk)
    vocab = engine.memory.shape.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
    tokens: dict = {}
    # half arrive while the others decode, so decode rows ride in padded chunks' forwards
    for step in range(10_000):
        if step in (0, 3):
            for i in range(len(prompts))[step // 3::2]:
                engine.add_request(str(i), prompts[i], SamplingParams(max_tokens=10, ignore_eos=True))
        record = engine.step()
        for out in record.outputs:
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if record.memory is not None:
            assert record.memory.measured_bytes <= record.memory.predicted_bytes, record
        for c in record.prefill_chunks:  # a pad only after a prompt's end, within the chunk size
            assert c.num_pad_tokens == 0 or c.completes_prompt and c.num_forward_tokens <= chunk
        if step >= 3 and not engine.has_unfinished():
            break
    for i, prompt in enumerate(prompts):
        assert tokens[str(i)] == reference_greedy(tiny_parts[0], prompt, 10), (way, i)
    assert sum(pad > 0 for pad, _ in seen) >= len(prompts) - 1  # every prompt off the grid was padded
    if engine.runner.mixed is not None:
        assert any(pad and mixed for pad, mixed in seen)
    assert engine.stats().kv_used_bytes == 0 and engine.kv.allocator.num_used == 0  # every block back


@pytest.mark.parametrize("way", list(OPTIONS))
def test_a_padded_chunk_samples_the_logits_of_the_unpadded_one(make_engine, way):
    """The first token's log-probabilities (its top 8) with and without the pad agree to float rounding:
    no real position reads a pad key. Last chunks of 1 (97 = 6 x 16 + 1) and 7 real tokens, and one
    starting off the grid after a prefix-cache hit (the first prompt again, then extended by 2), while
    another request decodes (its rows ride in the chunks' forwards where the runner mixes)."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 40000) for _ in range(n)] for n in (97, 39)]
    prompts += [prompts[0], prompts[0] + [11, 12]]

    def first_logprobs(pad: bool) -> tuple[list, list]:
        engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=48, runner_options=OPTIONS[way],
                             execution={"pad_last_chunk": pad})
        engine.add_request("decoding", prompts[1][:5], SamplingParams(max_tokens=200, ignore_eos=True))
        found, pads = [], []
        for i, prompt in enumerate(prompts):  # one after another: the later ones hit the prefix cache
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, logprobs=8))
            while str(i) in engine.scheduler.requests:
                record = engine.step()
                pads += [c.num_pad_tokens for c in record.prefill_chunks if c.request_id == str(i) and c.completes_prompt]
                found += [o.new_logprobs[0] for o in record.outputs if o.request_id == str(i)]
        return found, pads

    (want, no_pads), (got, pads) = first_logprobs(False), first_logprobs(True)
    assert not any(no_pads) and all(pads) and len(pads) == len(prompts)
    for a, b in zip(want, got):
        assert a.token_id == b.token_id and [t.token_id for t in a.top] == [t.token_id for t in b.top]
        assert [t.logprob for t in b.top] == pytest.approx([t.logprob for t in a.top], abs=1e-4)


def test_padding_off_by_default_on_the_cpu(make_engine):
    engine = make_engine(prefill_chunk_size=16, max_num_batched_tokens=24)
    assert engine.config.execution.pad_last_chunk is False and not engine.scheduler.config.pad_last_chunk
    engine.add_request("a", list(range(3, 40)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        record = engine.step()
        assert all(c.num_pad_tokens == 0 for c in record.prefill_chunks)
