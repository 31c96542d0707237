"""Batched sessions (``serve --batched-session N``): one decode step for several sessions gives each the logits it
gets alone; the worker's N live sessions answer concurrent jobs exactly as one at a time, keep each agent's
live prefix, let one job be cancelled without touching the others, and stay within their memory budget.

The worker scenarios run in one child process (this file run as a script), which leaves with ``os._exit`` as
``serve`` does: MLX aborts a process that frees, at interpreter exit, what a worker thread made."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.backend import kernel_backend, set_kernel_backend
from ds4_mlx.chat import ThinkMode, cli_prompt_tokens
from ds4_mlx.kernels.sim import compiler
from ds4_mlx.loader import load
from ds4_mlx.memory import kv_bytes_estimate, plan_sessions
from ds4_mlx.server.worker import GenParams, Job, Worker
from ds4_mlx.generate import sample_and_step
from ds4_mlx.sampling import GREEDY_PARAMS, Sampler, SamplingParams
from ds4_mlx.session import Session, step_batch


@pytest.fixture(scope="module")
def model(tiny_gguf):
    return load(tiny_gguf())[0]


def _rel(a, ref) -> float:
    return float(np.abs(np.asarray(a) - ref).max() / np.abs(ref).max())


# ---- the model: one step, B sessions ------------------------------------------------------------------------


def _op_by_op_on_sim(model) -> None:
    set_kernel_backend("sim")
    model.set_compile_decode(False)


def _prefilled_pair(model, prompts) -> tuple[list[Session], list[Session]]:
    alone, batched = [Session(model) for _ in prompts], [Session(model) for _ in prompts]
    for a, b, p in zip(alone, batched, prompts):
        a.prefill(p)
        b.prefill(p)
    return alone, batched


def _step_alone_and_batched(model, prompt_lengths, steps: int, seed: int, before_steps=None) -> tuple[list, list]:
    """Sessions of random prompts, each stepped alone and all stepped together on the same random tokens: every
    batched row within 1e-5 of the session's own -> (alone, batched)."""
    rng = np.random.default_rng(seed)
    prompts = [[0] + rng.integers(2, 512, n).tolist() for n in prompt_lengths]
    alone, batched = _prefilled_pair(model, prompts)
    if before_steps:
        before_steps(model)
    for _ in range(steps):
        tokens = rng.integers(2, 512, len(prompts)).tolist()
        want = [np.array(s.step(t)) for s, t in zip(alone, tokens)]
        got = step_batch(batched, tokens)
        for w, g in zip(want, got):
            assert _rel(g, w) <= 1e-5
    return alone, batched


def test_batched_decode_logits_equal_single_session_logits(model):
    """Three sessions at different positions (one still filling its raw window, so steps of both the compiled and
    the op-by-op kind) stepped together for 24 tokens: every row equals the same session stepped alone."""
    alone, batched = _step_alone_and_batched(model, (3, 20, 37), 24, seed=0)
    for a, b in zip(alone, batched):
        assert a.tokens == b.tokens
        assert all(np.array_equal(np.array(x), np.array(y)) or _rel(y, np.array(x)) <= 1e-5
                   for x, y in zip(a.state_arrays(), b.state_arrays(), strict=True))


@pytest.mark.skipif(kernel_backend() in ("metal", "cuda") or compiler() is None,
                    reason="the GPU's own run is benchmarks/batched.py; the sim backend needs g++")
def test_batched_decode_on_the_kernels_equals_each_session_alone(model):
    """The decode kernels' CUDA text (the sim backend), op by op: three sessions stepped together take every
    kernel path one session's step takes (the routed experts' x quantized by HC pre, the matvecs that give a
    threadgroup several tokens' rows) and give each session's logits alone."""
    assert all(b.ffn.quantized_x for b in model.layers)  # the ds4 profile, IQ2_XXS gate/up and Q8_0 shared
    try:
        _step_alone_and_batched(model, (18, 25, 33), 2, seed=4, before_steps=_op_by_op_on_sim)
    finally:
        set_kernel_backend(None)
        model.set_compile_decode(True)


def test_batched_steps_of_streamed_experts_equal_the_resident_models(model, tiny_gguf):
    """``serve --batched-session N --ssd-streaming``: two sessions stepped together through a 12-expert cache give
    the resident model's logits, step by step, and the ids drawn from them."""
    streamed = load(tiny_gguf(), expert_cache="12")[0]
    prompts = [[0, 5, 6, 7], [0] + list(range(40, 70))]
    resident, batched = [Session(model) for _ in prompts], [Session(streamed) for _ in prompts]
    for r, b, p in zip(resident, batched, prompts):
        r.prefill(p)
        b.prefill(p)
    for step in range(4):
        want = [np.array(s.step(t)) for s, t in zip(resident, (11 + step, 20 + step))]
        got = step_batch(batched, [11 + step, 20 + step])
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g), w)
    ids, _ = sample_and_step(batched, [(Sampler(GREEDY_PARAMS), GREEDY_PARAMS) for _ in batched])
    assert ids == [int(np.argmax(w)) for w in want] and streamed.expert_cache.stats()["misses"] > 12


def test_step_batch_refuses_what_it_cannot_step(model):
    a, b = Session(model), Session(model)
    a.prefill([0, 5])
    b.prefill([0, 6])
    with pytest.raises(ValueError, match="2 sessions, 1 tokens"):
        step_batch([a, b], [3])
    with pytest.raises(ValueError, match="twice"):
        step_batch([a, a], [3, 4])
    assert a.pos == b.pos == 2  # nothing ran


@pytest.mark.parametrize("wait", [False, True])
def test_sample_and_step_draws_each_sessions_ids_as_alone(model, wait):
    """A forced id, greedy and seeded sampling on the device, and top-k sampling on the host, drawn and stepped
    together for 6 steps: the ids each session draws alone, with the same seed, one synchronous step at a time."""
    knobs = [None, GREEDY_PARAMS, SamplingParams(temperature=0.8, top_p=1.0, top_k=0), SamplingParams(0.8, 1.0, 5)]
    prompts = [[0, 9, 17], [0] + list(range(30, 50)), [0, 5, 6, 7, 8], [0, 100, 101]]
    alone, batched = _prefilled_pair(model, prompts)
    samplers = [[Sampler(p, seed=7 + i) if p else None for i, p in enumerate(knobs)] for _ in range(2)]
    for step in range(6):
        want = []
        for s, sampler, p in zip(alone, samplers[0], knobs):
            want.append(sampler.next_id(s.logits, p) if p else 40 + step)
            s.step(want[-1])
        draws = [(sampler, p) if p else 40 + step for sampler, p in zip(samplers[1], knobs)]
        got, _ = sample_and_step(batched, draws, wait=wait)
        assert got == want
    for a, b in zip(alone, batched):
        assert b.tokens == a.tokens
        assert _rel(b.logits, np.array(a.logits)) <= 1e-5


def test_a_session_rewound_after_a_batched_step_is_as_before_it(model):
    """The rewind point :func:`sample_and_step` returns takes one session back to before the step (its id never
    entered the KV) and leaves the others' steps; the rewound session then goes on as one that never took it."""
    prompts = [[0, 3, 4, 5], [0] + list(range(60, 90))]
    alone, batched = _prefilled_pair(model, prompts)
    greedy = [(Sampler(GREEDY_PARAMS), GREEDY_PARAMS) for _ in prompts]
    before = [s.snapshot() for s in batched]
    ids, points = sample_and_step(batched, greedy)
    batched[0].rewind(points[0])
    assert batched[0].tokens == list(before[0].tokens) and batched[1].tokens == prompts[1] + [ids[1]]
    alone[1].step(ids[1])
    for a, b in zip(alone, batched):  # each now steps one token: the rewound one from its prompt's end
        a.step(11)
        b.step(11)
        assert a.tokens == b.tokens
        assert _rel(b.logits, np.array(a.logits)) <= 1e-5
    with pytest.raises(ValueError, match="2 sessions, 1 draws"):
        sample_and_step(batched, [5])


# ---- the worker: N live sessions (scenarios run in a child process) -------------------------------------------


class _Job(Job):
    """A job that records its events (no HTTP loop) and can cancel itself after its ``cancel_after``-th text."""

    def __init__(self, *a, cancel_after: int = 0, **kw) -> None:
        super().__init__(*a, **kw)
        self.events_seen: list[tuple] = []
        self.cancel_after = cancel_after
        self.finished = threading.Event()

    def post(self, *event) -> None:
        self.events_seen.append(event)
        texts = sum(e[0] == "text" for e in self.events_seen)
        if event[0] == "text" and self.cancel_after and texts >= self.cancel_after:
            self.cancel()
        if event[0] in ("done", "error"):
            self.finished.set()

    @property
    def outcome(self) -> dict:
        kind, *rest = self.events_seen[-1]
        if kind != "done":
            return {"event": kind, "detail": [str(x) for x in rest]}
        r = rest[0]
        return {"event": kind, "text": r.text, "finish": r.finish, "completion_tokens": r.completion_tokens,
                "cached_tokens": r.cached_tokens}


def _rendered(tok, prompt: str) -> str:
    return tok.decode(cli_prompt_tokens(tok, prompt, mode=ThinkMode.NONE))


def _job(tok, prompt: str, max_tokens: int, *, text: str | None = None, **kw) -> _Job:
    """A greedy completions job for ``prompt`` (rendered as a one-turn chat), or for the raw ``text``."""
    text = _rendered(tok, prompt) if text is None else text
    return _Job("completions", text, tok.encode_chat(text), ThinkMode.NONE,
                GenParams(temperature=0, max_tokens=max_tokens), **kw)


@contextlib.contextmanager
def _worker(engine, sessions: int, ctx: int = 1024, **kw):
    """A started worker over the tiny model, stopped at the end."""
    model, tok = engine
    worker = Worker(lambda: (Session(model, reserve=ctx), tok), ctx=ctx, sessions=sessions, **kw)
    worker.start()
    try:
        assert worker.ready.wait(60)
        yield worker
    finally:
        worker.stop()


def _run(worker: Worker, jobs: list[_Job]) -> list[dict]:
    for j in jobs:
        worker.submit(j)
    for j in jobs:
        assert j.finished.wait(300), "the worker never finished the job"
    return [j.outcome for j in jobs]


PROMPTS = [("Tell me about the sea", 14), ("Hi", 6), ("A much longer prompt " * 6, 20), ("Count: one two", 9)]


def _concurrent(engine) -> dict:
    """Four greedy jobs of different lengths, alone one after another, then together on three sessions (one
    waits for a slot)."""
    _, tok = engine
    with _worker(engine, 3, prefill_quantum=8) as worker:
        alone = [_run(worker, [_job(tok, p, n)])[0] for p, n in PROMPTS]
        together = _run(worker, [_job(tok, p, n) for p, n in PROMPTS])
        stats = worker.stats()
    return {"alone": alone, "together": together, "stats": stats}


def _agents(engine) -> dict:
    """Two agents take turns, two turns each, on one and on two sessions: each turn's cached tokens."""
    _, tok = engine

    def turns(sessions: int) -> list[int]:
        with _worker(engine, sessions) as worker:
            cached, history = [], {"a": _rendered(tok, "Agent A asks"), "b": _rendered(tok, "Agent B wants")}
            for _ in range(2):
                for agent in ("a", "b"):
                    # a forced answer (valid UTF-8, which the random model's often is not) through the real KV
                    done = _run(worker, [_job(tok, "", 9, text=history[agent], test_output=f"Yes {agent}.")])[0]
                    cached.append(done["cached_tokens"])
                    history[agent] += done["text"] + " and more"
            return cached

    return {"one": turns(1), "two": turns(2)}


def _cancel(engine) -> dict:
    """Three jobs decode together; the second cancels itself after its third piece of text."""
    _, tok = engine
    with _worker(engine, 3) as worker:
        alone = [_run(worker, [_job(tok, p, n)])[0] for p, n in PROMPTS[:2]]
        jobs = [_job(tok, PROMPTS[0][0], PROMPTS[0][1]), _job(tok, "Cancel me", 40, cancel_after=3),
                _job(tok, PROMPTS[1][0], PROMPTS[1][1])]
        together = _run(worker, jobs)
    return {"alone": alone, "together": together}


def _capacity_bytes(session: Session) -> int:
    """Bytes of every buffer a session holds, spare capacity included."""
    arrays = [a for c in session.caches for a in (c.raw, c.comp, c.index) if a is not None]
    states = [s.nbytes for c in session.caches for s in (c.comp_state, c.index_state) if s is not None]
    return sum(a.nbytes for a in arrays) + sum(states)


BUDGET_CTX = 96


def _budget(engine) -> dict:
    """Two sessions run to the end of a small context at once: their buffers' bytes."""
    _, tok = engine
    with _worker(engine, 2, ctx=BUDGET_CTX) as worker:
        done = _run(worker, [_job(tok, "Fill the context", 500), _job(tok, "Fill it too", 500)])
        sizes = [_capacity_bytes(s.session) for s in worker.slots]
        positions = [s.session.pos for s in worker.slots]
    return {"done": done, "sizes": sizes, "positions": positions}


SCENARIOS = {"concurrent": _concurrent, "agents": _agents, "cancel": _cancel, "budget": _budget}


def main(gguf: str) -> None:
    """The scenarios' results as one JSON line on stdout, then ``os._exit``."""
    engine = load(Path(gguf))
    print(json.dumps({name: run(engine) for name, run in SCENARIOS.items()}), flush=True)
    os._exit(0)


@pytest.fixture(scope="module")
def scenarios(tiny_gguf) -> dict:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "tests")])}
    r = subprocess.run([sys.executable, __file__, str(tiny_gguf())], capture_output=True, text=True, timeout=600,
                       env=env, cwd=root)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_concurrent_jobs_answer_as_each_alone(scenarios):
    """Each job answers alone exactly what it answers beside the others, and the decode steps ran batched."""
    sc = scenarios["concurrent"]
    assert all(e["event"] == "done" for e in sc["alone"] + sc["together"])
    assert [e["text"] for e in sc["together"]] == [e["text"] for e in sc["alone"]]
    assert [e["completion_tokens"] for e in sc["together"]] == [n for _, n in PROMPTS]
    stats = sc["stats"]
    assert max(int(b) for b in stats["batch_sizes"]) >= 2  # sessions decoded in one step
    assert sorted(s["slot"] for s in stats["sessions"]) == [0, 1, 2]
    assert stats["queue_wait_s"]["jobs"] == 8


def test_each_agent_keeps_its_live_prefix(scenarios):
    """With two sessions each agent continues its own live KV (cached tokens: its previous prompt and answer),
    where one session loses it to the other agent every turn."""
    sc = scenarios["agents"]
    assert sc["one"][2:] == [0, 0]  # evicted by the other agent
    assert sc["two"][:2] == [0, 0] and min(sc["two"][2:]) > 0


def test_cancelling_one_job_leaves_the_others_unchanged(scenarios):
    sc = scenarios["cancel"]
    cancelled = sc["together"][1]
    assert cancelled["event"] == "done" and cancelled["finish"] == "error" and cancelled["completion_tokens"] < 40
    assert [sc["together"][0]["text"], sc["together"][2]["text"]] == [e["text"] for e in sc["alone"]]


def test_sessions_stay_within_their_memory_budget(scenarios, model):
    """Each of two sessions run to the end of the context holds at most the KV that :func:`plan_sessions`
    counts per session at that context."""
    sc = scenarios["budget"]
    assert [e["finish"] for e in sc["done"]] == ["length", "length"]
    assert sc["positions"] == [BUDGET_CTX, BUDGET_CTX]
    budget = kv_bytes_estimate(model.cfg, BUDGET_CTX)
    assert all(0 < n <= budget for n in sc["sizes"]), (sc["sizes"], budget)


def test_plan_sessions_sizes_from_memory(model):
    cfg, ctx, weights, chunk = model.cfg, 4096, 1 << 30, 512
    from ds4_mlx.memory import scratch_bytes_estimate

    kv, scratch = kv_bytes_estimate(cfg, ctx), scratch_bytes_estimate(cfg, chunk)
    room = (weights + scratch + int(2.5 * kv), "test")
    assert plan_sessions(2, cfg, ctx, weights, chunk, room) == 2
    assert plan_sessions(0, cfg, ctx, weights, chunk, room) == 2  # as many as fit
    with pytest.raises(ValueError, match=r"3 session\(s\) of --ctx 4096 do not fit: .* at most 2 fit"):
        plan_sessions(3, cfg, ctx, weights, chunk, room)
    with pytest.raises(ValueError, match=r"1 session\(s\) .* at most 0 fit"):
        plan_sessions(0, cfg, ctx, weights, chunk, (weights, "test"))
    with pytest.raises(ValueError, match=">= 0"):
        plan_sessions(-1, cfg, ctx, weights, chunk, room)
    huge = (1 << 50, "test")
    assert plan_sessions(0, cfg, ctx, weights, chunk, huge) == 8  # capped


if __name__ == "__main__":
    main(sys.argv[1])
