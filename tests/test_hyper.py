"""mHC pre / post / output head (ds4_mlx.model.hyper) against a float64 NumPy implementation of docs/model.md §4.3,
§4.9, §4.10."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx.model.hyper import hc_head, hc_post, hc_pre
from ds4_mlx.weights import QuantWeight

N_HC, E, T = 4, 256, 7


def _cfg(rms_eps=1e-6, hc_eps=1e-6, iters=20):
    return SimpleNamespace(n_hc=N_HC, rms_eps=rms_eps, hc_eps=hc_eps, n_sinkhorn_iter=iters)


# ---- float64 reference, written from the spec ----------------------------------------------------------


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def ref_mix(S, fn, rms_eps):
    flat = S.reshape(S.shape[0], -1)
    flat = flat / np.sqrt((flat**2).mean(-1, keepdims=True) + rms_eps)
    return flat @ fn.T


def ref_hc_pre(S, fn, scale, base, cfg):
    n = cfg.n_hc
    out_x, out_post, out_comb = [], [], []
    for t, m in enumerate(ref_mix(S, fn, cfg.rms_eps)):
        pre = _sigmoid(m[:n] * scale[0] + base[:n]) + cfg.hc_eps
        post = 2 * _sigmoid(m[n : 2 * n] * scale[1] + base[n : 2 * n])
        L = np.array([[m[2 * n + n * r + c] * scale[2] + base[2 * n + n * r + c] for c in range(n)] for r in range(n)])
        C = np.exp(L - L.max(1, keepdims=True))
        C = C / C.sum(1, keepdims=True) + cfg.hc_eps
        C = C / (C.sum(0, keepdims=True) + cfg.hc_eps)
        for _ in range(cfg.n_sinkhorn_iter - 1):
            C = C / (C.sum(1, keepdims=True) + cfg.hc_eps)
            C = C / (C.sum(0, keepdims=True) + cfg.hc_eps)
        out_x.append(sum(pre[h] * S[t, h] for h in range(n)))
        out_post.append(post)
        out_comb.append(C)
    return np.array(out_x), np.array(out_post), np.array(out_comb)


def ref_hc_post(S, y, post, C):
    out = np.zeros_like(S)
    for t in range(S.shape[0]):
        for c in range(S.shape[1]):
            out[t, c] = post[t, c] * y[t] + sum(C[t, r, c] * S[t, r] for r in range(S.shape[1]))
    return out


# ---- fixtures ---------------------------------------------------------------------------------------------


def _inputs(seed, n_mix):
    rng = np.random.default_rng(seed)
    S = rng.standard_normal((T, N_HC, E)) * rng.uniform(0.5, 3.0, (T, N_HC, 1))  # streams of different scale
    fn16 = (rng.standard_normal((n_mix, N_HC * E)) * 2.0 / np.sqrt(N_HC * E)).astype(np.float16)
    scale = rng.uniform(0.3, 2.0, 3 if n_mix > N_HC else 1).astype(np.float32)
    base = rng.standard_normal(n_mix).astype(np.float32)
    fn = QuantWeight.from_numpy(fn16, QT.F16, fn16.shape)
    return S, fn, fn16.astype(np.float64), scale, base


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


@pytest.mark.parametrize("hc_eps,rms_eps", [(1e-6, 1e-6), (0.05, 0.5)])  # large eps: its placement shows
def test_hc_pre_matches_reference(hc_eps, rms_eps):
    cfg = _cfg(rms_eps=rms_eps, hc_eps=hc_eps)
    S, fn, fn64, scale, base = _inputs(1, 2 * N_HC + N_HC * N_HC)
    x, post, comb = hc_pre(mx.array(S.astype(np.float32)), fn, mx.array(scale), mx.array(base), cfg)
    rx, rpost, rcomb = ref_hc_pre(S.astype(np.float32).astype(np.float64), fn64, scale, base, cfg)
    assert x.shape == (T, E) and post.shape == (T, N_HC) and comb.shape == (T, N_HC, N_HC)
    assert _rel(post, rpost) < 1e-5
    assert _rel(comb, rcomb) < 1e-5
    assert _rel(x, rx) < 1e-5
    # the test data must make the gates informative: comb far from uniform, pre weights spread out
    assert np.abs(rcomb - 1 / N_HC).max() > 0.05


def test_sinkhorn_is_nearly_doubly_stochastic():
    S, fn, _, scale, base = _inputs(2, 2 * N_HC + N_HC * N_HC)
    _, _, comb = hc_pre(mx.array(S.astype(np.float32)), fn, mx.array(scale), mx.array(base), _cfg())
    c = np.array(comb)
    assert np.abs(c.sum(-2) - 1).max() < 1e-4 and np.abs(c.sum(-1) - 1).max() < 1e-3


def test_hc_post_matches_reference():
    rng = np.random.default_rng(3)
    S = rng.standard_normal((T, N_HC, E)).astype(np.float32)
    y = rng.standard_normal((T, E)).astype(np.float32)
    post = rng.uniform(0, 2, (T, N_HC)).astype(np.float32)
    C = rng.uniform(0, 1, (T, N_HC, N_HC)).astype(np.float32)  # not symmetric: the transpose matters
    out = hc_post(mx.array(S), mx.array(y), mx.array(post), mx.array(C))
    assert _rel(out, ref_hc_post(S.astype(np.float64), y.astype(np.float64), post, C)) < 1e-6


@pytest.mark.parametrize("hc_eps", [1e-6, 0.05])
def test_hc_head_matches_reference(hc_eps):
    cfg = _cfg(hc_eps=hc_eps)
    S, fn, fn64, scale, base = _inputs(4, N_HC)
    x = hc_head(mx.array(S.astype(np.float32)), fn, mx.array(scale), mx.array(base), cfg)
    m = ref_mix(S.astype(np.float32).astype(np.float64), fn64, cfg.rms_eps)
    w = _sigmoid(m * scale[0] + base) + hc_eps
    ref = np.einsum("th,the->te", w, S.astype(np.float32).astype(np.float64))
    assert _rel(x, ref) < 1e-5
