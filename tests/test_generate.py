"""generate / stream_generate on the tiny model: determinism, greedy = argmax chain, stop rules, session reuse."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.chat import ThinkMode
from ds4_mlx.generate import decode_tokens, generate, prompt_tokens, stream_generate
from ds4_mlx.loader import load
from ds4_mlx.sampling import GREEDY_PARAMS, Sampler, SamplingParams
from ds4_mlx.session import Session


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return load(tiny_gguf())


def _run(model, prompt, **kw):
    m, tok = model
    return list(stream_generate(m, tok, prompt, **kw))


def test_same_seed_same_tokens_other_seed_differs(model):
    a = [r.token for r in _run(model, "Hello", max_tokens=8, seed=5)]
    b = [r.token for r in _run(model, "Hello", max_tokens=8, seed=5)]
    c = [r.token for r in _run(model, "Hello", max_tokens=8, seed=6)]
    assert a == b and len(a) == 8
    assert a != c


def test_greedy_is_the_argmax_chain(model):
    m, tok = model
    out = _run(model, "The quick brown fox", max_tokens=8, sampling=GREEDY_PARAMS)
    ids = prompt_tokens(tok, "The quick brown fox")
    s = Session(m)
    logits = s.prefill(ids)
    want = []
    for _ in range(8):
        t = int(mx.argmax(logits).item())
        if t == tok.eos_id:
            break
        want.append(t)
        logits = s.step(t)
    assert [r.token for r in out if r.token is not None] == want
    assert out[-1].finish_reason == "length" and out[-1].generation_tokens == 8
    text = "".join(r.text for r in out)
    assert text == tok.decode([t for t in want if t not in (tok.think_id, tok.think_end_id)])


def test_prompt_rendering_forms(model):
    m, tok = model
    ids = prompt_tokens(tok, "Hi", system="", think=ThinkMode.NONE)
    assert ids == [tok.bos_id, tok.user_id, *tok.encode("Hi"), tok.assistant_id, tok.think_end_id]
    msgs = [{"role": "user", "content": "Hi"}]
    assert prompt_tokens(tok, msgs, think="none") == [tok.bos_id, tok.user_id, *tok.encode("Hi"), tok.assistant_id,
                                                      tok.think_end_id]
    assert prompt_tokens(tok, [5, 6, 7]) == [5, 6, 7]


def test_stop_string_truncates_before_it(model):
    full = "".join(r.text for r in _run(model, "Hello", max_tokens=24, seed=3))
    # a stop string of plain ASCII from the middle of the text (random text also holds U+FFFD replacements)
    starts = [i for i in range(4, len(full) - 2) if full[i : i + 2].isascii() and full[i : i + 2].isprintable()]
    assert starts, full
    stop = full[starts[0] : starts[0] + 2]
    cut = full.index(stop)
    out = _run(model, "Hello", max_tokens=24, seed=3, stop=[stop])
    assert out[-1].finish_reason == "stop"
    assert "".join(r.text for r in out) == full[:cut]


def test_context_limits(model):
    m, tok = model
    n = len(prompt_tokens(tok, "Hello"))
    out = _run(model, "Hello", max_tokens=50, seed=1, ctx=n + 3)
    assert out[-1].finish_reason == "length" and out[-1].generation_tokens <= 2
    with pytest.raises(ValueError, match="free slot"):
        _run(model, "Hello", ctx=n)


def test_session_prefix_reuse_matches_fresh_run(model):
    m, tok = model
    s = Session(m)
    first = prompt_tokens(tok, "Tell me a story")
    _run(model, first, max_tokens=3, sampling=GREEDY_PARAMS, session=s)
    longer = s.tokens + tok.encode(" and more")
    reused = _run(model, longer, max_tokens=5, sampling=GREEDY_PARAMS, session=s)
    fresh = _run(model, longer, max_tokens=5, sampling=GREEDY_PARAMS)
    assert reused[0].cached_tokens == len(longer) - len(tok.encode(" and more"))
    assert fresh[0].cached_tokens == 0
    assert [r.token for r in reused] == [r.token for r in fresh]
    # an unrelated prompt resets the session instead of reusing it
    other = _run(model, "Something else", max_tokens=1, session=s, seed=1)
    assert other[0].cached_tokens == 0


@pytest.mark.parametrize("lag", [0, 2])
def test_eos_and_think_markers(model, monkeypatch, lag):
    """EOS stops without being emitted or entering the KV (also when steps after it were already queued);
    <think>/</think> switch the reasoning channel and print nothing."""
    m, tok = model
    a, b = tok.encode("ab")[0], tok.encode(" c")[0]
    script = itertools.chain([a, tok.think_end_id, b, b, tok.eos_id], itertools.repeat(a))
    monkeypatch.setattr(Sampler, "draw", lambda self, logits, params=None: mx.array(next(script), dtype=mx.int32))
    s = Session(m)
    out = _run(model, "Hi", max_tokens=10, think="high", session=s, lag=lag)
    assert [r.token for r in out] == [a, tok.think_end_id, b, b, None]
    assert [r.reasoning for r in out] == [True, True, False, False, False]
    assert out[1].text == "" and out[-1].finish_reason == "stop" and out[-1].generation_tokens == 4
    assert "".join(r.text for r in out) == tok.decode([a, b, b])
    assert s.tokens == prompt_tokens(tok, "Hi", think="high") + [a, tok.think_end_id, b, b]


def _state(s: Session) -> list[np.ndarray]:
    return [np.array(a) for a in s.state_arrays()]


@pytest.mark.parametrize("kw", [dict(seed=4), dict(sampling=GREEDY_PARAMS), dict(seed=3, max_tokens=5),
                                dict(sampling=SamplingParams(top_k=5), seed=2)], ids=["seeded", "greedy", "length",
                                                                                      "host-sampler"])
def test_pipelined_decode_is_the_synchronous_one(model, kw, encode_thread):
    """Queued steps (lag 1, 2) give the tokens, text and final session of one step at a time (lag 0): the
    steps queued past the end (stop string or max_tokens) are rewound."""
    m, tok = model
    kw = dict(dict(max_tokens=20), **kw)
    if "max_tokens" not in kw:  # stop at a string from the middle of the text
        text = "".join(r.text for r in _run(model, "Hello", **kw))
        kw["stop"] = [text[len(text) // 2 :][:2]]
    runs = {}
    for lag in (0, 1, 2):
        s = Session(m)
        out = _run(model, "Hello", session=s, lag=lag, **kw)
        runs[lag] = ([r.token for r in out], "".join(r.text for r in out), s.tokens, _state(s))
    assert runs[0][0][-1] is not None and len(runs[0][0]) < kw["max_tokens"] or "stop" not in kw
    for lag in (1, 2):
        assert runs[lag][:3] == runs[0][:3], lag
        assert all(np.array_equal(x, y) for x, y in zip(runs[lag][3], runs[0][3], strict=True))
    assert len(runs[0][2]) == len(prompt_tokens(tok, "Hello")) + sum(t is not None for t in runs[0][0]) - 1


def test_pipelined_decode_across_a_buffer_growth(model):
    """Steps queued two deep from the encoder thread (CUDA's default) while a compressed-row buffer grows (no
    reserve: the ratio-4 rows go 16 -> 32 when the window ending at position 67 completes) give the ids and
    state of a session whose buffers were sized up front. Two full-shape A/B runs on CUDA died at such a
    growth; on a GPU this is the one-version check."""
    m, _ = model
    runs = {}
    for reserve in (0, 80):
        s = Session(m, reserve=reserve)
        s.prefill(list(range(5, 63)))  # 58 tokens: 14 rows at ratio 4
        got = [t for t, _ in decode_tokens(s, Sampler(seed=5), 14, lag=2, encode_thread=True)]
        caps = {c.comp.shape[0] for c in s.caches if c.ratio == 4}
        runs[reserve] = (got, s.tokens, _state(s), caps)
    (got, toks, state, caps), (got_r, toks_r, state_r, caps_r) = runs[0], runs[80]
    assert caps == {32} and caps_r == {20}  # the first run grew its buffers mid-decode, the second did not
    assert got == got_r and toks == toks_r and len(toks) == 58 + 13
    for a, b in zip(state, state_r, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_pipelined_decode_across_the_indexers_first_selection(model, encode_thread):
    """From a prompt too short for the indexer (2 ratio-4 rows, top-k 4), queued steps reach its first
    selection (5 rows: position 20), which reads the indexer's weights for the first time, and give the
    synchronous loop's ids and state. On CUDA that first read once evaluated on the caller's thread while the
    encoder thread queued a step, and crashed the process."""
    m, _ = model
    runs = []
    for lag in (0, 2):
        s = Session(m)
        s.prefill(list(range(7, 15)))
        runs.append(([t for t, _ in decode_tokens(s, Sampler(seed=8), 20, lag=lag)], s.tokens, _state(s)))
    assert runs[1][:2] == runs[0][:2] and len(runs[0][1]) == 8 + 19
    for a, b in zip(runs[1][2], runs[0][2], strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_tokens_rewinds_when_the_caller_stops(model, encode_thread):
    m, tok = model
    ids = prompt_tokens(tok, "Stop early")
    s = Session(m)
    s.prefill(ids)
    gen = decode_tokens(s, Sampler(seed=9), 50, lag=2)
    got = [next(gen)[0] for _ in range(4)]
    gen.close()
    assert s.tokens == ids + got[:3]  # the last id read never entered the KV; the queued steps are gone
    with pytest.raises(ValueError, match="lag"):
        next(decode_tokens(s, Sampler(seed=9), 5, lag=-1))
    ref = Session(m)
    ref.prefill(ids)
    for t in got[:3]:  # the decode path, as the generator ran it (a GPU's prefill rounds differently)
        ref.step(t)
    np.testing.assert_allclose(np.array(s.logits), np.array(ref.logits), rtol=1e-5, atol=1e-5)


def test_generate_returns_text_and_logprobs(model, encode_thread):
    m, tok = model
    text = generate(m, tok, "Hello", max_tokens=6, seed=2)
    assert isinstance(text, str) and text
    out = _run(model, "Hello", max_tokens=3, seed=2, logprobs=True, sampling=SamplingParams(temperature=0.7))
    lp = out[0].logprobs
    assert lp.shape == (m.cfg.n_vocab,)
    assert abs(float(mx.logsumexp(lp).item())) < 1e-4
    assert out[0].prompt_tps > 0 and out[-1].generation_tps > 0 and out[-1].peak_memory > 0


def test_decode_tokens_redraws_ids_whose_knobs_changed(model, encode_thread):
    """Knobs that depend on the ids already taken (the server's: greedy inside DSML structure) are known only
    once the host has read those ids: an id drawn ahead with other knobs is redrawn from its own logits and
    uniform. Ids, final session and the sampler's stream match one synchronous step at a time, through on-device
    knobs switching between greedy and sampled and host-only ones (top-k); also when the caller stops early."""
    m, tok = model
    ids = prompt_tokens(tok, "Knobs")
    host = SamplingParams(top_k=7)

    def run(lag: int, n: int, stop_after: int | None = None):
        s, taken, sampler = Session(m), [], Sampler(seed=11)
        s.prefill(ids)

        def knobs():  # changes every few ids, from the caller's own state
            k = (sum(taken) + len(taken)) % 5
            return GREEDY_PARAMS if k < 2 else host if k == 4 else SamplingParams()

        gen = decode_tokens(s, sampler, n, lag=lag, knobs=knobs)
        for token, _ in gen:
            taken.append(token)
            if len(taken) == stop_after:
                gen.close()
        return taken, s.tokens, _state(s), sampler.rng.pos

    for n, stop_after in ((24, None), (24, 6), (24, 13)):  # to the end; stopped early and late
        ref = run(0, n, stop_after)
        kinds = {(sum(ref[0][:i]) + i) % 5 for i in range(len(ref[0]))}
        assert {0, 2, 4} <= kinds or {1, 3, 4} <= kinds  # greedy, sampled and host-only knobs all ran
        for lag in (1, 2):
            got = run(lag, n, stop_after)
            assert got[0] == ref[0] and got[1] == ref[1] and got[3] == ref[3], (lag, n, stop_after)
            assert all(np.array_equal(x, y) for x, y in zip(got[2], ref[2], strict=True))
