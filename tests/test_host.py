"""The numpy path for prefill chunks on the CPU (ds4_mlx.host) against the MLX path it stands in for."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import backend, host
from ds4_mlx.loader import load
from ds4_mlx.model.ops import attend, index_scores_reference
from ds4_mlx.numerics import hadamard128
from ds4_mlx.weights import expert_groups
from kernel_util import make_weight

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the numpy path is for the CPU backend")

T = 70  # a chunk: at least host.MIN_TOKENS tokens


@pytest.fixture(autouse=True)
def _fallback_backend():
    backend.set_kernel_backend("fallback")
    yield
    backend.set_kernel_backend(None)


def numpy_and_mlx(fn, monkeypatch) -> tuple[np.ndarray, np.ndarray]:
    """``fn()`` on the numpy path, then with the numpy path turned off (each checked to be the path it names)."""
    calls = []
    to_numpy = host.to_numpy
    monkeypatch.setattr(host, "to_numpy", lambda *a: calls.append(len(a)) or to_numpy(*a))
    got = np.array(fn())
    assert calls, "the numpy path did not run"
    calls.clear()
    with monkeypatch.context() as m:
        m.setattr(host, "MIN_TOKENS", 1 << 30)
        want = np.array(fn())
    assert not calls, "the numpy path ran"
    return got, want


def test_wanted_counts_tokens_from_the_threshold():
    assert host.wanted(host.MIN_TOKENS) and not host.wanted(host.MIN_TOKENS - 1)
    assert not host.wanted(1)  # a decode step stays one MLX graph


def test_wanted_is_false_off_the_cpu(monkeypatch):
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # GPU chunks stay in MLX (and its kernels)
    assert not host.wanted(4096)


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.Q2_K, QT.IQ2_XXS, QT.F16])
def test_matmul(qt, monkeypatch):
    rng = np.random.default_rng(1)
    w, ref = make_weight(rng, qt, (48, 256))
    x = mx.array(rng.standard_normal((T, 256)).astype(np.float32))
    got, want = numpy_and_mlx(lambda: w.matmul(x), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got, np.array(x, np.float64) @ ref.T, rtol=1e-4, atol=1e-4)


def test_batched_matmul(monkeypatch):
    rng = np.random.default_rng(2)
    w, _ = make_weight(rng, QT.Q8_0, (3, 16, 64))
    x = mx.array(rng.standard_normal((3, T, 64)).astype(np.float32))
    got, want = numpy_and_mlx(lambda: w.batched_matmul(x), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_gather_matmul_with_idle_and_busy_experts(monkeypatch):
    rng = np.random.default_rng(3)
    w, _ = make_weight(rng, QT.Q2_K, (8, 32, 256))
    ids = rng.integers(0, 5, (T, 3)).astype(np.int32)  # experts 5..7 get no token
    ids[:40, 0] = 2  # one expert with many
    x = mx.array(rng.standard_normal((T, 256)).astype(np.float32))
    got, want = numpy_and_mlx(lambda: w.gather_matmul(x, mx.array(ids)), monkeypatch)
    assert got.shape == (T, 3, 32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_expert_groups_and_out_of_range_ids():
    groups = expert_groups(np.array([3, 1, 3, 0, 1]), 4)
    assert [(e, p.tolist()) for e, p in groups] == [(0, [3]), (1, [1, 4]), (3, [0, 2])]
    with pytest.raises(IndexError, match="out of range"):
        expert_groups(np.array([0, 4]), 4)
    with pytest.raises(IndexError, match="out of range"):
        expert_groups(np.array([-1]), 4)


@pytest.mark.parametrize("keys, Nc", [("comp", 12), ("comp", 0), ("gathered", 12)])
def test_attend(keys, Nc, monkeypatch):
    rng = np.random.default_rng(4)
    H, D, Mr = 4, 32, 90
    q = mx.array(rng.standard_normal((T, H, D)).astype(np.float32))
    raw = mx.array(rng.standard_normal((Mr, D)).astype(np.float32))
    raw_mask = np.tril(np.ones((T, Mr), bool), k=Mr - T)  # causal, the first query sees 21 rows
    sinks = mx.array(rng.standard_normal(H).astype(np.float32))
    comp = gathered = None
    if keys == "comp":
        comp = mx.array(rng.standard_normal((Nc, D)).astype(np.float32))
        comp_mask = mx.array(rng.random((T, Nc)) < 0.5)
    else:
        gathered = mx.array(rng.standard_normal((T, Nc, D)).astype(np.float32))
        comp_mask = mx.array(rng.random((T, Nc)) < 0.5)
    got, want = numpy_and_mlx(lambda: attend(q, raw, raw_mask, comp, gathered, comp_mask, sinks, D**-0.5), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_index_scores_and_hadamard(monkeypatch):
    rng = np.random.default_rng(5)
    iq = mx.array(rng.standard_normal((T, 4, 128)).astype(np.float32))
    w = mx.array(rng.standard_normal((T, 4)).astype(np.float32))
    keys = mx.array(rng.standard_normal((33, 128)).astype(np.float32))
    got, want = numpy_and_mlx(lambda: index_scores_reference(iq, w, keys, 0.125), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    got, want = numpy_and_mlx(lambda: hadamard128(iq), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("il", [0, 4])  # a hash-routed layer and a top-k routed one
def test_routed_experts(tiny_gguf, il, monkeypatch):
    model, _ = load(tiny_gguf(experts="q2"), numerics="hf")
    ffn = model.layers[il].ffn
    rng = np.random.default_rng(il)
    n = mx.array(rng.standard_normal((T, model.cfg.n_embd)).astype(np.float32))
    sel, w = ffn.route(n, mx.array(rng.integers(2, 500, T).astype(np.int32)))
    got, want = numpy_and_mlx(lambda: ffn.routed(n, sel, w), monkeypatch)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_small_models_keep_their_weights_dequantized(tiny_gguf, monkeypatch):
    """On the CPU a small model keeps every weight's float32 values (stacked and split ones too), exactly the
    GGUF's; a model over the limit keeps none."""
    import ds4_mlx.model.model as model_mod

    model, _ = load(tiny_gguf(experts="q2"))
    weights = model_mod._quant_weights(model)
    assert len(weights) > 60 and all("f32" in w._cache for w in weights)
    for w in weights[:: len(weights) // 8]:
        np.testing.assert_array_equal(np.array(w._cache["f32"]), np.array(w.dequantize()))
    monkeypatch.setattr(model_mod, "KEEP_DEQUANTIZED_MAX_BYTES", 0)
    big, _ = load(tiny_gguf(experts="q2"))
    assert not any("f32" in w._cache for w in model_mod._quant_weights(big))

