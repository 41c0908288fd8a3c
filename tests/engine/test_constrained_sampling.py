"""Grammar masks, logit bias, penalties, min_p and logprobs on the real engine (tiny random llama).

The tiny model is random: its free output is noise, so a constrained answer that parses shows the mask.
"""

from __future__ import annotations

import json
import math

import pytest

from engine.core.types import Grammar, LogitBias, SamplingParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "ok": {"type": "boolean"}}}


def _run(engine, prompts, params, records=None):
    """[(token ids, text, finish reason, logprobs)] of prompts run together; `records`: gets the steps'."""
    for i, (p, s) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", p, s)
    out = {f"r{i}": ([], [], None, []) for i in range(len(prompts))}
    while engine.has_unfinished():
        record = engine.step()
        if records is not None:
            records.append(record)
        for o in record.outputs:
            ids, text, _, lps = out[o.request_id]
            ids.extend(o.new_token_ids)
            text.append(o.new_text)
            lps.extend(o.new_logprobs)
            out[o.request_id] = (ids, text, o.finish_reason if o.finished else None, lps)
    return [(ids, "".join(t), r, lps) for ids, t, r, lps in (out[f"r{i}"] for i in range(len(prompts)))]


@pytest.mark.parametrize("async_decode, overlap_steps", [(True, None), (False, None), (True, True)])
def test_constrained_rows_parse_and_free_rows_keep_their_tokens(make_engine, tiny_parts, reference_greedy,
                                                                async_decode, overlap_steps):
    engine = make_engine(async_decode=async_decode, overlap_steps=overlap_steps)
    model, _, _ = tiny_parts
    prompts = [engine.encode([{"role": "user", "content": f"question {i}"}]) for i in range(4)]
    grammar = Grammar("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=60, grammar=grammar),
              SamplingParams(max_tokens=16, temperature=0.8, seed=5),
              SamplingParams(max_tokens=60, grammar=grammar, temperature=1.0, seed=1)]
    records = []
    results = _run(engine, prompts, params, records)
    # constrained rows keep the decode pipeline (their sampling is built when the forward is launched)
    assert any(r.memory is not None and r.memory.pipelined for r in records) == async_decode
    assert results[0][0] == reference_greedy(model, prompts[0], 16, engine.eos_token_ids)
    alone = _run(make_engine(async_decode=async_decode, overlap_steps=overlap_steps), [prompts[2]], [params[2]])[0]
    assert results[2][0] == alone[0]  # a seeded free row: same tokens with or without the constrained
    for ids, text, reason, _ in (results[1], results[3]):
        value = json.loads(text)
        assert set(value) == {"name", "age", "ok"} and 0 <= value["age"] <= 120 and len(value["name"]) <= 8
        assert reason.value == "stop" and ids[-1] not in engine.eos_token_ids  # ends on its "}"


def test_masks_from_the_grammars_thread_give_the_same_tokens(make_engine, monkeypatch):
    """Where the host has cores to spare, llguidance's threads compute a decode's masks from a host thread
    of their own while the engine's thread launches the forward (elsewhere the engine's thread computes
    them after the launch): the same tokens either way, the pipeline kept."""
    import engine.model.grammar as grammar

    schema = Grammar("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(max_tokens=40, grammar=schema), SamplingParams(max_tokens=12),
              SamplingParams(max_tokens=40, grammar=schema, temperature=1.0, seed=2)]
    engine = make_engine()
    prompts = [engine.encode([{"role": "user", "content": f"item {i}"}]) for i in range(3)]
    monkeypatch.setattr(grammar, "MIN_CORES_FOR_THREADS", 10_000)
    on_the_engines = _run(engine, prompts, params)
    assert engine._grammars()._masks._thread is None
    monkeypatch.setattr(grammar, "MIN_CORES_FOR_THREADS", 1)
    engine, records = make_engine(), []
    assert _run(engine, prompts, params, records) == on_the_engines
    assert engine._grammars()._masks._thread is not None and any(r.memory.pipelined for r in records if r.memory)
    json.loads(on_the_engines[0][1])


def test_regex_and_lark_grammars_and_a_bad_schema(make_engine):
    engine = make_engine()
    prompt = engine.encode("The answer is")
    r = _run(engine, [prompt, prompt], [SamplingParams(max_tokens=20, grammar=Grammar("regex", r"(yes|no)!")),
                                        SamplingParams(max_tokens=20, grammar=Grammar("lark", 'start: "a" "b"+ "c"'))])
    assert r[0][1] in ("yes!", "no!")
    assert r[1][1].startswith("ab") and r[1][1].endswith("c")
    with pytest.raises(ValueError, match="Invalid type"):
        engine.check_request(prompt, SamplingParams(grammar=Grammar("json_schema", '{"type": "objectx"}')))


def test_logprobs_are_the_models_log_softmax_for_plain_greedy(make_engine, tiny_parts):
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    engine = make_engine()
    model, _, _ = tiny_parts
    prompt = engine.encode([{"role": "user", "content": "hello"}])
    ids, _, _, lps = _run(engine, [prompt], [SamplingParams(max_tokens=6, logprobs=5)])[0]
    assert [lp.token_id for lp in lps] == ids
    for (token, ref), lp in zip(generate_step(mx.array(prompt), model, max_tokens=6), lps):
        ref = ref.astype(mx.float32)
        assert lp.token_id == int(token)
        assert math.isclose(lp.logprob, ref[lp.token_id].item(), abs_tol=2e-3)
        expected = mx.argsort(-ref)[:5].tolist()
        assert [t.token_id for t in lp.top] == expected and lp.top[0].token_id == lp.token_id
        assert all(a.logprob >= b.logprob for a, b in zip(lp.top, lp.top[1:]))
    # under a grammar, the forbidden tokens are out of the distribution: a forced token has logprob 0
    ids, text, _, lps = _run(engine, [prompt], [SamplingParams(
        max_tokens=8, logprobs=3, grammar=Grammar("regex", "ok"))])[0]
    assert text == "ok" and all(t.token_id == lp.token_id or t.logprob < 0 for lp in lps for t in lp.top)
    assert all(lp.logprob <= 0 for lp in lps)


def test_bias_penalties_and_min_p_change_the_output(make_engine):
    engine = make_engine()
    prompt = engine.encode([{"role": "user", "content": "hi"}])
    bias = (LogitBias(100, 15.0),)  # the random model's logits span about +-10: token 100 wins, again and again

    def tokens(**kw):
        return _run(engine, [prompt], [SamplingParams(max_tokens=12, logit_bias=bias, **kw)])[0][0]

    assert tokens() == [100] * 12
    assert tokens(frequency_penalty=2.0)[:3] == [100] * 3 and tokens(frequency_penalty=2.0).count(100) < 12
    assert tokens(presence_penalty=2.0, frequency_penalty=0.0) == [100] * 12  # 15 - 2 still wins
    assert tokens(repetition_penalty=3.0)[0] == 100 and tokens(repetition_penalty=3.0).count(100) < 12
    # min_p = 1 keeps only the most likely token: sampling at temperature 1 becomes greedy
    greedy = _run(engine, [prompt], [SamplingParams(max_tokens=10)])[0][0]
    assert _run(engine, [prompt], [SamplingParams(max_tokens=10, temperature=1.0, seed=3, min_p=1.0)])[0][0] == greedy
    assert _run(engine, [prompt], [SamplingParams(max_tokens=10, temperature=1.0, seed=3)])[0][0] != greedy


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_grammar_ended_by_eos_shows_no_eos_text(make_engine, ignore_eos):
    """A complete grammar allows EOS; taken with ignore_eos set, it ends the request without its text."""
    engine = make_engine()
    eos = sorted(engine.eos_token_ids)[0]
    eos_text = engine.tokenizer.decode([eos])
    params = SamplingParams(max_tokens=30, ignore_eos=ignore_eos, grammar=Grammar("regex", "[ab]{1,3}"),
                            logit_bias=(LogitBias(eos, 100.0),))
    [(ids, text, reason, _)] = _run(engine, [list(range(200, 230))], [params])
    assert ids[-1] == eos and reason.value == "stop"
    assert eos_text not in text and text and set(text) <= {"a", "b"}


@pytest.mark.parametrize("extra", [0, 7])  # the model's vocabulary past its tokenizer's
def test_mask_words_expand_on_the_device(tiny_parts, extra):
    """A batch's masks are packed words (bit t of a row: token t allowed), computed on the grammars'
    thread or on the caller's; the logits they allow are those numpy's unpacked bits select, whether the bits are unpacked
    on the host (the CPU) or expanded on the device (a GPU), also for a vocabulary that is not a
    multiple of 32 and for a row without a grammar (None: all allowed)."""
    import mlx.core as mx
    import numpy as np

    from engine.model.grammar import GrammarCompiler, MaskWorker
    from engine.model.sampling import _allowed_only, _expand_and_select

    _, tokenizer, config = tiny_parts
    vocab = config["vocab_size"] + extra
    compiler = GrammarCompiler(tokenizer._tokenizer, vocab, [0])
    matchers = [compiler.matcher(Grammar("regex", "[a-z]+")), None, compiler.matcher(Grammar("regex", "[0-9]"))]
    words = MaskWorker(2).start(matchers).result()  # llguidance's threads, from the worker's thread
    assert (words == MaskWorker(0).start(matchers).result()).all()  # on this thread, row after row
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    assert bits[1].all() and 0 < bits[0].sum() < vocab and 0 < bits[2].sum() < bits[0].sum()
    logits = np.random.default_rng(0).standard_normal((3, vocab)).astype(np.float32)
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.array(logits).astype(dtype)
        expected = np.where(bits, np.array(x.astype(mx.float32)), -np.inf)
        for got in (_allowed_only(words, x), _expand_and_select(mx.array(words), x)):  # the CPU's way, a GPU's
            assert got.dtype == mx.float32 and (np.array(got) == expected).all()
