"""Fused kernels (custom_kernels/fused.py) and the graph's fused operations that run them (ds4_mlx/model/fused.py):
HC pre / HC post / compressor window, and the decode step's attention, Q/KV rows, indexer query, indexer top-k
and MoE router.

CPU (CI): the Metal instantiation of each body type-checks as MLX renders it (g++ + metal_shim.h), the CUDA
instantiation compiles with nvcc, the wrapper's fallback equals the pure-MLX graph code (and a float64 numpy
reference of the compressor window), shape/dtype validation raises.
GPU, or the sim backend without one (skipped if neither): each kernel against its fallback, computed on the CPU
device, on random inputs at the tiny and the real V4 shapes.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import kernels
from ds4_mlx.kernels import Cols
from ds4_mlx.kernels.fused import kernel_counts, kernel_index  # and kernels.fused: the launches
from ds4_mlx.model import fused, hyper
from ds4_mlx.model.compressor import NEG, Compressor, CompressorState
from ds4_mlx.model.ops import index_scores_reference
from ds4_mlx.model.rope import Rope
from ds4_mlx.numerics import RowRounding
from ds4_mlx.weights import QuantWeight
from kernel_util import BACKEND, gpu_only, gxx_metal_check, needs_gpu, nvcc_compile, render_metal_sources

ROOT = Path(__file__).resolve().parent.parent


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
DT = {"float": mx.float32, "uint32_t": mx.uint32, "int32_t": mx.int32, "half": mx.float16}
SMALL = {("hc_post", "post"): 4, ("hc_mix", "post"): 4, ("hc_pre", "scale"): 3, ("hc_pre_xq", "scale"): 3}  # < 8 elements: Metal makes a `constant` pointer
d = tempfile.mkdtemp()
for i, (kind, template) in enumerate(fused.instantiations()):
    spec = fused.SPECS[kind]
    kern = fused.get_fused_kernel(kind, "metal")
    def f(*a):
        return kern(inputs=list(a), template=list(template), grid=(256, 1, 1), threadgroup=(256, 1, 1),
                    output_shapes=[(8,)] * len(spec.outputs), output_dtypes=[DT[spec.out_type(i)] for i in range(len(spec.outputs))],
                    verbose=True)[0]
    args = [mx.zeros((SMALL.get((kind, n), 64),), dtype=DT[t]) for n, t in spec.inputs]
    print(f"@@@ {fused.tag(kind, template)}", flush=True)
    mx.export_function(os.path.join(d, f"{i}.mlxfn"), f, *args)
"""


def test_metal_instantiations_typecheck(tmp_path):
    sources = render_metal_sources(RENDER_METAL)
    templates = {kernels.fused.tag(k, t): t for k, t in kernels.fused.instantiations()}
    assert sorted(sources) == sorted(templates)
    for tag, src in sources.items():
        assert "#define DS_METAL" in src and "[[kernel]]" in src
        assert ("template [[host_name(" in src) == bool(templates[tag])  # comp_write has no template
        assert "ds_lane = thread_index_in_simdgroup" in src
    assert "const constant float* post" in sources["hc_post_NHC4"]  # the decode case's small input
    assert "const constant float* scale" in sources["hc_pre_NHC4_NITER20_TPB4_SPLIT0_NORM0"]
    assert "device float* out" in sources["hc_pre_NHC4_NITER20_TPB1_SPLIT1_NORM1"]  # x, post, comb: one row
    assert "device float* out" in sources["hc_pre_xq_NHC4_NITER20_TPB1_SPLIT1_NORM1"]
    assert "device float* out" in sources["hc_mix_NHC4_POST1"]  # the new state and the partials: one array
    r = gxx_metal_check(sources.values(), tmp_path, "fused_metal")
    assert r.returncode == 0, r.stderr[-6000:]


def test_cuda_instantiations_compile(tmp_path):
    insts = kernels.fused.instantiations()
    r = nvcc_compile(kernels.fused.render_cuda_unit(insts), tmp_path, "fused")
    assert r.returncode == 0, r.stderr[-6000:]
    for kind, template in insts:
        assert f"custom_kernel_ds_{kernels.fused.tag(kind, template)}" in r.stderr  # ptxas built every entry point
    assert "spill" not in r.stderr.replace("0 bytes spill", "")


def test_cuda_check_catches_errors(tmp_path):
    """The nvcc check is not vacuous: a body error fails it."""
    src = kernels.fused.render_cuda_unit([("hc_post", (("NHC", 4),))])
    src = src.replace("const float yv", "const float yv = no_such;//")
    r = nvcc_compile(src, tmp_path, "bad")
    assert r.returncode != 0 and "no_such" in r.stderr


def test_rendered_sources_share_one_body():
    f = kernels.fused
    for kind in f.SPECS:
        m, c = f.render_body(kind, "metal"), f.render_body(kind, "cuda")
        assert m[len(kernels.minify(kernels.METAL_PROLOGUE)):] == c[len(kernels.minify(kernels.CUDA_PROLOGUE)):]
    for backend in ("metal", "cuda"):  # fused.h, each backend's branches only
        header = kernels.render_prelude(backend) + kernels.keep_backend(kernels._read("fused.h"), backend)
        assert f.render_fused_header(backend) == header
    assert "metal::log(w)" not in f.render_fused_header("cuda") and "log1pf" not in f.render_fused_header("metal")
    assert "#define HC_PRE_XQ 1" in f.render_fused_header("cuda", "hc_pre_xq")
    assert "HC_PRE_XQ 1" not in f.render_fused_header("cuda", "hc_pre")


# --- fallback path and validation (CPU) -------------------------------------------------------------------


def test_backend_follows_env(monkeypatch):
    """Without a ``backend`` argument the fused operations run on ``$DS4_MLX_KERNELS``'s backend."""
    S, fn, scale, base = hc_inputs(1, 32)
    y, post, comb = mx.ones((1, 32)), mx.ones((1, 4)), mx.ones((1, 4, 4))
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    assert mx.array_equal(fused.hc_post(S, y, post, comb), hyper.hc_post(S, y, post, comb))
    if not mx.cuda.is_available():
        monkeypatch.setenv("DS4_MLX_KERNELS", "cuda")
        with pytest.raises(RuntimeError, match="DS4_MLX_KERNELS=cuda"):
            fused.hc_post(S, y, post, comb)


def test_hc_fallback_is_the_graph_code(monkeypatch):
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(3, 64, seed=1)
    got, ref = fused.hc_pre(S, fn, scale, base, cfg), hyper.hc_pre(S, fn, scale, base, cfg)
    for g, r in zip(got, ref):
        assert g.shape == r.shape and mx.array_equal(g, r)
    x, post, comb = ref
    y = mx.random.normal((3, 64), key=mx.random.key(2))
    S2 = hyper.hc_post(S, y, post, comb)
    assert mx.array_equal(fused.hc_post(S, y, post, comb), S2)
    norm = mx.random.uniform(0.5, 1.5, (64,), key=mx.random.key(3))
    got = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=norm, quantize=True)
    assert got[4] is None  # the MLX path quantizes nothing
    ref = (S2, *hyper.hc_pre(S2, fn, scale, base, cfg))
    for g, r in zip(got, ref[:1] + (mx.fast.rms_norm(ref[1], norm, cfg.rms_eps),) + ref[2:]):
        assert mx.array_equal(g, r)
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
    with pytest.raises(ValueError, match="norm"):
        fused.hc_pre(S, fn, scale, base, cfg, norm=mx.ones((31,)), backend="cuda")
    with pytest.raises(ValueError, match="post"):
        fused.hc_post_pre(S, mx.ones((2, 32)), mx.ones((2, 3)), comb, fn, scale, base, cfg, backend="cuda")


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
    """Float64 reference of docs/model.md §4.6 steps 4-6 from the frontier layout."""
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
    """A Compressor with random F16 weights and no storage rounding."""
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
    return Compressor(Cfg(), 2, weights, "attn_compressor", hd, ratio, rope)


def decode_rows_fused(comp: Compressor, n: mx.array, backend: str):
    """Decode token by token, emitting rows through fused.compressor_pool on the frontier (the wire-in)."""
    r, hd = comp.ratio, comp.hd
    state, rows = comp.init_state(), []
    for p in range(n.shape[0]):
        kv_cur, sc_cur = comp.project(n[p : p + 1])
        sc_cur = sc_cur + comp.ape[p % r : p % r + 1]
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


def hc_post_inputs(T: int, E: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    y = mx.array(rng.standard_normal((T, E)).astype(np.float32))
    post = mx.array(rng.uniform(0.1, 2.0, (T, 4)).astype(np.float32))
    comb = mx.array(rng.uniform(0.05, 0.5, (T, 4, 4)).astype(np.float32))
    return y, post, comb


def hc_norm_reference(S, fn, scale, base, cfg, norm):
    x, post, comb = hyper.hc_pre(S, fn, scale, base, cfg)
    return mx.fast.rms_norm(x, norm, cfg.rms_eps), post, comb


@needs_gpu
@pytest.mark.parametrize("T,E,tpb,split", [(1, 4096, 1, True), (3, 256, 1, True), (5, 256, 2, False),
                                           (64, 4096, 2, False), (7, 256, 4, False)])
def test_hc_pre_norm_kernel(T, E, tpb, split):
    """hc_pre with the sublayer's input RMSNorm folded in."""
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(T, E, seed=T + E + 1)
    norm = mx.array(np.random.default_rng(T).uniform(0.5, 1.5, E).astype(np.float32))
    ref = on_cpu(hc_norm_reference, S, fn, scale, base, cfg, norm)
    got = fused.hc_pre(S, fn, scale, base, cfg, norm=norm, backend=BACKEND, tpb=tpb, split=split)
    for g, r, tol in zip(got, ref, (2e-5, 1e-5, 1e-5)):
        close(g, r, tol)


@needs_gpu
@pytest.mark.parametrize("T,E,norm", [(1, 4096, True), (1, 4096, False), (3, 256, True), (16, 256, True)])
def test_hc_post_pre_kernel(T, E, norm):
    """HC post inside the mix launch (T <= 8; T = 16 takes the two-launch path) against post then pre."""
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(T, E, seed=T + 7)
    y, post, comb = hc_post_inputs(T, E, seed=T + 8)
    nw = mx.array(np.random.default_rng(T).uniform(0.5, 1.5, E).astype(np.float32)) if norm else None

    def reference(S, y, post, comb):
        S = hyper.hc_post(S, y, post, comb)
        return (S, *(hc_norm_reference(S, fn, scale, base, cfg, nw) if norm else hyper.hc_pre(S, fn, scale, base, cfg)))

    ref = on_cpu(reference, S, y, post, comb)
    got = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=nw, backend=BACKEND)
    np.testing.assert_array_equal(np.array(got[0]), np.array(fused.hc_post(S, y, post, comb, backend=BACKEND)))
    for g, r, tol in zip(got, ref, (1e-5, 2e-5, 1e-5, 1e-5)):
        close(g, r, tol)
    assert got[4] is None  # nothing quantized unless asked


@needs_gpu
@pytest.mark.parametrize("T,E", [(1, 4096), (3, 256), (16, 256)])
def test_hc_post_pre_quantized(T, E):
    """hc_pre_xq: the same outputs as hc_pre, plus n quantized as kernels.quantize_x lays it out: the same
    scales and bytes (a remainder may differ by one where the kernel fuses y - q·d), x̂ within 1/32000 of each
    octet's max|n|. T = 16 takes the prefill path, which quantizes nothing."""
    cfg = HCfg()
    S, fn, scale, base = hc_inputs(T, E, seed=T + 17)
    y, post, comb = hc_post_inputs(T, E, seed=T + 18)
    nw = mx.array(np.random.default_rng(T).uniform(0.5, 1.5, E).astype(np.float32))
    plain = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=nw, backend=BACKEND)
    got = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=True, backend=BACKEND)
    for g, p in zip(got[:4], plain[:4]):
        np.testing.assert_array_equal(np.array(g), np.array(p))
    if T > kernels.fused.HC_PRE_SPLIT_MAX_T:
        assert got[4] is None
        return
    if BACKEND == "metal":  # no integer dot there: f32 x
        assert got[4] is None
        return
    xq, want = np.array(got[4]), np.array(kernels.quantize_x(got[1]))
    assert xq.shape == (T, 5 * E // 8) and xq.dtype == np.float32
    b, wb = xq.view(np.uint8), want.view(np.uint8)
    np.testing.assert_array_equal(xq[:, E // 2 :], want[:, E // 2 :])  # scales
    np.testing.assert_array_equal(b[:, :E], wb[:, :E])  # q
    assert np.abs(b[:, E : 2 * E].view(np.int8).astype(int) - wb[:, E : 2 * E].view(np.int8)).max() <= 1  # r
    n = np.array(got[1])
    xh = np.repeat(xq[:, E // 2 :], 8, axis=1) * (b[:, :E].view(np.int8) + b[:, E : 2 * E].view(np.int8) / 128.0)
    amax = np.repeat(np.abs(n).reshape(T, -1, 8).max(-1), 8, axis=1)
    assert np.all(np.abs(xh - n) <= amax / 32000) and np.abs(n).max() > 0.1


@needs_gpu
def test_hc_pre_cols_feed_the_decode_kernels():
    """The decode step's HC pre (``cols=True``): one output row holds n, post, comb and n quantized, as Cols; they
    equal the arrays of ``cols=False`` bit for bit, and each reader of a Cols (HC post, HC post inside the next
    mix, the matvec, the routed experts' launches) gives exactly what it gives for the arrays."""
    cfg, T, E, F = HCfg(), 1, 256, 256
    S, fn, scale, base = hc_inputs(T, E, seed=41)
    y, post, comb = hc_post_inputs(T, E, seed=42)
    nw = mx.array(np.random.default_rng(43).uniform(0.5, 1.5, E).astype(np.float32))
    quantize = BACKEND != "metal"
    arrs = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=quantize, backend=BACKEND)
    got = fused.hc_post_pre(S, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=quantize, cols=True,
                            backend=BACKEND)  # fmt: skip
    S1, n, p, c, nq = got
    assert all(isinstance(v, kernels.Cols) and v.a is n.a for v in (n, p, c) + ((nq,) if quantize else ()))
    # the new state: columns 0.. of the mix launch's one output row, the partials after it
    assert isinstance(S1, kernels.Cols) and S1.start == 0 and S1.a.shape[1] > 4 * E
    eq = np.testing.assert_array_equal
    eq(np.array(kernels.cols(S1, 4 * E)).reshape(T, 4, E), np.array(arrs[0]))
    for v, a, w in ((n, arrs[1], E), (p, arrs[2], 4), (c, arrs[3], 16)) + (((nq, arrs[4], 5 * E // 8),) * quantize):
        eq(np.array(kernels.cols(v, w)).reshape(a.shape), np.array(a))
    y2 = mx.array(np.random.default_rng(44).standard_normal((T, E)).astype(np.float32))
    eq(np.array(fused.hc_post(S1, y2, p, c, n_hc=4, backend=BACKEND)),
       np.array(fused.hc_post(arrs[0], y2, *arrs[2:4], backend=BACKEND)))
    nxt = [fused.hc_post_pre(ss, y2, pp, cc, fn, scale, base, cfg, cols=True, backend=BACKEND)
           for ss, pp, cc in ((S1, p, c), arrs[0:1] + arrs[2:4])]  # fmt: skip
    for a, b in zip(nxt[0][:4], nxt[1][:4]):
        eq(np.array(a.a), np.array(b.a))  # the next mix's row (state, partials) and HC pre's row
    # the next HC pre alone from S1 (the decode step's first sublayer reads a state as Cols too)
    eq(np.array(fused.hc_pre(S1, fn, scale, base, cfg, norm=nw, backend=BACKEND)[0]),
       np.array(fused.hc_pre(arrs[0], fn, scale, base, cfg, norm=nw, backend=BACKEND)[0]))
    with pytest.raises(ValueError, match="Cols"):
        fused.hc_post(S1, y2, p, arrs[3], n_hc=4, backend=BACKEND)
    with pytest.raises(ValueError, match="n_hc"):
        fused.hc_post(S1, y2, p, c, backend=BACKEND)

    (w,) = expert_weights(QT.Q8_0, (48, E), 1, seed=45)
    eq(np.array(w.matmul(n)), np.array(w.matmul(arrs[1])))  # the matvec reads n where it is
    gate, up = expert_weights(QT.IQ2_XXS, (8, F, E), 2, seed=46)
    (down,) = expert_weights(QT.Q2_K, (8, E, F), 1, seed=47)
    sgu = QuantWeight.stack_rows(expert_weights(QT.Q8_0, (F, E), 2, seed=48))
    (sd,) = expert_weights(QT.Q8_0, (E, F), 1, seed=49)
    ids = mx.array([[3, 0, 6, 1, 7, 2]], dtype=mx.int32)
    rw = mx.array(np.random.default_rng(50).uniform(0.1, 1.0, (1, 6)).astype(np.float32))
    moe = [fused.experts_with_shared(gate, up, down, sgu, sd, xx, ids, rw, 0.02, xq=qq, backend=BACKEND)
           for xx, qq in ((n, nq), (arrs[1], arrs[4]))]  # fmt: skip
    eq(np.array(moe[0]), np.array(moe[1]))
    assert np.abs(np.array(moe[0])).max() > 0


@needs_gpu
@pytest.mark.parametrize("T,E", [(1, 256), (7, 256), (1, 4096), (33, 4096)])
def test_hc_post_kernel(T, E):
    S, *_ = hc_inputs(T, E, seed=T)
    y, post, comb = hc_post_inputs(T, E, seed=T)
    ref = on_cpu(hyper.hc_post, S, y, post, comb)
    got = fused.hc_post(S, y, post, comb, backend=BACKEND)
    close(got, ref, 1e-5)


def comp_write_inputs(R: int, W: int, at: int, seed: int = 0):
    """Random frontier kv/score [R, W] (some NEG rows, as unwritten ones are), new rows and an APE row view."""
    rng = np.random.default_rng(seed)
    kv = rng.standard_normal((R, W)).astype(np.float32)
    score = rng.standard_normal((R, W)).astype(np.float32)
    score[rng.random(R) < 0.3] = NEG
    rows = [rng.standard_normal((1, W)).astype(np.float32) for _ in range(2)]
    ape = mx.array(rng.standard_normal((R, W)).astype(np.float32))[at % R : at % R + 1]  # a row view, as decode passes
    return kv, score, rows, ape, kernel_index(at)


def frontier(kv, score) -> mx.array:
    """A compressor frontier as the kernels take it (``CompressorState.fr``): ``[2, R, W]``, kv then score."""
    return CompressorState.of(mx.array(kv), mx.array(score)).fr


def comp_write_numpy(kv, score, rows, ape, at):
    kv, score = kv.copy(), score.copy()
    kv[at], score[at] = rows[0][0], rows[1][0] + np.array(ape)[0]
    return kv, score


@pytest.mark.parametrize("R,W,at", [(8, 1024, 5), (128, 512, 127), (8, 256, 0)])
def test_comp_write_fallback_vs_numpy(R, W, at):
    kv, score, rows, ape, at_a = comp_write_inputs(R, W, at, seed=R + at)
    got = on_cpu(fused.compressor_write, frontier(kv, score), *map(mx.array, rows), ape, at_a)
    for g, r in zip(got, comp_write_numpy(kv, score, rows, ape, at)):
        np.testing.assert_array_equal(np.array(g), r)


def test_comp_write_validation():
    kv, score, rows, ape, at = comp_write_inputs(8, 256, 1)
    args = [frontier(kv, score), *map(mx.array, rows), ape]
    with pytest.raises(ValueError, match="frontier must be"):
        fused.compressor_write(mx.array(kv), *args[1:], at)
    with pytest.raises(ValueError, match="score_row"):
        fused.compressor_write(*args[:2], mx.zeros((1, 128)), ape, at)
    with pytest.raises(ValueError, match="at must be"):
        fused.compressor_write(*args, mx.array([1, 2], dtype=mx.int32))


def test_decode_index_inputs_are_not_small_allocations():
    """A kernel's index input is int32 [8]: MLX-CUDA's allocations of up to 8 bytes read like host memory,
    where a 512 KB frontier write reading its row index took 18 µs instead of 2.3 on the H200."""
    at = kernel_index(5)
    assert at.shape == (8,) and at.dtype == mx.int32 and np.array(at).tolist() == [5] + [0] * 7
    io = make_compressor(4, 64).decode_inputs(6)
    assert io["at"].nbytes > 8 and int(io["at"][0]) == 6 % 4 + 4


@needs_gpu
@pytest.mark.parametrize("R,W,at", [(8, 1024, 5), (128, 512, 127), (8, 256, 0), (128, 1024, 64)])
def test_comp_write_kernel(R, W, at):
    kv, score, rows, ape, at_a = comp_write_inputs(R, W, at, seed=R + at)
    got = fused.compressor_write(frontier(kv, score), *map(mx.array, rows), ape, at_a, backend=BACKEND)
    for g, r in zip(got, comp_write_numpy(kv, score, rows, ape, at)):
        np.testing.assert_array_equal(np.array(g), r)


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


def emit_inputs(ratio: int, hd: int, at: int, seed: int):
    """One decode frontier [coff*r, coff*hd] (previous-window rows unwritten on the first window), the completing
    token's rows, its APE row, its frontier row ``at`` and the pool's norm and RoPE row."""
    kv, sc, norm, C, S, rope, starts = pool_inputs(1, ratio, hd, seed=seed, first=seed % 2 == 0)
    _, _, rows, ape, at_a = comp_write_inputs(kv.shape[1], kv.shape[2], at, seed=seed)
    return kv[0], sc[0], [mx.array(r) for r in rows], ape, at_a, norm, C, S, rope, starts


def emit_numpy(kv, sc, rows, ape, at, norm, rope, starts, ratio):
    """compressor_emit by its definition: write the token's rows, pool, then shift/empty the frontier."""
    kv, sc = comp_write_numpy(np.array(kv), np.array(sc), [np.array(r) for r in rows], ape, at)
    row = pool_numpy(kv[None], sc[None], norm, rope, starts, ratio)
    nkv, nsc = np.zeros_like(kv), np.full_like(sc, NEG)
    if ratio == 4:
        nkv[:ratio], nsc[:ratio] = kv[ratio:], sc[ratio:]
    return row, nkv, nsc


@pytest.mark.parametrize("ratio,hd,at", [(4, 128, 7), (16, 64, 15), (128, 64, 127)])
def test_emit_fallback_vs_numpy(ratio, hd, at):
    kv, sc, rows, ape, at_a, norm, C, S, rope, starts = emit_inputs(ratio, hd, at, seed=ratio + hd)
    got = on_cpu(fused.compressor_emit, frontier(kv, sc), *rows, ape, at_a, norm, C, S, 1e-6,
                 lanes=2 if ratio == 4 else 1, neg=NEG, backend="fallback")  # fmt: skip
    ref = emit_numpy(kv, sc, rows, ape, at, norm, rope, starts, ratio)
    close(got[0], ref[0], 2e-5)
    for g, r in zip(got[1], ref[1:]):
        np.testing.assert_array_equal(np.array(g), r)


def test_emit_validation():
    kv, sc, rows, ape, at_a, norm, C, S, *_ = emit_inputs(4, 128, 7, seed=1)
    fr = frontier(kv, sc)
    with pytest.raises(ValueError, match="lanes"):
        fused.compressor_emit(fr, *rows, ape, at_a, norm, C, S, 1e-6, lanes=3, neg=NEG, backend="cuda")
    with pytest.raises(ValueError, match="frontier must be"):
        fused.compressor_emit(mx.array(kv), *rows, ape, at_a, norm, C, S, 1e-6, lanes=2, neg=NEG, backend="cuda")
    with pytest.raises(ValueError, match="score_row"):
        fused.compressor_emit(fr, rows[0], rows[1][:, :8], ape, at_a, norm, C, S, 1e-6, lanes=2, neg=NEG,
                              backend="cuda")  # fmt: skip
    with pytest.raises(ValueError, match="at must be"):
        fused.compressor_emit(fr, *rows, ape, mx.array([1, 2], dtype=mx.int32), norm, C, S, 1e-6, lanes=2,
                              neg=NEG, backend="cuda")  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("ratio,hd,at", [(4, 512, 7), (4, 128, 4), (128, 512, 127), (16, 128, 15)])
def test_emit_kernel(ratio, hd, at):
    kv, sc, rows, ape, at_a, norm, C, S, rope, starts = emit_inputs(ratio, hd, at, seed=ratio + hd + at)
    lanes = 2 if ratio == 4 else 1
    got = fused.compressor_emit(frontier(kv, sc), *rows, ape, at_a, norm, C, S, 1e-6, lanes=lanes, neg=NEG,
                                backend=BACKEND)  # fmt: skip
    ref = emit_numpy(kv, sc, rows, ape, at, norm, rope, starts, ratio)
    close(got[0], ref[0], 2e-5)
    assert got[1].shape == (2, *kv.shape)
    for g, r in zip(got[1], ref[1:]):  # copies: exact
        np.testing.assert_array_equal(np.array(g), r)


ROUNDINGS = {  # name: (rounding, row dtype, head dim) as the model uses them (numerics.kv_rounding, ...)
    "kv_fp8_f16": (RowRounding(fp8_dims=448, f16=True), mx.float16, 512),
    "kv_fp8": (RowRounding(fp8_dims=448), mx.float32, 512),
    "kv_f16_only": (RowRounding(f16=True), mx.float16, 512),
    "index_qat_f16": (RowRounding(qat=True, f16=True), mx.float32, 128),
    "index_qat": (RowRounding(qat=True), mx.float32, 128),
}


@needs_gpu
@pytest.mark.parametrize("emit", [False, True])
@pytest.mark.parametrize("name", list(ROUNDINGS))
def test_pool_rounding_kernel(name, emit):
    """ds4's storage rounding applied inside comp_pool equals MLX's rounding of the kernel's unrounded row:
    FP8 and f16 exactly, the QAT up to rare FP4 boundary steps (:func:`assert_fp4_steps`)."""
    rounding, dtype, hd = ROUNDINGS[name]
    if emit:
        kv, sc, rows, ape, at_a, norm, C, S, _, _ = emit_inputs(4, hd, 7, seed=hd + 1)

        def run(**kw):
            return fused.compressor_emit(frontier(kv, sc), *rows, ape, at_a, norm, C, S, 1e-6, lanes=2, neg=NEG,
                                         backend=BACKEND, **kw)[0]  # fmt: skip
    else:
        kv, sc, norm, C, S, _, _ = pool_inputs(3, 4, hd, seed=hd)

        def run(**kw):
            return fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=2, backend=BACKEND, **kw)

    plain = run()
    got = run(rounding=rounding, out_dtype=dtype)
    assert got.dtype == dtype and got.shape == plain.shape
    ref = np.array(on_cpu(rounding, plain), np.float64)
    got = np.array(got.astype(mx.float32), np.float64)
    assert np.abs(ref - np.array(plain)).max() > 0  # the rounding does something
    if rounding.qat:
        assert_fp4_steps(got, ref)
    else:
        np.testing.assert_array_equal(got, ref)


def test_pool_rounding_validation():
    kv, sc, norm, C, S, _, _ = pool_inputs(1, 4, 128, seed=0)
    with pytest.raises(ValueError, match="f16-exact"):
        fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=2, out_dtype=mx.float16, backend="cuda")
    with pytest.raises(ValueError, match="out_dtype"):
        fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=2, rounding=RowRounding(f16=True),
                              out_dtype=mx.bfloat16, backend="cuda")  # fmt: skip
    # the kernel rounds only where it can (QAT: a 128-wide row); the MLX path rounds and casts the pooled rows
    kv, sc, norm, C, S, _, _ = pool_inputs(2, 4, 64, seed=1)
    r = RowRounding(qat=True, f16=True)
    assert kernels.fused._rounding_template(r, 64) is None and kernels.fused._rounding_template(r, 128) is not None
    r = RowRounding(fp8_dims=64, f16=True)
    got = fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=2, rounding=r, out_dtype=mx.float16, backend="fallback")
    plain = fused.compressor_pool(kv, sc, norm, C, S, 1e-6, lanes=2, backend="fallback")
    assert got.dtype == mx.float16
    np.testing.assert_array_equal(np.array(got), np.array(r(plain).astype(mx.float16)))


# --- one-token attention ----------------------------------------------------------------------------------


def attn_inputs(H: int, D: int, n_raw: int, cap: int, n_comp: int, k: int, kv16: bool, seed: int = 0):
    """Random q, raw/comp rows (f16-exact when kv16), selected rows, sinks and a RoPE row; keys at ~unit norm
    so scores spread over several units (a non-trivial softmax)."""
    rng = np.random.default_rng(seed)
    dt = np.float16 if kv16 else np.float32
    q = rng.standard_normal((1, H, D)).astype(np.float32) * 1.5
    raw = rng.standard_normal((n_raw, D)).astype(dt)
    comp = rng.standard_normal((cap, D)).astype(dt) if cap else None
    idx = rng.choice(n_comp, size=(1, k), replace=False).astype(np.int32) if k else None
    sinks = rng.standard_normal(H).astype(np.float32)
    rope = Rope(n_rot=64, base=10000.0)  # RoPE on the last 64 dims, as in the model
    C, S = rope.tables([int(rng.integers(0, 5000))], D)
    return q, raw, comp, idx, sinks, C, S


def attn_numpy(q, raw, comp, idx, n_comp, sinks, C, S, scale):
    """float64 reference: softmax over [sink, raw rows, comp rows], sink in the denominator only; inverse RoPE."""
    q, raw = np.asarray(q, np.float64)[0], np.asarray(raw, np.float64)
    keys = raw
    if comp is not None:
        comp = np.asarray(comp, np.float64)
        keys = np.concatenate([raw, comp[np.asarray(idx)[0]] if idx is not None else comp[:n_comp]])
    s = q @ keys.T * scale  # [H, N]
    logits = np.concatenate([np.asarray(sinks, np.float64)[:, None], s], axis=1)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    o = p[:, 1:] @ keys  # [H, D]
    C, S = np.asarray(C, np.float64), np.asarray(S, np.float64)
    swapped = o.reshape(o.shape[0], -1, 2)[..., ::-1].reshape(o.shape)
    return (o * C - swapped * S)[None]


ATTN_CASES = [  # H, D, n_raw, cap, n_comp, k, kv16
    (4, 128, 1, 0, 0, 0, True),  # first token: raw only
    (4, 128, 16, 0, 0, 0, False),
    (4, 128, 16, 32, 5, 0, True),  # dense compressed rows, most of the buffer not visible yet
    (4, 128, 9, 24, 24, 0, False),
    (4, 128, 16, 40, 30, 4, True),  # the indexer's selection
    (64, 512, 128, 1024, 512, 0, True),  # V4 Flash: full window + 512 dense rows
    (64, 512, 128, 2048, 700, 512, True),  # V4 Flash: top-512 of 700 rows
    (64, 512, 100, 64, 17, 0, False),
]


@pytest.mark.parametrize("case", ATTN_CASES[:5] + ATTN_CASES[-1:])
def test_attend_one_fallback_vs_numpy(case):
    H, D, n_raw, cap, n_comp, k, kv16 = case
    q, raw, comp, idx, sinks, C, S = attn_inputs(H, D, n_raw, cap, n_comp, k, kv16, seed=n_raw + cap)
    scale = 1.0 / math.sqrt(D)
    counts = kernel_counts(n_raw, k or n_comp)
    got = on_cpu(fused.attend_one, mx.array(q), mx.array(raw), None if comp is None else mx.array(comp),
                 None if idx is None else mx.array(idx), counts, mx.array(sinks), C, S, scale, backend="fallback")
    close(got, attn_numpy(q, raw, comp, idx, n_comp, sinks, C, S, scale), 2e-6)


def test_attend_one_validation():
    q, raw, comp, idx, sinks, C, S = attn_inputs(4, 128, 16, 40, 30, 4, True)
    q, raw, comp, idx, sinks = map(mx.array, (q, raw, comp, idx, sinks))
    counts = kernel_counts(16, 4)
    with pytest.raises(ValueError, match="q must be"):
        fused.attend_one(q[0], raw, comp, idx, counts, sinks, C, S, 0.1)
    with pytest.raises(ValueError, match="comp must be"):
        fused.attend_one(q, raw, comp.astype(mx.float32), idx, counts, sinks, C, S, 0.1)
    with pytest.raises(ValueError, match="idx must be"):
        fused.attend_one(q, raw, None, idx, counts, sinks, C, S, 0.1)
    with pytest.raises(ValueError, match="counts must be"):
        fused.attend_one(q, raw, comp, idx, mx.array([16, 4], dtype=mx.int32), sinks, C, S, 0.1)
    with pytest.raises(ValueError, match="sinks"):
        fused.attend_one(q, raw, comp, idx, counts, sinks[:3], C, S, 0.1)
    with pytest.raises(ValueError, match="nsg=3"):
        fused.attend_one(q, raw, comp, idx, counts, sinks, C, S, 0.1, nsg=3)
    q5, raw5 = mx.zeros((1, 4, 512)), mx.zeros((4, 512), mx.float16)  # 17 x 2 KB: over Metal's 32 KB, not CUDA's 48
    with pytest.raises(ValueError, match="metal threadgroup"):
        fused.attend_one(q5, raw5, None, None, counts, sinks, mx.ones((1, 512)), mx.zeros((1, 512)), 0.1, nsg=16,
                         backend="metal")  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("case", ATTN_CASES)
def test_attend_one_kernel(case):
    H, D, n_raw, cap, n_comp, k, kv16 = case
    q, raw, comp, idx, sinks, C, S = attn_inputs(H, D, n_raw, cap, n_comp, k, kv16, seed=H + n_raw + cap + k)
    args = (mx.array(q), mx.array(raw), None if comp is None else mx.array(comp), None if idx is None else mx.array(idx),
            kernel_counts(n_raw, k or n_comp), mx.array(sinks), C, S, 1.0 / math.sqrt(D))  # fmt: skip
    ref = on_cpu(fused.attend_one, *args, backend="fallback")
    got = fused.attend_one(*args, backend=BACKEND)
    close(got, ref, 2e-5)
    close(got, attn_numpy(q, raw, comp, idx, n_comp, sinks, C, S, args[-1]), 2e-5)


@needs_gpu
@pytest.mark.parametrize("nsg", [1, 4, 16])
def test_attend_one_kernel_simdgroups(nsg):
    """Other simdgroup counts a head (the keys dealt out nsg apart, merged in the threadgroup): the same result."""
    case = ATTN_CASES[6] if BACKEND != "sim" else ATTN_CASES[4]  # V4 Flash's top-512 (the sim: a small one)
    H, D, n_raw, cap, n_comp, k, kv16 = case
    q, raw, comp, idx, sinks, C, S = attn_inputs(H, D, n_raw, cap, n_comp, k, kv16, seed=nsg)
    args = (mx.array(q), mx.array(raw), mx.array(comp), mx.array(idx), kernel_counts(n_raw, k), mx.array(sinks),
            C, S, 1.0 / math.sqrt(D))  # fmt: skip
    want = attn_numpy(q, raw, comp, idx, n_comp, sinks, C, S, args[-1])
    close(fused.attend_one(*args, nsg=nsg, backend=BACKEND), want, 2e-5)


# --- indexer top-k ----------------------------------------------------------------------------------------


def topk_numpy(scores: np.ndarray, n: int, k: int) -> np.ndarray:
    """ds4's order: score descending, then row ascending; the k first rows, returned ascending."""
    s = scores[0, :n].astype(np.float64)
    order = sorted(range(n), key=lambda c: (-s[c], c))
    return np.sort(np.array(order[:k]))[None]


def topk_scores(N: int, n: int, k: int, ties: bool, seed: int) -> np.ndarray:
    """Random scores (negative and positive); ``ties`` draws them from a few values, zeros of both signs
    included, so the k-th value is shared by rows on both sides of the cut."""
    rng = np.random.default_rng(seed)
    s = rng.standard_normal((1, N)).astype(np.float32) * 3
    if ties:
        s = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0], np.float32), size=(1, N))
    s[0, n:] = 1e9  # rows beyond n are not visible, whatever they hold
    return s


TOPK_CASES = [(40, 30, 4, False), (40, 30, 4, True), (64, 13, 12, True), (2048, 700, 512, False),
              (2048, 700, 512, True), (4096, 4000, 512, False), (20000, 9000, 512, True), (16, 16, 15, False)]


@pytest.mark.parametrize("N,n,k,ties", TOPK_CASES)
def test_top_k_rows_fallback_vs_numpy(N, n, k, ties):
    s = topk_scores(N, n, k, ties, seed=N + n)
    got = on_cpu(fused.top_k_rows, mx.array(s), kernel_counts(n, k), k, backend="fallback")
    assert got.dtype == mx.int32
    np.testing.assert_array_equal(np.array(got), topk_numpy(s, n, k))


def chunk_topk_numpy(scores: np.ndarray, first: int, ratio: int, k: int) -> np.ndarray:
    """Per query r: topk_numpy of its first (first + r) // ratio rows, or 0 .. k-1 where it sees at most k."""
    rows = []
    for r in range(scores.shape[0]):
        n = min((first + r) // ratio, scores.shape[1])
        rows.append(topk_numpy(scores[r : r + 1], n, k)[0] if n > k else np.arange(k))
    return np.stack(rows)


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("backend", ["fallback", pytest.param(BACKEND, marks=needs_gpu)])
def test_chunk_top_k_matches_each_querys_choice(ties, backend):
    """A chunk's queries in one launch: each row its own causal count of visible rows (some at most k, which list
    0 .. k-1), the k highest of them ties to the lower row, as the one-token choice orders them."""
    k, ratio, R, N = 12, 4, 12, 20
    first = k * ratio - 3  # row r sees (45 + r) // 4 of the 20 rows: 11, 11, 11, 12 (listed whole), then 12 .. 14
    rng = np.random.default_rng(7 + ties)
    s = rng.standard_normal((R, N)).astype(np.float32)
    if ties:
        s = rng.choice(np.array([-1.5, -0.0, 0.0, 0.25, 2.0], np.float32), size=(R, N))
    want = chunk_topk_numpy(s, first, ratio, k)
    got = fused.chunk_top_k(mx.array(s), first, ratio, k, backend=backend)
    assert got.dtype == mx.int32 and got.shape == (R, k)
    np.testing.assert_array_equal(np.array(got), want)


def index_scores_inputs(H: int, D: int, N: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    iq = rng.standard_normal((1, H, D)).astype(np.float32)
    w = rng.standard_normal((1, H)).astype(np.float32)
    keys = rng.standard_normal((N, D)).astype(np.float32)
    return iq, w, keys


def index_scores_numpy(iq, w, keys, scale):
    dots = np.einsum("hd,nd->hn", iq[0].astype(np.float64), keys.astype(np.float64))
    return (np.maximum(dots, 0.0) * (w[0].astype(np.float64) * scale)[:, None]).sum(axis=0)[None]


@pytest.mark.parametrize("H,D,N", [(64, 128, 40), (16, 128, 9)])
def test_index_scores_fallback_vs_numpy(H, D, N):
    iq, w, keys = index_scores_inputs(H, D, N, seed=H + N)
    scale = 1.0 / math.sqrt(H * D)
    got = on_cpu(fused.index_scores, mx.array(iq), mx.array(w), mx.array(keys), kernel_counts(N, 4), scale)
    np.testing.assert_allclose(np.array(got), index_scores_numpy(iq, w, keys, scale), rtol=1e-5, atol=1e-6)


def test_index_scores_validation():
    iq, w, keys = map(mx.array, index_scores_inputs(16, 128, 8))
    counts = kernel_counts(8, 4)
    with pytest.raises(ValueError, match="iq must be"):
        fused.index_scores(iq[0], w, keys, counts, 1.0)
    with pytest.raises(ValueError, match="keys"):
        fused.index_scores(iq, w, keys[:, :64], counts, 1.0)
    with pytest.raises(ValueError, match="counts must be"):
        fused.index_scores(iq, w, keys, mx.array([8, 4]), 1.0)


@needs_gpu
@pytest.mark.parametrize("H,D,N,n", [(64, 128, 512, 300), (16, 128, 40, 33), (64, 128, 300000, 1000),
                                     pytest.param(64, 128, 4096, 4096, marks=gpu_only),
                                     pytest.param(64, 128, 300000, 70000, marks=gpu_only)])
def test_index_scores_kernel(H, D, N, n):
    """The first n of N rows against the fallback (on the CPU device); 0 past them."""
    iq, w, keys = index_scores_inputs(H, D, N, seed=N + n)
    scale = 1.0 / math.sqrt(H * D)
    ref = on_cpu(index_scores_reference, mx.array(iq), mx.array(w), mx.array(keys), scale)
    got = np.array(fused.index_scores(mx.array(iq), mx.array(w), mx.array(keys), kernel_counts(n, 4), scale,
                                      backend=BACKEND))  # fmt: skip
    close(got[:, :n], np.array(ref)[:, :n], 1e-5)
    assert not got[:, n:].any()


def test_top_k_rows_validation():
    with pytest.raises(ValueError, match="scores must be"):
        fused.top_k_rows(mx.zeros((2, 8)), kernel_counts(8, 2), 2)
    with pytest.raises(ValueError, match="scores must be"):
        kernels.fused.top_k_rows(mx.zeros((8,)), kernel_counts(8, 2), 2, backend="fallback")
    with pytest.raises(ValueError, match="counts must be"):
        fused.top_k_rows(mx.zeros((1, 8)), mx.array([8, 2]), 2)


@needs_gpu
@pytest.mark.parametrize("N,n,k,ties", TOPK_CASES)
def test_top_k_rows_kernel(N, n, k, ties):
    s = topk_scores(N, n, k, ties, seed=N + n + 1)
    got = fused.top_k_rows(mx.array(s), kernel_counts(n, k), k, backend=BACKEND)
    np.testing.assert_array_equal(np.array(got), topk_numpy(s, n, k))


# --- query heads and KV row -------------------------------------------------------------------------------


def qkv_inputs(T: int, H: int, D: int, seed: int = 0):
    """Random projections at a few units (the FP8 scale then varies per 64-block), norm weight, RoPE tables."""
    rng = np.random.default_rng(seed)
    qb = mx.array(rng.standard_normal((T, H * D)).astype(np.float32) * 2)
    kvb = mx.array((rng.standard_normal((T, D)) * rng.uniform(0.01, 30, (1, D))).astype(np.float32))
    norm = mx.array(rng.uniform(0.2, 3.0, D).astype(np.float32))
    C, S = Rope(n_rot=64, base=10000.0).tables(1000 + np.arange(T) * 7, D)
    return qb, kvb, norm, C, S


def fp8_codes(x: np.ndarray, nope: int) -> np.ndarray:
    """Per element of the FP8 dims: the value in units of its block's scale (an integer-spaced E4M3 code)."""
    xb = x[..., :nope].reshape(*x.shape[:-1], -1, 64)
    amax = np.maximum(np.abs(xb).max(axis=-1, keepdims=True), 1e-4)
    return xb / 2.0 ** np.ceil(np.log2(amax / 448))


@pytest.mark.parametrize("nope,f16", [(448, True), (0, False)])
def test_qkv_rows_fallback_is_the_graph_code(nope, f16):
    from ds4_mlx.model.rope import apply_rope
    from ds4_mlx.numerics import fp8_e4m3_round_trip

    qb, kvb, norm, C, S = qkv_inputs(3, 2, 512)
    q, kv = fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, 2, nope_fp8=nope, f16r=f16, backend="fallback")
    ref_kv = apply_rope(mx.fast.rms_norm(kvb, norm, 1e-6), C, S)
    if nope:
        ref_kv = fp8_e4m3_round_trip(ref_kv, nope)
    ref_kv = ref_kv.astype(mx.float16).astype(mx.float32) if f16 else ref_kv
    np.testing.assert_array_equal(np.array(kv), np.array(ref_kv))
    ref_q = apply_rope(mx.fast.rms_norm(qb.reshape(3, 2, 512), None, 1e-6), C[:, None], S[:, None])
    np.testing.assert_array_equal(np.array(q), np.array(ref_q))


def test_qkv_rows_validation():
    qb, kvb, norm, C, S = qkv_inputs(1, 2, 128)
    with pytest.raises(ValueError, match="qb"):
        fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, 3)
    with pytest.raises(ValueError, match="nope_fp8"):
        fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, 2, nope_fp8=100)


@needs_gpu
@pytest.mark.parametrize("T,H,D,nope,f16", [(1, 64, 512, 448, True), (1, 64, 512, 0, False), (5, 4, 128, 64, True),
                                            (3, 4, 128, 0, True), (17, 64, 512, 448, True)])
def test_qkv_rows_kernel(T, H, D, nope, f16):
    """q matches to f32 rounding. The KV row goes through FP8, where a last-bit difference in the norm or RoPE
    can move a value across a rounding boundary: all but a few elements must agree exactly (after f16), and
    those few by at most one E4M3 code step."""
    qb, kvb, norm, C, S = qkv_inputs(T, H, D, seed=T + H + nope)
    ref_q, ref_kv = on_cpu(fused.qkv_rows, qb, kvb, norm, C, S, 1e-6, H, nope_fp8=nope, f16r=f16, backend="fallback")
    q, kv = fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, H, nope_fp8=nope, f16r=f16, backend=BACKEND)
    close(q, ref_q, 2e-6)
    kv, ref_kv = np.array(kv, np.float64), np.array(ref_kv, np.float64)
    rope_part = slice(nope, D)
    close(kv[:, rope_part], ref_kv[:, rope_part], 2e-3 if f16 else 2e-6)  # f16 rounding can flip one ulp
    if nope:
        got, want = fp8_codes(kv, nope), fp8_codes(ref_kv, nope)
        diff = np.abs(got - want)
        assert (diff > 0).mean() < 0.01, f"{(diff > 0).mean():.3%} of FP8 values differ"
        assert np.all(diff <= np.maximum(np.abs(want) / 8, 2**-9) * 1.01), "an FP8 value moved by more than one step"


@needs_gpu
def test_qkv_rows_reads_a_products_f16_output():
    """qb as the dense product leaves it (Scaled16): the kernel scales it back exactly, so q equals q from the same
    values given as float32, bit for bit; and the fallback reads it too."""
    qb, kvb, norm, C, S = qkv_inputs(9, 4, 128, seed=11)
    scaled = kernels.Scaled16.of(qb)
    for backend in (BACKEND, "fallback"):
        q16, kv16 = fused.qkv_rows(scaled, kvb, norm, C, S, 1e-6, 4, f16r=True, backend=backend)
        q32, kv32 = fused.qkv_rows(scaled.values(), kvb, norm, C, S, 1e-6, 4, f16r=True, backend=backend)
        np.testing.assert_array_equal(np.array(q16), np.array(q32))
        np.testing.assert_array_equal(np.array(kv16), np.array(kv32))
    with pytest.raises(ValueError, match="qb"):
        fused.qkv_rows(scaled.a, kvb, norm, C, S, 1e-6, 4, backend=BACKEND)  # f16 without the scale's mark


def test_qkv_rows_window_fallback():
    """The window mode of the fallback: the kept raw rows, then the new row, as the cache dtype."""
    qb, kvb, norm, C, S = qkv_inputs(1, 4, 128, seed=3)
    raw = mx.array(np.random.default_rng(3).standard_normal((9, 128)).astype(np.float16))
    q, kv = on_cpu(fused.qkv_rows, qb, kvb, norm, C, S, 1e-6, 4, f16r=True)
    q2, win = on_cpu(fused.qkv_rows, qb, kvb, norm, C, S, 1e-6, 4, f16r=True, window=(raw, 7, mx.float16))
    assert win.dtype == mx.float16 and win.shape == (8, 128) and mx.array_equal(q, q2)
    np.testing.assert_array_equal(np.array(win), np.concatenate([np.array(raw)[2:], np.array(kv).astype(np.float16)]))
    with pytest.raises(ValueError, match="window needs"):
        fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, 4, window=(raw, 10, mx.float16), backend="cuda")


@needs_gpu
@pytest.mark.parametrize("n_raw,keep,f16", [(127, 127, True), (128, 127, True), (5, 5, True), (0, 0, True),
                                            (20, 20, False)])
def test_qkv_rows_window_kernel(n_raw, keep, f16):
    H, D = 64, 512
    qb, kvb, norm, C, S = qkv_inputs(1, H, D, seed=n_raw)
    dtype = mx.float16 if f16 else mx.float32
    raw = mx.array(np.random.default_rng(n_raw).standard_normal((n_raw, D)).astype(np.float32)).astype(dtype)
    kw = dict(nope_fp8=0, f16r=f16, window=(raw, keep, dtype))
    ref_q, ref_w = on_cpu(fused.qkv_rows, qb, kvb, norm, C, S, 1e-6, H, backend="fallback", **kw)
    q, win = fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, H, backend=BACKEND, **kw)
    assert win.dtype == dtype and win.shape == (keep + 1, D)
    close(q, ref_q, 2e-6)
    np.testing.assert_array_equal(np.array(win[:keep]), np.array(ref_w[:keep]))  # copied rows: exact
    close(np.array(win[keep:]), np.array(ref_w[keep:]), 2e-3 if f16 else 2e-6)


# --- MoE router -------------------------------------------------------------------------------------------


def route_inputs(T: int, NE: int, ties: bool, seed: int = 0):
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((T, NE)).astype(np.float32) * 4  # both softplus branches and the x > 20 cut
    logits[:, :3] = [25.0, -25.0, 21.0]
    bias = rng.standard_normal(NE).astype(np.float32) * 0.5
    if ties:  # few distinct logits, no bias: equal scores, so the lower-id rule decides
        logits, bias = rng.choice(np.array([-1.0, 0.5, 2.0], np.float32), size=(T, NE)), None
    return mx.array(logits), None if bias is None else mx.array(bias)


def test_moe_route_validation():
    logits, bias = route_inputs(2, 16, False)
    with pytest.raises(ValueError, match="k must be"):
        fused.moe_route(logits, bias, 17, 1.5, True)
    with pytest.raises(ValueError, match="bias"):
        fused.moe_route(logits, bias[:8], 6, 1.5, True)
    sel, w = fused.moe_route(logits, bias, 6, 1.5, True, backend="fallback")
    assert sel.shape == w.shape == (2, 6) and sel.dtype == mx.int32


@needs_gpu
@pytest.mark.parametrize("T,NE,k,norm,ties", [(1, 256, 6, True, False), (1, 256, 6, True, True),
                                              (7, 16, 6, False, False), (3, 16, 6, True, True),
                                              (65, 256, 6, True, False), (2, 40, 8, True, False)])
def test_moe_route_kernel(T, NE, k, norm, ties):
    from ds4_mlx.model.ops import route_top_k

    logits, bias = route_inputs(T, NE, ties, seed=T + NE)
    ref_sel, ref_w = on_cpu(route_top_k, logits, bias, k, 1.5, norm)
    sel, w = fused.moe_route(logits, bias, k, 1.5, norm, backend=BACKEND)
    np.testing.assert_array_equal(np.array(sel), np.array(ref_sel))
    close(w, ref_w, 2e-6)
    route, none = fused.moe_route(logits, bias, k, 1.5, norm, packed=True, backend=BACKEND)  # one output array
    assert none is None and route.shape == (T, 2 * k) and route.dtype == mx.int32
    for a, b in zip(kernels.fused.unpack_route(route), (sel, w)):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@needs_gpu
def test_experts_read_the_packed_route():
    """The routed experts' two launches read moe_route's packed row (ids, then the weights' bits) as they read
    the two arrays, bit for bit; the weights in the row are used (doubling them changes the result)."""
    E, F, NE, k = 256, 256, 8, 6
    logits, bias = route_inputs(1, NE, False, seed=5)
    route, _ = fused.moe_route(logits, bias, k, 1.5, True, packed=True, backend=BACKEND)
    sel, w = kernels.fused.unpack_route(route)
    gate, up = expert_weights(QT.IQ2_XXS, (NE, F, E), 2, seed=51)
    (down,) = expert_weights(QT.Q2_K, (NE, E, F), 1, seed=52)
    sgu = QuantWeight.stack_rows(expert_weights(QT.Q8_0, (F, E), 2, seed=53))
    (sd,) = expert_weights(QT.Q8_0, (E, F), 1, seed=54)
    x = mx.array(np.random.default_rng(55).standard_normal((1, E)).astype(np.float32))

    def moe(ids, rw):
        return np.array(fused.experts_with_shared(gate, up, down, sgu, sd, x, ids, rw, 0.02, backend=BACKEND))

    got, want = moe(route, None), moe(sel, w)
    np.testing.assert_array_equal(got, want)
    doubled = mx.concatenate([sel, (w * 2).view(mx.int32)], axis=1)
    assert np.abs(moe(doubled, None) - got).max() > 1e-3 * np.abs(got).max()
    with pytest.raises(ValueError, match="packed"):
        kernels.mv(down, x, BACKEND, ids=route, k_slots=k, epi=kernels.MV_SUM, aux=x, route_packed=True)


# --- indexer query heads ----------------------------------------------------------------------------------


def test_index_query_fallback_is_the_graph_code():
    from ds4_mlx.model.rope import apply_rope
    from ds4_mlx.numerics import indexer_qat

    rng = np.random.default_rng(3)
    qb = mx.array(rng.standard_normal((2, 4 * 128)).astype(np.float32))
    C, S = Rope(n_rot=64, base=10000.0).tables([5, 900], 128)
    ref = apply_rope(qb.reshape(2, 4, 128), C[:, None], S[:, None])
    np.testing.assert_array_equal(np.array(fused.index_query(qb, C, S, 4, False, backend="fallback")), np.array(ref))
    got = fused.index_query(qb, C, S, 4, True, backend="fallback")
    np.testing.assert_array_equal(np.array(got), np.array(indexer_qat(ref)))
    with pytest.raises(ValueError, match="qb"):
        fused.index_query(qb, C, S, 3, True)


@needs_gpu
@pytest.mark.parametrize("T,H,qat", [(1, 64, True), (1, 64, False), (5, 16, True), (33, 64, True)])
def test_index_query_kernel(T, H, qat):
    """RoPE alone matches to f32 rounding. With QAT the Hadamard sums in another order than the reference
    matmul, so a value on an FP4 rounding boundary may land one step away: rare, and never further."""
    rng = np.random.default_rng(T + H)
    qb = mx.array((rng.standard_normal((T, H * 128)) * rng.uniform(0.1, 10, (1, H * 128))).astype(np.float32))
    C, S = Rope(n_rot=64, base=160000.0, freq_scale=1 / 16, yarn=True, corr_low=15.0, corr_high=25.0).tables(
        300 + np.arange(T) * 3, 128)  # fmt: skip
    ref = np.array(on_cpu(fused.index_query, qb, C, S, H, qat, backend="fallback"), np.float64)
    got = np.array(fused.index_query(qb, C, S, H, qat, backend=BACKEND), np.float64)
    if not qat:
        close(got, ref, 2e-6)
        return
    assert_fp4_steps(got, ref)


def assert_fp4_steps(got: np.ndarray, ref: np.ndarray) -> None:
    """FP4 round trips (blocks of 32) that agree but for rare values one FP4 step apart: a Hadamard summed in
    another order than the reference's may put a value on the other side of a rounding boundary."""
    blocks = ref.reshape(-1, 32)
    scale = 2.0 ** np.ceil(np.log2(np.maximum(np.abs(blocks).max(axis=-1, keepdims=True), 1e-30) / 6))
    g, r = got.reshape(blocks.shape) / scale, blocks / scale  # FP4 codes: multiples of 0.5 / 1 / 2
    diff = np.abs(g - r)
    assert (diff > 0).mean() < 0.01, f"{(diff > 0).mean():.3%} of FP4 values differ"
    assert np.all(diff <= np.where(np.abs(r) < 2, 0.5, np.where(np.abs(r) < 4, 1.0, 2.0)) * 1.01)


# --- MoE experts: matvec epilogues (SwiGLU of gate and up; sum of a token's experts) ------------------------


def expert_weights(qt: QT, shape: tuple, n: int, seed: int) -> list[QuantWeight]:
    from kernel_util import make_weight

    rng = np.random.default_rng(seed)
    return [make_weight(rng, qt, shape)[0] for _ in range(n)]


def test_expert_epilogue_fallbacks_are_the_graph_code():
    """On the fallback backend the wrappers are the MoE composition: two products + swiglu (× route weight),
    one gathered product summed over the slots (+ the addend)."""
    from ds4_mlx.model.ops import swiglu

    rng = np.random.default_rng(5)
    gate, up = expert_weights(QT.Q2_K, (8, 64, 256), 2, seed=5)
    down = expert_weights(QT.Q8_0, (8, 256, 64), 1, seed=6)[0]
    x = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    ids = mx.array(rng.integers(0, 8, (3, 6)).astype(np.int32))
    rw = mx.array(rng.uniform(0.1, 1.0, (3, 6)).astype(np.float32))
    add = mx.array(rng.standard_normal((3, 256)).astype(np.float32))
    mid = fused.expert_swiglu(gate, up, x, 0.03, ids, rw, backend="fallback")
    ref = swiglu(gate.gather_matmul(x, ids), up.gather_matmul(x, ids), 0.03) * rw[..., None]
    close(mid, ref, 0.0)
    unclamped = swiglu(gate.gather_matmul(x, ids), up.gather_matmul(x, ids), 0.0) * rw[..., None]
    assert float(mx.abs(ref - unclamped).max()) > 1e-3 * float(mx.abs(ref).max())  # the clamp bit
    out = fused.expert_down_sum(down, mid, ids, add, backend="fallback")
    close(out, down.gather_matmul(mid, ids).sum(axis=1) + add, 0.0)
    with pytest.raises(ValueError, match="differ"):
        fused.expert_swiglu(gate, down, x, 0.03, ids, rw)
    f32 = QuantWeight.from_numpy(rng.standard_normal((4, 256)).astype(np.float32), QT.F32, (4, 256))
    with pytest.raises(ValueError, match="SwiGLU epilogue"):  # checked before any kernel is built
        kernels.mv(f32, x, "cuda", epi=kernels.MV_SWIGLU, w2=f32)
    with pytest.raises(ValueError, match="sum epilogue"):
        kernels.mv(down, x, "cuda", epi=kernels.MV_SUM)


EXPERT_CASES = [  # qt, E experts, F, n_embd, T, k: small (K split, ragged rows) and the real V4 decode shape
    (QT.IQ2_XXS, 16, 75, 256, 1, 6), (QT.Q2_K, 16, 75, 256, 3, 6), (QT.Q4_K, 16, 40, 512, 2, 4),
    (QT.Q8_0, 8, 75, 256, 1, 6), (QT.F16, 8, 96, 128, 2, 6),
    pytest.param(QT.IQ2_XXS, 32, 2048, 4096, 1, 6, marks=gpu_only),
]


@needs_gpu
@pytest.mark.parametrize("qt,E,F,D,T,k", EXPERT_CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("clamp", [0.0, 0.02])
def test_expert_swiglu_kernel(qt, E, F, D, T, k, clamp):
    rng = np.random.default_rng(F + T + int(qt))
    gate, up = expert_weights(qt, (E, F, D), 2, seed=int(qt) + F)
    x = mx.array(rng.standard_normal((T, D)).astype(np.float32) * 0.05)  # pre-activations of a few units
    ids = mx.array(rng.integers(0, E, (T, k)).astype(np.int32))
    rw = mx.array(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    y = fused.expert_swiglu(gate, up, x, clamp, ids, rw, backend=BACKEND)
    assert y.shape == (T, k, F)
    g, u = on_cpu(lambda: (gate.gather_matmul(x, ids), up.gather_matmul(x, ids)))
    swiglu_close(y, g, u, clamp, rw)
    # dense (the shared expert): expert 0's matrices as 2-D weights; every row written (NaN-filled output)
    g0, u0 = (QuantWeight(w.data[0], w.qtype, w.shape[1:]) for w in (gate, up))
    y = kernels.mv(g0, x, BACKEND, epi=kernels.MV_SWIGLU, w2=u0, clamp=clamp, init=float("nan"))
    swiglu_close(y, *on_cpu(lambda: (g0.matmul(x), u0.matmul(x))), clamp, None)


def swiglu_close(y, g, u, clamp: float, rw) -> None:
    """``y`` against float64 swiglu of the f32 pre-activations ``g, u`` (× ``rw``), element by element within
    what the kernel's own f32 dot products may differ by (1e-6 of the largest pre-activation) carried
    through the activation: clamping shrinks the outputs far below the pre-activations' scale."""
    g, u = np.asarray(g, np.float64), np.asarray(u, np.float64)
    w = np.ones(g.shape[:-1] + (1,)) if rw is None else np.asarray(rw, np.float64)[..., None]
    delta = 1e-6 * max(np.abs(g).max(), np.abs(u).max())
    if clamp > 0:
        g, u = np.minimum(g, clamp), np.clip(u, -clamp, clamp)
    silu = g / (1.0 + np.exp(-g))
    ref = silu * u * w
    bound = delta * (1.1 * np.abs(u) + np.abs(silu)) * w + 1e-7 * np.abs(ref).max()
    y = np.asarray(y, np.float64)
    assert np.isfinite(y).all() and y.shape == ref.shape
    bad = np.abs(y - ref) > bound
    assert not bad.any(), f"{bad.sum()} of {bad.size} outside the bound, max err {np.abs(y - ref).max():.3g}"


@needs_gpu
@pytest.mark.parametrize("qt,E,F,D,T,k", EXPERT_CASES, ids=lambda v: getattr(v, "name", str(v)))
@pytest.mark.parametrize("with_add", [False, True])
def test_expert_down_sum_kernel(qt, E, F, D, T, k, with_add):
    rng = np.random.default_rng(F + T + int(qt) + 1)
    F = F if F % 256 == 0 else 256  # the down projection's input width: whole blocks of every type
    (down,) = expert_weights(qt, (E, D, F), 1, seed=int(qt) + D)
    mid = mx.array(rng.standard_normal((T, k, F)).astype(np.float32))
    ids = mx.array(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    add = mx.array(rng.standard_normal((T, D)).astype(np.float32)) if with_add else None
    y = kernels.mv(down, mid.reshape(T * k, F), BACKEND, ids=ids, k_slots=k, epi=kernels.MV_SUM, aux=add,
                   init=float("nan"))  # fmt: skip
    ref = on_cpu(fused.expert_down_sum, down, mid, ids, add, backend="fallback")
    assert y.shape == (T, D)
    close(y, ref, 1e-5)
    close(fused.expert_down_sum(down, mid, ids, add, backend=BACKEND), ref, 1e-5)


SHARED_CASES = [  # routed type, E, F, n_embd, T, k (the shared expert is Q8_0, as in ds4's GGUFs)
    (QT.IQ2_XXS, 16, 256, 256, 1, 6), (QT.Q2_K, 16, 256, 512, 2, 4), (QT.Q4_K, 8, 256, 256, 1, 6),
    pytest.param(QT.IQ2_XXS, 32, 2048, 4096, 1, 6, marks=gpu_only),
]


@needs_gpu
@pytest.mark.parametrize("qt,E,F,D,T,k", SHARED_CASES, ids=lambda v: getattr(v, "name", str(v)))
def test_experts_with_shared_kernel(qt, E, F, D, T, k, monkeypatch):
    """Routed experts and the shared expert in two launches (mv ``shared``) against the MoE's separate pieces
    on the CPU: the SwiGLU launch's shared rows, and the summed output; with x quantized too, where (IQ2_XXS
    experts on CUDA or sim) the gate+up launch hands the down launch its mid quantized."""
    from ds4_mlx.model.ops import swiglu

    rng = np.random.default_rng(F + D + T + int(qt))
    gate, up = expert_weights(qt, (E, F, D), 2, seed=int(qt) + 3)
    (down,) = expert_weights(qt if qt != QT.IQ2_XXS else QT.Q2_K, (E, D, F), 1, seed=int(qt) + 4)
    sg, su = expert_weights(QT.Q8_0, (F, D), 2, seed=int(qt) + 5)
    (sd,) = expert_weights(QT.Q8_0, (D, F), 1, seed=int(qt) + 6)
    sgu = QuantWeight.stack_rows([sg, su])
    x = mx.array(rng.standard_normal((T, D)).astype(np.float32) * 0.05)
    ids = mx.array(np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int32))
    rw = mx.array(rng.uniform(0.1, 1.0, (T, k)).astype(np.float32))
    clamp = 0.02

    mid = kernels.mv(gate, x, BACKEND, ids=ids, k_slots=k, epi=kernels.MV_SWIGLU, w2=up, aux=rw, clamp=clamp,
                     shared=sgu, init=float("nan"))  # fmt: skip
    assert mid.shape == (T * k + T, F)
    g, u = on_cpu(lambda: (gate.gather_matmul(x, ids), up.gather_matmul(x, ids)))
    swiglu_close(mid[: T * k].reshape(T, k, F), g, u, clamp, rw)
    swiglu_close(mid[T * k :], *on_cpu(lambda: (sg.matmul(x), su.matmul(x))), clamp, None)

    y = fused.experts_with_shared(gate, up, down, sgu, sd, x, ids, rw, clamp, backend=BACKEND)
    shared = on_cpu(lambda: sd.matmul(swiglu(sg.matmul(x), su.matmul(x), clamp)))
    ref = on_cpu(fused.expert_down_sum, down, swiglu(g, u, clamp) * rw[..., None], ids, shared, backend="fallback")
    assert y.shape == (T, D)
    close(y, ref, 1e-5)
    if kernels.fused.takes_quantized_x(gate, up, sgu):
        launched, mv = [], kernels.fused.mv
        monkeypatch.setattr(kernels.fused, "mv", lambda *a, **kw: launched.append(kw) or mv(*a, **kw))
        yq = fused.experts_with_shared(gate, up, down, sgu, sd, x, ids, rw, clamp, xq=kernels.quantize_x(x),
                                       backend=BACKEND)  # fmt: skip
        close(yq, ref, 1e-3)
        assert not np.array_equal(np.array(yq), np.array(y))  # the integer dots ran
        q_mid = qt == QT.IQ2_XXS and BACKEND in ("cuda", "sim")
        assert [kw["quantize_y"] for kw in launched[:1]] + [kw["xq"] for kw in launched[1:]] == [q_mid, q_mid]
    assert fused.experts_with_shared(gate, up, down, sgu, sd, x, ids, rw, clamp, backend="fallback") is None
    with pytest.raises(ValueError, match="shared expert"):  # the up rows missing
        kernels.mv(gate, x, BACKEND, ids=ids, k_slots=k, epi=kernels.MV_SWIGLU, w2=up, aux=rw, shared=sg)


@pytest.mark.parametrize("make", ["kernel_counts", "index_array"])
def test_cached_step_inputs_serve_any_thread(make, monkeypatch, in_other_thread):
    """A cached step input is made in whichever thread builds a step first and reused by the others (the
    StepEncoder's worker, a server worker), and MLX streams belong to their thread: ``resident`` (its CUDA
    path, forced here) returns evaluated data, not a lazy op of the maker's stream ("There is no Stream(cpu, 0)
    in current thread" otherwise). The copy's own eval must not disturb a step being built on the caller's."""
    from ds4_mlx.model import compressor

    monkeypatch.setattr(kernels.fused, "_on_cuda", lambda: True)
    kernel_counts.cache_clear()
    compressor.index_array.cache_clear()
    f = {"kernel_counts": lambda: kernel_counts(123457, 11), "index_array": lambda: compressor.index_array(98765)}[make]
    pending = mx.arange(5) * 2  # a lazy op of this thread's stream, still unevaluated
    mine = f()
    theirs = in_other_thread(lambda: np.array(f() + 0))
    np.testing.assert_array_equal(np.array(mine), theirs)
    assert theirs[0] == {"kernel_counts": 123457, "index_array": 98765}[make]
    np.testing.assert_array_equal(np.array(pending), np.arange(5) * 2)
    kernel_counts.cache_clear()  # made with the forced path: not for later tests
    compressor.index_array.cache_clear()


# --- Cols: one token's columns read in place -----------------------------------------------------------------


def in_row(parts: list[mx.array], seed: int) -> tuple[mx.array, list[Cols]]:
    """The one-row arrays ``parts`` laid out in one wider row (with random columns around them, as in a stacked
    projection's output) and a Cols of each."""
    rng = np.random.default_rng(seed)
    pieces, at, cols = [], 0, []
    for p in parts:
        gap = rng.standard_normal((1, 3)).astype(np.float32)
        pieces += [gap, np.array(p)]
        cols.append(at + 3)
        at += 3 + p.shape[1]
    row = mx.array(np.concatenate(pieces + [rng.standard_normal((1, 5)).astype(np.float32)], axis=1))
    return row, [Cols(row, c) for c in cols]


@pytest.mark.parametrize("b", ["fallback", BACKEND])
def test_comp_write_and_emit_read_cols(b):
    """The compressor's kv and gate rows as columns of one projection row: the same frontier and pooled row as
    separate arrays, bit for bit, on the kernel and on the fallback."""
    kv, sc, rows, ape, at_a, norm, C, S, *_ = emit_inputs(4, 128, 6, seed=11)
    _, cols = in_row(rows, seed=11)
    pool = dict(norm=norm, C=C, S=S, eps=1e-6, lanes=2, neg=NEG, backend=b)
    fr = frontier(kv, sc)
    for got, want in (((fused.compressor_write(fr, *cols, ape, at_a, backend=b),),
                       (fused.compressor_write(fr, *rows, ape, at_a, backend=b),)),
                      (fused.compressor_emit(fr, *cols, ape, at_a, **pool),
                       fused.compressor_emit(fr, *rows, ape, at_a, **pool))):  # fmt: skip
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g), np.array(w))
    with pytest.raises(ValueError, match="kv_row: columns"):
        fused.compressor_write(fr, Cols(cols[0].a, cols[0].a.shape[1] - 8), cols[1], ape, at_a, backend=b)


@pytest.mark.parametrize("b", ["fallback", BACKEND])
def test_qkv_rows_and_index_scores_read_cols(b):
    """The KV projection and the indexer's head weights as columns of a wider row: the same results as the arrays."""
    qb, kvb, norm, C, S = qkv_inputs(1, 4, 128, seed=4)
    _, (kv_c,) = in_row([kvb], seed=4)
    for win in (None, (mx.array(np.random.default_rng(4).standard_normal((6, 128)).astype(np.float16)), 5, mx.float16)):
        got = fused.qkv_rows(qb, kv_c, norm, C, S, 1e-6, 4, nope_fp8=64, f16r=True, window=win, backend=b)
        want = fused.qkv_rows(qb, kvb, norm, C, S, 1e-6, 4, nope_fp8=64, f16r=True, window=win, backend=b)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(np.array(g), np.array(w))
    iq, w, keys = index_scores_inputs(16, 128, 40, seed=2)
    _, (w_c,) = in_row([mx.array(w)], seed=2)
    counts = kernel_counts(33, 4)
    got = fused.index_scores(mx.array(iq), w_c, mx.array(keys), counts, 0.1, backend=b)
    want = fused.index_scores(mx.array(iq), mx.array(w), mx.array(keys), counts, 0.1, backend=b)
    np.testing.assert_array_equal(np.array(got), np.array(want))
