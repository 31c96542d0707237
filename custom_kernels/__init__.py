"""ds4-mlx custom kernels (installed as ``ds4_mlx.kernels``): write-once bodies for Metal and CUDA.

Each kernel is one ``*.body`` file plus the shared ``ds_prelude.h`` macro layer and, for the quant kernels,
``ds_quant.h`` and the kernel's own ``<kind>.h`` (docs/quants.md §3.4). This module renders them without comments
or indentation (:func:`minify`) for ``mx.fast.metal_kernel`` / ``mx.fast.cuda_kernel``, builds each kernel
once per backend, validates inputs and picks grid and threadgroup. :class:`ds4_mlx.weights.QuantWeight` calls
:func:`matmul` and :func:`gather_matmul` here when the backend is ``metal`` or ``cuda`` (or ``sim``: the CUDA
text run on the CPU by sim.py, for tests); the graph's fused kernels are in :mod:`.fused`.

The kernels sit under the rest of the package: they take weights duck-typed and the backend as an argument, and
import from ``ds4_mlx`` only the leaf modules :mod:`ds4_mlx.paths` (where CUDA's rendered sources are written)
and :mod:`ds4_mlx.quants` (the IQ2_XXS grid).

Kernels:
- ``mv``: decode matvec for a few tokens, dense or expert-gathered (``mul_mv_id``): f32 activations, weights
  decoded exactly in registers, f32 accumulation (docs/quants.md §2.5); epilogues for the MoE (the SwiGLU of gate
  and up read in one launch, the sum of a token's routed experts).
- ``mv_reg``: the same results for the types and epilogues of ``MV_REG``, each thread reading its rows' bytes
  straight into registers instead of staging spans in threadgroup memory; where measured faster on CUDA (the
  routed gate+up with quantized x, the F16 matvecs), ``mv`` dispatches to it.
- ``mm``: the routed experts' prefill product (``mul_mm_id`` over a pair list sorted by expert): 128 weight rows
  by 32 or 64 tokens a threadgroup, f16 tiles, f32 accumulation (docs/quants.md §8 ruling 2); an epilogue for the
  experts' SwiGLU of gate and up in one launch.
- ``deq``: weight rows decoded to exact f32, or rounded once to f16 for the dense prefill products, which then
  run on MLX's own matmul (cuBLAS on CUDA: f16 tensor cores with f32 accumulation).
- ``index_mm``: the indexer's scores of a prefill chunk, one tiled product with the ReLU and the head-weighted sum
  as its epilogue (the [T, H, N] head scores never reach memory).
- ``attn_chunk``: a prefill chunk's attention, every query over its window and its compressed or selected rows,
  read where they are; two passes over the keys (max and sum, then the normalized P·V).
- Q8_0 2-D weights can instead run through MLX's own affine 8-bit kernels after a lossless repack
  (``u = q + 128, scale = d, bias = -128 d``, docs/quants.md §4.3), see :func:`q8_0_affine` and :func:`q8_mode`.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from ds4_mlx.paths import cache_dir
from ds4_mlx.quants import iq2xxs_grid_bytes

SOURCE_DIR = Path(__file__).resolve().parent

#: Types the custom kernels handle (plain types need ``in % 32 == 0``).
KERNEL_TYPES = (QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS, QT.F16, QT.BF16, QT.F32)

#: Decode matvec tuning per type: (NR rows per simdgroup, NSG simdgroups per threadgroup), measured on the H200
#: (benchmarks/RESULTS.md): NR 4 → 8 helped Q4_K (+33%) and NR 2 → 4 the Q8_0 launches; IQ2_XXS at NR 16 and
#: Q2_K at NR 8 were slower (registers / fewer blocks); F16 (4, 2) took 0.75-0.83x the device time of (2, 4)
#: on the model's F16 launches (benchmarks/mv_sweep.py, Nsight Compute).
MV_CONFIG = {
    QT.IQ2_XXS: (4, 2),
    QT.Q2_K: (4, 2),
    QT.Q4_K: (8, 2),
    QT.Q8_0: (4, 4),
    QT.F16: (4, 2),
    QT.BF16: (4, 2),
    QT.F32: (1, 4),
}
#: Weights of a row that a simdgroup stages at a time (mv.body: a span of 32 units of 32 weights).
MV_SPAN = 1024
#: Rows of at most this many weights are one span per simdgroup, so the activation loads (and an RMSNorm
#: prologue's) are a large part of the launch: twice the rows per simdgroup and half the simdgroups (the same
#: staged bytes), where NSG >= 4. Q8_0 q_b (32768 x 1024) with its RMSNorm prologue: 34.4 -> 27.7 µs.
MV_SHORT_K = MV_SPAN
#: Split K across simdgroups when the launch has few threadgroups (all output rows counted): all NSG of them
#: below MV_KSPLIT_ALL threadgroups, two below MV_KSPLIT_BELOW (out_b 4096 x 8192: KS 4 25.8 µs, KS 2
#: 22.8; the routed down sum, 512 threadgroups: KS 1 40.3, KS 2 36.1), none above (the routed SwiGLU launch,
#: 3584 threadgroups: KS 2 was slower).
MV_KSPLIT_ALL = 128
MV_KSPLIT_BELOW = 1024
#: Token tile widths of the experts' prefill kernel: 64 once the pairs average at least MM_BN_WIDE_MIN an expert
#: (a 2048-token chunk gives 48 of the 6 x 2048 pairs to each of 256 experts), else 32.
MM_BN_CHOICES = (32, 64)
MM_BN_WIDE_MIN = 24
#: The experts' prefill kernel's epilogues: the plain product, and the SwiGLU of gate and up (``w2``).
MM_PLAIN, MM_SWIGLU = 0, 1
#: f16's largest finite value: what the f16 operands of the prefill products are held within.
F16_MAX = 65504.0
#: Largest slab (elements) a dense prefill product decodes at once: 2**26 f16 values = 128 MiB.
DEQ_MAX_ELEMS = 1 << 26
#: Up to this many tokens, dense and gathered products use the matvec kernel.
MV_MAX_TOKENS = 8
#: Matvec epilogues (mv.body ``EPI``): plain, SwiGLU of two weights (gate, up), sum over each token's experts,
#: and an RMSNorm of the input first (dense).
MV_PLAIN, MV_SWIGLU, MV_SUM, MV_RMS = 0, 1, 2, 3
MV_EPILOGUES = (MV_PLAIN, MV_SWIGLU, MV_SUM, MV_RMS)
#: Types the SwiGLU epilogue takes (F32 rows of two weights would not fit CUDA's 48 KB of static shared memory).
MV_SWIGLU_TYPES = tuple(t for t in KERNEL_TYPES if t != QT.F32)
#: The shared expert's pair inside the routed experts' launches (mv.body ``SH``): its weight type (ds4's
#: GGUFs: Q8_0), and the routed types the compile checks pair it with (every launch type works).
MV_SHARED_TYPE = QT.Q8_0
MV_SHARED_ROUTED = (QT.IQ2_XXS, QT.Q2_K, QT.Q4_K)
#: Quantized x (mv.body XQ; the routed experts' gate+up launch in decode): the types that decode in octets.
MV_XQ_TYPES = (QT.Q8_0, QT.Q2_K, QT.IQ2_XXS)


class RegLaunch(NamedTuple):
    """What mv_reg.body (weights read straight into registers) runs of one matvec epilogue."""

    types: tuple  # the weights' types it decodes (routed and shared)
    xqs: tuple[bool, ...]  # x quantized (kernels.quantize_x) and/or f32
    gathers: tuple[bool, ...]  # dense and/or expert-gathered
    config: tuple[int, int, int]  # (NR, NSG, RG); rows of at most MV_REG_SHORT_K weights take NSG 1
    backends: tuple[str, ...]  # where it replaces mv.body's launch by default ...
    on: tuple  # ... for weights of these types


#: The matvecs mv_reg.body runs, per epilogue. H200, Nsight Compute, µs against mv.body's launch at its default
#: (measured one kernel at a time):
#: - gate+up of 6 routed pairs of 2048 × 4096 IQ2_XXS and the Q8_0 shared pair: (4, 2, 2) 31.1 (sign masks in ALU
#:   ops), (4, 4) 33.1; mv.body 43.5; writing mid quantized (quantize_y) costs nothing measurable (31.3);
#: - the routed down sum, 6 pairs of 4096 × 2048 Q2_K and the shared pair, a plane group a thread: 23.4 at (4, 2, 1)
#:   against mv.body's 30.9; with mid quantized (XQ, integer dots) 18.3 (17.0 at (8, 2, 1));
#: - F16: the router 256 × 4096 5.9 against 6.3, the ratio-4 stack 2112 × 4096 8.8 against 11.2, the ratio-128
#:   projection 1024 × 4096 7.0 against 7.6 (all (4, 4, 1)); the indexer's q_b 8192 × 1024 8.8 at (4, 1, 1)
#:   against 11.5, but 13.2 at (4, 4, 1): short rows run one simdgroup a row group;
#: - Q8_0 with x in f32, a quarter unit a thread: q_b 32768 × 1024 with the norm 16.5 at (4, 1, 1) against 23.6,
#:   out_b 4096 × 8192 13.7 at (4, 4, 1) against 17.4, the grouped out_a 8 × 1024 × 4096 18.0 (15.4 at (8, 4, 1))
#:   against 18.5, q_a+kv 1536 × 4096 with the norm 6.3 at (4, 8, 1) against 7.5.
#: Metal keeps mv.body (not measured there); BF16 is not measured.
MV_REG = {
    MV_PLAIN: RegLaunch((QT.Q8_0, QT.F16, QT.BF16), (False,), (False, True), (4, 4, 1), ("cuda", "sim"),
                        (QT.F16, QT.Q8_0)),
    MV_SWIGLU: RegLaunch((QT.IQ2_XXS, QT.Q8_0), (True,), (True,), (4, 2, 2), ("cuda", "sim"), (QT.IQ2_XXS, QT.Q8_0)),
    MV_SUM: RegLaunch((QT.Q2_K, QT.Q8_0), (False, True), (True,), (4, 2, 1), ("cuda", "sim"), (QT.Q2_K,)),
    MV_RMS: RegLaunch((QT.Q8_0, QT.F16, QT.BF16), (False,), (False,), (4, 8, 1), ("cuda", "sim"), (QT.F16, QT.Q8_0)),
}
#: Rows of at most this many weights: one simdgroup a row group (a thread has few units of a row to load).
MV_REG_SHORT_K = 1024
#: Rows of y a threadgroup of mv_reg.body writes from one decoding of the weights (its XB): a dense launch's
#: tokens, or the SwiGLU launch's shared pairs. A batched decode step of B sessions takes the smallest that holds
#: B (up to MV_MAX_TOKENS), so each weight is decoded once a step instead of B times.
MV_REG_XB = (1, 2, 4, 8)


def reg_direct(qw, backend: str | None, epi: int, gather: bool, xq: bool = False, shared_qt: QT | None = None) -> bool:
    """Whether ``MV_REG`` has this matvec (epilogue, weight and shared types, x's form, gathering, K % 64 == 0)
    and, given a ``backend``, runs it as mv_reg.body there by default."""
    reg = MV_REG.get(epi)
    fits = (reg is not None and gather in reg.gathers and xq in reg.xqs and qw.shape[-1] % 64 == 0
            and {qw.qtype, shared_qt or qw.qtype} <= set(reg.types))  # fmt: skip
    return fits and (backend is None or (backend in reg.backends and qw.qtype in reg.on))


def reg_config(epi: int, n_in: int) -> tuple[int, int, int]:
    """mv_reg.body's default (NR, NSG, RG) for rows of ``n_in`` weights."""
    nr, nsg, rg = MV_REG[epi].config
    return (nr, 1, rg) if n_in <= MV_REG_SHORT_K else (nr, nsg, rg)


def reg_xb(n_rows: int) -> int:
    """mv_reg.body's XB for ``n_rows`` rows of y that read the same weight: the smallest of MV_REG_XB that
    holds them, else the largest."""
    return next((xb for xb in MV_REG_XB if xb >= n_rows), MV_REG_XB[-1])


def reg_groups(epi: int, gather: bool, shared: bool) -> bool:
    """Whether mv_reg.body groups a launch's rows of y XB to a threadgroup: a dense launch's tokens, the SwiGLU
    launch's shared pairs (the routed pairs read different experts)."""
    return not gather or (epi == MV_SWIGLU and shared)


INPUTS = {
    "mv": ["w", "x", "ids", "params", "w2", "aux", "ws"],
    "mv_reg": ["w", "x", "ids", "params", "w2", "aux", "ws"],
    "mm": ["w", "x", "ids", "tiles", "params", "w2", "aux"],
    "deq": ["w", "params"],
    "index_mm": ["iq", "hw", "keys", "params"],
    "attn_chunk": ["q", "raw", "comp", "idx", "sinks", "rc", "rs", "params", "oparams"],
}
#: Kernels whose helpers live in another kind's header (``<kind>.h``).
HEADER_OF = {"deq": "mm", "index_mm": "mm", "attn_chunk": "mm"}
#: Heads a threadgroup of attn_chunk takes (on CUDA 32, with 8 warps, ran 2-3 % slower on an H100: fewer
#: threadgroups share a multiprocessor); the head dims it is built for (multiples of 128).
ATTN_CHUNK_HG = 16
ATTN_CHUNK_DIMS = (128, 512)
#: Indexer head counts the chunk's index-score kernel is built for (any H dividing 128 works).
INDEX_MM_HEADS = (16, 64)

METAL_PROLOGUE = """\
const uint3 ds_tg_id = threadgroup_position_in_grid;
const uint32_t ds_tid = thread_index_in_threadgroup;
const uint32_t ds_tg_threads = threads_per_threadgroup.x * threads_per_threadgroup.y * threads_per_threadgroup.z;
const uint32_t ds_lane = thread_index_in_simdgroup;
const uint32_t ds_simd = simdgroup_index_in_threadgroup;
(void)ds_tg_threads; (void)ds_lane; (void)ds_simd; (void)ds_tid;
"""

CUDA_PROLOGUE = """\
const uint3 ds_tg_id = blockIdx;
const uint32_t ds_tid = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
const uint32_t ds_tg_threads = blockDim.x * blockDim.y * blockDim.z;
const uint32_t ds_lane = ds_tid & 31u;
const uint32_t ds_simd = ds_tid >> 5;
(void)ds_tg_threads; (void)ds_lane; (void)ds_simd; (void)ds_tid;
"""


# --- rendering ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def iq2_grid_words() -> str:
    """The IQ2_XXS grid from gguf-py as 512 u32 literals (lo, hi of each u64 word)."""
    words = iq2xxs_grid_bytes().copy().view("<u4").reshape(-1)
    return ", ".join(f"0x{int(w):08x}u" for w in words)


def minify(text: str) -> str:
    """Kernel text without comments, indentation, runs of blanks and empty lines; tokens, string literals and
    line structure (preprocessor lines, ``\\`` continuations) are kept.

    MLX keys its compiled-module cache by a hash of the kernel's whole generated source, and on CUDA computes
    it at every launch, so each byte of source costs host time in every decode step: on the H200 the hashing
    was a quarter of MLX's encode time (benchmarks/RESULTS.md). Metal keys kernels by source too (unmeasured).
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":  # a string or char literal, copied as is
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i : j + 1])
            i = j + 1
        elif text.startswith("//", i):
            i = text.find("\n", i)
            i = n if i < 0 else i
        elif c in " \t" or text.startswith("/*", i):  # blanks and block comments: at most one blank
            if c == "/":
                j = text.find("*/", i + 2)
                i = n - 1 if j < 0 else j + 1  # on the comment's last character
            if out and out[-1][-1:] not in (" ", "\n"):
                out.append(" ")
            i += 1
        elif c == "\n":
            if out and out[-1] == " ":
                out.pop()  # trailing blank
            if out and out[-1][-1:] != "\n":
                out.append("\n")  # empty lines vanish
            i += 1
        else:
            out.append(c)
            i += 1
    return "".join(out).lstrip()


@lru_cache(maxsize=None)
def _read(name: str) -> str:
    return minify((SOURCE_DIR / name).read_text())


_BACKEND_IFS = {"#if defined(DS_METAL)": True, "#if !defined(DS_METAL)": False}


def keep_backend(text: str, backend: str) -> str:
    """``text`` without the branches of its ``#if defined(DS_METAL)`` and ``#if !defined(DS_METAL)`` blocks that
    ``backend`` does not compile, so a launch carries only its own backend's code (each byte of source costs
    host time, :func:`minify`). Other conditionals are left to the compiler."""
    metal = backend == "metal"
    out: list[str] = []
    stack: list[bool | None] = []  # per open conditional: whether its current branch is kept; None: not ours
    for line in text.split("\n"):
        d = line.strip()
        if d in _BACKEND_IFS:
            stack.append(_BACKEND_IFS[d] == metal)
            continue
        if d.startswith("#if"):
            stack.append(None)
        elif stack and stack[-1] is not None and d == "#else":
            stack[-1] = not stack[-1]
            continue
        elif stack and stack[-1] is not None and d.startswith("#elif"):
            raise ValueError(f"keep_backend: #elif in a backend conditional: {line!r}")
        elif d == "#endif":
            if not stack:
                raise ValueError("keep_backend: #endif without #if")
            if stack.pop() is not None:
                continue
        if False not in stack:
            out.append(line)
    if stack:
        raise ValueError("keep_backend: #if without #endif")
    return "\n".join(out)


@lru_cache(maxsize=None)
def _read_for(name: str, backend: str) -> str:
    return keep_backend(_read(name), backend)


def render_prelude(backend: str) -> str:
    """Backend define plus the macro layer (ds_prelude.h): all that the fused kernels build on."""
    define = {"metal": "#define DS_METAL\n", "cuda": "#define DS_CUDA\n", "sim": "#define DS_CUDA\n#define DS_SIM\n"}[backend]
    return define + _read("ds_prelude.h")


def render_header(kind: str, backend: str, iq2_grid: bool = True) -> str:
    """Quant kernel ``kind``'s ``header``: the prelude, the IQ2 grid (a zero placeholder where no IQ2_XXS
    weight is read, see ds_quant.h), ds_quant.h, then the kernel's own helpers (``<kind>.h``)."""
    words = iq2_grid_words() if iq2_grid else "0u"
    own = HEADER_OF.get(kind, kind)
    quant, helpers = _read_for("ds_quant.h", backend), _read_for(f"{own}.h", backend)
    return f"{render_prelude(backend)}#define DS_IQ2_GRID_WORDS {words}\n{quant}{helpers}"


def render_source(kind: str, backend: str) -> str:
    """The kernel ``source``: backend prologue (names the thread attributes) plus the shared body, its backend's
    branches only (:func:`keep_backend`)."""
    prologue = METAL_PROLOGUE if backend == "metal" else CUDA_PROLOGUE  # "sim" runs the CUDA text
    return minify(prologue) + _read_for(f"{kind}.body", backend)


def kernel_cache_dir() -> Path:
    """Where the CUDA launches' rendered headers and bodies are written: ``kernels/`` in the package's cache
    folder (:func:`ds4_mlx.paths.cache_dir`, e.g. ``~/.cache/ds4-mlx``)."""
    return cache_dir() / "kernels"


def as_include(text: str) -> str:
    """CUDA: ``text`` as an ``#include`` of a file named by its content hash, which NVRTC reads from disk.

    MLX-CUDA hashes a kernel's whole source at every launch (benchmarks/RESULTS.md), so the launched source is
    kept to one line per part. The name changes with the content, so MLX's on-disk PTX cache, keyed by that
    source, never serves a stale build. Returns ``text`` itself where the file cannot be written.
    """
    path = kernel_cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.h"
    if any(c in str(path) for c in '"\\\n'):
        return text
    try:
        if not path.is_file() or path.read_text() != text:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(text)
            os.replace(tmp, path)  # atomic: a concurrent process reads the old file or the new one
    except OSError:
        return text
    return f'#include "{path}"\n'


def build(name: str, input_names: list[str], output_names: list[str], header: str, source: str, backend: str):
    """The launchable kernel of the rendered ``header`` and ``source``: ``mx.fast.metal_kernel`` of the text itself
    on Metal (its runtime compiler reads no files); on CUDA cubins compiled once and cached on disk
    (:class:`.cubin.CubinKernel`), else ``mx.fast.cuda_kernel`` of one ``#include`` line each (:func:`as_include`)."""
    if backend == "metal":
        make = mx.fast.metal_kernel
    elif backend == "cuda":
        from . import cubin

        def jit():
            return mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names,
                                       source=as_include(source), header=as_include(header))  # fmt: skip

        if cubin.enabled():
            return cubin.CubinKernel(name, input_names, output_names, header, source, kernel_cache_dir() / "cubin", jit)
        return jit()
    elif backend == "sim":
        from .sim import SimKernel

        return SimKernel(name, input_names, output_names, header, source)
    else:
        raise ValueError(f"no kernels for backend {backend!r}")
    return make(name=name, input_names=input_names, output_names=output_names, source=source, header=header)


@lru_cache(maxsize=None)
def get_kernel(kind: str, backend: str, iq2_grid: bool = True):
    """Build kernel ``kind`` for ``backend`` once (MLX caches each template specialization); ``iq2_grid``: the
    launches read IQ2_XXS weights."""
    header, source = render_header(kind, backend, iq2_grid), render_source(kind, backend)
    return build(f"ds_{kind}", INPUTS[kind], ["y"], header, source, backend)


@dataclass(frozen=True)
class Instantiation:
    """One template specialization: what the compile checks build and the dispatcher launches."""

    kind: str
    template: tuple  # ((name, value), ...) in template order

    @property
    def tag(self) -> str:
        return f"{self.kind}_" + "_".join(f"{k}{int(v)}" for k, v in self.template)

    @property
    def iq2_grid(self) -> bool:
        t = dict(self.template)
        return "QT" in t and QT.IQ2_XXS in (t["QT"], t.get("SQT"))


def mv_config(qtype: QT, n_out: int, n_rows: int, epi: int = MV_PLAIN, n_in: int = 0) -> tuple[int, int, int]:
    """(NR, NSG, KS) of a matvec launch with ``n_rows`` rows of output (tokens, pairs, or tokens of a summed
    gather) of ``n_out`` each: the type's tuning, short rows (``n_in`` <= MV_SHORT_K) and K split as above.
    The SwiGLU epilogue reads two weights, so it stages NR/2 rows of each (the same bytes per simdgroup)."""
    nr, nsg = MV_CONFIG[QT(qtype)]
    if epi == MV_SWIGLU:
        nr = max(1, nr // 2)
    elif 0 < n_in <= MV_SHORT_K and nsg >= 4:
        nr, nsg = 2 * nr, nsg // 2
    groups = -(-n_out // (nr * nsg)) * n_rows
    ks = nsg if groups < MV_KSPLIT_ALL else 2 if groups < MV_KSPLIT_BELOW and nsg % 2 == 0 else 1
    return nr, nsg, ks


def mv_launch_shapes(qtype: QT, epi: int) -> list[tuple[int, int, int]]:
    """Every (NR, NSG, KS) :func:`mv_config` can pick for a type and epilogue (the compile-check matrix)."""
    shapes = {mv_config(qtype, 1, 1, epi)[:2], mv_config(qtype, 1, 1, epi, MV_SHORT_K)[:2]}
    return [(nr, nsg, ks) for nr, nsg in sorted(shapes) for ks in sorted({1, 2, nsg}) if nsg % ks == 0]


def quantize_x(x: mx.array) -> mx.array:
    """x [..., in] (in % 8 == 0) as the quantized-x matvec reads it (ds_quant.h ds_xq_load), float32-typed: per row,
    q = rint(x / d) as int8 [in], the remainder r = rint(128 (x − d·q) / d) as int8 [in], then d = max|x| / 127
    per 8 values as float32 [in / 8]: 5·in/8 words a row, x ≈ d·(q + r/128). In the model HC pre's kernel writes it
    (:func:`ds4_mlx.kernels.fused.hc_pre` ``quantize``); these MLX ops are the tests' and benchmarks' reference."""
    *lead, n = x.shape
    o = x.astype(mx.float32).reshape(-1, n // 8, 8)
    amax = mx.abs(o).max(axis=-1, keepdims=True)
    d = amax * np.float32(1 / 127)
    inv = mx.where(amax > 0, 127.0 / mx.where(amax > 0, amax, 1.0), 0.0)
    q = mx.round(o * inv)
    r = mx.round((o - q * d) * (128.0 * inv))
    rows = [q.astype(mx.int8).reshape(-1, n).view(mx.uint8), r.astype(mx.int8).reshape(-1, n).view(mx.uint8),
            d.reshape(-1, n // 8).view(mx.uint8)]
    return mx.concatenate(rows, axis=1).view(mx.float32).reshape(*lead, 5 * n // 8)


def mv_template(
    qtype: QT, gather: bool, nr: int, nsg: int, ks: int, epi: int = MV_PLAIN, shared_qt: QT | None = None,
    xq: bool = False,
) -> tuple:  # fmt: skip
    """``shared_qt``: the type of the shared expert's weight read by the same launch (mv.body ``SH``); ``xq``:
    x comes quantized (:func:`quantize_x`)."""
    return (("QT", int(qtype)), ("NR", nr), ("NSG", nsg), ("GATHER", bool(gather)), ("KS", ks), ("EPI", epi),
            ("SH", shared_qt is not None), ("SQT", int(qtype if shared_qt is None else shared_qt)), ("XQ", bool(xq)))


def mv_reg_template(
    qtype: QT, nr: int, nsg: int, rg: int, gather: bool, epi: int, shared_qt: QT | None = None,
    xq: bool | None = None, qy: bool = False, xb: int = 1,
) -> tuple:  # fmt: skip
    """mv_reg.body's template: the weight type, the launch shape, the epilogue, the shared expert's type, x
    quantized (default: the SwiGLU epilogue's, which always reads it so), y quantized (``mv`` ``quantize_y``),
    the rows of y a threadgroup writes from one decoding of the weights (:func:`reg_xb`)."""
    xq = epi == MV_SWIGLU if xq is None else xq
    return (("QT", int(qtype)), ("NR", nr), ("NSG", nsg), ("RG", rg), ("GATHER", bool(gather)), ("EPI", epi),
            ("SH", shared_qt is not None), ("SQT", int(qtype if shared_qt is None else shared_qt)), ("XQ", bool(xq)),
            ("QY", bool(qy)), ("XB", xb))  # fmt: skip


def mm_template(qtype: QT, bn: int, epi: int = MM_PLAIN) -> tuple:
    return (("QT", int(qtype)), ("BN", bn), ("EPI", epi))


def deq_template(qtype: QT, f16: bool = False) -> tuple:
    return (("QT", int(qtype)), ("H", bool(f16)))


def attn_chunk_template(head_dim: int, indexed: bool) -> tuple:
    return (("HG", ATTN_CHUNK_HG), ("D", head_dim), ("IDX", bool(indexed)))


def attn_chunk_threads(backend: str) -> int:
    """``attn_chunk``'s threads a threadgroup: Metal's 8 simdgroups split the dims of the ATTN_CHUNK_HG heads; CUDA
    gives each 16 heads 4 warps, a quarter of the dims each."""
    return 256 if backend == "metal" else ATTN_CHUNK_HG // 16 * 128


def instantiations() -> list[Instantiation]:
    """Every specialization the dispatcher can launch (the compile-check matrix)."""
    out = []
    for qt in KERNEL_TYPES:
        for gather in (False, True):
            for epi in MV_EPILOGUES:
                if ((epi == MV_SUM and not gather) or (epi == MV_RMS and gather)
                        or (epi == MV_SWIGLU and qt not in MV_SWIGLU_TYPES)):  # fmt: skip
                    continue
                for nr, nsg, ks in mv_launch_shapes(qt, epi):
                    shared = [None]
                    if gather and epi in (MV_SWIGLU, MV_SUM) and qt in MV_SHARED_ROUTED:  # MoE + shared expert
                        shared.append(MV_SHARED_TYPE)
                    for sh in shared:
                        xq_ok = sh is not None and epi == MV_SWIGLU and qt in MV_XQ_TYPES  # the model's gate+up
                        for xq in (False, True) if xq_ok else (False,):
                            out.append(Instantiation("mv", mv_template(qt, gather, nr, nsg, ks, epi, sh, xq)))
        for bn in MM_BN_CHOICES:
            for epi in (MM_PLAIN, MM_SWIGLU):
                out.append(Instantiation("mm", mm_template(qt, bn, epi)))
        for f16 in (False, True):
            out.append(Instantiation("deq", deq_template(qt, f16)))
    for h in INDEX_MM_HEADS:
        out.append(Instantiation("index_mm", (("H", h),)))
    for d in ATTN_CHUNK_DIMS:
        for idx in (False, True):
            out.append(Instantiation("attn_chunk", attn_chunk_template(d, idx)))
    for epi, reg in MV_REG.items():
        for qt, gather, xq in itertools.product(reg.types, reg.gathers, reg.xqs):
            for sh in (None, MV_SHARED_TYPE) if epi in (MV_SWIGLU, MV_SUM) else (None,):
                for qy in (False, True) if epi == MV_SWIGLU and sh is not None else (False,):  # the model's gate+up
                    for config in {reg_config(epi, n) for n in (MV_REG_SHORT_K, 2 * MV_REG_SHORT_K)}:
                        for xb in MV_REG_XB if reg_groups(epi, gather, sh is not None) else (1,):
                            template = mv_reg_template(qt, *config, gather, epi, sh, xq, qy, xb)
                            out.append(Instantiation("mv_reg", template))
    return out


_CUDA_DTYPES = {"w": "uint8_t", "x": "float", "ids": "int32_t", "tiles": "int32_t", "params": "int32_t",
                "w2": "uint8_t", "aux": "float", "ws": "uint8_t", "iq": "__nv_bfloat16", "hw": "float",
                "keys": "__nv_bfloat16", "q": "float", "raw": "__half", "comp": "__half", "idx": "int32_t",
                "sinks": "float", "rc": "float", "rs": "float", "oparams": "int32_t"}


def render_cuda_translation_unit(insts: list[Instantiation]) -> str:
    """CUDA text as MLX's cuda_kernel generates it (docs/quants.md §3.2), for an nvcc compile check.

    MLX's ``utils.cuh`` include is replaced by the CUDA headers it brings in; several kernels share one unit
    (the header is guarded per kernel by a namespace so repeated prelude definitions do not collide).
    """
    parts = ["#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cstdint>\n#include <cooperative_groups.h>\n#include <mma.h>\n"]
    for i, inst in enumerate(insts):
        t = dict(inst.template)
        x_f16 = inst.kind == "mm"  # the experts' prefill product reads x as f16; its SwiGLU writes f16
        params = ", ".join(f"const {'__half' if n == 'x' and x_f16 else _CUDA_DTYPES[n]}* {n}"
                           for n in INPUTS[inst.kind])
        y_f16 = (x_f16 and t.get("EPI") == MM_SWIGLU) or (inst.kind == "deq" and t["H"]) or inst.kind == "attn_chunk"
        params += f", {'__half' if y_f16 else 'float'}* y"
        consts = "".join(
            f"constexpr bool {k} = {'true' if v else 'false'};\n" if isinstance(v, bool) else f"constexpr int {k} = {v};\n"
            for k, v in inst.template
        )
        parts.append(
            f"namespace ds_tu{i} {{\n{render_header(inst.kind, 'cuda', inst.iq2_grid)}\n"
            f"namespace mlx {{ namespace core {{ namespace cu {{ namespace cg = cooperative_groups;\n"
            f"__global__ void custom_kernel_ds_{inst.tag}({params}) {{\n{consts}{render_source(inst.kind, 'cuda')}\n}}\n"
            f"}}}}}}\n}}\n"
        )
    return "\n".join(parts)


# --- dispatch -----------------------------------------------------------------------------------------------


class Cols(NamedTuple):
    """Columns ``start ..`` of a one-row f32 array ``a [1, N]``, which a decode kernel reads where they are.

    Decode splits a projection's output among several kernels (the Q/KV rows, the compressors' kv and gate,
    the indexer's head weights). A slice is a graph node of its own, and MLX-CUDA's encode pays ~2 µs for every
    node of a step, views included (measured on the H200): a kernel given ``Cols`` takes
    the offset as a parameter instead."""

    a: mx.array
    start: int


def cols(x: mx.array | Cols, width: int) -> mx.array:
    """``x`` as an array: a :class:`Cols` sliced to its ``width`` columns (the pure-MLX paths), else ``x``."""
    return x.a[:, x.start : x.start + width] if isinstance(x, Cols) else x


@lru_cache(maxsize=4096)
def _params(*vals: int) -> mx.array:
    """The int32[8] scalar block of a launch (cached: a fresh host array per call costs a copy)."""
    v = list(vals) + [0] * (8 - len(vals))
    a = mx.array(np.array(v, dtype=np.int32))
    return a  # built from host data: already materialized (and safe to create inside a compile trace)


def _f32_bits(v: float) -> int:
    """A float32's bits as an int32 (a float in an int32 parameter block)."""
    return int(np.array(v, dtype=np.float32).view(np.int32))


def _pad_ids(ids: mx.array, backend: str) -> mx.array:
    """Index input: int32, padded for Metal (:func:`_pad8`)."""
    return _pad8(ids if ids.dtype == mx.int32 else ids.astype(mx.int32), backend)


def _pad8(a: mx.array, backend: str) -> mx.array:
    """Metal turns inputs of < 8 elements into `constant` pointers: give small inputs ≥ 8 there (flat).

    Otherwise ``a`` as it is shaped: kernels index their inputs flat, and a reshape would be one more graph
    node for MLX to replay and encode at every decode step."""
    if backend != "metal" or a.size >= 8:
        return a
    return mx.concatenate([a.reshape(a.size), mx.zeros((8 - a.size,), dtype=a.dtype)])


@lru_cache(maxsize=None)
def _dummy(dtype: mx.Dtype = mx.int32) -> mx.array:
    """An 8-element stand-in for an input a launch does not read."""
    return mx.array(np.zeros(8, dtype={mx.int32: np.int32, mx.uint8: np.uint8, mx.float32: np.float32}[dtype]))


def weight_bytes(qw) -> mx.array:
    """The weight as uint8 ``(*shape[:-1], row_bytes)`` (plain types viewed as bytes)."""
    # evaluated once (a view sharing the weight's buffer): left lazy, a compiled decode step would replay it
    return qw.derived("bytes", lambda: qw.data if qw.data.dtype == mx.uint8 else qw.data.view(mx.uint8))


def supports(qw) -> bool:
    """Whether the custom kernels handle this weight (every block type; plain types with in % 32 == 0)."""
    return qw.qtype in KERNEL_TYPES and qw.shape[-1] % 32 == 0


def mv(
    qw, x2: mx.array | Cols, backend: str, ids: mx.array | None = None, k_slots: int = 1, init=None,
    config: tuple[int, int, int] | None = None, *, epi: int = MV_PLAIN, w2=None, aux: mx.array | None = None,
    clamp: float = 0.0, shape: tuple[int, ...] | None = None, shared=None, xq: bool = False,
    route_packed: bool = False, direct: bool | None = None, quantize_y: bool = False,
) -> mx.array:  # fmt: skip
    """Matvec kernel. Dense: x2 [N, in] → [N, out]. Gathered: ids [P], x2 [P or P/k, in] → [P, out].

    ``x2``, ``ids`` and ``aux`` may come in any shape with those sizes (the kernel reads them flat), and
    ``shape`` names the output's shape (same size), so callers need no reshapes (each is a graph node).
    ``x2`` may be :class:`Cols`: one token's x (``xq``: its words) read in place from a row that holds more. The
    kernel loads x as float4: a ``Cols`` start must be a multiple of 4, and a slice passed in must start 16-byte
    aligned (MLX hands a view's pointer over at its offset; every column start the model takes is a multiple of
    4 floats).

    Epilogues (mv.body): ``MV_SWIGLU`` reads ``w2`` (the up weight, same type and shape) next to ``qw`` (gate)
    and returns ``silu(min(g, clamp)) * clip(u, ±clamp)``, times ``aux [P]`` (route weights) if given;
    ``MV_SUM`` (gathered) returns ``[P/k, out]``, each token's k products summed, plus ``aux`` if given;
    ``MV_RMS`` (dense) returns ``W @ rms_norm(x, aux, clamp)``: ``aux [in]`` is the norm weight, ``clamp`` eps.
    ``config`` overrides the launch's ``(NR, NSG, KS)`` (benchmarks sweep it; KS must divide NSG). ``xq``: x2
    holds x quantized by :func:`quantize_x` (5·in/8 words a row; types in MV_XQ_TYPES, no RMSNorm epilogue).

    ``route_packed`` (gathered): ``ids`` is :func:`~ds4_mlx.kernels.fused.moe_route`'s packed ``[P/k, 2k]``, each
    token's k ids then its route weights' f32 bits, which ``MV_SWIGLU`` multiplies by (``aux`` is then None).

    ``shared`` (gathered ``MV_SWIGLU`` / ``MV_SUM``): the shared expert in the same launch, T = P/k tokens.
    SwiGLU: ``shared`` holds its gate rows then its up rows (``[2·out, in]``) and the result is ``[P + T, out]``,
    the T shared rows last (no route weight). Sum: ``x2`` is that ``[P + T, in]``, ``shared`` the down weight
    ``[out, in]``, and each token's shared product joins its sum.

    ``direct``: run the launch as mv_reg.body, which reads the weights straight into registers (``config``:
    its ``(NR, NSG[, RG])``), where ``MV_REG`` has the epilogue with these types, x's form and gathering, and
    K % 64 == 0; default on the epilogue's ``MV_REG`` backends for its ``on`` types (:func:`reg_direct`).
    ``quantize_y`` (``MV_SWIGLU`` as mv_reg.body): the result comes quantized as :func:`quantize_x` lays it out,
    ``[rows, 5·out/8]``, for a down launch with ``xq`` (ds4-CUDA quantizes the experts' mid, docs/quants.md §2.4).
    """
    gather = ids is not None
    if shared is not None:
        rows = qw.shape[-2] * (2 if epi == MV_SWIGLU else 1)
        if (not gather or epi not in (MV_SWIGLU, MV_SUM) or shared.shape != (rows, qw.shape[-1])
                or shared.qtype not in MV_SWIGLU_TYPES):  # fmt: skip
            raise ValueError(f"mv: a shared expert {shared!r} does not fit this launch of {qw!r}")
    if epi == MV_SWIGLU and (
        w2 is None or (w2.shape, w2.qtype) != (qw.shape, qw.qtype) or qw.qtype not in MV_SWIGLU_TYPES
    ):
        raise ValueError(f"mv: the SwiGLU epilogue needs an up weight like {qw!r} of a type in MV_SWIGLU_TYPES")
    if epi == MV_RMS and (gather or aux is None or aux.shape != (qw.shape[-1],) or aux.dtype != mx.float32):
        raise ValueError(f"mv: the RMSNorm epilogue is dense and needs the norm weight as float32 aux [{qw.shape[-1]}]")
    if isinstance(x2, Cols):  # one token's row, read from column x_off on (mv.body params[8])
        x2, x_off, n_x = x2.a, x2.start, 1
        if x_off % 4:
            raise ValueError(f"mv: x's columns start at {x_off}, not a multiple of 4")
    else:
        x_off, n_x = 0, x2.size // (5 * qw.shape[-1] // 8 if xq else qw.shape[-1])  # rows of x
    if route_packed and (not gather or aux is not None or ids.size % (2 * k_slots)):
        raise ValueError("mv: a packed route is a gathered launch's ids [T, 2·k_slots], with no aux")
    P = (ids.size // 2 if route_packed else ids.size) if gather else n_x
    if shared is not None and epi == MV_SUM:
        n_x -= P // k_slots  # the shared rows after the routed ones
    shared_qt = None if shared is None else shared.qtype
    if xq and (epi == MV_RMS or qw.qtype not in MV_XQ_TYPES or shared_qt not in (None, *MV_XQ_TYPES)):
        raise ValueError(f"mv: quantized x needs weights of a type in MV_XQ_TYPES and no RMSNorm epilogue, not {qw!r}")
    # A decode step makes ~700 of these calls: the launch plan is worked out once per weight and call shape.
    has_aux = 2 if route_packed and epi == MV_SWIGLU else int(aux is not None)
    key = (backend, P, n_x, k_slots, gather, config, epi, has_aux, clamp, shared_qt, xq, x_off, route_packed, direct,
           quantize_y)
    plan = qw._cache.get(("mv",) + key)
    if plan is None:
        plan = qw._cache[("mv",) + key] = _mv_plan(qw, *key)
    kind, wb, params, template, grid, threadgroup, out_shape = plan
    return get_kernel(kind, backend, QT.IQ2_XXS in (qw.qtype, shared_qt))(
        inputs=[
            wb, x2, _pad_ids(ids, backend) if gather else _dummy(), params,
            _dummy(mx.uint8) if w2 is None else weight_bytes(w2),
            _dummy(mx.float32) if aux is None else _pad8(aux, backend),
            _dummy(mx.uint8) if shared is None else weight_bytes(shared),
        ],
        template=template,
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[out_shape if shape is None else shape],
        output_dtypes=[mx.float32],
        init_value=init,  # tests pass NaN to catch unwritten outputs
    )[0]  # fmt: skip


def _mv_plan(
    qw, backend: str, P: int, n_x: int, k_slots: int, gather: bool, config, epi: int = MV_PLAIN, has_aux: int = 0,
    clamp: float = 0.0, shared_qt: QT | None = None, xq: bool = False, x_off: int = 0, route_packed: bool = False,
    direct: bool | None = None, quantize_y: bool = False,
) -> tuple:  # fmt: skip
    """(kernel kind, weight bytes, params, template, grid, threadgroup, output shape) of one matvec call shape."""
    *_, n_out, n_in = qw.shape
    if direct and not reg_direct(qw, None, epi, gather, xq, shared_qt):
        raise ValueError(f"mv: no launch of mv_reg.body for {qw!r} (shared {shared_qt}, epilogue {epi}, xq {xq}): "
                         f"see MV_REG, and K % 64 == 0")  # fmt: skip
    direct = reg_direct(qw, backend, epi, gather, xq, shared_qt) if direct is None else direct
    wb = weight_bytes(qw)
    rows = P // k_slots if epi == MV_SUM else P + (P // k_slots if shared_qt is not None else 0)  # of y
    clamp_bits = _f32_bits(clamp)
    ip = k_slots * (2 if route_packed else 1)  # the ids' row pitch
    if epi == MV_SUM and (not gather or P % k_slots):
        raise ValueError("mv: the sum epilogue needs a gathered launch of whole tokens")
    per_slot = int(gather and n_x == P and k_slots > 1)
    params = _params(n_in, n_out, wb.shape[-1], k_slots, per_slot, P, clamp_bits, has_aux, x_off, ip)
    if direct:
        nr, nsg, rg = (*config, 1)[:3] if config else reg_config(epi, n_in)
        if quantize_y and (epi != MV_SWIGLU or nr * rg != 8 or n_out % 8):
            raise ValueError(f"mv: quantize_y needs the SwiGLU epilogue at NR·RG = 8 rows and out % 8 == 0, not "
                             f"{epi}, ({nr}, {nsg}, {rg}), out {n_out}")  # fmt: skip
        # the rows of y that read one weight, grouped XB to a threadgroup (the dense tokens, the shared pairs)
        grouped = (P if not gather else P // k_slots) if reg_groups(epi, gather, shared_qt is not None) else 0
        xb = reg_xb(grouped)
        z = rows - grouped + -(-grouped // xb)
        template = list(mv_reg_template(qw.qtype, nr, nsg, rg, gather, epi, shared_qt, xq, quantize_y, xb))
        grid = (-(-n_out // (nr * rg)) * 32 * nsg, 1, z)
        return "mv_reg", wb, params, template, grid, (32 * nsg, 1, 1), (rows, 5 * n_out // 8 if quantize_y else n_out)
    if quantize_y:
        raise ValueError("mv: quantize_y is a launch of mv_reg.body's")
    nr, nsg, ks = config or mv_config(qw.qtype, n_out, rows, epi, n_in)
    if nsg % ks:
        raise ValueError(f"mv: KS={ks} must divide NSG={nsg}")
    groups = -(-n_out // (nr * nsg // ks))
    template = list(mv_template(qw.qtype, gather, nr, nsg, ks, epi, shared_qt, xq))
    return "mv", wb, params, template, (groups * 32 * nsg, 1, rows), (32 * nsg, 1, 1), (rows, n_out)


def dequantize(qw, backend: str, rows: tuple[int, int] | None = None, f16: bool = False) -> mx.array:
    """The weight's exact values as float32 ``qw.shape`` (the ``deq`` kernel), or only output rows ``rows =
    (start, stop)`` of a 2-D weight, ``[stop - start, in]``. ``f16``: each value rounded once to float16 (held
    within ±65504); an F16 weight is then its own data, no launch."""
    if f16 and qw.qtype == QT.F16:
        return qw.data if rows is None else qw.data[rows[0] : rows[1]]
    *lead, n_in = qw.shape
    wb = weight_bytes(qw).reshape(-1, weight_bytes(qw).shape[-1])
    shape = tuple(qw.shape)
    if rows is not None:
        wb, shape = wb[rows[0] : rows[1]], (rows[1] - rows[0], n_in)
    n_rows = wb.shape[0]
    threads = n_rows * (n_in // 16)
    return get_kernel("deq", backend, qw.qtype == QT.IQ2_XXS)(
        inputs=[wb, _params(n_in, n_rows, wb.shape[-1])],
        template=list(deq_template(qw.qtype, f16)),
        grid=(-(-threads // 256) * 256, 1, 1),
        threadgroup=(256, 1, 1),
        output_shapes=[shape],
        output_dtypes=[mx.float16 if f16 else mx.float32],
    )[0]


#: The dense prefill products scale x by this power of two before rounding it to f16, and their result back:
#: exact, and it moves the f16 range the products' input and output must fit from 65504 to 2^8 times that (the
#: values it pushes below f16's normal range, |x| < 2^-6, lose at most 2^-17 in absolute terms).
F16_PRODUCT_SCALE = 2.0**-8


# Each side of the product one fused elementwise launch (compiled once for every shape).
_scaled_f16 = mx.compile(lambda x: _f16(x * F16_PRODUCT_SCALE), shapeless=True)
_unscaled_f32 = mx.compile(lambda y: y.astype(mx.float32) * (1.0 / F16_PRODUCT_SCALE), shapeless=True)


class Scaled16(NamedTuple):
    """An f16 array ``a`` holding values times :data:`F16_PRODUCT_SCALE`, as the dense prefill products read and
    write them: a kernel's output made for such a product, or one product's output passed to the next without
    the round trip through f32 (exact both ways: the scale is a power of two)."""

    a: mx.array

    @classmethod
    def of(cls, values: mx.array) -> "Scaled16":
        """``values`` scaled and rounded to f16 (held within f16's range)."""
        return cls(_scaled_f16(values))

    def values(self) -> mx.array:
        """The values as float32."""
        return _unscaled_f32(self.a)


def f16_product(x: mx.array | Scaled16, w16_t: mx.array, keep_scaled: bool = False) -> mx.array | Scaled16:
    """``x @ w16_t`` for f16 weights ``w16_t`` (already transposed, any batch shape) on f16 tensor cores with f32
    accumulation -> float32: x is rounded once to f16 (scaled by :data:`F16_PRODUCT_SCALE`, held within f16's
    range; a :class:`Scaled16` x already is), the product once to f16 (docs/quants.md §8 ruling 2), returned as
    :class:`Scaled16` with ``keep_scaled``."""
    y = (x if isinstance(x, Scaled16) else Scaled16.of(x)).a @ w16_t
    return Scaled16(y) if keep_scaled else _unscaled_f32(y)


def dense_matmul(qw, x2: mx.array | Scaled16, backend: str, keep_scaled: bool = False) -> mx.array | Scaled16:
    """``x2 [N, in] @ W.T`` -> float32 ``[N, out]`` for a prefill chunk: the weight decoded to f16 (``deq``), at
    most DEQ_MAX_ELEMS of it at a time, times x with MLX's matmul (:func:`f16_product`, which also says what
    :class:`Scaled16` x and ``keep_scaled`` do; cuBLAS on CUDA). The f16 slabs are transient: nothing stays
    resident."""
    n_out, n_in = qw.shape
    step = max(1, DEQ_MAX_ELEMS // n_in)
    if step >= n_out:
        return f16_product(x2, dequantize(qw, backend, f16=True).T, keep_scaled)
    parts = [f16_product(x2, dequantize(qw, backend, (r, min(r + step, n_out)), f16=True).T, keep_scaled)
             for r in range(0, n_out, step)]  # fmt: skip
    return Scaled16(mx.concatenate([p.a for p in parts], axis=1)) if keep_scaled else mx.concatenate(parts, axis=1)


def route_tiles(flat: mx.array, n_expert: int, bn: int) -> tuple[mx.array, mx.array]:
    """Pairs sorted by expert and the token-tile list for ``mm_id`` (docs/quants.md §4.2), without a host sync.

    Returns ``sorted_pairs`` int32 [P] and ``tiles`` int32 [T_max, 4] = (expert, first index, count, 0);
    tiles past the real count have count 0. T_max = ⌈P/bn⌉ + min(E, P) bounds Σ_e ⌈count_e/bn⌉.
    """
    P = flat.size
    flat = flat.astype(mx.int32)
    order = mx.argsort(flat * P + mx.arange(P, dtype=mx.int32)).astype(mx.int32)  # unique keys: deterministic
    counts = mx.zeros((n_expert,), dtype=mx.int32).at[flat].add(mx.ones((P,), dtype=mx.int32))
    n_tiles = (counts + bn - 1) // bn
    tile_end = mx.cumsum(n_tiles)
    tile_start = tile_end - n_tiles
    pair_off = mx.cumsum(counts) - counts
    t_max = -(-P // bn) + min(n_expert, P)
    t = mx.arange(t_max, dtype=mx.int32)
    e = (tile_end[None, :] <= t[:, None]).astype(mx.int32).sum(axis=1)  # expert owning tile t (E if none)
    ec = mx.minimum(e, n_expert - 1)
    local = (t - tile_start[ec]) * bn
    count = mx.where(e < n_expert, mx.clip(counts[ec] - local, 0, bn), 0)
    tiles = mx.stack([ec, pair_off[ec] + local, count, mx.zeros_like(t)], axis=1).astype(mx.int32)
    return order, tiles


def index_mm_launch(backend: str, T: int, H: int, N: int) -> tuple[tuple[int, int, int], int]:
    """``index_mm``'s grid (256-thread threadgroups) and keys a threadgroup. Metal: 128 / H queries times 64 keys
    a threadgroup. CUDA: 8 queries times a run of keys, a multiple of 64 near N / 8 within 256 .. 2048, so that a
    chunk's queries reading their B registers once serve many keys and a short chunk still fills the GPU."""
    if backend == "metal":
        return (-(-N // 64) * 256, -(-T // (128 // H)), 1), 64
    nk = min(2048, max(256, -(-N // 512) * 64))
    return (-(-N // nk) * 256, -(-T // 8), 1), nk


def index_scores_chunk(iq: mx.array, hw: mx.array, keys: mx.array, backend: str) -> mx.array:
    """The indexer's scores of a prefill chunk: ``y [T, N] = Σ_h hw[t, h] · relu(keys[c] · iq[t, h])`` for ``iq
    [T, H, 128]``, ``hw [T, H]`` (head weights times the scale), ``keys [N, 128]`` -> float32, in one launch
    (``index_mm``). It reads iq and keys as bf16 and multiplies bf16 tiles: exact for bf16-exact inputs
    (FP4-simulated queries and rows)."""
    T, H, D = iq.shape
    N = keys.shape[0]
    if D != 128 or 128 % H or hw.shape != (T, H) or keys.shape != (N, D):
        raise ValueError(f"index_scores_chunk: iq {iq.shape}, hw {hw.shape}, keys {keys.shape} do not fit "
                         f"[T, H | 128, 128], [T, H], [N, 128]")  # fmt: skip
    iq, keys = (a if a.dtype == mx.bfloat16 else a.astype(mx.bfloat16) for a in (iq, keys))
    hw = hw if hw.dtype == mx.float32 else hw.astype(mx.float32)
    grid, nk = index_mm_launch(backend, T, H, N)
    return get_kernel("index_mm", backend, False)(
        inputs=[iq, hw, keys, _params(T, N, nk)],
        template=[("H", H)],
        grid=grid,
        threadgroup=(256, 1, 1),
        output_shapes=[(T, N)],
        output_dtypes=[mx.float32],
    )[0]


def attention_chunk(
    q: mx.array, raw: mx.array, comp: mx.array | None, idx: mx.array | None, sinks: mx.array, *, keep: int,
    window: int, pos: int, ratio: int, top_k: int, scale: float, C: mx.array, S: mx.array, groups: int, backend: str,
) -> Scaled16:  # fmt: skip
    """A prefill chunk's attention in one launch (``attn_chunk``): ``q [T, H, D]`` at positions ``pos ..``, each query
    over its raw window (``raw [R, D]``: the chunk's rows after ``keep`` carried ones) and its visible compressed
    rows ``c < (p + 1) // ratio`` of ``comp`` (all of them, or with ``idx [T, top_k]`` the first
    ``min(visible, top_k)`` listed), the per-head sink logit in the softmax, then the inverse RoPE with the
    tokens' tables ``C, S [T, D]``. Returns the output as the grouped output product reads it: :class:`Scaled16`
    ``[G, T, H/G * D]``, group g holding heads g*H/G .. of each token. Keys are read as f16 (the ds4 profile
    stores them f16-rounded). A head count that is not a multiple of ATTN_CHUNK_HG runs padded with zero heads
    (the tiny test models' 4)."""
    T, H, D = q.shape
    if D not in ATTN_CHUNK_DIMS or raw.shape[1] != D or sinks.shape != (H,) or groups < 1 or H % groups:
        raise ValueError(f"attention_chunk: q {q.shape}, raw {raw.shape}, sinks {sinks.shape}, {groups} groups do "
                         f"not fit [T, H, D in {ATTN_CHUNK_DIMS}], [R, D], [H], G | H")  # fmt: skip
    if C.shape != (T, D) or S.shape != (T, D):
        raise ValueError(f"attention_chunk: RoPE tables {C.shape}, {S.shape}, expected [{T}, {D}]")
    if raw.shape[0] != keep + T or (ratio and (comp is None or comp.shape[1] != D)):
        raise ValueError(f"attention_chunk: {raw.shape[0]} raw rows for {keep} carried + {T} tokens, comp "
                         f"{None if comp is None else comp.shape}")  # fmt: skip
    if idx is not None and (idx.shape != (T, top_k) or not ratio):
        raise ValueError(f"attention_chunk: idx {idx.shape}, expected [{T}, {top_k}] with a ratio")
    f16 = [a if a.dtype == mx.float16 else a.astype(mx.float16) for a in (raw, raw if comp is None else comp)]
    q, sinks = q.astype(mx.float32), sinks.astype(mx.float32)
    Hp, threads = -(-H // ATTN_CHUNK_HG) * ATTN_CHUNK_HG, attn_chunk_threads(backend)
    if Hp != H:
        q, sinks = mx.pad(q, [(0, 0), (0, Hp - H), (0, 0)]), mx.pad(sinks, [(0, Hp - H)])
    C, S = (a if a.dtype == mx.float32 else a.astype(mx.float32) for a in (C, S))
    return Scaled16(get_kernel("attn_chunk", backend, False)(
        inputs=[q, *f16, _dummy() if idx is None else _pad_ids(idx, backend), sinks, C, S,
                _params(T, Hp, keep, window, pos, ratio, top_k, _f32_bits(scale)),
                _params(H, H // groups, _f32_bits(F16_PRODUCT_SCALE))],
        template=list(attn_chunk_template(D, idx is not None)),
        grid=(Hp // ATTN_CHUNK_HG * threads, T, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(groups, T, H // groups * D)],
        output_dtypes=[mx.float16],
    )[0])  # fmt: skip



def mm_bn(n_pairs: int, n_expert: int) -> int:
    """The token tile width of ``mm`` for ``n_pairs`` pairs over ``n_expert`` experts (MM_BN_WIDE_MIN)."""
    return 64 if n_pairs >= MM_BN_WIDE_MIN * n_expert else 32


class Routes(NamedTuple):
    """The pairs of a routed prefill product sorted by expert, and their token tiles (:func:`route_tiles`):
    made once, read by the gate+up and the down launches."""

    order: mx.array
    tiles: mx.array
    bn: int


def routes_for(flat: mx.array, n_expert: int, backend: str, bn: int | None = None) -> Routes:
    """:class:`Routes` of the flat expert ids ``[P]`` (``bn`` default: :func:`mm_bn`)."""
    bn = bn or mm_bn(flat.size, n_expert)
    if bn not in MM_BN_CHOICES:
        raise ValueError(f"mm: token tile width {bn} not in {MM_BN_CHOICES}")
    order, tiles = route_tiles(flat, n_expert, bn)
    return Routes(_pad_ids(order, backend), tiles.reshape(-1), bn)


def mm_launch(backend: str) -> tuple[int, int]:
    """``mm``'s threads and weight rows a threadgroup: Metal multiplies 128-row tiles from threadgroup memory with 8
    simdgroups; CUDA decodes into the tensor cores' registers, 16 rows a warp, ``DS_MM_WARPS`` warps (mm.body)."""
    if backend == "metal":
        return 256, 128
    warps = _mm_warps()
    return 32 * warps, 16 * warps


@lru_cache(maxsize=None)
def _mm_warps() -> int:
    return int(re.search(r"#define DS_MM_WARPS (\d+)", _read("mm.body")).group(1))


def _mm(qw, x2: mx.array, flat: mx.array, k_slots: int, backend: str, routes: Routes | None, epi: int, w2=None,
        aux: mx.array | None = None, clamp: float = 0.0, init=None) -> mx.array:  # fmt: skip
    E, n_out, n_in = qw.shape
    P = flat.size
    if n_in % 32 or not supports(qw):
        raise ValueError(f"mm: no kernel for {qw!r}")
    if x2.ndim != 2 or x2.shape[1] != n_in or x2.shape[0] not in (P, P // k_slots) or P % k_slots:
        raise ValueError(f"mm: x {x2.shape} does not fit {P} pairs of {k_slots} slots and in = {n_in}")
    routes = routes or routes_for(flat, E, backend)
    wb = weight_bytes(qw)
    per_slot = int(x2.shape[0] == P and k_slots > 1)
    clamp_bits = _f32_bits(clamp)
    params = _params(n_in, n_out, wb.shape[-1], k_slots, per_slot, P, clamp_bits, int(aux is not None))
    threads, rows = mm_launch(backend)
    ro = rows // 2 if epi == MM_SWIGLU else rows
    return get_kernel("mm", backend, qw.qtype == QT.IQ2_XXS)(
        inputs=[wb, _f16(x2), routes.order, routes.tiles, params,
                _dummy(mx.uint8) if w2 is None else weight_bytes(w2),
                _dummy(mx.float32) if aux is None else _pad8(aux.astype(mx.float32), backend)],
        template=list(mm_template(qw.qtype, routes.bn, epi)),
        grid=(routes.tiles.size // 4 * threads, -(-n_out // ro), 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(P, n_out)],
        output_dtypes=[mx.float16 if epi == MM_SWIGLU else mx.float32],
        init_value=init,  # tests pass NaN to catch unwritten outputs
    )[0]  # fmt: skip


def _f16(x: mx.array) -> mx.array:
    """``x`` as mm reads it: f16, held within f16's finite range (a value past it would be an infinity)."""
    return x if x.dtype == mx.float16 else _clamped_f16(x)


# one fused launch (uncompiled: a strided read for the clip's lower bound, another for its upper, then the cast)
_clamped_f16 = mx.compile(lambda x: mx.clip(x, -F16_MAX, F16_MAX).astype(mx.float16), shapeless=True)


def mm_gather(qw, x2: mx.array, flat: mx.array, k_slots: int, backend: str, *, routes: Routes | None = None,
              init=None) -> mx.array:  # fmt: skip
    """The routed experts' prefill product: flat expert ids ``[P]`` (pair p = token·k_slots + slot), ``x2`` one
    row per token ``[P/k, in]`` or per pair ``[P, in]`` (any float type: the kernel reads it as f16) -> float32
    ``[P, out]``, row p = ``W[flat[p]] @ x(p)``. ``routes``: :func:`routes_for` of ``flat``, to share."""
    return _mm(qw, x2, flat, k_slots, backend, routes, MM_PLAIN, init=init)


def mm_gather_swiglu(gate, up, x2: mx.array, flat: mx.array, k_slots: int, clamp: float, backend: str, *,
                     route_w: mx.array | None = None, routes: Routes | None = None, init=None) -> mx.array:  # fmt: skip
    """The routed experts' SwiGLU in one launch: ``silu(min(g, c)) * clamp(u, -c, c)`` of ``g = gate[e] x``,
    ``u = up[e] x`` (no clamp if ``clamp`` <= 0), times the route weight ``route_w [P]`` if given -> float16
    ``[P, F]`` (the down product's input, rounded as its f16 tiles round it). Shapes as :func:`mm_gather`."""
    if (gate.shape, gate.qtype) != (up.shape, up.qtype):
        raise ValueError(f"mm: gate {gate!r} and up {up!r} differ")
    if route_w is not None and route_w.size != flat.size:
        raise ValueError(f"mm: {route_w.size} route weights for {flat.size} pairs")
    return _mm(gate, x2, flat, k_slots, backend, routes, MM_SWIGLU, up,
               None if route_w is None else route_w.reshape(-1), clamp, init)  # fmt: skip


# --- lossless Q8_0 → MLX affine 8-bit (docs/quants.md §4.3, §8 ruling 1) ---------------------------------------


def q8_0_affine(qw) -> tuple[mx.array, mx.array, mx.array]:
    """Repack a Q8_0 weight for ``mx.quantized_matmul(bits=8, group_size=32)``: exact, values unchanged.

    ``u = q XOR 0x80`` (= q + 128) packed LSB-first into uint32, ``scale = d``, ``bias = -128·d``. Params are
    f16 (d and -128·d are exact in f16) unless some |d| ≥ 512, where -128·d would overflow: then f32.
    """
    return qw.derived("q8_affine", lambda: _q8_0_repack(qw))


def _q8_0_repack(qw) -> tuple[mx.array, mx.array, mx.array]:
    *lead, n_out, n_in = qw.shape
    nb = n_in // 32
    blocks = qw.data.reshape(*lead, n_out, nb, 34)
    u = (blocks[..., 2:] ^ 0x80).reshape(*lead, n_out, n_in)  # uint8 codes 0..255
    wq = u.view(mx.uint32)  # (..., out, in/4): little-endian = LSB-first
    d = blocks[..., :2].view(mx.float16).reshape(*lead, n_out, nb)
    dtype = mx.float16 if float(mx.abs(d.astype(mx.float32)).max()) < 512 else mx.float32
    return wq, d.astype(dtype), (d.astype(mx.float32) * -128.0).astype(dtype)


def q8_mode() -> str:
    """How 2-D Q8_0 weights run on GPU: ``custom`` (default) or ``affine`` (MLX repack), from $DS4_MLX_Q8.

    On the H200 the custom kernels beat the repack at the large shapes (LM head matvec 1.77x, prefill 1.44x)
    and need no second copy of the weights; the repack was faster only for the small 1024/2048×4096 matvecs.
    """
    return os.environ.get("DS4_MLX_Q8", "custom").strip().lower()


# --- entry points used by QuantWeight -------------------------------------------------------------------------


def _q8_affine(qw) -> bool:
    """A Q8_0 weight that runs through MLX's affine 8-bit kernels (:func:`q8_mode`)."""
    return qw.qtype == QT.Q8_0 and q8_mode() == "affine"


def _dense_mv(qw, N: int) -> bool:
    """Whether a dense product of ``N`` tokens runs the matvec kernel."""
    return 0 < N <= MV_MAX_TOKENS and supports(qw) and not _q8_affine(qw)


def _row_cols(qw, x: Cols) -> bool:
    """Whether the matvec reads ``x``'s columns where they are: one row, an aligned start, a dense matvec."""
    return x.a.shape[0] == 1 and x.start % 4 == 0 and x.start + qw.shape[-1] <= x.a.shape[-1] and _dense_mv(qw, 1)


def matmul(qw, x: mx.array | Cols | Scaled16, backend: str, scaled_out: bool = False) -> mx.array | Scaled16:
    """``x @ W.T`` on the GPU backends: x [..., in] → float32 [..., out]. ``x`` may be one token's columns of a
    wider row (:class:`Cols`): the matvec reads them in place; or a :class:`Scaled16` ``[N, in]``, which the
    dense prefill product reads as it is. ``scaled_out``: the caller also takes a :class:`Scaled16` result,
    which the dense prefill product then returns (its own f16 output)."""
    n_in = qw.shape[-1]
    if isinstance(x, Scaled16):
        if x.a.ndim == 2 and supports(qw) and not _q8_affine(qw) and not _dense_mv(qw, x.a.shape[0]):
            return dense_matmul(qw, x, backend, scaled_out)
        x = x.values()
    if isinstance(x, Cols):
        if _row_cols(qw, x):
            return mv(qw, x, backend, shape=(1, qw.shape[0]))
        x = cols(x, n_in)
    lead = x.shape[:-1]
    N = x.size // n_in
    if N == 0:
        return mx.zeros((*lead, qw.shape[0]), dtype=mx.float32)
    x = x if x.dtype == mx.float32 else x.astype(mx.float32)
    if _dense_mv(qw, N):
        return mv(qw, x, backend, shape=(*lead, qw.shape[0]))  # x as it is shaped: no reshape nodes
    x2 = x.reshape(N, n_in)  # explicit shape: a no-op (no graph node) when x is already 2-D
    if _q8_affine(qw):
        wq, s, b = q8_0_affine(qw)
        y = mx.quantized_matmul(x2, wq, s, b, transpose=True, group_size=32, bits=8).astype(mx.float32)
    elif not supports(qw):
        y = qw._fallback_matmul(x2)
    else:
        y = dense_matmul(qw, x2, backend, scaled_out)
        if isinstance(y, Scaled16):
            return Scaled16(y.a.reshape(*lead, qw.shape[0]))
    return y.reshape(*lead, qw.shape[0])


def matmul_rms(qw, x: mx.array | Cols, norm: mx.array, eps: float, backend: str,
               scaled_out: bool = False) -> mx.array | Scaled16:  # fmt: skip
    """``rms_norm(x, norm, eps) @ W.T`` on the GPU backends: one matvec launch with the norm as its prologue
    for decode-sized x, else MLX's rms_norm then :func:`matmul` (``scaled_out`` as there). ``x`` may be the
    first columns of one token's wider row (:class:`Cols`): the kernel reads them in place."""
    n_in = qw.shape[-1]
    if isinstance(x, Cols):
        if _row_cols(qw, x):
            return mv(qw, x, backend, epi=MV_RMS, aux=norm, clamp=eps, shape=(1, qw.shape[0]))
        x = cols(x, n_in)
    if _dense_mv(qw, x.size // n_in):
        x = x if x.dtype == mx.float32 else x.astype(mx.float32)
        return mv(qw, x, backend, epi=MV_RMS, aux=norm, clamp=eps, shape=(*x.shape[:-1], qw.shape[0]))
    return matmul(qw, mx.fast.rms_norm(x, norm, eps), backend, scaled_out)


def gather_matmul(qw, x: mx.array, ids: mx.array, backend: str, out_shape: tuple[int, ...] | None = None) -> mx.array:
    """Expert-gathered product on the GPU backends: returns float32 [N, k, out] (or ``out_shape``, same size)."""
    N, k = ids.shape
    E, n_out, n_in = qw.shape
    out_shape = (N, k, n_out) if out_shape is None else out_shape
    if N * k == 0:
        return mx.zeros(out_shape, dtype=mx.float32)
    x = x if x.dtype == mx.float32 else x.astype(mx.float32)  # [N, in] shared or N·k rows of in, per slot
    if not supports(qw):
        return qw._fallback_gather_matmul(x, ids, out_shape)
    if N <= MV_MAX_TOKENS:
        return mv(qw, x, backend, ids=ids, k_slots=k, shape=out_shape)  # as shaped: no reshape nodes
    y = mm_gather(qw, x.reshape(x.size // n_in, n_in), ids.reshape(N * k), k, backend)
    return y.reshape(out_shape)


def source_digest() -> str:
    """Hash of every kernel source file (for benchmark records)."""
    h = hashlib.sha256()
    for p in sorted(SOURCE_DIR.glob("*")):
        if p.suffix in (".h", ".body"):
            h.update(p.read_bytes())
    return h.hexdigest()[:12]
