"""Fused hyper-connection and KV-compressor kernels (``ds4_mlx.kernels.fused``).

Four write-once bodies next to the quant kernels, rendered with the same header and prologues
(:func:`ds4_mlx.kernels.render_header`, ``METAL_PROLOGUE`` / ``CUDA_PROLOGUE``) plus ``fused.h``:

- ``hc_pre.body``: HC pre (MODEL.md §4.3) in one launch, one threadgroup per token (prefill); for decode-sized
  T, ``hc_mix.body`` first spreads the mixing matvec over many threadgroups and hc_pre sums its partials.
- ``hc_post.body``: HC post (§4.9), ``S_new = post ⊗ y + Cᵀ S``.
- ``comp_pool.body``: the compressor's window pooling, RMSNorm × weight and RoPE at the window start
  (§4.6 steps 4–6); the FP8/QAT/f16r simulations that follow stay in MLX.

Each public function has the signature of the pure-MLX code it replaces and falls back to it on the
``fallback`` backend (CPU, or ``DS4_MLX_KERNELS=fallback``) and for inputs the kernels do not cover.
The pure-MLX versions are the oracle of the tests.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

from . import CUDA_PROLOGUE, METAL_PROLOGUE, SOURCE_DIR, render_header

#: Threads per threadgroup of the HC pre kernel (8 simdgroups split the 24 dot products over n_hc*E).
HC_PRE_THREADS = 256
#: Tokens per HC pre threadgroup: 1 for decode-sized T, more in prefill so each fn read serves several tokens.
#: H200, E=4096, T=512: TPB 1 / 2 / 4 took 166 / 156 / 268 µs (TPB=4 needs 128 registers a thread).
HC_PRE_TPB_CHOICES = (1, 2, 4)
HC_PRE_TPB_PREFILL = 2
HC_PRE_TPB_MIN_T = 64  # from this many tokens on, use HC_PRE_TPB_PREFILL
#: Up to this many tokens HC pre runs in two launches: hc_mix over K slices, then hc_pre on the partials.
HC_PRE_SPLIT_MAX_T = 8
#: Threads per hc_mix threadgroup; one f16 pair of fn per thread per slice.
HC_MIX_THREADS = 256
#: Threads per threadgroup of the HC post kernel (largest of these dividing E).
HC_POST_THREADS = (256, 128, 64, 32)


@dataclass(frozen=True)
class KernelSpec:
    """Inputs ``(name, dtype)``, outputs and template parameter names of one fused kernel."""

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    template: tuple[str, ...]


SPECS = {
    "hc_pre": KernelSpec(
        (("S", "float"), ("fnw", "uint32_t"), ("scale", "float"), ("base", "float"), ("epsv", "float"),
         ("params", "int32_t"), ("part", "float")),
        ("x_out", "post_out", "comb_out"),
        ("NHC", "NITER", "TPB", "SPLIT"),
    ),
    "hc_mix": KernelSpec((("S", "float"), ("fnw", "uint32_t"), ("params", "int32_t")), ("part",), ("NHC",)),
    "hc_post": KernelSpec(
        (("S", "float"), ("y", "float"), ("post", "float"), ("comb", "float"), ("params", "int32_t")),
        ("S_out",),
        ("NHC",),
    ),
    "comp_pool": KernelSpec(
        (("kv", "float"), ("score", "float"), ("norm", "float"), ("rc", "float"), ("rs", "float"), ("fparams", "float")),
        ("row",),
        ("HD", "ROWS", "LANES"),
    ),
}


# --- rendering and building -----------------------------------------------------------------------------


def render_fused_header(backend: str) -> str:
    """The quant kernels' header (backend define + ds_prelude.h) followed by ``fused.h``."""
    return render_header(backend) + "\n" + (SOURCE_DIR / "fused.h").read_text()


def render_fused_source(kind: str, backend: str) -> str:
    """Backend prologue (names the thread attributes) plus the shared body."""
    prologue = {"metal": METAL_PROLOGUE, "cuda": CUDA_PROLOGUE}[backend]
    return prologue + (SOURCE_DIR / f"{kind}.body").read_text()


@lru_cache(maxsize=None)
def get_fused_kernel(kind: str, backend: str):
    """Build fused kernel ``kind`` once per backend (MLX caches each template specialization)."""
    spec = SPECS[kind]
    args = dict(
        name=f"ds_{kind}",
        input_names=[n for n, _ in spec.inputs],
        output_names=list(spec.outputs),
        source=render_fused_source(kind, backend),
        header=render_fused_header(backend),
    )
    if backend == "metal":
        return mx.fast.metal_kernel(**args)
    if backend == "cuda":
        return mx.fast.cuda_kernel(**args)
    raise ValueError(f"no fused kernels for backend {backend!r}")


def instantiations() -> list[tuple[str, tuple]]:
    """Specializations launched at the V4 and tiny shapes (the compile-check matrix): (kind, template)."""
    out = [("hc_pre", (("NHC", 4), ("NITER", 20), ("TPB", tpb), ("SPLIT", 0))) for tpb in HC_PRE_TPB_CHOICES]
    out += [("hc_pre", (("NHC", 4), ("NITER", 20), ("TPB", 1), ("SPLIT", 1))), ("hc_mix", (("NHC", 4),))]
    out.append(("hc_post", (("NHC", 4),)))
    for hd, rows, lanes in ((512, 8, 2), (128, 8, 2), (512, 128, 1), (128, 16, 1), (128, 128, 1)):
        out.append(("comp_pool", (("HD", hd), ("ROWS", rows), ("LANES", lanes))))
    return out


def tag(kind: str, template: tuple) -> str:
    return f"{kind}_" + "_".join(f"{k}{v}" for k, v in template)


def render_cuda_unit(insts: list[tuple[str, tuple]]) -> str:
    """CUDA text as MLX's ``cuda_kernel`` generates it (QUANTS.md §3.2), for an ``nvcc -c`` check.

    MLX's ``utils.cuh`` include is replaced by the CUDA headers it brings in; each kernel gets its own
    namespace so the repeated header does not collide.
    """
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n"]
    for i, (kind, template) in enumerate(insts):
        spec = SPECS[kind]
        params = ", ".join([f"const {t}* {n}" for n, t in spec.inputs] + [f"float* {o}" for o in spec.outputs])
        consts = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in template)
        parts.append(
            f"namespace ds_fu{i} {{\n{render_fused_header('cuda')}\n"
            f"namespace mlx {{ namespace core {{ namespace cu {{ namespace cg = cooperative_groups;\n"
            f"__global__ void custom_kernel_ds_{tag(kind, template)}({params}) {{\n{consts}"
            f"{render_fused_source(kind, 'cuda')}\n}}\n}}}}}}\n}}\n"
        )
    return "\n".join(parts)


# --- backend ----------------------------------------------------------------------------------------------


def backend() -> str:
    """``fallback``, ``metal`` or ``cuda``: the same choice as the quant kernels (``DS4_MLX_KERNELS``)."""
    from ds4_mlx.weights import kernel_backend

    return kernel_backend()


def _pick(b: str | None) -> str:
    return backend() if b is None else b


@lru_cache(maxsize=256)
def _i32(*vals: int) -> mx.array:
    a = mx.array(list(vals) + [0] * (8 - len(vals)), dtype=mx.int32)
    return a  # built from host data: already materialized (and safe to create inside a compile trace)


@lru_cache(maxsize=256)
def _f32(*vals: float) -> mx.array:
    a = mx.array(list(vals) + [0.0] * (8 - len(vals)), dtype=mx.float32)
    return a  # built from host data: already materialized (and safe to create inside a compile trace)


def _check_f32(name: str, a: mx.array, shape: tuple) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.dtype != mx.float32:
        raise ValueError(f"{name}: dtype {a.dtype}, expected float32")


# --- HC pre -----------------------------------------------------------------------------------------------


def _fn_pairs(fn: Any) -> mx.array | None:
    """fn's f16 values as u32 pairs ``[mix, n/2]`` (cached on the weight), or None if fn is not plain F16."""
    if getattr(fn, "qtype", None) != QT.F16 or getattr(fn, "data", None) is None or fn.data.dtype != mx.float16:
        return None
    cache = getattr(fn, "_cache", None)
    w = cache.get("f16_pairs") if cache is not None else None
    if w is None:
        w = fn.data.view(mx.uint32)  # [mix, n/2]: element 2i in the low half (little endian)
        if cache is not None:
            cache["f16_pairs"] = w
    return w


def hc_pre(
    S: mx.array, fn: Any, scale: mx.array, base: mx.array, cfg, *, backend: str | None = None, tpb: int | None = None,
    split: bool | None = None,
):  # fmt: skip
    """Fused HC pre (MODEL.md §4.3); same signature and results as :func:`ds4_mlx.model.hyper.hc_pre`.

    S ``[T, n_hc, E]`` f32; fn the F16 ``QuantWeight [2n+n², n*E]``; scale ``[3]``; base ``[2n+n²]``.
    Returns ``x [T, E]``, ``post [T, n_hc]``, ``comb [T, n_hc, n_hc]``. ``tpb`` and ``split`` override the
    launch choice (tests and benchmarks): ``split`` runs hc_mix first (default for T <= HC_PRE_SPLIT_MAX_T).
    """
    from ds4_mlx.model import hyper

    b = _pick(backend)
    if S.ndim != 3:
        raise ValueError(f"hc_pre: S must be [T, n_hc, E], got shape {tuple(S.shape)}")
    T, n_hc, E = S.shape
    mix = 2 * n_hc + n_hc * n_hc
    _check_f32("hc_pre: S", S, (T, cfg.n_hc, E))
    if tuple(fn.shape) != (mix, n_hc * E):
        raise ValueError(f"hc_pre: fn shape {tuple(fn.shape)}, expected {(mix, n_hc * E)}")
    _check_f32("hc_pre: scale", scale, (3,))
    _check_f32("hc_pre: base", base, (mix,))
    fnw = _fn_pairs(fn)
    if b == "fallback" or fnw is None or n_hc not in (1, 2, 4) or T == 0:
        return hyper.hc_pre(S, fn, scale, base, cfg)
    if split is None:
        split = tpb is None and T <= HC_PRE_SPLIT_MAX_T
    if tpb is None:
        tpb = HC_PRE_TPB_PREFILL if T >= HC_PRE_TPB_MIN_T and not split else 1
    if tpb not in HC_PRE_TPB_CHOICES or (split and tpb != 1):
        raise ValueError(f"hc_pre: tpb must be one of {HC_PRE_TPB_CHOICES} (1 with split), got {tpb}")
    S2 = S.reshape(T, n_hc * E)
    part, G = _f32(0.0), 0
    if split:
        G = -(-(n_hc * E // 2) // HC_MIX_THREADS)
        params = _i32(E, T, G)
        part = get_fused_kernel("hc_mix", b)(
            inputs=[S2, fnw, params],
            template=[("NHC", n_hc)],
            grid=(G * HC_MIX_THREADS, T, 1),
            threadgroup=(HC_MIX_THREADS, 1, 1),
            output_shapes=[(T, G, mix + 1)],
            output_dtypes=[mx.float32],
        )[0]
    x, post, comb = get_fused_kernel("hc_pre", b)(
        inputs=[S2, fnw, scale, base, _f32(cfg.rms_eps, cfg.hc_eps), _i32(E, T, G), part],
        template=[("NHC", n_hc), ("NITER", cfg.n_sinkhorn_iter), ("TPB", tpb), ("SPLIT", int(split))],
        grid=(-(-T // tpb) * HC_PRE_THREADS, 1, 1),
        threadgroup=(HC_PRE_THREADS, 1, 1),
        output_shapes=[(T, E), (T, n_hc), (T, n_hc * n_hc)],
        output_dtypes=[mx.float32] * 3,
    )
    return x, post, comb.reshape(T, n_hc, n_hc)


# --- HC post ----------------------------------------------------------------------------------------------


def hc_post(S: mx.array, y: mx.array, post: mx.array, comb: mx.array, *, backend: str | None = None) -> mx.array:
    """Fused HC post (MODEL.md §4.9); same signature and results as :func:`ds4_mlx.model.hyper.hc_post`."""
    from ds4_mlx.model import hyper

    b = _pick(backend)
    if S.ndim != 3:
        raise ValueError(f"hc_post: S must be [T, n_hc, E], got shape {tuple(S.shape)}")
    T, n, E = S.shape
    _check_f32("hc_post: S", S, (T, n, E))
    _check_f32("hc_post: y", y, (T, E))
    _check_f32("hc_post: post", post, (T, n))
    _check_f32("hc_post: comb", comb, (T, n, n))
    tg = next((t for t in HC_POST_THREADS if E % t == 0), None)
    if b == "fallback" or tg is None or T == 0:
        return hyper.hc_post(S, y, post, comb)
    return get_fused_kernel("hc_post", b)(
        inputs=[S, y, post, comb.reshape(T, n * n), _i32(E, T)],
        template=[("NHC", n)],
        grid=(E, T, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(T, n, E)],
        output_dtypes=[mx.float32],
    )[0]


# --- compressor window ------------------------------------------------------------------------------------


def _pool_reference(kv: mx.array, score: mx.array, norm: mx.array, C: mx.array, S: mx.array, eps: float, lanes: int):
    """The pure-MLX pooling of ``Compressor._finish`` (before ``finish_row``), for either layout."""
    from ds4_mlx.model.rope import apply_rope

    if lanes == 2:  # frontier layout -> entries: lane A of rows 0..n-1, lane B of rows n..2n-1
        n, hd = kv.shape[1] // 2, kv.shape[2] // 2
        kv = mx.concatenate([kv[:, :n, :hd], kv[:, n:, hd:]], axis=1)
        score = mx.concatenate([score[:, :n, :hd], score[:, n:, hd:]], axis=1)
    pooled = (mx.softmax(score, axis=1) * kv).sum(axis=1)  # [nw, hd]
    c = mx.fast.rms_norm(pooled, norm, eps)
    return apply_rope(c, C, S)


def compressor_pool(
    kv: mx.array,
    score: mx.array,
    norm: mx.array,
    C: mx.array,
    S: mx.array,
    eps: float,
    *,
    lanes: int = 1,
    backend: str | None = None,
) -> mx.array:
    """Pool, norm and RoPE finished compressor windows (MODEL.md §4.6 steps 4–6) -> ``[nw, hd]``.

    ``lanes=1``: ``kv``/``score`` are the entries ``[nw, n_ent, hd]`` (what ``Compressor._finish`` builds).
    ``lanes=2``: the ratio-4 frontier layout ``[nw, 2r, 2hd]`` (lane A of rows 0..r-1, lane B of rows r..2r-1),
    so decode can pass the state directly. Scores already include APE. ``norm [hd]``; ``C, S [nw, hd]`` are
    ``Rope.tables(window_starts, hd)``. The FP8/QAT/f16r rounding (``finish_row``) is left to the caller.
    """
    b = _pick(backend)
    if kv.ndim != 3 or lanes not in (1, 2):
        raise ValueError(f"compressor_pool: kv must be [nw, rows, lanes*hd] with lanes 1|2, got {tuple(kv.shape)}, {lanes}")
    nw, rows, width = kv.shape
    if width % lanes or rows % lanes:
        raise ValueError(f"compressor_pool: rows {rows} / width {width} not divisible by lanes={lanes}")
    hd = width // lanes
    _check_f32("compressor_pool: kv", kv, (nw, rows, width))
    _check_f32("compressor_pool: score", score, (nw, rows, width))
    _check_f32("compressor_pool: norm", norm, (hd,))
    _check_f32("compressor_pool: C", C, (nw, hd))
    _check_f32("compressor_pool: S", S, (nw, hd))
    if b == "fallback" or hd % 32 or hd > 1024 or nw == 0:
        return _pool_reference(kv, score, norm, C, S, eps, lanes)
    return get_fused_kernel("comp_pool", b)(
        inputs=[kv, score, norm, C, S, _f32(float(eps))],
        template=[("HD", hd), ("ROWS", rows), ("LANES", lanes)],
        grid=(nw * hd, 1, 1),
        threadgroup=(hd, 1, 1),
        output_shapes=[(nw, hd)],
        output_dtypes=[mx.float32],
    )[0]
