"""MoE sublayer (ds4_mlx.model.moe) against a float64 NumPy implementation of docs/model.md §4.8."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import dequantize as gguf_dequantize

from ds4_mlx.model.moe import MoE
from ds4_mlx.model.ops import route_weights, sqrt_softplus, topk_lowest_index
from ds4_mlx.quants import random_blocks
from ds4_mlx.weights import QuantWeight

E, F, NE, K, V, T = 256, 256, 16, 6, 64, 9
N_HASH = 3


def _cfg(**kw):
    d = dict(n_expert=NE, n_expert_used=K, expert_weights_norm=True, expert_weights_scale=1.5,
             swiglu_clamp=(10.0,) * 6, rms_eps=1e-6, n_hash_layer=N_HASH)
    d.update(kw)
    cfg = SimpleNamespace(**d)
    cfg.is_hash_layer = lambda il: il < cfg.n_hash_layer
    return cfg


# ---- float64 reference, written from the spec ----------------------------------------------------------


def ref_sqrt_softplus(x):
    x = np.asarray(x, np.float64)
    sp = np.where(x > 20, x, np.where(x < -20, np.exp(x), np.log1p(np.exp(np.minimum(x, 20)))))
    return np.sqrt(sp)


def ref_topk(score, k):
    """ds4 topk_desc(): repeated arg-max with strict '>' -> ties to the lower index."""
    chosen = []
    for _ in range(k):
        best = -1
        for e in range(len(score)):
            if e in chosen:
                continue
            if best < 0 or score[e] > score[best]:
                best = e
        chosen.append(best)
    return chosen


def ref_moe(x, tokens, W, cfg, il):
    n = x / np.sqrt((x**2).mean(-1, keepdims=True) + cfg.rms_eps) * W["ffn_norm"]
    c = cfg.swiglu_clamp[il]
    silu = lambda z: z * 0.5 * (1 + np.tanh(z / 2))  # noqa: E731
    out = np.zeros_like(n)
    sels, clamped = [], 0
    for t in range(len(n)):
        prob = ref_sqrt_softplus(W["ffn_gate_inp"] @ n[t])
        if cfg.is_hash_layer(il):
            sel = list(W["tid2eid"][tokens[t]])
        else:
            sel = ref_topk(prob + W["bias"], cfg.n_expert_used)
        sels.append(sel)
        p = prob[sel]
        w = p / max(p.sum(), 6.103515625e-5) * cfg.expert_weights_scale
        for i, e in enumerate(sel):
            g, u = W["gate"][e] @ n[t], W["up"][e] @ n[t]
            clamped += int((g > c).sum() + (np.abs(u) > c).sum())
            g, u = np.minimum(g, c), np.clip(u, -c, c)
            out[t] += W["down"][e] @ (silu(g) * u * w[i])
        g = np.minimum(W["gate_sh"] @ n[t], c)
        u = np.clip(W["up_sh"] @ n[t], -c, c)
        out[t] += W["down_sh"] @ (silu(g) * u)
    return out, np.array(sels), clamped


# ---- weights --------------------------------------------------------------------------------------------


def _qw(rng, qtype, shape, std):
    """A QuantWeight plus its exact float64 values (dequantized independently by gguf-py)."""
    if qtype == QT.F16:
        data = (rng.standard_normal(shape) * std).astype(np.float16)
        return QuantWeight.from_numpy(data, qtype, shape), data.astype(np.float64)
    seed = int(rng.integers(1 << 30))
    probe = gguf_dequantize(random_blocks(np.random.default_rng(seed), qtype, shape, scale=(1e-3, 3e-3)), qtype)
    k = std / probe.std()  # same bytes again, f16 scale fields multiplied so the weights have the wanted std
    data = random_blocks(np.random.default_rng(seed), qtype, shape, scale=(1e-3 * k, 3e-3 * k))
    return QuantWeight.from_numpy(data, qtype, shape), gguf_dequantize(data, qtype).reshape(shape).astype(np.float64)


def _layer(seed, il, experts, router_std=3.0 / np.sqrt(E), dup_rows=False):
    rng = np.random.default_rng(seed)
    gate_t, up_t, down_t = {"f16": (QT.F16,) * 3, "q2": (QT.IQ2_XXS, QT.IQ2_XXS, QT.Q2_K),
                            "q4": (QT.Q4_K,) * 3}[experts]
    p = f"blk.{il}."
    w, ref = {}, {}
    norm = rng.uniform(0.5, 1.5, E).astype(np.float32)
    w[p + "ffn_norm.weight"], ref["ffn_norm"] = mx.array(norm), norm.astype(np.float64)
    gi = (rng.standard_normal((NE, E)) * router_std).astype(np.float16)
    bias = (rng.standard_normal(NE) * 0.3).astype(np.float32)
    if dup_rows:  # experts 3, 7, 11 get identical router rows and bias: exact score ties
        gi[7] = gi[11] = gi[3]
        bias[7] = bias[11] = bias[3] = 5.0  # make sure the tied group is selected and ordering matters
    w[p + "ffn_gate_inp.weight"] = QuantWeight.from_numpy(gi, QT.F16, gi.shape)
    ref["ffn_gate_inp"] = gi.astype(np.float64)
    w[p + "exp_probs_b.bias"], ref["bias"] = mx.array(bias), bias.astype(np.float64)
    tid = np.stack([rng.permutation(NE)[:K] for _ in range(V)]).astype(np.int32)
    if il < N_HASH:
        w[p + "ffn_gate_tid2eid.weight"], ref["tid2eid"] = mx.array(tid), tid
    # gate/up large enough that the ±10 clamp is hit
    w[p + "ffn_gate_exps.weight"], ref["gate"] = _qw(rng, gate_t, (NE, F, E), 0.5)
    w[p + "ffn_up_exps.weight"], ref["up"] = _qw(rng, up_t, (NE, F, E), 0.5)
    w[p + "ffn_down_exps.weight"], ref["down"] = _qw(rng, down_t, (NE, E, F), 1.0 / np.sqrt(F))
    for name, key, shape, std in [("ffn_gate_shexp", "gate_sh", (F, E), 0.5), ("ffn_up_shexp", "up_sh", (F, E), 0.5),
                                  ("ffn_down_shexp", "down_sh", (E, F), 1.0 / np.sqrt(F))]:
        d = QT.Q8_0
        data = (rng.standard_normal(shape) * std).astype(np.float32)
        import gguf.quants as gq

        qb = gq.quantize(data, d)
        w[p + name + ".weight"] = QuantWeight.from_numpy(qb, d, shape)
        ref[key] = gguf_dequantize(qb, d).reshape(shape).astype(np.float64)
    return w, ref


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# ---- tests ----------------------------------------------------------------------------------------------


def test_sqrt_softplus_thresholds():
    x = np.concatenate([np.linspace(-40, 40, 801), [-20.0, 20.0, -20.0001, 20.0001, -19.9999, 19.9999]]).astype(np.float32)
    got = np.array(sqrt_softplus(mx.array(x)))
    np.testing.assert_allclose(got, ref_sqrt_softplus(x), rtol=2e-6, atol=0)


def test_topk_ties_go_to_lower_index():
    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, size=(200, 16)).astype(np.float32)  # many exact ties
    scores[0] = 1.0  # all equal
    got = np.array(topk_lowest_index(mx.array(scores), K))
    want = np.array([ref_topk(s, K) for s in scores])
    np.testing.assert_array_equal(got, want)


def test_topk_blocked_rows(monkeypatch):
    """Long prefills rank the tokens in blocks; the result must not depend on the block size."""
    import ds4_mlx.model.ops as ops

    rng = np.random.default_rng(1)
    scores = rng.integers(0, 3, size=(37, 16)).astype(np.float32)
    monkeypatch.setattr(ops, "RANK_MAX_ELEMS", 5 * 16 * 16)  # blocks of 5 tokens
    got = np.array(topk_lowest_index(mx.array(scores), K))
    np.testing.assert_array_equal(got, np.array([ref_topk(s, K) for s in scores]))


def test_route_weights_floor_and_scale():
    cfg = _cfg()
    p = np.array([[3e-7, 1e-6, 2e-7, 5e-7, 1e-7, 4e-7], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]], np.float32)
    got = np.array(route_weights(mx.array(p), cfg.expert_weights_scale, cfg.expert_weights_norm))
    want = p / np.maximum(p.sum(-1, keepdims=True), 6.103515625e-5) * 1.5
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert got[0].sum() < 0.1  # the floor, not the sum, divided the tiny row


@pytest.mark.parametrize("il,experts", [(0, "f16"), (2, "q2"), (3, "q2"), (4, "q4"), (5, "f16")])
def test_moe_matches_reference(il, experts):
    cfg = _cfg()
    w, ref = _layer(10 + il, il, experts)
    rng = np.random.default_rng(il)
    x = (rng.standard_normal((T, E)) * 2.0).astype(np.float32)
    tokens = rng.integers(0, V, T).astype(np.int32)
    moe = MoE(cfg, il, w)
    y = moe(mx.array(x), mx.array(tokens))
    ry, rsel, clamped = ref_moe(x.astype(np.float64), tokens, ref, cfg, il)
    sel, _ = moe.route(mx.fast.rms_norm(mx.array(x), w[f"blk.{il}.ffn_norm.weight"], cfg.rms_eps), mx.array(tokens))
    np.testing.assert_array_equal(np.sort(np.array(sel), -1), np.sort(rsel, -1))
    assert _rel(y, ry) < 1e-5
    assert clamped > 0  # the data exercises the SwiGLU clamp


def test_moe_tied_router_scores():
    """Three experts with identical router rows and bias tie exactly; selection order must be by index."""
    cfg = _cfg(n_expert_used=2)
    w, ref = _layer(99, 4, "f16", dup_rows=True)
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((T, E))).astype(np.float32)
    moe = MoE(cfg, 4, w)
    n = mx.fast.rms_norm(mx.array(x), w["blk.4.ffn_norm.weight"], cfg.rms_eps)
    sel, _ = moe.route(n, mx.zeros((T,), mx.int32))
    # bias 5.0 dominates: the top-2 is the tied group's two lowest indices, in index order
    np.testing.assert_array_equal(np.array(sel), np.tile([3, 7], (T, 1)))
    ry, _, _ = ref_moe(x.astype(np.float64), None, ref, cfg, 4)
    assert _rel(moe(mx.array(x), mx.zeros((T,), mx.int32)), ry) < 1e-5
