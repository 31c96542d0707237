"""Session: chunked prefill == full prefill == token-by-token decode, snapshot/restore (docs/model.md §4.11, §5)."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.backend import kernel_backend, set_kernel_backend
from ds4_mlx.kernels.sim import compiler
from ds4_mlx.loader import load
from ds4_mlx.numerics import PROFILES
from ds4_mlx.session import Session, StepEncoder
from ds4_mlx.weights import QT, QuantWeight

GPU = kernel_backend() in ("metal", "cuda")
# On the GPU, prefill products of more than 8 tokens round their operands to f16 (the routed experts' mm tiles,
# the dense products on MLX's f16 matmul): on this random tiny model that moves prefill logits well past
# the f32 tolerance at 45 tokens (H200 figures and their CPU reproduction by rounding the routed operands:
# benchmarks/prefill_precision.py, benchmarks/RESULTS.md). Decode steps match the exact logits to ~1.5e-6.
PREFILL_ROUNDS = pytest.mark.xfail(GPU, reason="GPU prefill rounds matmul operands to f16", strict=True)


def prompt(T: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [0] + rng.integers(2, 512, T - 1).tolist()


@pytest.fixture(scope="module", params=["hf", "ds4"])
def model(request, tiny_gguf):
    m, _ = load(tiny_gguf(experts="q2", hca_ratio=16), numerics=request.param)
    return m


def _rel(a, ref) -> float:
    return float(np.abs(np.asarray(a) - ref).max() / np.abs(ref).max())


T = 45  # > 2R (R=16), > 4*top_k+4 = 20, > window 16


@pytest.mark.slow
@PREFILL_ROUNDS
def test_chunked_prefill_and_decode_match_full_prefill(model):
    tokens = prompt(T)
    full = np.array(model(tokens, 0, model.make_cache(), all_logits=True))  # [T, V]

    for chunk in (7, 5, 13):  # boundaries off the 4 / 16 grid
        caches, parts = model.make_cache(), []
        for i in range(0, T, chunk):
            parts.append(np.array(model(tokens[i : i + chunk], i, caches, all_logits=True)))
        assert _rel(np.concatenate(parts), full) <= 1e-5, chunk

    s = Session(model)
    stepped = np.stack([np.array(s.step(t)) for t in tokens])
    assert s.pos == T and s.tokens == tokens
    assert _rel(stepped, full) <= 1e-5

    s2 = Session(model, chunk_size=9)
    last = s2.prefill(tokens)
    assert s2.pos == T and _rel(last, full[-1]) <= 1e-5 and _rel(s2.logits, full[-1]) <= 1e-5


def test_snapshot_restore(model):
    tokens, more = prompt(T), prompt(12, seed=1)[1:]
    s = Session(model, chunk_size=6)
    s.prefill(tokens[:30])
    kv30 = s.kv_bytes
    snap = s.snapshot()
    a = [np.array(s.step(t)) for t in tokens[30:] + more]
    assert s.kv_bytes >= kv30 > 0

    s.restore(snap)
    assert s.pos == 30 and s.tokens == tokens[:30]
    b = [np.array(s.step(t)) for t in tokens[30:] + more]
    np.testing.assert_array_equal(np.stack(a), np.stack(b))  # same graph, same state: bit-identical


def test_rewind_point(model):
    """A rewind point brings back the state it marked (valid rows, frontiers, logits, tokens): the steps after
    it repeat bit for bit, across completed windows; it refuses a session that went back past it."""
    tokens, more = prompt(T), prompt(12, seed=1)[1:]
    s = Session(model, chunk_size=6)
    s.prefill(tokens[:30])
    point, before = s.rewind_point(), [np.array(x) for x in s.state_arrays()]
    a = [np.array(s.step(t)) for t in tokens[30:] + more]
    s.rewind(point)
    assert s.pos == 30 and s.tokens == tokens[:30]
    assert all(np.array_equal(x, np.array(y)) for x, y in zip(before, s.state_arrays(), strict=True))
    b = [np.array(s.step(t)) for t in tokens[30:] + more]
    np.testing.assert_array_equal(np.stack(a), np.stack(b))
    s.reset()
    with pytest.raises(ValueError, match="ahead"):
        s.rewind(point)


def test_rewind_point_leaves_row_buffers_unpinned(model):
    """Holding a snapshot makes the next compressed-row append copy each whole buffer (MLX updates a buffer in
    place only when nothing else holds it); a rewind point holds none, so decode_tokens can keep one per
    queued step at any context length."""
    grown = {}
    for hold in ("snapshot", "rewind_point"):
        s = Session(model, reserve=200_000)  # buffers of 50000 ratio-4 rows: a copy is easy to see
        s.prefill(prompt(7))  # the step at position 7 completes the ratio-4 windows
        mx.eval(s.state_arrays())
        mx.synchronize()
        base = mx.get_active_memory()
        held = getattr(s, hold)()
        s.step(5)
        mx.eval([a for c in s.caches for a in (c.comp, c.index) if a is not None])
        grown[hold] = mx.get_active_memory() - base
        del held
    buffers = sum(c.comp.nbytes + c.index.nbytes for c in s.caches if c.index is not None)
    assert grown["snapshot"] >= buffers and grown["rewind_point"] < buffers / 20, (grown, buffers)


@PREFILL_ROUNDS
def test_snapshot_restore_then_prefill(model):
    """The snapshot is reusable: a fresh session restored from it and prefilled continues as decode steps do."""
    tokens, more = prompt(T), prompt(12, seed=1)[1:]
    s = Session(model, chunk_size=6)
    s.prefill(tokens[:30])
    snap = s.snapshot()
    a = [np.array(s.step(t)) for t in tokens[30:] + more]
    s2 = Session(model)
    s2.restore(snap)
    c = s2.prefill(tokens[30:] + more, chunk_size=5)
    assert _rel(c, a[-1]) <= 1e-5


@pytest.mark.skipif(not GPU, reason="no Metal/CUDA kernels here")
def test_gpu_decode_steps_match_exact_prefill(model):
    """Every decode kernel on the GPU path: one-token steps against the CPU's exact (f32) full prefill."""
    if model.numerics != PROFILES["hf"]:
        pytest.skip("measured with the hf profile (FP8/f16 rounding may flip on last-bit differences)")
    tokens = prompt(T)
    mx.set_default_device(mx.cpu)
    try:
        exact = np.array(model(tokens, 0, model.make_cache(), all_logits=True))
    finally:
        mx.set_default_device(mx.gpu)
    s = Session(model)
    assert _rel(np.stack([np.array(s.step(t)) for t in tokens]), exact) <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(GPU or compiler() is None, reason="a GPU runs the real kernels; the sim backend needs g++")
def test_sim_decode_steps_match_exact_prefill(model):
    """Every decode kernel's CUDA text, run on the CPU by the sim backend, against the exact f32 full prefill:
    six steps after a 42-token prefill, through two ratio-4 windows and a ratio-16 one completing (pos 43, 47)
    with the indexer selecting. Steps run op by op: a sim launch evaluates its inputs, which a compiled step
    cannot."""
    if model.numerics != PROFILES["hf"]:
        pytest.skip("hf profile only (FP8/f16 rounding may flip on last-bit differences)")
    tokens = prompt(48)
    exact = np.array(model(tokens, 0, model.make_cache(), all_logits=True))
    s = Session(model)
    s.prefill(tokens[:42])
    set_kernel_backend("sim")
    model.set_compile_decode(False)
    try:
        got = np.stack([np.array(s.step(t)) for t in tokens[42:]])
    finally:
        set_kernel_backend(None)
        model.set_compile_decode(True)
    assert _rel(got, exact[42:]) <= 1e-5


@pytest.mark.slow
@pytest.mark.skipif(not GPU and compiler() is None, reason="needs a GPU's kernels, or g++ for the sim backend")
def test_decode_quantized_x(model):
    """The routed experts' input quantized (Numerics.quantized_x, the ds4 profile's default on the GPU): four
    steps with it against the same steps with f32 x, op by op (the flag is read when a step is built), on the
    GPU's kernels or else on the sim backend's. They differ (the quantized path ran), by little, and pick
    the same greedy tokens (docs/quants.md §8 ruling 4). The FP8 KV rounding amplifies the difference: 5e-4 to 2e-3
    of the logit scale here, against 5e-5 to 7.5e-5 in the hf profile (measured; not run, to save CI time)."""
    if not model.numerics.quantized_x:
        pytest.skip("the ds4 profile's default (the hf profile keeps f32 x)")
    if kernel_backend() == "metal":
        pytest.skip("CUDA's (and the sim backend's) only: Metal keeps f32 x")
    tokens = prompt(46, seed=3)
    s = Session(model)
    s.prefill(tokens[:42])
    snap = s.snapshot()
    if not GPU:
        set_kernel_backend("sim")
    model.set_compile_decode(False)
    assert all(b.ffn.quantized_x for b in model.layers)  # q2 experts: IQ2_XXS gate/up, Q8_0 shared
    try:
        got = {}
        for xq in (True, False):
            s.restore(snap)
            for b in model.layers:
                b.ffn.quantized_x = xq
            got[xq] = np.stack([np.array(s.step(t)) for t in tokens[42:]])
    finally:
        for b in model.layers:
            b.ffn.quantized_x = True
        set_kernel_backend(None)
        model.set_compile_decode(True)
    err = _rel(got[True], got[False])
    assert 0 < err <= 5e-3, err
    assert (got[True].argmax(-1) == got[False].argmax(-1)).all()


def test_prefill_rejects_empty(model):
    with pytest.raises(ValueError):
        Session(model).prefill([])


def test_pipelined_steps_match_plain_steps(model):
    """step() with lazily computed tokens (greedy argmax, never synced in the loop) == step() with ints."""
    tokens = prompt(20)
    s1 = Session(model)
    s1.prefill(tokens)
    want = [np.array(s1.logits)]
    for _ in range(6):
        want.append(np.array(s1.step(int(np.argmax(want[-1])))))

    s2 = Session(model)
    s2.prefill(tokens)
    tok, got = mx.argmax(s2.logits), []
    for _ in range(6):
        logits = s2.step(tok)  # queued, not waited for
        got.append(logits)
        tok = mx.argmax(logits)
    assert s2.pos == 26
    assert s2.tokens == s1.tokens  # resolves the queued ids
    np.testing.assert_array_equal(np.stack([np.array(g) for g in got]), np.stack(want[1:]))


def test_compiled_steps_match_op_by_op(model):
    """Decode through compiled steps == the same steps built op by op (crossing window completions, the
    indexer's top-k start and a compressed-buffer growth: 16 -> 32 rows at ratio 4)."""
    tokens = prompt(70, seed=2)
    runs = []
    for compiled in (True, False):
        model.set_compile_decode(compiled)
        s = Session(model)
        s.prefill(tokens[:10])
        runs.append(np.stack([np.array(s.step(t)) for t in tokens[10:]]))
        assert any(layer._steps for layer in model.layers) == compiled  # the steps really were compiled
    model.set_compile_decode(True)
    assert _rel(runs[0], runs[1]) <= 1e-5


def test_reserved_buffers_keep_compiled_steps(model, monkeypatch):
    """``Session(reserve=N)``: the compressed-row buffers are sized once, so decode never retraces a compiled
    step after its first few tokens; with growing buffers (the default) a growth (16 -> 32 rows at ratio 4,
    token 68) retraces. Same logits either way."""
    from ds4_mlx.model.model import Block

    traced_at: list[int] = []
    step = Block._step

    def counting_step(self, key, S, tokens, st, io):  # runs once per trace (and every uncompiled step)
        traced_at.append(pos)
        return step(self, key, S, tokens, st, io)

    monkeypatch.setattr(Block, "_step", counting_step)
    tokens = prompt(84, seed=4)
    runs = {}
    for reserve in (0, 100):
        model.set_compile_decode(True)  # drop the traces of earlier runs
        s = Session(model, reserve=reserve)
        s.prefill(tokens[:20])
        traced_at.clear()
        out = []
        for pos, t in enumerate(tokens[20:], start=20):
            out.append(np.array(s.step(t)))
        runs[reserve] = (np.stack(out), [p for p in traced_at if p >= 40], s.caches[2].comp.shape[0])
    (grown, late_grown, cap_grown), (kept, late_kept, cap_kept) = runs[0], runs[100]
    assert cap_grown == 32 and cap_kept == 25  # the growing buffer doubled; the reserved one holds 100/4 rows
    assert late_grown and min(late_grown) == 67  # the step whose window completion needs the 17th row
    assert late_kept == [] and traced_at  # (traced_at: the reserved run traced its steps early on)
    assert _rel(kept, grown) <= 1e-5


def test_step_encoder_queues_steps_and_reports_a_failed_one(tiny_gguf):
    """Steps queued from the encoder thread compute what the caller's own queueing does; a step the worker
    cannot queue (here: an array of the caller's own stream, which MLX lets no other thread run) fails the
    caller's next wait with the cause attached, and the session queues from its own thread again."""
    m, _ = load(tiny_gguf())
    toks = prompt(12, seed=3)
    ref, s = Session(m), Session(m)
    ref.prefill(toks)
    s.prefill(toks)
    want = ref.step(mx.array([5]))
    with StepEncoder(s) as enc:
        got = s.step(mx.array([5]))
        enc.wait(enc.last)
        np.testing.assert_array_equal(np.array(got), np.array(want))
    foreign = mx.ones((3,)) + 1  # lazy, on this thread's stream
    with pytest.raises(RuntimeError, match="failed to queue") as err:
        with StepEncoder(s) as enc:
            enc.wait(enc.submit([foreign]))
    assert "Stream" in str(err.value.__cause__)
    assert s.queue_work is mx.async_eval


def test_a_weights_first_use_waits_while_the_encoder_thread_queues(tiny_gguf, monkeypatch):
    """A weight's derived form (made on first use, e.g. the indexer's weight bytes once it first selects) is
    never evaluated while the worker queues a step: MLX's encoders are not thread-safe, and on the H200 the two
    at once crashed a decode at ~2K tokens."""
    m, _ = load(tiny_gguf())
    s = Session(m)
    s.prefill(prompt(12, seed=3))
    queueing, spans = threading.Event(), {}
    real = mx.async_eval

    def slow_async_eval(work):  # the worker's queueing of a step, stretched
        queueing.set()
        time.sleep(0.3)
        real(work)
        spans["queued"] = time.perf_counter()

    def make():
        spans["made"] = time.perf_counter()
        return qw.data * 2

    monkeypatch.setattr(mx, "async_eval", slow_async_eval)
    data = np.random.default_rng(1).standard_normal((4, 32)).astype(np.float32)
    qw = QuantWeight(mx.array(data), QT.F32, (4, 32))
    with StepEncoder(s) as enc:
        done = enc.submit([mx.ones((3,)) + 1])  # on the encoder's stream, so the worker may queue it
        assert queueing.wait(5)
        got = qw.derived("twice", make)
        enc.wait(done)
    assert spans["made"] > spans["queued"]
    np.testing.assert_array_equal(np.array(got), 2 * data)
    assert qw.derived("twice", lambda: pytest.fail("made twice")) is got
