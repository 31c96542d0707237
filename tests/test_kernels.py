"""Custom kernels (ds4_mlx.kernels) vs gguf-py dequant + float64 matmul (docs/quants.md §5.3).

The CPU-runnable parts (routing map, lossless Q8_0 repack) run in CI. The kernel runs need a GPU backend
(Metal or CUDA) and are skipped otherwise; ``benchmarks/gpu_check.py`` runs this file on the H200.
"""

import itertools

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import quants
from ds4_mlx.weights import QuantWeight, _kernels
from kernel_util import (
    BACKEND, gpu_only, kernel_backend_set, make_weight, needs_gpu, quantize_x_octets,
)  # fmt: skip

kernels = _kernels()

F32_TOL = 1e-6  # decode kernels: exact weights, f32 activations and accumulation
DENSE_TOL = 4e-3  # dense prefill products: f16 weights, x and product (each rounding ≤ 2^-11), f32 accumulation
MM_TOL = 2e-3  # the routed prefill product: f16 weights and activations (each rounding ≤ 2^-11), f32 accumulation
MM_EMU_TOL = 2e-5  # mm vs a float64 product of the same f16-rounded operands: only f32 accumulation
XQ_TOL = 5e-3  # x quantized to signed bytes (the routed experts on CUDA, docs/quants.md §5.3)
XQ_EMU_TOL = 2e-6  # quantized x vs a float64 product of the same quantized x: only f32 scales and sums


def f16(a: np.ndarray) -> np.ndarray:
    """Round f32 → f16 (RNE) → f32, as the routed prefill product's tiles do."""
    return np.asarray(a, dtype=np.float32).astype(np.float16).astype(np.float32)


def rel_err(y, x, w, spec) -> float:
    y64 = np.einsum(spec, x.astype(np.float64), w.astype(np.float64))
    scale = np.einsum(spec, np.abs(x.astype(np.float64)), np.abs(w.astype(np.float64)))
    return float(np.max(np.abs(y.astype(np.float64) - y64) / scale))


def n_in_for(qt):
    return 768 if qt in (QT.Q2_K, QT.Q4_K, QT.IQ2_XXS) else 352


# --- CPU-runnable ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bn", [32, 64])
@pytest.mark.parametrize(
    "ids",
    [np.array([[5, 1, 5, 9, 0, 15]] * 7), np.full((40, 6), 3), np.arange(6 * 31).reshape(31, 6) % 16, np.zeros((1, 1))],
    ids=["repeated", "one_expert", "spread", "single"],
)
def test_route_tiles(ids, bn):
    E = 16
    flat = ids.reshape(-1).astype(np.int32)
    order, tiles = kernels.route_tiles(mx.array(flat), E, bn)
    order, tiles = np.array(order), np.array(tiles)
    P = flat.size
    assert sorted(order.tolist()) == list(range(P))
    assert np.all(np.diff(flat[order]) >= 0)  # grouped by expert
    assert tiles.shape == (-(-P // bn) + min(E, P), 4)
    seen = []
    for e, start, count, _ in tiles:
        assert 0 <= count <= bn
        if count:
            pairs = order[start : start + count]
            assert np.all(flat[pairs] == e)
            seen += pairs.tolist()
    assert sorted(seen) == list(range(P))  # every pair in exactly one tile


def test_q8_0_affine_repack_is_exact():
    rng = np.random.default_rng(20)
    w, ref = make_weight(rng, QT.Q8_0, (48, 256), np.float32)
    b = np.array(w.data).reshape(-1, 34)
    b[:3, :2] = np.array([0.0, -0.03125, 2.0**-20], dtype=np.float16).view(np.uint8).reshape(3, 2)
    b[3, 2:] = 0x80  # q = -128
    w = QuantWeight.from_numpy(b.reshape(48, -1), QT.Q8_0, (48, 256))
    ref = gguf.quants.dequantize(np.array(w.data), QT.Q8_0)
    wq, s, bias = kernels.q8_0_affine(w)
    assert s.dtype == mx.float16 and wq.shape == (48, 64)
    deq = mx.dequantize(wq, s.astype(mx.float32), bias.astype(mx.float32), group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(deq), ref)  # values equal (±0 compare equal)
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = mx.quantized_matmul(mx.array(x), wq, s, bias, transpose=True, group_size=32, bits=8)
    assert y.dtype == mx.float32
    assert rel_err(np.array(y), x, ref, "ni,oi->no") <= 1e-5


def test_q8_0_affine_large_scales_use_f32_params():
    b = quants.random_blocks(np.random.default_rng(21), QT.Q8_0, (4, 64))
    b[0, :2] = np.array([1024.0], dtype=np.float16).view(np.uint8)  # -128·d overflows f16
    w = QuantWeight.from_numpy(b, QT.Q8_0, (4, 64))
    wq, s, bias = kernels.q8_0_affine(w)
    assert s.dtype == mx.float32
    deq = mx.dequantize(wq, s, bias, group_size=32, bits=8)
    np.testing.assert_array_equal(np.array(deq), gguf.quants.dequantize(b, QT.Q8_0))


# --- GPU kernels --------------------------------------------------------------------------------------------

NAN = float("nan")
ALL = kernels.KERNEL_TYPES


@needs_gpu
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("N", [1, 2, 5, 8])
def test_mv_dense(qt, N):
    rng = np.random.default_rng(int(qt) * 100 + N)
    w, ref = make_weight(rng, qt, (75, n_in_for(qt)), np.float32)
    x = rng.standard_normal((N, w.shape[1])).astype(np.float32)
    y = np.array(kernels.mv(w, mx.array(x), BACKEND, init=NAN))
    assert y.shape == (N, 75) and not np.isnan(y).any()
    assert rel_err(y, x, ref, "ni,oi->no") <= F32_TOL


@needs_gpu
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("config", [None, (4, 2, 1), (4, 2, 2), (2, 8, 8), (4, 4, 2)], ids=str)
@pytest.mark.parametrize("gather", [False, True])
def test_mv_k_split(qt, config, gather):
    """K split across simdgroups (KS > 1) over 37 blocks of 256: 10 spans, the last one partial, unevenly
    dealt to the KS simdgroups; every result equals the reference whatever (NR, NSG, KS) the launch uses."""
    rng = np.random.default_rng(int(qt) * 31 + (config or (0,))[0])
    n_in = 37 * 256
    if gather:
        w, ref = make_weight(rng, qt, (5, 75, n_in), np.float32)
        ids = np.array([4, 0, 4, 2], dtype=np.int32)
        x = rng.standard_normal((1, n_in)).astype(np.float32)
        y = np.array(kernels.mv(w, mx.array(x), BACKEND, ids=mx.array(ids), k_slots=4, init=NAN, config=config))
        assert y.shape == (4, 75) and not np.isnan(y).any()
        assert rel_err(y, np.repeat(x, 4, 0), ref[ids], "ki,koi->ko") <= F32_TOL
    else:
        w, ref = make_weight(rng, qt, (75, n_in), np.float32)
        x = rng.standard_normal((3, n_in)).astype(np.float32)
        y = np.array(kernels.mv(w, mx.array(x), BACKEND, init=NAN, config=config))
        assert y.shape == (3, 75) and not np.isnan(y).any()
        assert rel_err(y, x, ref, "ni,oi->no") <= F32_TOL


@needs_gpu
@pytest.mark.parametrize("qt", [QT.Q8_0, QT.F16, QT.Q2_K, QT.IQ2_XXS], ids=lambda q: q.name)
@pytest.mark.parametrize("N,config", [(1, None), (3, None), (1, (4, 2, 2)), (2, (2, 4, 4))], ids=str)
def test_mv_rms_prologue(qt, N, config):
    """EPI 3: y = W (x * nw) / rms(x), whatever the K split (the sum of squares is then summed across it)."""
    rng = np.random.default_rng(int(qt) * 13 + N)
    n_in = 9 * 256
    w, ref = make_weight(rng, qt, (75, n_in), np.float32)
    x = (rng.standard_normal((N, n_in)) * 3.0 + 0.5).astype(np.float32)
    nw = rng.uniform(0.2, 2.0, n_in).astype(np.float32)
    y = np.array(kernels.mv(w, mx.array(x), BACKEND, init=NAN, config=config, epi=kernels.MV_RMS,
                            aux=mx.array(nw), clamp=1e-6))  # fmt: skip
    assert y.shape == (N, 75) and not np.isnan(y).any()
    xn = x.astype(np.float64) / np.sqrt((x.astype(np.float64) ** 2).mean(-1, keepdims=True) + 1e-6) * nw
    assert rel_err(y, xn, ref, "ni,oi->no") <= F32_TOL
    with kernel_backend_set(BACKEND):  # the public entry point takes the same launch
        y2 = np.array(w.matmul_rms(mx.array(x), mx.array(nw), 1e-6))
    if config is None:
        np.testing.assert_array_equal(y2, y)


def test_mv_rms_validation():
    rng = np.random.default_rng(0)
    w, _ = make_weight(rng, QT.F16, (8, 64), np.float32)
    x = mx.array(rng.standard_normal((1, 64)).astype(np.float32))
    with pytest.raises(ValueError, match="RMSNorm epilogue"):
        kernels.mv(w, x, "cuda", epi=kernels.MV_RMS)
    with pytest.raises(ValueError, match="RMSNorm epilogue"):
        kernels.mv(w, x, "cuda", epi=kernels.MV_RMS, aux=mx.ones((32,)))
    # the fallback path against the definition
    w, ref = make_weight(rng, QT.Q8_0, (8, 64), np.float64)
    nw = rng.uniform(0.5, 1.5, 64)
    xn = np.array(x, np.float64) / np.sqrt((np.array(x, np.float64) ** 2).mean() + 1e-6) * nw
    got = np.array(w.matmul_rms(x, mx.array(nw.astype(np.float32)), 1e-6))
    assert rel_err(got, xn, ref, "ni,oi->no") <= 1e-5


@needs_gpu
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
def test_dequantize_is_exact(qt):
    """deq: every weight's exact value (2-D, 3-D, and a slab of rows), as gguf-py decodes it; and in f16, that
    value rounded once."""
    rng = np.random.default_rng(int(qt) + 3)
    w, ref = make_weight(rng, qt, (3, 5, n_in_for(qt)), np.float32)
    np.testing.assert_array_equal(np.array(kernels.dequantize(w, BACKEND)), ref)
    w2, ref2 = make_weight(rng, qt, (75, n_in_for(qt)), np.float32)
    np.testing.assert_array_equal(np.array(kernels.dequantize(w2, BACKEND, (10, 47))), ref2[10:47])
    h = kernels.dequantize(w2, BACKEND, (10, 47), f16=True)
    assert h.dtype == mx.float16
    np.testing.assert_array_equal(np.array(h), np.clip(ref2[10:47], -65504, 65504).astype(np.float16))


@needs_gpu
def test_f16_products_hold_large_values():
    """Weights past f16's range decode to ±65504 in f16, never to an infinity; a dense product whose y passes
    65504 stays finite and right (its 2^8 scaling)."""
    blocks = np.zeros((16, 2, 34), np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blocks[:, :, 2:] = 100  # q = 100, d = 1: every weight is 100
    blocks[0, 0, :2] = np.frombuffer(np.float16(4096.0).tobytes(), np.uint8)  # row 0's first 32: 409600
    w = QuantWeight.from_numpy(blocks.reshape(16, 68), QT.Q8_0, (16, 64))
    h = np.array(kernels.dequantize(w, BACKEND, f16=True)).astype(np.float32)
    np.testing.assert_array_equal(h[0, :32], 65504.0)
    np.testing.assert_array_equal(h[1:], 100.0)
    x = np.full((9, 64), 100.0, np.float32)
    x[0] = 2000.0  # y = 12.8e6: past f16's range, within 2^8 times it
    y = np.array(kernels.dense_matmul(QuantWeight.from_numpy(blocks[1:].reshape(15, 68), QT.Q8_0, (15, 64)),
                                      mx.array(x), BACKEND))  # fmt: skip
    np.testing.assert_array_equal(y[1:], 640000.0)  # exact: 100·2^-8 and the sums are f16 values
    np.testing.assert_allclose(y[0], 64 * 100 * 2000.0, rtol=1e-3)


@needs_gpu
@pytest.mark.parametrize("qt", [QT.Q8_0, QT.F16, QT.IQ2_XXS], ids=lambda q: q.name)
def test_dense_matmul_in_slabs(qt, monkeypatch):
    """A prefill chunk's dense product: f16 weights times f16 x with f32 accumulation, also when the weight is
    decoded a slab of rows at a time."""
    rng = np.random.default_rng(int(qt) + 5)
    w, ref = make_weight(rng, qt, (75, n_in_for(qt)), np.float32)
    x = rng.standard_normal((13, w.shape[1])).astype(np.float32)
    whole = np.array(kernels.dense_matmul(w, mx.array(x), BACKEND))
    monkeypatch.setattr(kernels, "DEQ_MAX_ELEMS", 20 * w.shape[1])  # 4 slabs of 20 rows
    slabs = np.array(kernels.dense_matmul(w, mx.array(x), BACKEND))
    if BACKEND == "sim":
        np.testing.assert_array_equal(slabs, whole)
    else:  # cuBLAS picks its kernel by shape, and so its order of summation
        assert np.abs(slabs - whole).max() <= 2e-3 * np.abs(whole).max()
    assert rel_err(whole, x, ref, "ni,oi->no") <= DENSE_TOL


GATHER_CASES = {
    "decode1": lambda rng: rng.integers(0, 16, (1, 6)),
    "decode4_repeat": lambda rng: np.array([[3, 3, 0, 15, 7, 3]] * 4),
    "n9": lambda rng: rng.integers(0, 16, (9, 6)),
    "n31": lambda rng: rng.integers(0, 16, (31, 6)),
    "n32": lambda rng: rng.integers(0, 16, (32, 6)),
    "n33_unhit": lambda rng: rng.integers(0, 5, (33, 6)) * 3,  # experts 1, 2, 4, ... never hit
    "n40_one_expert": lambda rng: np.full((40, 6), 15),
    "n512": lambda rng: rng.integers(0, 16, (512, 6)),
}


@needs_gpu
@pytest.mark.parametrize("qt", [QT.IQ2_XXS, QT.Q2_K, QT.Q4_K, QT.Q8_0, QT.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("case", [pytest.param(c, marks=gpu_only) if c == "n512" else c for c in GATHER_CASES])
@pytest.mark.parametrize("per_slot", [False, True])
def test_gather(qt, case, per_slot):
    rng = np.random.default_rng(int(qt) * 7 + len(case))
    E, out = 16, 75
    w, ref = make_weight(rng, qt, (E, out, n_in_for(qt)), np.float32)
    ids = GATHER_CASES[case](rng).astype(np.int32)
    N, k = ids.shape
    x = rng.standard_normal((N, k, w.shape[2]) if per_slot else (N, w.shape[2])).astype(np.float32)
    x2 = mx.array(x.reshape(-1, w.shape[2]))
    flat = mx.array(ids.reshape(-1))
    if N <= kernels.MV_MAX_TOKENS:
        y = kernels.mv(w, x2, BACKEND, ids=flat, k_slots=k, init=NAN)
        tol, emu = F32_TOL, False
    else:
        y = kernels.mm_gather(w, x2, flat, k, BACKEND, init=NAN)
        tol, emu = MM_TOL, True
    y = np.array(y).reshape(N, k, out)
    assert not np.isnan(y).any()
    xs = x if per_slot else np.broadcast_to(x[:, None], (N, k, w.shape[2]))
    assert rel_err(y, xs, ref[ids], "nki,nkoi->nko") <= tol
    if emu:
        assert rel_err(y, f16(xs), f16(ref)[ids], "nki,nkoi->nko") <= MM_EMU_TOL
    # pair-major order and the public entry point agree
    with kernel_backend_set(BACKEND):
        y2 = np.array(w.gather_matmul(mx.array(x), mx.array(ids)))
    np.testing.assert_array_equal(y2, y)


@needs_gpu
@pytest.mark.parametrize("qt", [QT.IQ2_XXS, QT.Q2_K, QT.Q4_K, QT.F16], ids=lambda q: q.name)
@pytest.mark.parametrize("case", ["n9", "n33_unhit", "n40_one_expert"])
@pytest.mark.parametrize("bn", kernels.MM_BN_CHOICES)
def test_gather_swiglu(qt, case, bn):
    """mm's SwiGLU epilogue: gate and up of the same expert rows in one tile, clamped SwiGLU times the route
    weight, rounded to f16; both token tile widths, an expert with more pairs than a tile, unhit experts."""
    rng = np.random.default_rng(int(qt) * 11 + len(case) + bn)
    E, F = 16, 70  # F not a multiple of the tile's 64 rows
    gate, g_ref = make_weight(rng, qt, (E, F, n_in_for(qt)), np.float32)
    up, u_ref = make_weight(rng, qt, (E, F, n_in_for(qt)), np.float32)
    ids = GATHER_CASES[case](rng).astype(np.int32)
    N, k = ids.shape
    x = rng.standard_normal((N, gate.shape[2])).astype(np.float32)
    rw = rng.uniform(0.1, 1.0, (N, k)).astype(np.float32)
    flat = mx.array(ids.reshape(-1))
    routes = kernels.routes_for(flat, E, BACKEND, bn)
    clamp = 2.0
    got = kernels.mm_gather_swiglu(gate, up, mx.array(x), flat, k, clamp, BACKEND, route_w=mx.array(rw),
                                   routes=routes, init=NAN)  # fmt: skip
    assert got.dtype == mx.float16 and got.shape == (N * k, F)
    got = np.array(got.astype(mx.float32)).reshape(N, k, F)
    assert not np.isnan(got).any()
    xb = f16(x).astype(np.float64)

    def swiglu(g, u, c):  # f64, from the products of the same f16 operands
        g, u = (np.minimum(g, c), np.clip(u, -c, c)) if c > 0 else (g, u)
        with np.errstate(over="ignore"):
            return g / (1 + np.exp(-g)) * u

    g = np.einsum("ni,nkoi->nko", xb, f16(g_ref)[ids].astype(np.float64))
    u = np.einsum("ni,nkoi->nko", xb, f16(u_ref)[ids].astype(np.float64))
    # the f16 result's rounding (2^-11), plus f32 accumulation where a product nearly cancels
    tol = lambda want: 2**-10 * np.abs(want) + 1e-4 * np.abs(want).max()  # noqa: E731
    want = swiglu(g, u, clamp) * rw[..., None]
    assert np.all(np.abs(got - want) <= tol(want))
    # no route weights, no clamp: the plain SwiGLU of the two products, held within f16's finite range
    got = np.array(kernels.mm_gather_swiglu(gate, up, mx.array(x), flat, k, 0.0, BACKEND).astype(mx.float32))
    want = np.clip(swiglu(g, u, 0.0), -kernels.F16_MAX, kernels.F16_MAX)
    assert np.all(np.abs(got.reshape(N, k, F) - want) <= tol(want))


def _attention_reference(q, raw, comp, idx, sinks, keep, W, pos, ratio, k, scale):
    """float64: each query over its window rows and its visible (or listed) compressed rows, the sink in the softmax."""
    out = []
    for t in range(q.shape[0]):
        j1 = t + keep + 1
        keys = [raw[j] for j in range(max(0, j1 - W), j1)]
        if ratio:
            nv = (pos + t + 1) // ratio
            keys += [comp[c] for c in (range(nv) if idx is None else idx[t][: min(nv, k)])]
        kk = np.stack(keys).astype(np.float64)
        s = np.concatenate([sinks[:, None].astype(np.float64), q[t].astype(np.float64) @ kk.T * scale], 1)
        p = np.exp(s - s.max(1, keepdims=True))
        out.append((p / p.sum(1, keepdims=True))[:, 1:] @ kk)
    return np.stack(out)


@needs_gpu
@pytest.mark.parametrize(
    "D,H,T,keep,W,pos,ratio,k,listed",
    [(128, 16, 7, 5, 16, 20, 4, 4, True),  # window edges, queries seeing fewer than k rows, listed rows
     (128, 4, 9, 0, 16, 0, 16, 4, False),  # padded heads, no compressed row for the first queries
     (128, 32, 5, 15, 16, 40, 0, 0, False),  # window only
     (512, 16, 3, 3, 128, 300, 4, 8, True)],
)  # fmt: skip
def test_attention_chunk(D, H, T, keep, W, pos, ratio, k, listed):
    rng = np.random.default_rng(D + H + T)
    q = rng.standard_normal((T, H, D)).astype(np.float32)
    raw = rng.standard_normal((keep + T, D)).astype(np.float16)
    C = max(1, (pos + T) // max(ratio, 1))
    comp = rng.standard_normal((C + 3, D)).astype(np.float16)  # spare rows past the visible ones
    idx = np.stack([rng.permutation(C)[:k] for _ in range(T)]).astype(np.int32) if listed else None
    sinks = rng.standard_normal(H).astype(np.float32)
    angle = rng.uniform(0, 2 * np.pi, (T, D // 2))
    C, S = np.repeat(np.cos(angle), 2, 1), np.repeat(np.sin(angle), 2, 1) * np.tile([-1, 1], D // 2)  # RoPE tables
    G = 2
    got = kernels.attention_chunk(
        mx.array(q), mx.array(raw), mx.array(comp) if ratio else None, None if idx is None else mx.array(idx),
        mx.array(sinks), keep=keep, window=W, pos=pos, ratio=ratio, top_k=k, scale=D**-0.5,
        C=mx.array(C.astype(np.float32)), S=mx.array(S.astype(np.float32)), groups=G, backend=BACKEND)  # fmt: skip
    o = _attention_reference(q.astype(np.float16), raw, comp, idx, sinks, keep, W, pos, ratio, k, D**-0.5)
    o = o * C[:, None] - o.reshape(T, H, D // 2, 2)[..., ::-1].reshape(T, H, D) * S[:, None]  # the inverse RoPE
    want = o.reshape(T, G, H // G * D).swapaxes(0, 1)  # the grouped product's layout
    assert got.a.dtype == mx.float16 and got.a.shape == (G, T, H // G * D)
    assert np.abs(np.array(got.a) / kernels.F16_PRODUCT_SCALE - want).max() <= 2e-3 * np.abs(want).max()
    assert np.abs(np.array(got.values()) - want).max() <= 2e-3 * np.abs(want).max()  # probabilities in f16


@needs_gpu
@pytest.mark.parametrize("H,T,N", [(64, 5, 70), (16, 9, 130), (16, 3, 600)])  # partial tiles; keys in 3 runs
def test_index_scores_chunk(H, T, N):
    """index_mm: Σ_h hw·relu(keys·iq) over bf16-exact inputs equals the float64 sums up to summation order; the
    inputs may come as f32 (converted, exactly) or bf16."""
    rng = np.random.default_rng(H + T + N)
    bf16_exact = lambda a: np.array(mx.array(a.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    iq = bf16_exact(rng.standard_normal((T, H, 128)))
    keys = bf16_exact(rng.standard_normal((N, 128)))
    hw = rng.standard_normal((T, H)).astype(np.float32)
    want = np.einsum("th,thc->tc", hw.astype(np.float64), np.maximum(np.einsum("thd,cd->thc", iq, keys), 0))
    for dtype in (mx.float32, mx.bfloat16):
        got = np.array(kernels.index_scores_chunk(mx.array(iq).astype(dtype), mx.array(hw),
                                                  mx.array(keys).astype(dtype), BACKEND))  # fmt: skip
        assert got.shape == (T, N) and np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_gpu
def test_mm_holds_f16_range():
    """mm reads x and writes the SwiGLU's output as f16: values past ±65504 are held at it, never infinities."""
    rng = np.random.default_rng(8)
    gate, _ = make_weight(rng, QT.IQ2_XXS, (2, 64, 256), np.float32)
    up, _ = make_weight(rng, QT.IQ2_XXS, (2, 64, 256), np.float32)
    x = rng.standard_normal((9, 256)).astype(np.float32) * 1e4
    x[0, :4] = [1e6, -1e6, np.inf, -np.inf]  # past f16's range in x
    flat = mx.array(rng.integers(0, 2, 9).astype(np.int32))
    mid = np.array(kernels.mm_gather_swiglu(gate, up, mx.array(x), flat, 1, 0.0, BACKEND).astype(mx.float32))
    assert np.isfinite(mid).all() and np.abs(mid).max() == kernels.F16_MAX  # products of ~1e4 overflow f16
    y = np.array(kernels.mm_gather(gate, mx.array(x), flat, 1, BACKEND))
    assert np.isfinite(y).all()


def test_mm_rejects_mismatched_inputs():
    rng = np.random.default_rng(2)
    w, _ = make_weight(rng, QT.Q8_0, (4, 24, 256), np.float32)
    flat = mx.array(np.zeros(12, np.int32))
    with pytest.raises(ValueError, match="does not fit"):
        kernels.mm_gather(w, mx.zeros((5, 256)), flat, 6, "sim")
    with pytest.raises(ValueError, match="token tile width"):
        kernels.routes_for(flat, 4, "sim", bn=48)
    w2, _ = make_weight(rng, QT.Q8_0, (4, 32, 256), np.float32)
    with pytest.raises(ValueError, match="differ"):
        kernels.mm_gather_swiglu(w, w2, mx.zeros((2, 256)), flat, 6, 0.0, "sim")


def test_quantize_x_layout():
    """kernels.quantize_x: per row q bytes, remainder bytes, then f32 scales; x̂ = d·(q + r/128) is the numpy
    emulation's (quantize_x_octets), within 1/32768 of each octet's max|x|. Bad calls fail clearly."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((3, 256)) * rng.uniform(0.01, 30, (3, 1))).astype(np.float32)
    x[1, 8:16] = 0.0
    p = np.array(kernels.quantize_x(mx.array(x)))
    assert p.shape == (3, 160) and p.dtype == np.float32
    b = p.view(np.uint8)
    q, r, d = b[:, :256].view(np.int8), b[:, 256:512].view(np.int8), p[:, 128:]
    assert np.abs(q).max() <= 127 and np.abs(r).max() <= 64
    xh = np.repeat(d, 8, axis=1).astype(np.float64) * (q + r / 128.0)
    np.testing.assert_array_equal(xh, quantize_x_octets(x))
    assert np.all(np.abs(xh - x) <= np.repeat(np.abs(x).reshape(3, 32, 8).max(-1), 8, axis=1) / 32000)
    w, _ = make_weight(rng, QT.F16, (2, 8, 256), np.float32)
    with pytest.raises(ValueError, match="quantized x"):
        kernels.mv(w, kernels.quantize_x(mx.zeros((1, 256))), "sim", ids=mx.zeros((1,), mx.int32), xq=True)


@needs_gpu
@pytest.mark.parametrize("qt", kernels.MV_XQ_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("epi", [kernels.MV_PLAIN, kernels.MV_SUM], ids=["plain", "sum"])
def test_mv_quantized_x(qt, epi):
    """mv.body XQ (x from kernels.quantize_x): within docs/quants.md §5.3's bound of the exact product, and equal (but
    for f32 rounding) to a float64 product of the quantized x (quantize_x_octets)."""
    rng = np.random.default_rng(int(qt) + epi)
    E, out, n_in, T, k = 8, 37, 512 + 256, 2, 3  # a short last span, rows not a multiple of NR
    w, ref = make_weight(rng, qt, (E, out, n_in))
    x = rng.standard_normal((T, k, n_in)).astype(np.float32) * rng.uniform(0.1, 3.0, (T, k, 1)).astype(np.float32)
    x[0, 0, :8] = 0.0  # an all-zero octet: d = 0
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    spec = "nki,nkoi->nko" if epi == kernels.MV_PLAIN else "nki,nkoi->no"

    def run(xq: bool) -> np.ndarray:
        x2 = mx.array(x.reshape(T * k, n_in))
        y = kernels.mv(w, kernels.quantize_x(x2) if xq else x2, BACKEND, ids=mx.array(ids.reshape(-1)), k_slots=k,
                       epi=epi, xq=xq, init=NAN)  # fmt: skip
        return np.array(y).reshape(T, k, out) if epi == kernels.MV_PLAIN else np.array(y)

    y = run(True)
    assert rel_err(y, x, ref[ids], spec) <= XQ_TOL
    emu = np.einsum(spec, quantize_x_octets(x), ref[ids])
    scale = np.einsum(spec, np.abs(x.astype(np.float64)), np.abs(ref[ids]))
    assert float(np.max(np.abs(y - emu) / scale)) <= XQ_EMU_TOL
    assert not np.array_equal(run(False), y)  # x was quantized: the f32 launch differs


@needs_gpu
def test_mv_quantized_x_moe_launches():
    """The routed experts' two launches with the shared expert inside (SwiGLU, then the sum), x quantized: the
    same as the f32 launches given x̂ itself (kernels.quantize_x's values), up to f32 rounding."""
    rng = np.random.default_rng(11)
    E, F, D, T, k = 8, 40, 512, 2, 3
    gate, up = (make_weight(rng, QT.IQ2_XXS, (E, F, D), np.float32)[0] for _ in range(2))
    (down,) = (make_weight(rng, QT.Q2_K, (E, D, 256), np.float32)[0],)
    sg, su, sd = (make_weight(rng, QT.Q8_0, s, np.float32)[0] for s in ((F, D), (F, D), (D, 256)))
    sgu = QuantWeight.stack_rows([sg, su])
    ids = mx.array(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    x = rng.standard_normal((T, D)).astype(np.float32) * 0.05
    mid = rng.standard_normal((T * k + T, 256)).astype(np.float32)

    def both(w, x, **kw):
        got = np.array(kernels.mv(w, kernels.quantize_x(mx.array(x)), BACKEND, ids=ids, k_slots=k, xq=True, **kw))
        xh = mx.array(quantize_x_octets(x).astype(np.float32))
        return got, np.array(kernels.mv(w, xh, BACKEND, ids=ids, k_slots=k, **kw))

    for got, want in (both(gate, x, epi=kernels.MV_SWIGLU, w2=up, aux=rw, clamp=0.02, shared=sgu),
                      both(down, mid, epi=kernels.MV_SUM, shared=sd)):
        assert got.shape == want.shape and np.isfinite(got).all()
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


@needs_gpu
@pytest.mark.parametrize("qt", kernels.MV_REG[kernels.MV_PLAIN].types, ids=lambda q: q.name)
def test_mv_reg_dense_and_grouped_launches_are_the_staged_ones(qt):
    """mv_reg.body's f32-x matvecs give mv.body's results: dense rows of x (and one token's x read in place), the
    grouped launch (out_a: group g's rows times x's slot g), and the RMSNorm prologue (MV_RMS's types)."""
    rng = np.random.default_rng(33 + int(qt))
    out, n_in, T, G = 37, 640, 3, 4
    w, _ = make_weight(rng, qt, (out, n_in), np.float32)
    wg, _ = make_weight(rng, qt, (G, out, n_in), np.float32)
    x = mx.array(rng.standard_normal((T, n_in)).astype(np.float32) * rng.uniform(0.2, 3.0, (T, 1)).astype(np.float32))
    xg = mx.array(rng.standard_normal((1, G, n_in)).astype(np.float32))
    nw = mx.array(rng.uniform(0.5, 1.5, n_in).astype(np.float32))
    wide = mx.concatenate([mx.zeros((1, 12)), x[:1]], axis=1)
    calls = {
        "dense": (w, x, dict()),
        "cols": (w, kernels.Cols(wide, 12), dict()),
        "grouped": (wg, xg, dict(ids=mx.arange(G, dtype=mx.int32), k_slots=G)),
    }
    if qt in kernels.MV_REG[kernels.MV_RMS].types:
        calls["rms"] = (w, x, dict(epi=kernels.MV_RMS, aux=nw, clamp=1e-6))
        calls["rms cols"] = (w, kernels.Cols(wide, 12), dict(epi=kernels.MV_RMS, aux=nw, clamp=1e-6))
    for name, (wt, x2, kw) in calls.items():
        want = np.array(kernels.mv(wt, x2, "sim", direct=False, init=NAN, **kw))
        assert np.isfinite(want).all() and np.abs(want).max() > 0
        # the default (rows this short: one simdgroup); four simdgroups, three row groups (the last one short);
        # eight simdgroups (MV_RMS's config for longer rows)
        for config in (None, (2, 4, 3), (4, 8, 1)):
            got = np.array(kernels.mv(wt, x2, "sim", direct=True, config=config, init=NAN, **kw))
            assert got.shape == want.shape and np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (name, config)
    with pytest.raises(ValueError, match="MV_REG"):  # a type it does not decode
        kernels.mv(make_weight(rng, QT.Q4_K, (out, 512), np.float32)[0], x[:, :512], "sim", direct=True)


@needs_gpu
@pytest.mark.parametrize("qt", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("N", [1, 3, 40])
def test_quantweight_matmul_dispatch(qt, N):
    """QuantWeight.matmul on the GPU backend (custom kernels, or the Q8_0 affine repack)."""
    rng = np.random.default_rng(int(qt) + 5 * N)
    w, ref = make_weight(rng, qt, (130, n_in_for(qt)), np.float32)
    x = rng.standard_normal((N, w.shape[1])).astype(np.float32)
    with kernel_backend_set(BACKEND):
        y = np.array(w.matmul(mx.array(x)))
    tol = F32_TOL if N <= kernels.MV_MAX_TOKENS else DENSE_TOL
    if qt == QT.Q8_0 and kernels.q8_mode() == "affine":
        tol = 1e-5
    assert rel_err(y, x, ref, "ni,oi->no") <= tol
    with kernel_backend_set("fallback"):
        yf = np.array(w.matmul(mx.array(x)))
    fallback_tol = 1e-3 if mx.cuda.is_available() else F32_TOL  # MLX-CUDA f32 GEMM uses TF32 (see test_weights)
    assert rel_err(yf, x, ref, "ni,oi->no") <= fallback_tol


@needs_gpu
def test_warp_is_32_lanes():
    """The prologue assumes 32-lane simdgroups/warps (docs/quants.md §3.4): a 1-unit row summed by lane 0..31."""
    rng = np.random.default_rng(9)
    w, ref = make_weight(rng, QT.F32, (4, 32 * 64), np.float32)
    x = rng.standard_normal((1, 32 * 64)).astype(np.float32)
    y = np.array(kernels.mv(w, mx.array(x), BACKEND, init=NAN))
    assert rel_err(y, x, ref, "ni,oi->no") <= F32_TOL


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.IQ2_XXS], ids=lambda q: q.name)
def test_mv_reads_cols_in_place(qt):
    """matmul_rms and matmul of ``Cols(row, start)``: ``in`` values of one token's wider row (attn_q_a n, then
    attn_kv n; HC pre's n, then its gates), read in place (mv takes the Cols, its start as ``x_off``): the same
    result as the sliced x, on the kernels and on the fallback."""
    rng = np.random.default_rng(int(qt))
    n_in = 4 * 256
    w, ref = make_weight(rng, qt, (40, n_in), np.float32)
    row = mx.array((rng.standard_normal((1, n_in + 512)) * 2.0).astype(np.float32))  # 1.5x in: x.size // in == 1
    wide = mx.array((rng.standard_normal((1, 3 * n_in)) * 2.0).astype(np.float32))  # 3x in
    nw = mx.array(rng.uniform(0.2, 2.0, n_in).astype(np.float32))
    for b in (BACKEND, "fallback"):
        with kernel_backend_set(b):
            for r in (row, wide):
                want = np.array(w.matmul_rms(r[:, :n_in], nw, 1e-6))
                np.testing.assert_array_equal(np.array(w.matmul_rms(kernels.Cols(r, 0), nw, 1e-6)), want)
            # a later start (16-byte aligned, as every start the model takes: the kernels load float4)
            for start in (12, 2 * n_in):
                np.testing.assert_array_equal(np.array(w.matmul_rms(kernels.Cols(wide, start), nw, 1e-6)),
                                              np.array(w.matmul_rms(wide[:, start : start + n_in], nw, 1e-6)))
                np.testing.assert_array_equal(np.array(w.matmul(kernels.Cols(wide, start))),
                                              np.array(w.matmul(wide[:, start : start + n_in])))  # fmt: skip
    with pytest.raises(ValueError, match="multiple of 4"):
        kernels.mv(w, kernels.Cols(wide, 6), BACKEND)


def test_gather_matmul_flat_x_and_out_shape():
    """gather_matmul takes per-slot x in any shape of [N, k, in]'s size and gives ``out_shape``: the decode's grouped
    output projection passes the attention's [T, H, D] and takes [T, G*L] (no reshape nodes)."""
    rng = np.random.default_rng(5)
    w, _ = make_weight(rng, QT.Q8_0, (4, 24, 256), np.float32)
    x = mx.array(rng.standard_normal((1, 8, 128)).astype(np.float32))  # [T, H, D] with H*D = k*in
    ids = mx.array([[0, 1, 2, 3]], dtype=mx.int32)
    for b in (BACKEND, "fallback"):
        with kernel_backend_set(b):
            want = np.array(w.gather_matmul(x.reshape(1, 4, 256), ids)).reshape(1, 96)
            got = w.gather_matmul(x, ids, out_shape=(1, 96))
            assert got.shape == (1, 96)
            np.testing.assert_array_equal(np.array(got), want)
    with pytest.raises(ValueError, match="out_shape"):
        w.gather_matmul(x, ids, out_shape=(1, 95))
    with pytest.raises(ValueError, match="does not fit"):
        w.gather_matmul(x[:, :7], ids)


@needs_gpu
@pytest.mark.parametrize("epi, qt", [(e, t) for e in (kernels.MV_SWIGLU, kernels.MV_SUM)
                                     for t in kernels.MV_REG[e].types],
                         ids=lambda v: v.name if isinstance(v, QT) else {1: "swiglu", 2: "sum"}[v])
def test_mv_reg_launches_are_the_staged_ones(epi, qt):
    """mv_reg.body (weights straight into registers) gives mv.body's result: the gate+up SwiGLU of quantized x,
    the down sum of f32 x and of quantized x. With and without the shared expert, route weights or a packed
    route, (SwiGLU) no clamp or one that bites and one token's x read in place, (sum) an addend or none; rows not
    a multiple of NR, K of 40 units (a thread takes one or two)."""
    for xq in (True,) if epi == kernels.MV_SWIGLU else (False, True):
        _check_mv_reg_launch(epi, qt, xq)


def _check_mv_reg_launch(epi, qt, xq):
    rng = np.random.default_rng(21 + int(qt) + epi)
    E, out, n_in, T, k = 8, 37, 1280 if epi == kernels.MV_SWIGLU else 512, 2, 3
    swiglu = epi == kernels.MV_SWIGLU
    w, up = (make_weight(rng, qt, (E, out, n_in), np.float32)[0] for _ in range(2))
    sh = [make_weight(rng, QT.Q8_0, (out, n_in), np.float32)[0] for _ in range(2 if swiglu else 1)]
    sh = QuantWeight.stack_rows(sh) if swiglu else sh[0]
    x = rng.standard_normal((T if swiglu else T * k + T, n_in)).astype(np.float32)
    x = kernels.quantize_x(mx.array(x)) if xq else mx.array(x)
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    rw = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    packed = mx.array(np.concatenate([ids, rw.view(np.int32)], axis=1))  # moe_route's [T, 2k]
    wide = mx.concatenate([mx.zeros((1, 8)), x[:1]], axis=1)  # token 0's words from column 8 on
    add = mx.array(rng.standard_normal((T, out)).astype(np.float32))
    variants = ([(0.0, "rows"), (0.05, "rows"), (0.0, "cols")] if swiglu else [(None, "rows"), (add, "rows")])
    seen = []
    for shared, (extra, xs), route in itertools.product((None, sh), variants, ("weights", "packed")):
        if route == "packed" and not swiglu and extra is not None:
            continue  # a packed route's launches take no aux
        n = 1 if xs == "cols" else T
        kw = dict(k_slots=k, epi=epi, shared=shared, xq=xq, init=NAN)
        kw |= dict(w2=up, clamp=extra) if swiglu else dict(aux=extra)
        if route == "packed":
            kw |= dict(ids=packed[:n], route_packed=True)
        else:
            kw |= dict(ids=mx.array(ids[:n].reshape(-1)))
            if swiglu:
                kw["aux"] = mx.array(rw[:n].reshape(-1))
        x2 = kernels.Cols(wide, 8) if xs == "cols" else x if swiglu or shared is not None else x[: T * k]
        want = np.array(kernels.mv(w, x2, "sim", direct=False, **kw))
        rows = n * k + (n if shared is not None else 0) if swiglu else n
        for config in (None, (4, 2, 3)):  # and three row groups a threadgroup, the last one short
            got = np.array(kernels.mv(w, x2, "sim", direct=True, config=config, **kw))
            assert got.shape == want.shape == (rows, out) and np.isfinite(want).all()
            assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), (shared is not None, xs, route, config)
        seen.append(want)
    assert np.abs(seen[0]).max() > 0 and not np.allclose(seen[0], seen[2])  # the clamp bites / the addend adds
    if swiglu:
        with pytest.raises(ValueError, match="MV_REG"):  # f32 x: not this launch
            kernels.mv(w, mx.zeros((T, n_in)), "sim", ids=mx.array(ids.reshape(-1)), k_slots=k, epi=epi, w2=up,
                       direct=True)  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("T", [2, 5, 8, 11])
def test_mv_reg_rows_of_a_batched_step_share_one_decoding(T):
    """A batched decode step's T tokens: a dense launch gives each threadgroup XB of them (the smallest of 2, 4, 8
    that holds T; 11 tokens: two groups of 8, the last short), the SwiGLU launch its shared pairs (y also
    quantized); every row equals the same launch of its token alone."""
    rng = np.random.default_rng(40 + T)
    out, n_in, E, k = 37, 768, 8, 3
    x = mx.array(rng.standard_normal((T, n_in)).astype(np.float32))
    nw = mx.array(rng.uniform(0.5, 1.5, n_in).astype(np.float32))
    xb = kernels.reg_xb(T)
    assert xb == min(8, 1 << (T - 1).bit_length())
    for qt in (QT.Q8_0, QT.F16):  # x in f32: quarter units (Q8_0), whole units (F16)
        w, _ = make_weight(rng, qt, (out, n_in), np.float32)
        for kw in (dict(), dict(epi=kernels.MV_RMS, aux=nw, clamp=1e-6)):
            plan = kernels._mv_plan(w, BACKEND, T, T, 1, False, None, kw.get("epi", 0), direct=True)
            assert dict(plan[3])["XB"] == xb and plan[4][2] == -(-T // xb)
            got = np.array(kernels.mv(w, x, BACKEND, direct=True, init=NAN, **kw))
            alone = np.concatenate([np.array(kernels.mv(w, x[t : t + 1], BACKEND, direct=True, **kw))
                                    for t in range(T)])  # fmt: skip
            assert np.isfinite(got).all() and np.abs(got).max() > 0
            assert np.abs(got - alone).max() <= 1e-6 * np.abs(alone).max(), (qt.name, kw.get("epi"))
    gate, up = (make_weight(rng, QT.IQ2_XXS, (E, 64, n_in), np.float32)[0] for _ in range(2))
    sh = QuantWeight.stack_rows([make_weight(rng, QT.Q8_0, (64, n_in), np.float32)[0] for _ in range(2)])
    ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32)
    rw = rng.uniform(0.1, 1.0, (T, k)).astype(np.float32)
    xq = kernels.quantize_x(x)
    for qy in (False, True):
        kw = dict(k_slots=k, epi=kernels.MV_SWIGLU, w2=up, clamp=0.5, shared=sh, xq=True, direct=True, quantize_y=qy)
        # (an unwritten word: 0 here, NaN in the launches of one token on sim, or the f32 result not finite)
        got = np.array(kernels.mv(gate, xq, BACKEND, ids=mx.array(ids.reshape(-1)), aux=mx.array(rw.reshape(-1)),
                                  init=0.0 if qy else NAN, **kw))  # fmt: skip
        each = [np.array(kernels.mv(gate, xq[t : t + 1], BACKEND, ids=mx.array(ids[t]), aux=mx.array(rw[t]), **kw))
                for t in range(T)]  # fmt: skip
        alone = np.concatenate([e[:k] for e in each] + [e[k:] for e in each])  # routed pairs, then shared ones
        assert got.shape == alone.shape and (qy or np.isfinite(got).all())
        np.testing.assert_array_equal(got.view(np.uint32), alone.view(np.uint32))


@needs_gpu
def test_mv_reg_swiglu_writes_quantized_mid():
    """The gate+up launch with quantize_y (the model's, where the down launch reads quantized x) writes the
    f32 launch's result as quantize_x lays it out: the same scales and q bytes, remainders within one (the
    kernel may fuse v − q·d); the down launch of it equals the down launch of quantize_x's. Bad shapes fail."""
    rng = np.random.default_rng(5)
    E, F, n_in, T, k = 8, 256, 512, 2, 3
    gate, up = (make_weight(rng, QT.IQ2_XXS, (E, F, n_in), np.float32)[0] for _ in range(2))
    sh = QuantWeight.stack_rows([make_weight(rng, QT.Q8_0, (F, n_in), np.float32)[0] for _ in range(2)])
    down, _ = make_weight(rng, QT.Q2_K, (E, n_in, F), np.float32)
    sd, _ = make_weight(rng, QT.Q8_0, (n_in, F), np.float32)
    x = kernels.quantize_x(mx.array(rng.standard_normal((T, n_in)).astype(np.float32)))
    ids = mx.array(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32).reshape(-1))
    kw = dict(ids=ids, k_slots=k, epi=kernels.MV_SWIGLU, w2=up, clamp=0.5, shared=sh, xq=True, direct=True)
    kw["aux"] = mx.array(rng.uniform(0.1, 1.0, T * k).astype(np.float32))
    y = kernels.mv(gate, x, BACKEND, **kw)
    got, want = (np.array(a) for a in (kernels.mv(gate, x, BACKEND, quantize_y=True, init=NAN, **kw),
                                       kernels.quantize_x(y)))  # fmt: skip
    assert got.shape == want.shape == (T * k + T, 5 * F // 8) and np.abs(np.array(y)).max() > 0.01
    b, wb = got.view(np.uint8), want.view(np.uint8)
    np.testing.assert_array_equal(got[:, F // 2 :], want[:, F // 2 :])  # scales
    np.testing.assert_array_equal(b[:, :F], wb[:, :F])  # q
    assert np.abs(b[:, F : 2 * F].view(np.int8).astype(int) - wb[:, F : 2 * F].view(np.int8)).max() <= 1  # r
    dkw = dict(ids=ids, k_slots=k, epi=kernels.MV_SUM, shared=sd, xq=True, direct=True)
    d_got, d_want = (np.array(kernels.mv(down, m, BACKEND, **dkw)) for m in (mx.array(got), mx.array(want)))
    assert np.abs(d_got - d_want).max() <= 1e-4 * np.abs(d_want).max()
    with pytest.raises(ValueError, match="quantize_y"):  # the octets of y are a threadgroup's 8 rows
        kernels.mv(gate, x, BACKEND, quantize_y=True, config=(4, 2, 1), **{**kw, "direct": True})
    with pytest.raises(ValueError, match="quantize_y"):
        kernels.mv(gate, x, BACKEND, quantize_y=True, **{**kw, "direct": False})
