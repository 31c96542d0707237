"""Fused HC pre / HC post / compressor-window kernels (custom_kernels/fused.py).

CPU (CI): the Metal instantiation of each body type-checks as MLX renders it (g++ + metal_shim.h), the CUDA
instantiation compiles with nvcc, the wrapper's fallback equals the pure-MLX graph code (and a float64 numpy
reference of the compressor window), shape/dtype validation raises.
GPU (skipped unless the backend is metal or cuda): each kernel against its fallback, computed on the CPU
device, on random inputs at the tiny and the real V4 shapes.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx.model import hyper
from ds4_mlx.model.compressor import NEG, Compressor
from ds4_mlx.model.rope import Rope
from ds4_mlx.kernels import fused
from ds4_mlx.weights import QuantWeight, _kernels, kernel_backend
from kernel_util import gxx_metal_check, nvcc_compile, render_metal_sources

kernels = _kernels()

ROOT = Path(__file__).resolve().parent.parent
BACKEND = kernel_backend()
GPU = BACKEND in ("metal", "cuda")
needs_gpu = pytest.mark.skipif(not GPU, reason=f"kernel backend is {BACKEND!r}: no Metal/CUDA here")


class HCfg:
    """The ModelConfig fields the HC functions read."""

    def __init__(self, n_hc=4, rms_eps=1e-6, hc_eps=1e-6, n_sinkhorn_iter=20):
        self.n_hc, self.rms_eps, self.hc_eps, self.n_sinkhorn_iter = n_hc, rms_eps, hc_eps, n_sinkhorn_iter


def hc_inputs(T: int, E: int, n_hc: int = 4, seed: int = 0):
    """Random S [T, n, E], F16 fn [mix, n*E] (fan-in scale), scale [3], base [mix]: all nonzero."""
    rng = np.random.default_rng(seed)
    mix = 2 * n_hc + n_hc * n_hc
    S = mx.array(rng.standard_normal((T, n_hc, E)).astype(np.float32) * 1.5 + 0.1)
    fn_np = (rng.standard_normal((mix, n_hc * E)) * (2.0 / math.sqrt(n_hc * E))).astype(np.float16)
    fn = QuantWeight.from_numpy(fn_np, QT.F16, (mix, n_hc * E))
    scale = mx.array(rng.uniform(0.5, 2.0, 3).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))
    return S, fn, scale, base


def on_cpu(f, *args, **kw):
    """Run the pure-MLX path on the CPU device (automatic backend = fallback there): the oracle."""
    old = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        out = f(*args, **kw)
        mx.eval(out)
        return out
    finally:
        mx.set_default_device(old)


def close(a, b, rtol):
    """max |a-b| <= rtol * max|b| (relative to the output's scale), finite."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.isfinite(a).all()
    err, scale = np.abs(a - b).max(), np.abs(b).max()
    assert err <= rtol * scale, f"max err {err:.3g} vs scale {scale:.3g}"


# --- compile checks (CPU) ---------------------------------------------------------------------------------

RENDER_METAL = r"""
import os, sys, tempfile
import mlx.core as mx
sys.path.insert(0, sys.argv[1])
from ds4_mlx.weights import _kernels
_kernels()
from ds4_mlx.kernels import fused
DT = {"float": mx.float32, "uint32_t": mx.uint32, "int32_t": mx.int32}
SMALL = {("hc_post", "post"): 4, ("hc_pre", "scale"): 3}  # < 8 elements: Metal makes a `constant` pointer
d = tempfile.mkdtemp()
for i, (kind, template) in enumerate(fused.instantiations()):
    spec = fused.SPECS[kind]
    kern = fused.get_fused_kernel(kind, "metal")
    def f(*a):
        return kern(inputs=list(a), template=list(template), grid=(256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[(8,)] * len(spec.outputs), output_dtypes=[mx.float32] * len(spec.outputs),
                    verbose=True)[0]
    args = [mx.zeros((SMALL.get((kind, n), 64),), dtype=DT[t]) for n, t in spec.inputs]
    print(f"@@@ {fused.tag(kind, template)}", flush=True)
    mx.export_function(os.path.join(d, f"{i}.mlxfn"), f, *args)
"""


def test_metal_instantiations_typecheck(tmp_path):
    sources = render_metal_sources(RENDER_METAL)
    assert sorted(sources) == sorted(fused.tag(k, t) for k, t in fused.instantiations())
    for tag, src in sources.items():
        assert "#define DS_METAL" in src and "[[kernel]]" in src and "template [[host_name(" in src
        assert "ds_lane = thread_index_in_simdgroup" in src
    assert "const constant float* post" in sources["hc_post_NHC4"]  # the decode case's small input
    assert "const constant float* scale" in sources["hc_pre_NHC4_NITER20_TPB4_SPLIT0"]
    assert "device float* comb_out" in sources["hc_pre_NHC4_NITER20_TPB1_SPLIT1"]
    assert "device float* part" in sources["hc_mix_NHC4"]
    r = gxx_metal_check(sources.values(), tmp_path, "fused_metal")
    assert r.returncode == 0, r.stderr[-6000:]


def test_cuda_instantiations_compile(tmp_path):
    insts = fused.instantiations()
    r = nvcc_compile(fused.render_cuda_unit(insts), tmp_path, "fused")
    assert r.returncode == 0, r.stderr[-6000:]
    for kind, template in insts:
        assert f"custom_kernel_ds_{fused.tag(kind, template)}" in r.stderr  # ptxas built every entry point
    assert "spill" not in r.stderr.replace("0 bytes spill", "")


def test_cuda_check_catches_errors(tmp_path):
    """The nvcc check is not vacuous: a body error fails it."""
    src = fused.render_cuda_unit([("hc_post", (("NHC", 4),))]).replace("const float yv", "const float yv = no_such;//")
    r = nvcc_compile(src, tmp_path, "bad")
    assert r.returncode != 0 and "no_such" in r.stderr


def test_rendered_sources_share_one_body():
    for kind in fused.SPECS:
        m, c = fused.render_fused_source(kind, "metal"), fused.render_fused_source(kind, "cuda")
        assert m[len(kernels.METAL_PROLOGUE):] == c[len(kernels.CUDA_PROLOGUE):]
    assert fused.render_fused_header("metal").replace("DS_METAL", "DS_CUDA", 1) == fused.render_fused_header("cuda")


# --- fallback path and validation (CPU) -------------------------------------------------------------------


def test_backend_follows_env(monkeypatch):
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    assert fused.backend() == "fallback"
    if not mx.cuda.is_available():
        monkeypatch.setenv("DS4_MLX_KERNELS", "cuda")
        with pytest.raises(RuntimeError):
            fused.backend()


def test_hc_fallback_is_the_graph_code(monkeypatch):
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(3, 64, seed=1)
    got, ref = fused.hc_pre(S, fn, scale, base, cfg), hyper.hc_pre(S, fn, scale, base, cfg)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and mx.array_equal(g, r)
    x, post, comb = ref
    y = mx.random.normal((3, 64), key=mx.random.key(2))
    assert mx.array_equal(fused.hc_post(S, y, post, comb), hyper.hc_post(S, y, post, comb))
    # and not trivially: comb is a non-uniform near-doubly-stochastic matrix, post in (0, 2)
    c = np.array(comb)
    assert np.allclose(c.sum(-2), 1, atol=1e-4) and c.std() > 1e-3 and 0 < float(post.min()) < 2


def test_hc_validation():
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(2, 32)
    with pytest.raises(ValueError, match="S must be"):
        fused.hc_pre(S[0], fn, scale, base, cfg, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        fused.hc_pre(S.astype(mx.float16), fn, scale, base, cfg, backend="cuda")
    with pytest.raises(ValueError, match="fn shape"):
        fused.hc_pre(S[:, :, :16], fn, scale, base, cfg, backend="cuda")
    with pytest.raises(ValueError, match="base"):
        fused.hc_pre(S, fn, scale, base[:5], cfg, backend="cuda")
    post, comb = mx.ones((2, 4)), mx.ones((2, 4, 4))
    with pytest.raises(ValueError, match="y"):
        fused.hc_post(S, mx.ones((2, 31)), post, comb, backend="cuda")
    with pytest.raises(ValueError, match="comb"):
        fused.hc_post(S, mx.ones((2, 32)), post, mx.ones((2, 16)), backend="cuda")


def pool_inputs(nw: int, ratio: int, hd: int, seed: int = 0, first: bool = False):
    """Random frontier-layout windows [nw, coff*r, coff*hd] (scores incl. APE), norm, RoPE tables."""
    rng = np.random.default_rng(seed)
    coff = 2 if ratio == 4 else 1
    kv = rng.standard_normal((nw, coff * ratio, coff * hd)).astype(np.float32)
    sc = (rng.standard_normal((nw, coff * ratio, coff * hd)) * 2.0).astype(np.float32)
    if first:  # the first window: lane A (previous window) rows unwritten -> kv 0, score NEG
        kv[0, :ratio], sc[0, :ratio] = 0.0, NEG
    norm = rng.uniform(0.5, 1.5, hd).astype(np.float32)
    rope = Rope(n_rot=64, base=160000.0, freq_scale=1 / 16, yarn=True, corr_low=15.0, corr_high=25.0)
    starts = [ratio * (i + 3) + 5000 for i in range(nw)]
    C, S = rope.tables(starts, hd)
    return mx.array(kv), mx.array(sc), mx.array(norm), C, S, rope, starts


def pool_numpy(kv, sc, norm, rope, starts, ratio, eps=1e-6):
    """Float64 reference of MODEL.md §4.6 steps 4-6 from the frontier layout."""
    kv, sc = np.asarray(kv, np.float64), np.asarray(sc, np.float64)
    nw, rows, w = kv.shape
    if ratio == 4:
        hd = w // 2
        ekv = np.concatenate([kv[:, :4, :hd], kv[:, 4:, hd:]], axis=1)
        esc = np.concatenate([sc[:, :4, :hd], sc[:, 4:, hd:]], axis=1)
    else:
        hd, ekv, esc = w, kv, sc
    p = np.exp(esc - esc.max(axis=1, keepdims=True))
    pooled = (p * ekv).sum(1) / p.sum(1)
    c = pooled / np.sqrt((pooled**2).mean(-1, keepdims=True) + eps) * np.asarray(norm, np.float64)
    theta = rope.angles(starts).astype(np.float64)  # [nw, 32]
    t = c[:, hd - 64:].copy()
    a, b = t[:, 0::2].copy(), t[:, 1::2].copy()
    t[:, 0::2], t[:, 1::2] = a * np.cos(theta) - b * np.sin(theta), a * np.sin(theta) + b * np.cos(theta)
    c[:, hd - 64:] = t
    return c


@pytest.mark.parametrize("ratio,hd", [(4, 128), (16, 128), (128, 64)])
def test_pool_fallback_vs_numpy(ratio, hd):
    kv, sc, norm, C, S, rope, starts = pool_inputs(3, ratio, hd, seed=ratio, first=True)
    ref = pool_numpy(kv, sc, norm, rope, starts, ratio)
    lanes = 2 if ratio == 4 else 1
    got = fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=lanes, backend="fallback")
    close(got, ref, 2e-5)
    if lanes == 2:  # the entries layout of Compressor._finish gives the same result
        ekv = mx.concatenate([kv[:, :4, :hd], kv[:, 4:, hd:]], axis=1)
        esc = mx.concatenate([sc[:, :4, :hd], sc[:, 4:, hd:]], axis=1)
        close(fused.compressor_pool(ekv, esc, norm, C, S, 1e-6, backend="fallback"), ref, 2e-5)


def test_pool_validation():
    kv, sc, norm, C, S, *_ = pool_inputs(2, 4, 64)
    with pytest.raises(ValueError, match="lanes"):
        fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=3, backend="cuda")
    with pytest.raises(ValueError, match="score"):
        fused.compressor_pool(kv, sc[:1], norm, C, S, 1e-6, lanes=2, backend="cuda")
    with pytest.raises(ValueError, match="norm"):
        fused.compressor_pool(kv, sc, norm[:32], C, S, 1e-6, lanes=2, backend="cuda")
    with pytest.raises(ValueError, match="C"):
        fused.compressor_pool(kv, sc, norm, C[:, :32], S, 1e-6, lanes=2, backend="cuda")
    with pytest.raises(ValueError, match="dtype"):
        fused.compressor_pool(kv.astype(mx.float16), sc, norm, C, S, 1e-6, lanes=2, backend="cuda")


def make_compressor(ratio: int, hd: int, E: int = 64, seed: int = 0) -> Compressor:
    """A Compressor with random F16 weights (finish_row = identity: the rounding stays in MLX)."""
    rng = np.random.default_rng(seed)
    coff = 2 if ratio == 4 else 1
    w = coff * hd

    def f16(shape, s):
        return QuantWeight.from_numpy((rng.standard_normal(shape) * s).astype(np.float16), QT.F16, shape)

    weights = {
        "blk.2.attn_compressor_kv.weight": f16((w, E), 1 / math.sqrt(E)),
        "blk.2.attn_compressor_gate.weight": f16((w, E), 2 / math.sqrt(E)),
        "blk.2.attn_compressor_ape.weight": f16((ratio, w), 0.5),
        "blk.2.attn_compressor_norm.weight": mx.array(rng.uniform(0.5, 1.5, hd).astype(np.float32)),
    }

    class Cfg:
        rms_eps = 1e-6

    rope = Rope(n_rot=64, base=160000.0, freq_scale=1 / 16, yarn=True, corr_low=15.0, corr_high=25.0)
    return Compressor(Cfg(), 2, weights, "attn_compressor", hd, ratio, rope, lambda c: c)


def decode_rows_fused(comp: Compressor, n: mx.array, backend: str):
    """Decode token by token, emitting rows through fused.compressor_pool on the frontier (the wire-in)."""
    r, hd = comp.ratio, comp.hd
    state, rows = comp.init_state(), []
    for p in range(n.shape[0]):
        kv_cur = comp.wkv.matmul(n[p : p + 1])
        sc_cur = comp.wgate.matmul(n[p : p + 1]) + comp.ape[p % r : p % r + 1]
        row = (r if comp.coff == 2 else 0) + p % r
        kv = mx.slice_update(state.kv, kv_cur, mx.array([row]), axes=(0,))
        sc = mx.slice_update(state.score, sc_cur, mx.array([row]), axes=(0,))
        if (p + 1) % r == 0:
            C, S = comp.rope.tables([p + 1 - r], hd)
            rows.append(fused.compressor_pool(kv[None], sc[None], comp.norm, C, S, comp.eps, lanes=comp.coff,
                                              backend=backend))
        # advance the reference state the graph's way (same frontier)
        _, state = comp(n[p : p + 1], p, state)
    return mx.concatenate(rows)


@pytest.mark.parametrize("ratio,hd", [(4, 128), (16, 64)])
def test_pool_wire_in_matches_compressor(ratio, hd, monkeypatch):
    """compressor_pool on the decode frontier (lanes = coff) reproduces Compressor's emitted rows.

    On the CPU device: MLX-CUDA's f32 matmul differs from it by ~3e-4 relative (seen on the H200), which
    would swamp the prefill-vs-decode comparison.
    """
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    comp = make_compressor(ratio, hd, seed=ratio)
    n = mx.random.normal((3 * ratio + 1, 64), key=mx.random.key(ratio))
    ref = on_cpu(lambda: comp(n, 0, comp.init_state())[0])  # the graph's prefill path
    close(on_cpu(decode_rows_fused, comp, n, "fallback"), ref, 1e-5)


# --- GPU: kernels vs fallback -----------------------------------------------------------------------------


@needs_gpu
@pytest.mark.parametrize("T,E,tpb,split", [(1, 256, 1, False), (5, 256, 1, False), (5, 256, 2, False),
                                           (7, 256, 4, False), (1, 4096, 1, False), (3, 4096, 1, False),
                                           (64, 4096, 4, False), (33, 4096, 2, False), (1, 4096, 1, True),
                                           (3, 4096, 1, True), (1, 200, 1, True), (8, 256, 1, True)])
def test_hc_pre_kernel(T, E, tpb, split):
    """Both launch shapes: one threadgroup per TPB tokens, and hc_mix's K slices + hc_pre on the partials."""
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(T, E, seed=T + E)
    ref = on_cpu(hyper.hc_pre, S, fn, scale, base, cfg)
    got = fused.hc_pre(S, fn, scale, base, cfg, backend=BACKEND, tpb=tpb, split=split)
    mx.eval(got)
    for name, g, r, tol in zip(("x", "post", "comb"), got, ref, (2e-5, 1e-5, 1e-5)):
        assert g.shape == r.shape, name
        close(g, r, tol)


@needs_gpu
@pytest.mark.parametrize("T,E", [(1, 256), (7, 256), (1, 4096), (33, 4096)])
def test_hc_post_kernel(T, E):
    S, *_ = hc_inputs(T, E, seed=T)
    rng = np.random.default_rng(T)
    y = mx.array(rng.standard_normal((T, E)).astype(np.float32))
    post = mx.array(rng.uniform(0.1, 2.0, (T, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0.05, 0.5, (T, 4, 4)).astype(np.float32))
    ref = on_cpu(hyper.hc_post, S, y, post, comb)
    got = fused.hc_post(S, y, post, comb, backend=BACKEND)
    close(got, ref, 1e-5)


@needs_gpu
@pytest.mark.parametrize("nw,ratio,hd,first", [(1, 4, 512, True), (1, 4, 512, False), (4, 4, 128, True),
                                               (1, 128, 512, False), (3, 128, 512, False), (2, 16, 128, False)])
def test_pool_kernel(nw, ratio, hd, first):
    kv, sc, norm, C, S, rope, starts = pool_inputs(nw, ratio, hd, seed=nw + ratio + hd, first=first)
    lanes = 2 if ratio == 4 else 1
    ref = on_cpu(fused.compressor_pool, kv, sc, norm, C, S, 1e-6, lanes=lanes, backend="fallback")
    got = fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=lanes, backend=BACKEND)
    close(got, ref, 2e-5)
    close(got, pool_numpy(kv, sc, norm, rope, starts, ratio), 2e-5)


@needs_gpu
def test_pool_kernel_wire_in():
    comp = make_compressor(4, 128, seed=7)
    n = mx.random.normal((13, 64), key=mx.random.key(7))
    ref = on_cpu(lambda: comp(n, 0, comp.init_state())[0])
    close(decode_rows_fused(comp, n, BACKEND), ref, 2e-5)
