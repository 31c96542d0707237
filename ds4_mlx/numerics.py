"""Numeric profiles and ds4's rounding simulations (docs/model.md §0.1, §4.1, §4.12).

ds4 rounds a few tensors on purpose, the way DeepSeek's own inference graph does: the KV rows go
through an FP8-E4M3 round trip, the indexer vectors through Hadamard-128 + FP4-E2M1 ("QAT"), and every
row written to a cache is rounded to f16. Each step is a separate switch of :class:`Numerics`; the
presets of :data:`PROFILES` bundle them (``hf`` = none of them, ``ds4`` = all, the default).

All functions take and return float32 MLX arrays and act on the last axis. Power-of-two scales are
derived from the float32 exponent bits, so ``2^ceil(log2(t))`` is exact (no ``log2`` rounding). The
round trips are chains of ~30 elementwise ops, so they are ``mx.compile``d (fused into a few kernels; every
step is exact, so fusion cannot change a bit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import partial

import mlx.core as mx
import numpy as np

from . import host

FP8_E4M3_MAX = 448.0
FP8_BLOCK = 64  # nope dims are quantized in blocks of 64 (7 blocks of the 448 nope dims)
FP8_AMAX_FLOOR = 1.0e-4
FP4_E2M1_MAX = 6.0
FP4_BLOCK = 32
FP4_AMAX_FLOOR = 7.052966104933725e-38
HADAMARD_DIM = 128


@dataclass(frozen=True)
class Numerics:
    """Which of ds4's rounding steps to simulate (each one independently switchable)."""

    fp8_kv: bool  # FP8-E4M3 round trip of the nope dims of raw and compressed KV rows
    indexer_qat: bool  # Hadamard-128 + FP4-E2M1 on indexer q and indexer compressed rows
    f16_cache: bool  # f16 rounding of every row written to a cache (raw, compressed, indexer)
    rope_recurrence: bool = False  # ds4 CPU's f32 angle recurrence t_{k+1} = t_k * base^(-2/n_rot)
    # CUDA decode: the routed experts' gate+up matvec reads its input quantized (int8 plus an int8 remainder per 8
    # values, integer dots), and writes mid so for the down sum, as ds4's CUDA build does with coarser Q8_K
    # (docs/quants.md §2.4); a kernel choice, so the MLX paths (CPU, prefill) keep f32, and so does Metal (no integer
    # dot; ds4's Metal build keeps f32)
    quantized_x: bool = False

    def with_(self, **changes) -> "Numerics":
        return replace(self, **changes)


PROFILES: dict[str, Numerics] = {
    "hf": Numerics(fp8_kv=False, indexer_qat=False, f16_cache=False),
    "ds4": Numerics(fp8_kv=True, indexer_qat=True, f16_cache=True, quantized_x=True),
}
DEFAULT_PROFILE = "ds4"


def get_numerics(name_or_obj: "str | Numerics | None" = None) -> Numerics:
    """A :class:`Numerics` from a preset name (``"hf"``, ``"ds4"``), an instance, or ``None`` (default)."""
    if name_or_obj is None:
        return PROFILES[DEFAULT_PROFILE]
    if isinstance(name_or_obj, Numerics):
        return name_or_obj
    try:
        return PROFILES[name_or_obj]
    except KeyError:
        raise ValueError(f"unknown numeric profile {name_or_obj!r}; choose one of {sorted(PROFILES)}") from None


# --- exact power-of-two helpers -------------------------------------------------------------------------


def _exponent(t: mx.array) -> mx.array:
    """``floor(log2 t)`` for positive normal float32 ``t``, read from the exponent bits (int32)."""
    bits = t.astype(mx.float32).view(mx.uint32)
    return ((bits >> 23) & 0xFF).astype(mx.int32) - 127


def _ceil_log2(t: mx.array) -> mx.array:
    """``ceil(log2 t)`` for positive normal float32 ``t`` (exact)."""
    bits = t.astype(mx.float32).view(mx.uint32)
    exact_pow2 = (bits & 0x7FFFFF) == 0
    return _exponent(t) + mx.where(exact_pow2, 0, 1)


def _pow2(e: mx.array) -> mx.array:
    """``2^e`` as float32 for integer ``e`` in the normal range (built from the exponent bits)."""
    return ((e + 127).astype(mx.uint32) << 23).view(mx.float32)


# --- FP8-E4M3 -------------------------------------------------------------------------------------------


def fp8_e4m3_round(v: mx.array) -> mx.array:
    """Round ``v`` (|v| <= 448) to the nearest E4M3FN value; exact ties go to the even code.

    Normal codes ``(1+m/8)*2^e`` (e >= -6) are spaced ``2^(e-3)`` within a binade, subnormals ``m*2^-9``.
    Code index parity equals mantissa parity, so "even code" is round-half-to-even on the mantissa
    (``mx.round`` rounds half to even).
    """
    a = mx.abs(v)
    e = mx.maximum(_exponent(mx.maximum(a, 2.0**-6)), -6)  # subnormals share the 2^-9 spacing of e=-6
    quantum = _pow2(e - 3)
    return mx.where(v < 0, -1.0, 1.0) * (mx.round(a / quantum) * quantum)


@partial(mx.compile, shapeless=False)
def _fp8_blocks(xb: mx.array) -> mx.array:
    """E4M3 round trip of ``xb [..., nb, 64]`` with one power-of-two scale per block."""
    amax = mx.maximum(mx.abs(xb).max(axis=-1, keepdims=True), FP8_AMAX_FLOOR)
    scale = _pow2(_ceil_log2(amax / FP8_E4M3_MAX))
    v = mx.clip(xb / scale, -FP8_E4M3_MAX, FP8_E4M3_MAX)
    return fp8_e4m3_round(v) * scale


def fp8_e4m3_round_trip(x: mx.array, n_dims: int | None = None) -> mx.array:
    """ds4's FP8 KV simulation (``dsv4_fp8_kv_quantize_row_inplace_cpu()``) on the first ``n_dims``.

    Blocks of 64: ``scale = 2^ceil(log2(max(amax,1e-4)/448))``, ``v = clamp(x/scale, ±448)``,
    ``x' = e4m3(v) * scale``. The remaining (RoPE) dims pass through untouched.
    """
    n = x.shape[-1] if n_dims is None else n_dims
    nope, rest = x[..., :n], x[..., n:]
    q = _fp8_blocks(nope.reshape(*nope.shape[:-1], n // FP8_BLOCK, FP8_BLOCK)).reshape(nope.shape)
    return q if rest.shape[-1] == 0 else mx.concatenate([q, rest], axis=-1)


# --- FP4-E2M1 and Hadamard (indexer QAT) ----------------------------------------------------------------


def fp4_e2m1_round(v: mx.array) -> mx.array:
    """Round ``v`` (|v| <= 6) to the nearest of ±{0, .5, 1, 1.5, 2, 3, 4, 6}; ties to the even table index.

    The table is spaced 0.5 below 2, 1 in [2, 4) and 2 in [4, 6]; the table index parity equals the parity
    of the multiple of that spacing, so the tie rule is round-half-to-even at the local spacing.
    """
    a = mx.abs(v)
    quantum = mx.where(a < 2.0, 0.5, mx.where(a < 4.0, 1.0, 2.0))
    return mx.where(v < 0, -1.0, 1.0) * (mx.round(a / quantum) * quantum)


@partial(mx.compile, shapeless=False)
def fp4_e2m1_round_trip(x: mx.array) -> mx.array:
    """ds4's FP4 activation simulation (``dsv4_fp4_act_quantize_row_inplace_cpu()``), blocks of 32:
    ``scale = 2^ceil(log2(max(amax, 7.05e-38)/6))``, ``x' = e2m1(clamp(x/scale, ±6)) * scale``."""
    xb = x.reshape(*x.shape[:-1], x.shape[-1] // FP4_BLOCK, FP4_BLOCK)
    amax = mx.maximum(mx.abs(xb).max(axis=-1, keepdims=True), FP4_AMAX_FLOOR)
    scale = _pow2(_ceil_log2(amax / FP4_E2M1_MAX))
    v = mx.clip(xb / scale, -FP4_E2M1_MAX, FP4_E2M1_MAX)
    return (fp4_e2m1_round(v) * scale).reshape(x.shape)


def hadamard_matrix(n: int = HADAMARD_DIM) -> mx.array:
    """Normalized Sylvester Hadamard matrix ``H[i][j] = (-1)^popcount(i&j) / sqrt(n)`` (symmetric)."""
    h = mx.array([[1.0]])
    while h.shape[0] < n:
        h = mx.concatenate([mx.concatenate([h, h], axis=1), mx.concatenate([h, -h], axis=1)], axis=0)
    return h * (1.0 / math.sqrt(n))


_HADAMARD: dict[int, mx.array] = {}


def hadamard128(x: mx.array) -> mx.array:
    """``x <- H x`` over each 128-wide vector (``dsv4_hadamard128_inplace_cpu()``), as one matmul."""
    h = _HADAMARD.get(HADAMARD_DIM)
    if h is None:
        h = _HADAMARD[HADAMARD_DIM] = hadamard_matrix(HADAMARD_DIM)
    if host.wanted(x.shape[0]):  # a chunk on the CPU: numpy's product (ds4_mlx.host)
        xn, hn = host.to_numpy(x, h)
        return mx.array((xn.reshape(-1, HADAMARD_DIM) @ hn).reshape(x.shape))
    return x @ h  # H is symmetric: (H x)^T = x^T H


def indexer_qat(x: mx.array) -> mx.array:
    """Indexer QAT (``dsv4_indexer_qat_row_inplace_cpu()``): Hadamard-128 then FP4 round trip."""
    return fp4_e2m1_round_trip(hadamard128(x))


def f16r(x: mx.array) -> mx.array:
    """Round float32 to IEEE half (nearest-even) and back."""
    return x.astype(mx.float16).astype(mx.float32)


# --- the switches applied to rows -----------------------------------------------------------------------


@dataclass(frozen=True)
class RowRounding:
    """How ds4 stores a finished row: an FP8 round trip of its first ``fp8_dims`` dims (KV rows) or the
    indexer QAT, then f16r; as one value, so the compressor kernels can apply it where the row is made."""

    fp8_dims: int = 0  # 0: no FP8
    qat: bool = False
    f16: bool = False

    def __call__(self, x: mx.array) -> mx.array:
        if self.fp8_dims:
            x = fp8_e4m3_round_trip(x, self.fp8_dims)
        if self.qat:
            x = indexer_qat(x)
        return f16r(x) if self.f16 else x


def kv_rounding(numerics: Numerics, nope_dim: int) -> RowRounding:
    """A KV row (raw or compressed) as ds4 stores it: FP8 on the nope dims, then f16r."""
    return RowRounding(fp8_dims=nope_dim if numerics.fp8_kv else 0, f16=numerics.f16_cache)


def indexer_rounding(numerics: Numerics) -> RowRounding:
    """An indexer compressed row as ds4 stores it: QAT, then f16r."""
    return RowRounding(qat=numerics.indexer_qat, f16=numerics.f16_cache)
