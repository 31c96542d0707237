"""The server worker's decode loop on the tiny model, without HTTP: pipelined steps (ids drawn on the device,
two steps ahead of the text) answer exactly as one synchronous step at a time, leave the same live session
(every emitted token in the KV but a stop), and a continued disk save in the middle of a generation saves the
session at its aligned frontier."""

from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest

from ds4_mlx.chat import ThinkMode, cli_prompt_tokens
from ds4_mlx.kvstore import CachePolicy, read_kv_file, session_from_file
from ds4_mlx.loader import load
from ds4_mlx.server.worker import GenParams, Job, Worker
from ds4_mlx.session import Session
from server_util import FakeSession, dsml_call


@pytest.fixture(scope="module")
def engine(tiny_gguf):
    return load(tiny_gguf())


def serve(engine, params: GenParams, *, lag: int, prompt: str = "Tell me", **worker_kw):
    """One completions job on a fresh worker: its result, the live session's tokens and arrays (read in the
    worker's thread: MLX streams are per thread)."""
    model, tok = engine
    worker = Worker(lambda: (Session(model), tok), ctx=4096, lag=lag, **worker_kw)
    worker.start()
    assert worker.ready.wait(60)
    done, out = threading.Event(), []
    text = tok.decode(cli_prompt_tokens(tok, prompt, mode=ThinkMode.NONE))
    job = Job("completions", text, tok.encode_chat(text), ThinkMode.NONE, params,
              on_result=lambda r: (out.append((r, worker.session.tokens, _state(worker.session))), done.set()))
    worker.submit(job)
    assert done.wait(300), "the worker never finished the job"
    worker.stop()
    return out[0]


def _state(s: Session) -> list[np.ndarray]:
    return [np.array(a) for a in s.state_arrays()]


@pytest.mark.parametrize("params", [GenParams(seed=5, max_tokens=14), GenParams(temperature=0, max_tokens=9),
                                    GenParams(top_k=6, seed=8, max_tokens=10), GenParams(seed=5, max_tokens=30)],
                         ids=["seeded", "greedy", "host-sampler", "stop-string"])
def test_pipelined_worker_answers_as_synchronous_steps(engine, params, encode_thread):
    params = dataclasses.replace(params)  # the parametrized value is shared by both encode_thread runs
    if params.max_tokens == 30:  # a stop string from the middle of the seeded answer
        text = serve(engine, params, lag=0)[0].text
        params.stop = [text[len(text) // 2 :][:2]]
    ref, ref_tokens, ref_state = serve(engine, params, lag=0)
    got, got_tokens, got_state = serve(engine, params, lag=2)
    assert (got.text, got.finish, got.completion_tokens) == (ref.text, ref.finish, ref.completion_tokens)
    assert got_tokens == ref_tokens
    assert all(np.array_equal(x, y) for x, y in zip(got_state, ref_state, strict=True))
    emitted = ref.completion_tokens - (ref.finish == "stop" and bool(params.stop))  # a stop-string hit stays out
    assert len(ref_tokens) == ref.prompt_tokens + emitted
    assert ref.finish == ("stop" if params.stop else "length")


def test_continued_save_in_the_middle_of_a_pipelined_generation(engine, tmp_path, encode_thread):
    """The save lands at the aligned frontier with exactly the session's first tokens, and the answer goes on
    as with synchronous steps (the same saves, so the same prefill chunks: a GPU's prefill rounds by chunk)."""
    model, _ = engine
    params = GenParams(seed=3, max_tokens=24)
    step = 8
    policy = CachePolicy(min_tokens=4, cold_max_tokens=0, continued_interval_tokens=step, boundary_align_tokens=0)
    ref, ref_tokens, ref_state = serve(engine, params, lag=0, kv_dir=str(tmp_path / "sync"), kv_policy=policy)
    P = ref.prompt_tokens
    frontier = (P // step + 1) * step  # reached after frontier - P generated tokens
    assert P < frontier <= P + ref.completion_tokens - 2
    got, got_tokens, _ = serve(engine, params, lag=2, kv_dir=str(tmp_path / "kv"), kv_policy=policy)
    assert (got.text, got_tokens) == (ref.text, ref_tokens)
    headers = {f: read_kv_file(f, with_payload=False).header for f in (tmp_path / "kv").glob("*.kv")}
    saved = {h.tokens: f for f, h in headers.items() if h.reason_name == "continued"}
    want = range(step, P + got.completion_tokens + 1, step)  # in the prefill, then in the generation
    assert sorted(saved) == list(want), sorted(saved)
    s = session_from_file(model, saved[frontier])
    assert s.tokens == ref_tokens[:frontier]
    for t in ref_tokens[frontier:]:  # decoded, as the worker went on from there
        s.step(t)
    np.testing.assert_allclose(np.array(s.logits), ref_state[0], rtol=1e-4, atol=1e-4)


class ScriptedSession(FakeSession):
    """The fake engine writing ``script`` after the prompt: the next script token gets a large logit, and a
    ``noise`` token one a ninth as likely, so greedy draws follow the script and sampled ones stray into noise a
    tenth of the time (noise does not advance the script). Counts rewinds."""

    def __init__(self, vocab: int, script: list[int], prompt_len: int, noise: int) -> None:
        self.script, self.prompt_len, self.noise, self.rewinds = script, prompt_len, noise, 0
        super().__init__(vocab)

    def _logits(self):
        x = super()._logits()
        done = sum(t != self.noise for t in self.tokens[self.prompt_len :])
        if self.pos >= self.prompt_len and done < len(self.script):
            x[self.script[done]] += 40.0
            x[self.noise] = x[self.script[done]] - np.log(9.0)
        return x

    def rewind(self, point) -> None:
        self.rewinds += 1
        super().rewind(point)


def test_tool_call_redraws_ids_at_dsml_boundaries(engine, encode_thread):
    """A sampled answer that writes a tool call: the knobs switch to greedy inside DSML structure and back, so
    ids drawn two steps ahead are redrawn at each boundary (the session rewinds); the answer, the call and
    the live tokens are those of synchronous steps (ids drawn with the wrong knobs would put noise into the
    structure, or leave it out of the text, and shift the stream of uniforms)."""
    _, tok = engine
    text = tok.decode(cli_prompt_tokens(tok, "List files", mode=ThinkMode.NONE))
    prompt = tok.encode_chat(text)
    script = tok.encode_chat("Sure, listing." + dsml_call("bash", {"command": "ls -la"}))
    (noise,) = tok.encode("z")
    out = {}
    for lag in (0, 2):
        session = ScriptedSession(tok.vocab_size, script, len(prompt), noise)
        worker = Worker(lambda: (session, tok), ctx=4096, lag=lag)
        worker.start()
        assert worker.ready.wait(60)
        done, res = threading.Event(), []
        worker.submit(Job("chat", text, prompt, ThinkMode.NONE, GenParams(seed=19, max_tokens=300), tools_active=True,
                          on_result=lambda r: (res.append(r), done.set())))
        assert done.wait(120)
        worker.stop()
        out[lag] = (res[0].finish, res[0].text, res[0].completion_tokens, list(session.tokens), session.rewinds)
    finish, answer, n, _, rewinds = out[0]  # seed 19: noise in the prose and in the value, none in structure
    assert finish == "tool_calls" and rewinds == 0 and n > len(script)
    assert answer.replace("z", "") == tok.decode(script).replace("z", "")
    assert out[2][:4] == out[0][:4]
    assert out[2][4] >= 2  # into the structure and out again, at least
