"""Fused kernels of the model graph (``ds4_mlx.kernels.fused``): hyper-connections, the KV compressor, and the
decode step's attention, Q/KV rows, router and indexer.

Write-once bodies next to the quant kernels, rendered like them (:func:`ds4_mlx.kernels.render_source`:
prologue plus body) on the macro layer (:func:`ds4_mlx.kernels.render_prelude`) plus ``fused.h``:

- ``hc_pre.body``: HC pre (docs/model.md §4.3) in one launch, one threadgroup per token (prefill); for decode-sized
  T, ``hc_mix.body`` first spreads the mixing matvec over many threadgroups and hc_pre sums its partials.
  Optionally hc_pre also applies the sublayer's input RMSNorm, and hc_mix first the previous sublayer's HC
  post (:func:`hc_pre` ``post_of``).
- ``hc_post.body``: HC post (§4.9), ``S_new = post ⊗ y + Cᵀ S``.
- ``comp_pool.body``: the compressor's window pooling, RMSNorm × weight and RoPE at the window start
  (§4.6 steps 4–6) and ds4's FP8/QAT/f16r rounding of the row. For the decode token that completes a window
  it also writes that token and emits the next frontier (:func:`compressor_emit`).
- ``comp_write.body``: one decode token's write into its compressor frontier (row and APE-biased score).
- ``qkv_rows.body``: the query heads' RMS norm and RoPE, and the KV row's norm, RoPE, FP8 and f16 rounding
  (§4.4, §4.12), in one launch instead of ~15 MLX ops; in decode it also writes the new raw window.
- ``moe_route.body``: the top-k router (sqrt-softplus, biased top-k with ds4's tie rule, normalized weights;
  §4.8) in one launch instead of ~10 MLX ops.
- ``index_q.body``: the indexer's query heads: RoPE, Hadamard-128 and FP4 (§4.7, §4.12) in one launch.
- ``index_scores.body``: the indexer's head-weighted ReLU scores of one decode token's visible rows (§4.7).
- ``topk_rows.body``: the indexer's top-k rows of one decode token or of each query of a chunk, ties to the lower
  row (§4.7), in one launch instead of MLX's topk + cumsum + argpartition + sort chain.
- ``mv.body`` epilogues: the experts' SwiGLU of two weights (gate, up) and the sum of a token's routed experts
  (§4.8), each one matvec launch instead of two or three MLX ops (:func:`expert_swiglu`, :func:`expert_down_sum`).
- ``sample.body``: the next token's id with ds4's greedy and top-p-1 rules, in one launch instead of ~50 MLX
  ops (:func:`sample_token`), so a pipelined decode step can take it as its input.
- ``attn_one.body``: one decode token's attention over the raw window and its compressed (or selected) rows,
  with the sink softmax and the output's inverse RoPE (§4.4), in one launch instead of ~15 MLX ops.

Each launch function checks its inputs on every backend, so bad input gets the same error on the CPU, then
launches its kernel on ``backend``, or returns None where the kernel does not run: on the ``fallback`` backend
and for shapes past the kernel's limits. The caller runs the pure-MLX form then: the graph's fused operations
(:mod:`ds4_mlx.model.fused`) and the device sampler (:func:`ds4_mlx.sampling.sample_on_device`) choose, and
their pure-MLX forms are the tests' oracle. The kernels take the model's weights as duck-typed
``QuantWeight``s (``qtype``, ``shape``, ``data``, ``derived``). On MLX-CUDA a decode step is host-bound (each
launch costs the host several µs to encode), so every launch these kernels save is time (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from . import (
    F16_PRODUCT_SCALE, MV_MAX_TOKENS, MV_SUM, MV_SWIGLU, MV_SWIGLU_TYPES, MV_XQ_TYPES, Cols, Scaled16, _dummy, _params,
    _read, _read_for, build, mv, reg_direct, render_prelude, render_source, supports,
)

#: Threads per threadgroup of the HC pre kernel (8 simdgroups split the 24 dot products over n_hc*E), and of
#: its decode launch on hc_mix's partials (one threadgroup for the token: more simdgroups sum the partials).
HC_PRE_THREADS = 256
HC_PRE_SPLIT_THREADS = 512  # twice HC_PRE_THREADS: hc_pre.body keeps XS = XK / 2 elements a thread
#: Elements of x a HC pre thread keeps in registers, read from hc_pre.body (its XK, the one definition): the
#: kernel takes E <= 16 * 256 = 4096 (the full shape's width); wider states take the MLX path.
HC_PRE_XK = int(re.search(r"constexpr int XK = (\d+);", _read("hc_pre.body")).group(1))
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
#: Simdgroups per head of the one-token attention kernel, by backend (each walks every NSG-th key); its
#: threadgroup memory is (NSG + 1) * head_dim floats. H200, V4 Flash's ratio-4 layer (ncu, mv_sweep.py "attn"):
#: NSG 4 / 8 / 16 took 100 / 55.7 / 32.6 µs; 16 heads of 512 need 34.9 KB, over Metal's 32 KB, so Metal keeps 8.
#: The sim backend runs CUDA's text, so it takes CUDA's.
ATTN_NSG = {"metal": 8, "cuda": 16, "sim": 16}
ATTN_MAX_HD = 512
#: Static threadgroup memory a launch may use (bytes): Metal's 32 KB, CUDA's 48 KB (the sim backend runs CUDA's).
TG_MEMORY = {"metal": 32 * 1024, "cuda": 48 * 1024, "sim": 48 * 1024}
#: Threads of the indexer top-k kernel (one threadgroup).
TOPK_THREADS = 512
#: Threads of the sampler's one threadgroup (sample.body): 127 logits each at V = 129280.
SAMPLE_THREADS = 1024


@dataclass(frozen=True)
class KernelSpec:
    """Inputs ``(name, dtype)``, outputs and template parameter names of one fused kernel."""

    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[str, ...]
    template: tuple[str, ...]
    out_types: tuple[str, ...] = ()  # per output; default float
    header: str = ""  # an extra header file after fused.h (only the kernels that need it carry its text)
    body: str = ""  # the body file's kind, where a variant shares another kernel's body (default: its own)
    define: str = ""  # a macro the header defines for that variant

    def out_type(self, i: int) -> str:
        return self.out_types[i] if self.out_types else "float"


SPECS = {
    "hc_pre": KernelSpec(
        (("S", "float"), ("fnw", "uint32_t"), ("scale", "float"), ("base", "float"), ("epsv", "float"),
         ("params", "int32_t"), ("part", "float"), ("nw", "float")),
        ("out",),
        ("NHC", "NITER", "TPB", "SPLIT", "NORM"),
    ),
    "hc_mix": KernelSpec(
        (("S", "float"), ("fnw", "uint32_t"), ("params", "int32_t"), ("y", "float"), ("post", "float"),
         ("comb", "float")),
        ("out",),
        ("NHC", "POST"),
    ),
    "hc_post": KernelSpec(
        (("S", "float"), ("y", "float"), ("post", "float"), ("comb", "float"), ("params", "int32_t")),
        ("S_out",),
        ("NHC",),
    ),
    "comp_pool": KernelSpec(
        (("kv", "float"), ("score", "float"), ("norm", "float"), ("rc", "float"), ("rs", "float"), ("fparams", "float"),
         ("kv_row", "float"), ("score_row", "float"), ("ape", "float"), ("at", "int32_t")),
        ("row", "fr_out"),
        ("HD", "ROWS", "LANES", "EMIT", "KVO", "SCO", "ROUND", "NOPE", "F16R"),
        ("half", "float"),  # the compile check's row type: the compressed KV cache's (f32 works too)
        "rounding.h",
    ),
    "comp_write": KernelSpec(
        (("fr", "float"), ("kv_row", "float"), ("score_row", "float"), ("ape", "float"), ("at", "int32_t"),
         ("params", "int32_t")),
        ("fr_out",),
        (),
    ),
    "attn_one": KernelSpec(
        (("q", "float"), ("raw", "half"), ("comp", "half"), ("idx", "int32_t"), ("sinks", "float"), ("rc", "float"),
         ("rs", "float"), ("counts", "int32_t"), ("fparams", "float")),
        ("o",),
        ("HD", "NSG", "USE_IDX", "KV16"),
    ),
    "qkv_rows": KernelSpec(
        (("qb", "float"), ("kvb", "float"), ("norm", "float"), ("rc", "float"), ("rs", "float"), ("fparams", "float"),
         ("raw", "half"), ("wparams", "int32_t")),
        ("q", "kv"),
        ("HD", "NH", "NOPE", "F16R", "WIN"),
        ("float", "half"),
        "rounding.h",
    ),
    "index_q": KernelSpec((("qb", "float"), ("rc", "float"), ("rs", "float")), ("q",), ("NH", "QAT"), header="rounding.h"),
    "index_scores": KernelSpec(
        (("iq", "float"), ("w", "float"), ("keys", "float"), ("counts", "int32_t"), ("params", "int32_t"),
         ("fparams", "float")),
        ("scores",),
        ("NH", "HD"),
    ),
    "topk_rows": KernelSpec((("scores", "float"), ("counts", "int32_t")), ("idx",), ("NT",), ("int32_t",)),
    "moe_route": KernelSpec(
        (("logits", "float"), ("bias", "float"), ("fparams", "float")), ("route",), ("NE", "K", "NORM"), ("int32_t",),
    ),
    "sample": KernelSpec(
        (("logits", "float"), ("fparams", "float"), ("u", "float"), ("counts", "int32_t")), ("token",), ("NT",),
        ("int32_t",),
        "sample.h",
    ),
}


# HC pre that also writes its output quantized for the routed experts' matvec (kernels.quantize_x's layout)
SPECS["hc_pre_xq"] = replace(SPECS["hc_pre"], body="hc_pre", define="HC_PRE_XQ")


# --- rendering and building -----------------------------------------------------------------------------


def render_fused_header(backend: str, kind: str | None = None) -> str:
    """The macro layer (backend define + ds_prelude.h) followed by ``fused.h`` and kernel ``kind``'s extra
    header, if any; no block decoding."""
    spec = SPECS[kind] if kind else KernelSpec((), (), ())
    define = f"#define {spec.define} 1\n" if spec.define else ""
    extra = _read_for(spec.header, backend) if spec.header else ""
    return render_prelude(backend) + _read_for("fused.h", backend) + extra + define


def render_body(kind: str, backend: str) -> str:
    """The ``source`` of fused kernel ``kind`` (:func:`ds4_mlx.kernels.render_source` of its body)."""
    return render_source(SPECS[kind].body or kind, backend)


@lru_cache(maxsize=None)
def get_fused_kernel(kind: str, backend: str):
    """Build fused kernel ``kind`` once per backend (MLX caches each template specialization)."""
    spec = SPECS[kind]
    return build(f"ds_{kind}", [n for n, _ in spec.inputs], list(spec.outputs), render_fused_header(backend, kind),
                 render_body(kind, backend), backend)  # fmt: skip


def instantiations() -> list[tuple[str, tuple]]:
    """Specializations launched at the V4 and tiny shapes (the compile-check matrix): (kind, template)."""
    out = [("hc_pre", (("NHC", 4), ("NITER", 20), ("TPB", tpb), ("SPLIT", 0), ("NORM", nm)))
           for tpb in HC_PRE_TPB_CHOICES for nm in (0, 1)]  # fmt: skip
    out += [("hc_pre", (("NHC", 4), ("NITER", 20), ("TPB", 1), ("SPLIT", 1), ("NORM", nm))) for nm in (0, 1)]
    out.append(("hc_pre_xq", (("NHC", 4), ("NITER", 20), ("TPB", 1), ("SPLIT", 1), ("NORM", 1))))  # the FFN's
    out += [("hc_mix", (("NHC", 4), ("POST", p))) for p in (0, 1)]
    out.append(("hc_post", (("NHC", 4),)))
    for hd, rows, lanes in ((512, 8, 2), (128, 8, 2), (512, 128, 1), (128, 16, 1), (128, 128, 1)):
        rnd = (("ROUND", 1), ("NOPE", 448), ("F16R", 1)) if hd == 512 else (("ROUND", 2), ("NOPE", 0), ("F16R", 1))
        out += [("comp_pool", (("HD", hd), ("ROWS", rows), ("LANES", lanes), ("EMIT", e), ("KVO", 0), ("SCO", so)) + r)
                for e, so in ((0, 0), (1, lanes * hd)) for r in (rnd, _NO_ROUNDING)]  # fmt: skip
    out.append(("comp_write", ()))
    for hd in (512, 128):
        out += [("attn_one", (("HD", hd), ("NSG", n), ("USE_IDX", u), ("KV16", 1)))
                for n in sorted(set(ATTN_NSG.values())) for u in (0, 1)]
    out += [("index_scores", (("NH", 64), ("HD", 128))), ("index_scores", (("NH", 16), ("HD", 128)))]
    out.append(("topk_rows", (("NT", TOPK_THREADS),)))
    out += [("qkv_rows", (("HD", 512), ("NH", 64), ("NOPE", 448), ("F16R", 1), ("WIN", w))) for w in (0, 1)]
    out += [("qkv_rows", (("HD", 128), ("NH", 4), ("NOPE", 0), ("F16R", 0), ("WIN", w))) for w in (0, 1)]
    out += [("index_q", (("NH", 64), ("QAT", 1))), ("index_q", (("NH", 16), ("QAT", 0)))]
    out += [("moe_route", (("NE", 256), ("K", 6), ("NORM", 1))), ("moe_route", (("NE", 16), ("K", 6), ("NORM", 0)))]
    out.append(("sample", (("NT", SAMPLE_THREADS),)))
    return out


def tag(kind: str, template: tuple) -> str:
    return f"{kind}_" + "_".join(f"{k}{v}" for k, v in template)


CUDA_TYPES = {"half": "__half"}


def render_cuda_unit(insts: list[tuple[str, tuple]]) -> str:
    """CUDA text as MLX's ``cuda_kernel`` generates it (docs/quants.md §3.2), for an ``nvcc -c`` check.

    MLX's ``utils.cuh`` include is replaced by the CUDA headers it brings in; each kernel gets its own
    namespace so the repeated header does not collide.
    """
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n"]
    for i, (kind, template) in enumerate(insts):
        spec = SPECS[kind]
        ins = [f"const {CUDA_TYPES.get(t, t)}* {n}" for n, t in spec.inputs]
        params = ", ".join(ins + [f"{spec.out_type(j)}* {o}" for j, o in enumerate(spec.outputs)])
        consts = "".join(f"constexpr int {k} = {int(v)};\n" for k, v in template)
        parts.append(
            f"namespace ds_fu{i} {{\n{render_fused_header('cuda', kind)}\n"
            f"namespace mlx {{ namespace core {{ namespace cu {{ namespace cg = cooperative_groups;\n"
            f"__global__ void custom_kernel_ds_{tag(kind, template)}({params}) {{\n{consts}"
            f"{render_body(kind, 'cuda')}\n}}\n}}}}}}\n}}\n"
        )
    return "\n".join(parts)


# --- input checks -----------------------------------------------------------------------------------------


@lru_cache(maxsize=256)
def _f32(*vals: float) -> mx.array:
    a = mx.array(list(vals) + [0.0] * (8 - len(vals)), dtype=mx.float32)
    return a  # built from host data: already materialized (and safe to create inside a compile trace)


def _check_block(kernel: str, name: str, a: mx.array) -> None:
    """An int32 ``[8]`` block a decode kernel reads: its ``counts`` (:func:`kernel_counts`) or a compressor
    write's frontier row ``at`` (:func:`kernel_index`)."""
    if a.shape != (8,) or a.dtype != mx.int32:
        raise ValueError(f"{kernel}: {name} must be int32 [8], got {tuple(a.shape)} {a.dtype}")


def _check_f32(name: str, a: mx.array, shape: tuple) -> None:
    if tuple(a.shape) != tuple(shape):
        raise ValueError(f"{name}: shape {tuple(a.shape)}, expected {tuple(shape)}")
    if a.dtype != mx.float32:
        raise ValueError(f"{name}: dtype {a.dtype}, expected float32")


def _row_in_place(name: str, x: mx.array | Cols, width: int) -> tuple[mx.array, int]:
    """``(array, column offset)`` of a one-row f32 input of ``width`` columns, given as an array or as Cols."""
    if not isinstance(x, Cols):
        _check_f32(name, x, (1, width))
        return x, 0
    a = x.a
    if a.ndim != 2 or not 0 <= x.start <= a.shape[1] - width:
        raise ValueError(f"{name}: columns {x.start}..{x.start + width} of shape {tuple(a.shape)}, "
                         "expected a [1, N] row")
    _check_f32(name, a, (1, a.shape[1]))
    return a, x.start


# --- HC pre -----------------------------------------------------------------------------------------------


def _fn_pairs(fn: Any) -> mx.array | None:
    """fn's f16 values as u32 pairs ``[mix, n/2]`` (cached on the weight), or None if fn is not plain F16."""
    if getattr(fn, "qtype", None) != QT.F16 or getattr(fn, "data", None) is None or fn.data.dtype != mx.float16:
        return None
    # [mix, n/2], element 2i in the low half (little endian); evaluated once (it shares fn's buffer): left lazy,
    # a compiled decode step would replay the view every step
    return fn.derived("f16_pairs", lambda: fn.data.view(mx.uint32))


def _streams(name: str, S: mx.array | Cols, n_hc: int, E: int) -> tuple[mx.array, int, int]:
    """``(array, T, E)`` of a stream state: ``S [T, n_hc, E]`` f32, or one token's ``Cols(a, 0)`` of hc_mix's
    output row (``a [1, >= n_hc*E]``: the state first, then the partials; the caller's ``E`` is its width)."""
    if not isinstance(S, Cols):
        if S.ndim != 3:
            raise ValueError(f"{name} must be [T, n_hc, E], got shape {tuple(S.shape)}")
        _check_f32(name, S, (S.shape[0], n_hc, S.shape[2]))
        return S, S.shape[0], S.shape[2]
    if S.start != 0:
        raise ValueError(f"{name}: a state given as Cols starts at column 0, got start {S.start}")
    return _row_in_place(name, S, n_hc * E)[0], 1, E


def hc_pre(
    S: mx.array | Cols, fn: Any, scale: mx.array, base: mx.array, n_hc: int, n_iter: int, rms_eps: float,
    hc_eps: float, *, norm: mx.array | None = None, post_of: tuple | None = None, backend: str,
    tpb: int | None = None, split: bool | None = None, quantize: bool = False, cols: bool = False,
) -> tuple | None:  # fmt: skip
    """HC pre (docs/model.md §4.3) of ``n_hc`` streams with ``n_iter`` Sinkhorn iterations -> ``(S', x or n, post,
    comb, xq or None)``, or None where the kernels do not run (the ``fallback`` backend, fn not plain F16, n_hc
    not 1, 2 or 4, T = 0, E > HC_PRE_XK * HC_PRE_THREADS).

    S ``[T, n_hc, E]`` f32 (or one token's :class:`Cols` of a mix launch's row, see :func:`_streams`); fn the F16
    ``QuantWeight [2n+n², n*E]``; scale ``[3]``; base ``[2n+n²]``. ``x [T, E]``, ``post [T, n_hc]``, ``comb [T,
    n_hc, n_hc]``; with ``norm [E]`` the sublayer's normed input ``rms_norm(x, norm, rms_eps)`` instead of ``x``.
    ``post_of = (y, post, comb)`` applies HC post to S first, inside the split mix (decode-sized T only). ``tpb``
    and ``split`` override the launch choice: ``split`` runs hc_mix first (default for T <= HC_PRE_SPLIT_MAX_T).
    ``quantize``: on CUDA (and the sim backend, which runs its text) the launch also writes x quantized as
    :func:`ds4_mlx.kernels.quantize_x` does (``xq``); Metal has no 4-byte integer dot and keeps f32 x. With
    ``cols`` and one token, S' and the results are :class:`Cols` of the launches' output rows (what hc_mix,
    hc_pre, hc_post and the matvecs read in place).
    """
    mix = 2 * n_hc + n_hc * n_hc
    S, T, E = _streams("hc_pre: S", S, n_hc, fn.shape[1] // n_hc)
    if tuple(fn.shape) != (mix, n_hc * E):
        raise ValueError(f"hc_pre: fn shape {tuple(fn.shape)}, expected {(mix, n_hc * E)}")
    _check_f32("hc_pre: scale", scale, (3,))
    _check_f32("hc_pre: base", base, (mix,))
    if norm is not None:
        _check_f32("hc_pre: norm", norm, (E,))
    fnw = _fn_pairs(fn)
    if backend == "fallback" or fnw is None or n_hc not in (1, 2, 4) or T == 0 or E > HC_PRE_XK * HC_PRE_THREADS:
        return None
    b = backend
    if split is None:
        split = tpb is None and T <= HC_PRE_SPLIT_MAX_T
    if tpb is None:
        tpb = HC_PRE_TPB_PREFILL if T >= HC_PRE_TPB_MIN_T and not split else 1
    if tpb not in HC_PRE_TPB_CHOICES or (split and tpb != 1):
        raise ValueError(f"hc_pre: tpb must be one of {HC_PRE_TPB_CHOICES} (1 with split), got {tpb}")
    # The kernels index S [T, n_hc*E] and comb [T, n_hc*n_hc] flat: no reshapes (each would be a graph node).
    unused = _dummy(mx.float32)
    part, G, PO, N = unused, 0, 0, n_hc * E
    S_new = None
    if split:
        G = -(-(N // 2) // HC_MIX_THREADS)
        y, post, comb, gate_params = (unused,) * 3 + ((),) if post_of is None else _gate_inputs(*post_of, n_hc)
        PO = T * N if post_of is not None else 0  # the partials follow the new state in the one output
        (part,) = get_fused_kernel("hc_mix", b)(
            inputs=[S, fnw, _params(E, T, G, *gate_params), y, post, comb],
            template=[("NHC", n_hc), ("POST", int(post_of is not None))],
            grid=(G * HC_MIX_THREADS, T, 1),
            threadgroup=(HC_MIX_THREADS, 1, 1),
            output_shapes=[(1, PO + T * G * (mix + 1))],
            output_dtypes=[mx.float32],
        )
        if post_of is not None:
            S = S_new = part
    threads = HC_PRE_SPLIT_THREADS if split else HC_PRE_THREADS
    quantize = quantize and b in ("cuda", "sim") and E % 8 == 0  # octets; Metal keeps f32 x
    # One output row a token: x, post, comb, then (quantize) x quantized from a 16-byte aligned column XO.
    XO = E + -(-(n_hc + n_hc * n_hc) // 4) * 4
    PW = XO + 5 * E // 8 if quantize else E + n_hc + n_hc * n_hc
    (out,) = get_fused_kernel("hc_pre_xq" if quantize else "hc_pre", b)(
        inputs=[S, fnw, scale, base, _f32(rms_eps, hc_eps), _params(E, T, G, PW, XO, PO), part,
                unused if norm is None else norm],  # fmt: skip
        template=[("NHC", n_hc), ("NITER", n_iter), ("TPB", tpb), ("SPLIT", int(split)),
                  ("NORM", int(norm is not None))],  # fmt: skip
        grid=(-(-T // tpb) * threads * (2 if split else 1), 1, 1),  # split: a collapse and a gates group a token
        threadgroup=(threads, 1, 1),
        output_shapes=[(T, PW)],
        output_dtypes=[mx.float32],
    )
    if cols and T == 1:
        S = Cols(S_new, 0) if S_new is not None else S
        return S, Cols(out, 0), Cols(out, E), Cols(out, E + n_hc), Cols(out, XO) if quantize else None
    if S_new is not None:
        S = S_new[:, :PO].reshape(T, n_hc, E)
    c0 = E + n_hc
    return (S, out[:, :E], out[:, E:c0], out[:, c0 : c0 + n_hc * n_hc].reshape(T, n_hc, n_hc),
            out[:, XO:] if quantize else None)  # fmt: skip


def _gate_inputs(y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, n: int) -> tuple:
    """HC post's operands as hc_mix.body and hc_post.body read them: ``(y, post, comb, (ps, po, cs, co))``, token
    t's post gates at ``post[t * ps + po]`` and its comb at ``comb[t * cs + co]``. ``post`` and ``comb`` are arrays
    ``[T, n]``, ``[T, n, n]`` or :class:`Cols` of HC pre's output row (:func:`hc_pre` ``cols``)."""
    if isinstance(post, Cols):
        return y, post.a, comb.a, (post.a.shape[-1], post.start, comb.a.shape[-1], comb.start)
    return y, post, comb, (n, 0, n * n, 0)


# --- HC post ----------------------------------------------------------------------------------------------


def hc_post(
    S: mx.array | Cols, y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, *, n_hc: int | None = None,
    backend: str,
) -> mx.array | None:  # fmt: skip
    """HC post (docs/model.md §4.9), ``S_new = post ⊗ y + Cᵀ S`` -> ``[T, n_hc, E]``, or None where the kernel does
    not run (the ``fallback`` backend, E not a multiple of 32, T = 0). ``post`` and ``comb`` may be :class:`Cols`
    of HC pre's output row (:func:`hc_pre` ``cols``), and ``S`` one token's state as :class:`Cols` of the mix
    launch's row (give ``n_hc`` then)."""
    S, T, n, E = check_hc_post(S, y, post, comb, n_hc)
    tg = next((t for t in HC_POST_THREADS if E % t == 0), None)
    if backend == "fallback" or tg is None or T == 0:
        return None
    y, post, comb, gate_params = _gate_inputs(y, post, comb, n)
    return get_fused_kernel("hc_post", backend)(
        inputs=[S, y, post, comb, _params(E, T, *gate_params)],  # comb [T, n, n] read flat
        template=[("NHC", n)],
        grid=(E, T, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[(T, n, E)],
        output_dtypes=[mx.float32],
    )[0]


def check_hc_post(
    S: mx.array | Cols, y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, n_hc: int | None
) -> tuple[mx.array, int, int, int]:
    """Checks HC post's operands -> ``(S as an array, T, n_hc, E)`` (see :func:`_streams`)."""
    if isinstance(S, Cols) and n_hc is None:
        raise ValueError("hc_post: a state given as Cols needs n_hc")
    n = n_hc if n_hc is not None else (S.shape[1] if S.ndim == 3 else 0)
    S, T, E = _streams("hc_post: S", S, n, y.shape[-1])
    _check_f32("hc_post: y", y, (T, E))
    if isinstance(post, Cols) or isinstance(comb, Cols):
        if T != 1 or not (isinstance(post, Cols) and isinstance(comb, Cols)):
            raise ValueError("hc_post: post and comb as Cols are one token's, both Cols")
        _row_in_place("hc_post: post", post, n)
        _row_in_place("hc_post: comb", comb, n * n)
    else:
        _check_f32("hc_post: post", post, (T, n))
        _check_f32("hc_post: comb", comb, (T, n, n))
    return S, T, n, E


# --- compressor window ------------------------------------------------------------------------------------


def compressor_pool(
    kv: mx.array,
    score: mx.array,
    norm: mx.array,
    C: mx.array,
    S: mx.array,
    eps: float,
    *,
    lanes: int = 1,
    rounding: Any = None,
    out_dtype: mx.Dtype = mx.float32,
    backend: str,
) -> mx.array | None:
    """Pool, norm and RoPE finished compressor windows (docs/model.md §4.6 steps 4–6), then ds4's storage rounding
    ``rounding`` (a row rounding with ``fp8_dims``, ``qat`` and ``f16``, callable on rows, or ``None``) -> ``[nw,
    hd]`` as ``out_dtype`` (float32, or float16 when the rounding ends in f16); None where the kernel does not
    run (the ``fallback`` backend, hd not a multiple of 32 or over 1024, nw = 0).

    ``lanes=1``: ``kv``/``score`` are the entries ``[nw, n_ent, hd]``. ``lanes=2``: the ratio-4 frontier layout
    ``[nw, 2r, 2hd]`` (lane A of rows 0..r-1, lane B of rows r..2r-1). Scores already include APE. ``norm [hd]``;
    ``C, S [nw, hd]`` are the window starts' RoPE tables.
    """
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
    _check_pool_out("compressor_pool", rounding, out_dtype)
    if backend == "fallback" or not _pool_kernel_fits(hd) or nw == 0:
        return None
    rnd, row_dtype, finish = _pool_rounding(rounding, hd, out_dtype)
    f, i = _dummy(mx.float32), _dummy(mx.int32)
    row = get_fused_kernel("comp_pool", backend)(
        inputs=[kv, score, norm, C, S, _f32(float(eps)), f, f, f, i],
        template=[("HD", hd), ("ROWS", rows), ("LANES", lanes), ("EMIT", 0), ("KVO", 0), ("SCO", 0), *rnd],
        grid=(nw * hd, 1, 1),
        threadgroup=(hd, 1, 1),
        output_shapes=[(nw, hd), (1,)],
        output_dtypes=[row_dtype, mx.float32],
    )[0]
    return finish(row)


def _pool_kernel_fits(hd: int) -> bool:
    return hd % 32 == 0 and hd <= 1024  # one thread per output dim, whole simdgroups


_NO_ROUNDING = (("ROUND", 0), ("NOPE", 0), ("F16R", 0))


def _rounding_template(rounding: Any, hd: int) -> tuple | None:
    """comp_pool's (ROUND, NOPE, F16R) for a row rounding (``None``: no rounding); ``None`` where the kernel
    cannot apply it (then the rounding's own MLX ops round the kernel's f32 row)."""
    if rounding is None:
        return _NO_ROUNDING
    fp8, qat = int(rounding.fp8_dims), bool(rounding.qat)
    if (fp8 and qat) or (fp8 and (fp8 % 64 or fp8 > hd or hd % 64)) or (qat and hd != 128):
        return None
    return (("ROUND", 1 if fp8 else (2 if qat else 0)), ("NOPE", fp8), ("F16R", int(bool(rounding.f16))))


def _pool_rounding(rounding: Any, hd: int, out_dtype: mx.Dtype) -> tuple[tuple, mx.Dtype, Any]:
    """A comp_pool launch's rounding template, its row's type, and what is left to do to the row: nothing
    where the kernel rounds, else the rounding's MLX ops and the cast of the kernel's f32 row."""
    rnd = _rounding_template(rounding, hd)
    if rnd is not None:
        return rnd, out_dtype, lambda row: row
    return _NO_ROUNDING, mx.float32, lambda row: rounding(row).astype(out_dtype)


def _check_pool_out(kernel: str, rounding: Any, out_dtype: mx.Dtype) -> None:
    if out_dtype not in (mx.float32, mx.float16):
        raise ValueError(f"{kernel}: out_dtype must be float32 or float16, got {out_dtype}")
    if out_dtype == mx.float16 and not (rounding is not None and rounding.f16):
        raise ValueError(f"{kernel}: a float16 row needs a rounding with f16 (the row must be f16-exact)")


def compressor_emit(
    fr: mx.array, kv_row: mx.array | Cols, score_row: mx.array | Cols, ape: mx.array, at: mx.array, norm: mx.array,
    C: mx.array, S: mx.array, eps: float, *, lanes: int, neg: float, rounding: Any = None,
    out_dtype: mx.Dtype = mx.float32, backend: str,
) -> tuple[mx.array, mx.array] | None:  # fmt: skip
    """The decode token that completes a window, in one launch: :func:`compressor_write` of its row,
    :func:`compressor_pool` of the frontier (``rounding``, ``out_dtype`` as there), then the next frontier
    (docs/model.md §4.6) -> ``(row [1, hd], fr)``; None where the kernel does not run (the ``fallback`` backend, hd
    not a multiple of 32 or over 1024).

    ``fr [2, rows, lanes*hd]`` is the frontier, kv then score. The next frontier: with ``lanes=2`` (ratio 4) the
    finished window's rows ``r..2r-1`` become rows ``0..r-1`` and rows ``r..`` are empty (kv 0, score ``neg``);
    with ``lanes=1`` it is all empty.
    """
    if fr.ndim != 3 or fr.shape[0] != 2 or lanes not in (1, 2) or fr.shape[1] % lanes or fr.shape[2] % lanes:
        raise ValueError(f"compressor_emit: the frontier must be [2, rows, lanes*hd] with lanes 1|2 dividing both, "
                         f"got {tuple(fr.shape)}, lanes={lanes}")
    _, rows, width = fr.shape
    hd = width // lanes
    for name, a, shape in (("frontier", fr, (2, rows, width)), ("ape", ape, (1, width)), ("norm", norm, (hd,)),
                           ("C", C, (1, hd)), ("S", S, (1, hd))):  # fmt: skip
        _check_f32(f"compressor_emit: {name}", a, shape)
    (kv_in, kvo), (sc_in, sco) = (_row_in_place(f"compressor_emit: {n}", a, width)
                                  for n, a in (("kv_row", kv_row), ("score_row", score_row)))  # fmt: skip
    _check_block("compressor_emit", "at", at)
    _check_pool_out("compressor_emit", rounding, out_dtype)
    if backend == "fallback" or not _pool_kernel_fits(hd):
        return None
    rnd, row_dtype, finish = _pool_rounding(rounding, hd, out_dtype)
    row, fr = get_fused_kernel("comp_pool", backend)(
        inputs=[fr, _dummy(mx.float32), norm, C, S, _f32(float(eps), float(neg)), kv_in, sc_in, ape, at],
        template=[("HD", hd), ("ROWS", rows), ("LANES", lanes), ("EMIT", 1), ("KVO", kvo), ("SCO", sco), *rnd],
        grid=(hd, 1, 1),
        threadgroup=(hd, 1, 1),
        output_shapes=[(1, hd), (2, rows, width)],
        output_dtypes=[row_dtype, mx.float32],
    )
    return finish(row), fr


#: Threads per threadgroup of the compressor frontier write.
COMP_WRITE_THREADS = 256


def compressor_write(
    fr: mx.array, kv_row: mx.array | Cols, score_row: mx.array | Cols, ape: mx.array, at: mx.array, *, backend: str
) -> mx.array | None:
    """One decode token into its compressor frontier ``fr [2, R, W]`` (kv, then score; docs/model.md §4.6):
    ``kv[at] = kv_row``, ``score[at] = score_row + ape`` -> the new frontier; None on the ``fallback`` backend.
    ``kv_row``, ``score_row`` (each ``[1, W]`` or :class:`Cols`) and ``ape`` ``[1, W]`` are f32, ``at`` the
    frontier row (:func:`kernel_index`)."""
    if fr.ndim != 3 or fr.shape[0] != 2:
        raise ValueError(f"compressor_write: the frontier must be [2, R, W], got shape {tuple(fr.shape)}")
    _, R, W = fr.shape
    _check_f32("compressor_write: frontier", fr, (2, R, W))
    _check_f32("compressor_write: ape", ape, (1, W))
    (kv_in, kvo), (sc_in, sco) = (_row_in_place(f"compressor_write: {n}", a, W)
                                  for n, a in (("kv_row", kv_row), ("score_row", score_row)))  # fmt: skip
    _check_block("compressor_write", "at", at)
    if backend == "fallback":
        return None
    return get_fused_kernel("comp_write", backend)(
        inputs=[fr, kv_in, sc_in, ape, at, _params(R, W, kvo, sco)],
        grid=(R * W, 1, 1),
        threadgroup=(COMP_WRITE_THREADS, 1, 1),
        output_shapes=[(2, R, W)],
        output_dtypes=[mx.float32],
    )[0]


# --- per-step inputs in device memory ---------------------------------------------------------------------


def resident(a: mx.array) -> mx.array:
    """``a``, made from host data, copied to device memory now (on CUDA; elsewhere ``a`` itself): for the
    per-step inputs of decode, which are cached and reused by later steps.

    MLX-CUDA keeps arrays made from host data in managed memory, which the GPU page-faults in at first use:
    under Nsight Compute the first kernel to read a step's new host arrays (RoPE rows, counts) took 100-300 µs
    instead of 3 µs, every step (benchmarks/RESULTS.md). The copy is evaluated here, on a stream of its own,
    not left to the step that first reads it: a step then queues the same graph whether or not it made new
    inputs, so MLX-CUDA reuses its CUDA graphs (each new one cost 1-3 ms to instantiate). Being data, not a
    lazy op, the result also serves any thread (MLX streams are per thread).
    """
    if not _on_cuda():
        return a
    with _RESIDENT_LOCK, mx.stream(_resident_stream()):
        out = a * 1
        mx.eval(out)
    return out


_RESIDENT_LOCK = threading.Lock()  # the copies' stream may serve any thread, one at a time


@cache
def _resident_stream() -> mx.Stream:
    return mx.new_thread_unsafe_stream(mx.default_device())


def fault_in(a: mx.array) -> None:
    """Read every page of ``a`` on the device once (on CUDA; nothing elsewhere): the pages of an array made from
    host data move to the GPU then, not one at a time in later steps. For the embedding table, which a decode
    step reads one row of, mostly rows that prefill never touched: that row's fault took 179 µs of a step's GPU
    time (Nsight Compute, benchmarks/RESULTS.md)."""
    if _on_cuda():
        mx.eval(a.max())


def _on_cuda() -> bool:
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def stream_key() -> str:
    """The current default stream, as a cache key for lazy arrays made once and reused by later steps (RoPE
    rows: views of a resident block), which only the stream they were made on may run: MLX's streams belong
    to their thread (the main thread's must not serve another thread's decode steps). ~0.5 µs."""
    return str(mx.default_stream(mx.default_device()))


@lru_cache(maxsize=4096)
def kernel_counts(a: int, b: int) -> mx.array:
    """The ``counts`` input of :func:`attend_one` and :func:`top_k_rows`: int32 ``[8] = (a, b, 0, ...)``, made
    on the host and cached, so a compiled step takes it as an input instead of baking the numbers into its trace."""
    return resident(_params(a, b))


def kernel_index(i: int) -> mx.array:
    """An index that a kernel reads (a compressor's frontier row): int32 ``[8] = (i, 0, ...)``, resident, cached.

    Not int32 ``[1]``: MLX-CUDA serves allocations of up to 8 bytes from a small-block pool that kernels read
    like host memory, every thread that reads the index waiting on the bus. A 512 KB frontier write took 18 µs
    reading ``[1]`` or ``[2]``, 2.3 µs reading ``[8]`` (Nsight Compute, benchmarks/RESULTS.md)."""
    return kernel_counts(i, 0)


# --- one-token attention ----------------------------------------------------------------------------------


def attend_one(
    q: mx.array,
    raw: mx.array,
    comp: mx.array | None,
    idx: mx.array | None,
    counts: mx.array,
    sinks: mx.array,
    C: mx.array,
    S: mx.array,
    scale: float,
    *,
    nsg: int | None = None,
    backend: str,
) -> mx.array | None:
    """One decode token's attention and the inverse RoPE of its output (docs/model.md §4.4) -> ``o [1, H, D]`` f32;
    None where the kernel does not run (the ``fallback`` backend, D not a multiple of 32 or over ATTN_MAX_HD).

    ``q [1, H, D]`` f32 (RoPE'd); ``raw [Mr, D]``: the raw window, every row visible; ``comp [cap, D]``: the
    compressed-row buffer (raw's dtype, f16 or f32) or None; ``idx [1, k]`` (u)int32: the rows of ``comp`` the
    indexer selected, or None to attend to the first ``counts[1]`` rows; ``counts`` int32 ``[8] = (Mr, rows of
    comp attended, ...)``, made on the host so one compiled step serves every token; ``sinks [H]``; ``C, S
    [1, D]``: the token's RoPE tables; ``scale``: the score scale. ``nsg``: simdgroups a head (default
    the backend's ``ATTN_NSG``; benchmarks sweep it), each walking every nsg-th key; ``(nsg + 1) * D`` floats
    of threadgroup memory must fit the backend's (``TG_MEMORY``).
    """
    b = backend
    if q.ndim != 3 or q.shape[0] != 1:
        raise ValueError(f"attend_one: q must be [1, H, D], got shape {tuple(q.shape)}")
    _, H, D = q.shape
    _check_f32("attend_one: q", q, (1, H, D))
    _check_f32("attend_one: sinks", sinks, (H,))
    _check_f32("attend_one: C", C, (1, D))
    _check_f32("attend_one: S", S, (1, D))
    if raw.ndim != 2 or raw.shape[1] != D or raw.dtype not in (mx.float16, mx.float32):
        raise ValueError(f"attend_one: raw must be [Mr, {D}] f16/f32, got {tuple(raw.shape)} {raw.dtype}")
    if comp is not None and (comp.ndim != 2 or comp.shape[1] != D or comp.dtype != raw.dtype):
        raise ValueError(f"attend_one: comp must be [cap, {D}] {raw.dtype}, got {tuple(comp.shape)} {comp.dtype}")
    if idx is not None and (comp is None or idx.ndim != 2 or idx.shape[0] != 1 or idx.dtype not in (mx.int32, mx.uint32)):
        raise ValueError(f"attend_one: idx must be [1, k] int32/uint32 rows of comp, got {(idx.shape, idx.dtype)}")
    _check_block("attend_one", "counts", counts)
    nsg = ATTN_NSG.get(b, 8) if nsg is None else nsg
    if nsg not in (1, 2, 4, 8, 16, 32) or (b in TG_MEMORY and 4 * (nsg + 1) * D + 8 * nsg > TG_MEMORY[b]):
        raise ValueError(f"attend_one: nsg={nsg} simdgroups of {D} dims do not fit a {b} threadgroup")
    if b == "fallback" or D % 32 or D > ATTN_MAX_HD:
        return None
    # The kernel indexes flat buffers: inputs go in as they are shaped (a reshape would be one more graph node).
    return get_fused_kernel("attn_one", b)(
        inputs=[q, raw, raw if comp is None else comp, _params(0) if idx is None else idx, sinks, C, S, counts,
                _f32(float(scale))],
        template=[("HD", D), ("NSG", nsg), ("USE_IDX", int(idx is not None)), ("KV16", int(raw.dtype == mx.float16))],
        grid=(H * nsg * 32, 1, 1),
        threadgroup=(nsg * 32, 1, 1),
        output_shapes=[(1, H, D)],
        output_dtypes=[mx.float32],
    )[0]  # fmt: skip


# --- indexer scores and top-k -----------------------------------------------------------------------------

#: Threads per threadgroup of the indexer scores (one simdgroup per row), and the most threadgroups a launch
#: uses (they stride over the rows: the grid follows the buffer's capacity, most of which may be unwritten).
INDEX_SCORES_THREADS = 256
INDEX_SCORES_MAX_GROUPS = 1024


def index_scores(
    iq: mx.array, w: mx.array | Cols, keys: mx.array, counts: mx.array, scale: float, *, backend: str
) -> mx.array | None:
    """The indexer's scores of one decode token (docs/model.md §4.7) -> ``[1, N]``, ``sum_h w[h] * scale *
    relu(keys . iq[h])``, or None where the kernel does not run (the ``fallback`` backend, D not a multiple of 32
    or over 256, N = 0): ``iq [1, H, D]`` query heads, ``w [1, H]`` head weights (or :class:`Cols`), ``keys [N,
    D]`` the indexer rows, of which the first ``counts[0]`` are scored (``counts`` from :func:`kernel_counts`;
    the kernel writes 0 past them)."""
    if iq.ndim != 3 or iq.shape[0] != 1:
        raise ValueError(f"index_scores: iq must be [1, H, D], got shape {tuple(iq.shape)}")
    _, H, D = iq.shape
    N = keys.shape[0]
    _check_f32("index_scores: iq", iq, (1, H, D))
    w_in, wo = _row_in_place("index_scores: w", w, H)
    _check_f32("index_scores: keys", keys, (N, D))
    _check_block("index_scores", "counts", counts)
    if backend == "fallback" or D % 32 or D > 256 or N == 0:
        return None
    nsg = INDEX_SCORES_THREADS // 32
    G = min(-(-N // nsg), INDEX_SCORES_MAX_GROUPS)
    return get_fused_kernel("index_scores", backend)(
        inputs=[iq, w_in, keys, counts, _params(N, G, wo), _f32(float(scale))],
        template=[("NH", H), ("HD", D)],
        grid=(G * INDEX_SCORES_THREADS, 1, 1),
        threadgroup=(INDEX_SCORES_THREADS, 1, 1),
        output_shapes=[(1, N)],
        output_dtypes=[mx.float32],
    )[0]


def top_k_rows(scores: mx.array, counts: mx.array, k: int, *, backend: str) -> mx.array | None:
    """Per row of ``scores [R, N]``: the ``k`` highest of its first n scores, ties to the lower row, as row indices
    ``[R, k]`` in ascending order; None on the ``fallback`` backend. ``counts`` int32 ``[8] = (n, k, first, ratio,
    N, ...)``: n is ``counts[0]`` for every row, or with ``ratio`` > 0 row r's ``min(n, (first + r) // ratio)``
    (a chunk's queries); a row with n <= k lists ``0 .. k-1``. Decode's one row takes :func:`kernel_counts`."""
    if scores.ndim != 2 or scores.dtype != mx.float32:
        raise ValueError(f"top_k_rows: scores must be f32 [R, N], got {tuple(scores.shape)} {scores.dtype}")
    _check_block("top_k_rows", "counts", counts)
    if backend == "fallback":
        return None
    return get_fused_kernel("topk_rows", backend)(
        inputs=[scores, counts],
        template=[("NT", TOPK_THREADS)],
        grid=(TOPK_THREADS, scores.shape[0], 1),
        threadgroup=(TOPK_THREADS, 1, 1),
        output_shapes=[(scores.shape[0], k)],
        output_dtypes=[mx.int32],
    )[0]


def chunk_top_k_counts(n: int, k: int, first: int, ratio: int) -> mx.array:
    """The ``counts`` of :func:`top_k_rows` for a chunk's queries: row r sees ``min(n, (first + r) // ratio)``
    compressed rows of its ``[R, n]`` scores."""
    return _params(n, k, first, ratio, n)


# --- query heads and KV row -------------------------------------------------------------------------------


def qkv_rows(
    qb: mx.array | Scaled16,
    kvb: mx.array | Cols,
    norm: mx.array,
    C: mx.array,
    S: mx.array,
    eps: float,
    n_head: int,
    *,
    nope_fp8: int = 0,
    f16r: bool = False,
    window: tuple[mx.array, int, mx.dtype] | None = None,
    backend: str,
) -> tuple[mx.array, mx.array] | None:
    """Query heads and KV row after their projections (docs/model.md §4.4, §4.12) -> ``q [T, n_head, D]``,
    ``kv [T, D]``; None where the kernel does not run (the ``fallback`` backend, D not a multiple of 64 or over 1024, T = 0).

    ``qb [T, n_head*D]`` (attn_q_b output, float32, or :class:`Scaled16` read as it is): per-head RMS norm (no
    weight), RoPE. ``kvb [T, D]`` (attn_kv output; one token's may be :class:`Cols`): RMS norm × ``norm [D]``,
    RoPE, then the FP8 round trip of the first ``nope_fp8`` dims (0: none) and f16 rounding (``f16r``), as ds4
    stores the row. ``C, S [T, D]``: the tokens' RoPE tables. ``window = (raw, keep, dtype)`` (one token):
    instead of the row, the raw window after it, ``concat(raw[-keep:], row)`` stored as ``dtype``, in the same
    launch.
    """
    qb, q_scale = (qb.a, 1.0 / F16_PRODUCT_SCALE) if isinstance(qb, Scaled16) else (qb, 1.0)
    if isinstance(kvb, Cols):  # one token
        T, D = 1, qb.shape[-1] // n_head
        kv_in, kvo = _row_in_place("qkv_rows: kvb", kvb, D)
    elif kvb.ndim != 2:
        raise ValueError(f"qkv_rows: kvb must be [T, D], got shape {tuple(kvb.shape)}")
    else:
        (T, D), kv_in, kvo = kvb.shape, kvb, 0
        _check_f32("qkv_rows: kvb", kvb, (T, D))
    if qb.shape != (T, n_head * D) or qb.dtype != (mx.float32 if q_scale == 1.0 else mx.float16):
        raise ValueError(f"qkv_rows: qb {qb.shape} {qb.dtype}, expected [{T}, {n_head * D}] float32 or Scaled16")
    _check_f32("qkv_rows: norm", norm, (D,))
    _check_f32("qkv_rows: C", C, (T, D))
    _check_f32("qkv_rows: S", S, (T, D))
    if nope_fp8 % 64 or not 0 <= nope_fp8 <= D:
        raise ValueError(f"qkv_rows: nope_fp8 must be a multiple of 64 in [0, {D}], got {nope_fp8}")
    if backend == "fallback" or D % 64 or D > 1024 or T == 0:
        return None
    if window is None:
        raw, keep, dtype, wparams, rows = _dummy(mx.float32), 0, mx.float32, _params(0, 0, kvo), T
    else:
        raw, keep, dtype = window
        if T != 1 or raw.ndim != 2 or raw.shape[1] != D or not 0 <= keep <= raw.shape[0]:
            raise ValueError(f"qkv_rows: window needs one token and raw [>= {keep}, {D}], got T={T}, {tuple(raw.shape)}")
        raw = raw.astype(dtype)  # a no-op once the window is stored as dtype (a fresh cache starts f32)
        wparams, rows = _params(raw.shape[0], keep, kvo), keep + 1
    # threadgroups a token (qkv_rows.body): the query heads' (a head a simdgroup) and the KV row's; a window's
    # copy is shared by n_head + 1 of them
    groups = n_head + 1 if window is not None else -(-n_head // (D // 32)) + 1
    return tuple(get_fused_kernel("qkv_rows", backend)(
        inputs=[qb, kv_in, norm, C, S, _f32(float(eps), q_scale), raw, wparams],
        template=[("HD", D), ("NH", n_head), ("NOPE", nope_fp8), ("F16R", int(f16r)), ("WIN", int(window is not None))],
        grid=(T * groups * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(T, n_head, D), (rows, D)],
        output_dtypes=[mx.float32, dtype],
    ))  # fmt: skip


# --- MoE router -------------------------------------------------------------------------------------------


@lru_cache(maxsize=16)
def _zeros(n: int) -> mx.array:
    return mx.array(np.zeros(n, np.float32))


def moe_route(
    logits: mx.array, bias: mx.array | None, k: int, scale: float, norm: bool, *, packed: bool = False,
    backend: str,
) -> tuple[mx.array, mx.array | None] | None:  # fmt: skip
    """Top-k router (docs/model.md §4.8) of ``logits [T, n_expert]`` (ffn_gate_inp output) -> expert ids int32
    ``[T, k]`` by descending ``sqrt(softplus(logit)) + bias`` (ties to the lower id) and their weights ``[T,
    k]``: the unbiased probs, normalized if ``norm``, times ``scale``; None where the kernel does not run (the
    ``fallback`` backend, k > 32, n_expert > 1024, T = 0). ``packed``: ``(route, None)`` instead, the launch's one
    int32 output ``[T, 2k]``, each row the ids then the weights' f32 bits, which :func:`experts_with_shared`
    reads as it is (:func:`unpack_route` splits it)."""
    if logits.ndim != 2:
        raise ValueError(f"moe_route: logits must be [T, n_expert], got shape {tuple(logits.shape)}")
    T, NE = logits.shape
    _check_f32("moe_route: logits", logits, (T, NE))
    if bias is not None:
        _check_f32("moe_route: bias", bias, (NE,))
    if not 0 < k <= NE:
        raise ValueError(f"moe_route: k must be in 1..{NE}, got {k}")
    if backend == "fallback" or k > 32 or NE > 1024 or T == 0:
        return None
    threads = -(-NE // 32) * 32
    (route,) = get_fused_kernel("moe_route", backend)(
        inputs=[logits, _zeros(NE) if bias is None else bias, _f32(float(scale))],
        template=[("NE", NE), ("K", k), ("NORM", int(norm))],
        grid=(T * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(T, 2 * k)],
        output_dtypes=[mx.int32],
    )
    return (route, None) if packed else unpack_route(route)


def unpack_route(route: mx.array) -> tuple[mx.array, mx.array]:
    """:func:`moe_route`'s packed ``[T, 2k]`` -> ``(ids [T, k] int32, weights [T, k] f32)``."""
    k = route.shape[1] // 2
    return route[:, :k], route[:, k:].view(mx.float32)


# --- indexer query heads ----------------------------------------------------------------------------------

#: The indexer's head width, which index_q.body's Hadamard transform spans.
INDEX_Q_DIM = 128


def index_query(
    qb: mx.array, C: mx.array, S: mx.array, n_head: int, qat: bool, *, backend: str
) -> mx.array | None:
    """The indexer's query heads (docs/model.md §4.7) -> ``[T, n_head, 128]``: RoPE of ``qb [T, n_head*128]``
    (indexer.attn_q_b output) with the tokens' tables ``C, S [T, 128]``, then, with ``qat``, Hadamard-128 and
    the FP4 round trip; None where the kernel does not run (the ``fallback`` backend, T = 0)."""
    if qb.ndim != 2:
        raise ValueError(f"index_query: qb must be [T, n_head*128], got shape {tuple(qb.shape)}")
    T, D = qb.shape[0], INDEX_Q_DIM
    _check_f32("index_query: qb", qb, (T, n_head * D))
    _check_f32("index_query: C", C, (T, D))
    _check_f32("index_query: S", S, (T, D))
    if backend == "fallback" or T == 0:
        return None
    return get_fused_kernel("index_q", backend)(
        inputs=[qb, C, S],
        template=[("NH", n_head), ("QAT", int(qat))],
        grid=(T * n_head * D, 1, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(T, n_head, D)],
        output_dtypes=[mx.float32],
    )[0]


# --- MoE experts: matvec epilogues --------------------------------------------------------------------------


def _mv_ok(b: str, T: int, *ws: Any) -> bool:
    return b != "fallback" and 0 < T <= MV_MAX_TOKENS and all(supports(w) for w in ws)


def expert_swiglu(
    gate: Any, up: Any, x: mx.array, clamp: float, ids: mx.array | None = None, route_w: mx.array | None = None,
    *, backend: str,
) -> mx.array | None:  # fmt: skip
    """The experts' clamped SwiGLU (docs/model.md §4.8), ``silu(min(gate·x, clamp)) * clip(up·x, ±clamp)``, times
    ``route_w`` if given, in one matvec launch that reads both weights; None where it does not run (the
    ``fallback`` backend, T = 0 or over MV_MAX_TOKENS, weights the kernels or the SwiGLU epilogue do not take).

    Dense (the shared expert): ``x [T, E]`` -> ``[T, F]``. Gathered (the routed experts, ``ids [T, k]``, route
    weights ``[T, k]``): -> ``[T, k, F]``.
    """
    T = x.shape[0]
    if gate.shape != up.shape or gate.qtype != up.qtype:
        raise ValueError(f"expert_swiglu: gate {gate.shape} {gate.qtype.name} and up {up.shape} {up.qtype.name} differ")
    if not _mv_ok(backend, T, gate) or gate.qtype not in MV_SWIGLU_TYPES:
        return None
    x2 = x if x.dtype == mx.float32 else x.astype(mx.float32)
    if ids is None:
        return mv(gate, x2, backend, epi=MV_SWIGLU, w2=up, aux=route_w, clamp=float(clamp))
    k = ids.shape[1]
    return mv(gate, x2, backend, ids=ids, k_slots=k, epi=MV_SWIGLU, w2=up, aux=route_w, clamp=float(clamp),
              shape=(T, k, gate.shape[1]))  # fmt: skip


def expert_down_sum(
    down: Any, mid: mx.array, ids: mx.array, add: mx.array | None = None, *, backend: str
) -> mx.array | None:
    """The routed experts' down projections summed per token (docs/model.md §4.8): ``mid [T, k, F]``, ``ids [T, k]``
    -> ``sum_j down[ids[t, j]] @ mid[t, j]`` ``[T, E]``, plus ``add [T, E]`` (the shared expert) if given, in one
    matvec launch; None where it does not run (the ``fallback`` backend, T = 0 or over MV_MAX_TOKENS, a weight
    the kernels do not take)."""
    T = mid.shape[0]
    if not _mv_ok(backend, T, down):
        return None
    x2 = mid if mid.dtype == mx.float32 else mid.astype(mx.float32)  # [T, k, F]: mv reads it flat
    return mv(down, x2, backend, ids=ids, k_slots=ids.shape[1], epi=MV_SUM, aux=add)


def takes_quantized_x(*weights: Any) -> bool:
    """Whether the routed gate+up launch can read quantized x with these weights (``MV_XQ_TYPES``)."""
    return all(w.qtype in MV_XQ_TYPES for w in weights)


def experts_with_shared(
    gate: Any, up: Any, down: Any, shared_gate_up: Any, shared_down: Any, x: mx.array | Cols, ids: mx.array,
    route_w: mx.array | None, clamp: float, *, xq: mx.array | Cols | None = None, backend: str,
) -> mx.array | None:  # fmt: skip
    """The whole expert part of the MoE (docs/model.md §4.8) in two matvec launches for decode-sized T:
    ``sum_j down[ids_j] (route_w_j · swiglu(gate[ids_j] x, up[ids_j] x)) + shared_down · swiglu(shared x)``
    ``[T, E]``, the shared expert read by the routed launches (mv ``shared``) instead of two launches of its
    own. ``shared_gate_up`` is its gate rows then its up rows. ``xq``: x quantized (:func:`hc_pre` ``quantize``),
    which the gate+up launch reads instead of x where its weight types allow (``MV_XQ_TYPES``): integer dots, as
    ds4-CUDA does (docs/quants.md §2.4); where both launches run as mv_reg.body, gate+up then writes mid quantized
    too and the down launch dots it in integers (ds4-CUDA quantizes mid as well). ``x`` and ``xq`` may be one
    token's :class:`Cols` of HC pre's output row. ``ids [T, k]`` with ``route_w [T, k]``, or :func:`moe_route`'s
    packed ``[T, 2k]`` with ``route_w`` None. None where the kernels do not apply (the caller runs
    :func:`expert_swiglu` and :func:`expert_down_sum` then)."""
    b, T = backend, 1 if isinstance(x, Cols) else x.shape[0]
    F, E = gate.shape[-2:]
    if not (_mv_ok(b, T, gate, down, shared_gate_up, shared_down) and gate.qtype == up.qtype
            and gate.qtype in MV_SWIGLU_TYPES and shared_gate_up.shape == (2 * F, E)
            and shared_down.shape == (E, F) and shared_down.qtype == shared_gate_up.qtype):  # fmt: skip
        return None
    packed = route_w is None
    k = ids.shape[1] // 2 if packed else ids.shape[1]
    use_xq = xq is not None and takes_quantized_x(gate, up, shared_gate_up)
    # and mid quantized by the gate+up launch, for integer dots in the down launch, where both run as mv_reg.body
    q_mid = (use_xq and reg_direct(gate, b, MV_SWIGLU, True, True, shared_gate_up.qtype)
             and reg_direct(down, b, MV_SUM, True, True, shared_down.qtype))  # fmt: skip
    x2 = xq if use_xq else x  # mv reads Cols in place
    if not isinstance(x2, Cols) and x2.dtype != mx.float32:
        x2 = x2.astype(mx.float32)
    mid = mv(gate, x2, b, ids=ids, k_slots=k, epi=MV_SWIGLU, w2=up, aux=route_w, clamp=float(clamp),
             shared=shared_gate_up, xq=use_xq, route_packed=packed, quantize_y=q_mid)  # [T·k + T, F]: routed, shared
    return mv(down, mid, b, ids=ids, k_slots=k, epi=MV_SUM, shared=shared_down, route_packed=packed, xq=q_mid)


# --- the next token ---------------------------------------------------------------------------------------


@lru_cache(maxsize=64)
def _sample_params(temperature: float, min_p: float) -> mx.array:
    return resident(_f32(temperature, min_p))


def sample_token(logits: mx.array, temperature: float, min_p: float, u: mx.array, *, backend: str) -> mx.array | None:
    """One id from ``logits`` f32 ``[V]`` with ds4's greedy (``temperature <= 0``) or top-k-off, top-p-1 draw, in
    one launch: int32 ``[1]``; None on the ``fallback`` backend. ``u`` f32 ``[1]``: the step's uniform; the id is
    the first whose running sum of the weights ``exp((l - l_max) / T)`` kept by ``min_p`` reaches ``u`` times
    their total."""
    if logits.ndim != 1 or logits.dtype != mx.float32:
        raise ValueError(f"sample_token: logits must be f32 [V], got {tuple(logits.shape)} {logits.dtype}")
    _check_f32("sample_token u", u, (1,))
    if backend == "fallback":
        return None
    return get_fused_kernel("sample", backend)(
        inputs=[logits, _sample_params(float(temperature), float(min_p)), u, kernel_counts(logits.shape[0], 0)],
        template=[("NT", SAMPLE_THREADS)],
        grid=(SAMPLE_THREADS, 1, 1),
        threadgroup=(SAMPLE_THREADS, 1, 1),
        output_shapes=[(1,)],
        output_dtypes=[mx.int32],
    )[0]
