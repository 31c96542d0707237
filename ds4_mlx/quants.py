"""GGUF block formats decoded with plain MLX ops (docs/quants.md §1 and §4.1).

This is the pure-MLX twin of the custom kernels: it runs on every backend, it is the CPU path, and it is the
oracle the kernels are tested against. Every recipe is value-exact with ``gguf.quants.dequantize`` (the f32
results of all four block types are exact, docs/quants.md §1), so the tests compare with ``==``.

Block bytes come in as a ``uint8`` array of shape ``(..., row_bytes)``; the result is float32
``(..., row_bytes // type_size * block_size)``.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Sequence

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as QT
from gguf.quants import IQ2_XXS

#: Block types with a custom decoder here (the ones ds4's files use).
BLOCK_TYPES = (QT.Q8_0, QT.Q2_K, QT.Q4_K, QT.IQ2_XXS)
#: Plain element types.
PLAIN_TYPES = (QT.F32, QT.F16, QT.BF16)
SUPPORTED_TYPES = BLOCK_TYPES + PLAIN_TYPES

#: sha256 of the 256 × 8 IQ2_XXS grid bytes (docs/quants.md §1.4); pinned by a test.
IQ2_GRID_SHA256 = "05826b5d3e472a3a78f196be62ac78acf81df0f909626e12ab9fa2a5d490dd54"


def block_size(qtype: QT) -> int:
    """Weights per block (1 for plain types)."""
    return GGML_QUANT_SIZES[QT(qtype)][0]


def type_size(qtype: QT) -> int:
    """Bytes per block (bytes per element for plain types)."""
    return GGML_QUANT_SIZES[QT(qtype)][1]


def row_bytes(qtype: QT, n: int) -> int:
    """Bytes of one row of ``n`` weights."""
    bs, ts = GGML_QUANT_SIZES[QT(qtype)]
    if n % bs:
        raise ValueError(f"{QT(qtype).name}: row length {n} is not a multiple of the block size {bs}")
    return n // bs * ts


# --- IQ2_XXS tables, taken from gguf-py (never re-typed) -------------------------------------------------


@lru_cache(maxsize=None)
def iq2xxs_grid_bytes() -> np.ndarray:
    """The IQ2_XXS grid as uint8 ``(256, 8)``: row g holds the 8 magnitudes (8, 25 or 43) of grid vector g."""
    if IQ2_XXS.grid is None:
        IQ2_XXS.init_grid()
    grid = np.asarray(IQ2_XXS.grid, dtype=np.float32).reshape(256, 8)
    out = grid.astype(np.uint8)
    assert np.array_equal(out.astype(np.float32), grid)
    if hashlib.sha256(out.tobytes()).hexdigest() != IQ2_GRID_SHA256:
        raise RuntimeError("gguf-py's IQ2_XXS grid does not match the pinned sha256")
    return out


def iq2xxs_grid_u64() -> np.ndarray:
    """The grid as 256 little-endian u64 words (byte j = element j), the form the kernels embed."""
    return iq2xxs_grid_bytes().copy().view("<u8").reshape(256)


@lru_cache(maxsize=None)
def iq2xxs_ksigns() -> np.ndarray:
    """The 128 sign masks ``s | parity(s) << 7`` as uint8 (gguf-py's ``IQ2_XXS.ksigns``)."""
    return np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8).copy()


@lru_cache(maxsize=None)
def _iq2_tables() -> tuple[mx.array, mx.array]:
    grid = mx.array(iq2xxs_grid_bytes().astype(np.float32))  # (256, 8) magnitudes
    bits = (iq2xxs_ksigns()[:, None] >> np.arange(8, dtype=np.uint8)) & 1  # (128, 8)
    signs = mx.array(np.where(bits == 1, -1.0, 1.0).astype(np.float32))  # (128, 8) ±1
    return grid, signs


# --- block decoders: b is uint8 (n, type_size) -> float32 (n, block_size) --------------------------------


def _f16(b: mx.array, o: int) -> mx.array:
    """The f16 field at byte offset ``o`` of each block, exactly as f32, shape (n, 1)."""
    return b[:, o : o + 2].view(mx.float16).astype(mx.float32)


def _deq_q8_0(b: mx.array) -> mx.array:
    d = _f16(b, 0)  # (n, 1)
    q = b[:, 2:].view(mx.int8).astype(mx.float32)  # (n, 32)
    return d * q


def _deq_q2_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    scales, qs = b[:, :16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = d * (scales & 15).astype(mx.float32)  # (n, 16) per 16-weight group
    ml = dmin * (scales >> 4).astype(mx.float32)  # (n, 16)
    shift = mx.array([0, 2, 4, 6], dtype=mx.uint8).reshape(1, 1, 4, 1)
    q = (qs.reshape(n, 2, 1, 32) >> shift) & 3  # (n, half, plane, l) = weight 128h + 32k + l
    q = q.reshape(n, 16, 16).astype(mx.float32)
    return (dl[..., None] * q - ml[..., None]).reshape(n, 256)


def _deq_q4_k(b: mx.array) -> mx.array:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    lo, mid, hi = b[:, 4:8], b[:, 8:12], b[:, 12:16]
    sc = mx.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1).astype(mx.float32)  # (n, 8)
    m = mx.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1).astype(mx.float32)  # (n, 8)
    shift = mx.array([0, 4], dtype=mx.uint8).reshape(1, 1, 2, 1)
    q = (b[:, 16:].reshape(n, 4, 1, 32) >> shift) & 15  # (n, chunk, nibble, l) = weight 64c + 32h + l
    q = q.reshape(n, 8, 32).astype(mx.float32)
    return ((d * sc)[..., None] * q - (dmin * m)[..., None]).reshape(n, 256)


def _deq_iq2_xxs(b: mx.array) -> mx.array:
    n = b.shape[0]
    grid, signs = _iq2_tables()
    d = _f16(b, 0)  # (n, 1)
    groups = b[:, 2:].reshape(n, 8, 8)  # (n, ib, byte)
    g = groups[:, :, :4].astype(mx.uint32)  # (n, 8, 4) grid indices
    B = groups[:, :, 4:].reshape(n, 8, 4).astype(mx.uint32)
    B = B[..., 0] | (B[..., 1] << 8) | (B[..., 2] << 16) | (B[..., 3] << 24)  # (n, 8) sign/scale word
    s = (B[..., None] >> mx.array([0, 7, 14, 21], dtype=mx.uint32)) & 127  # (n, 8, 4) sign indices
    dl = d * (0.5 + (B >> 28).astype(mx.float32)) * 0.25  # (n, 8)
    w = dl[..., None, None] * grid[g] * signs[s]  # (n, 8, 4, 8)
    return w.reshape(n, 256)


_DECODERS = {QT.Q8_0: _deq_q8_0, QT.Q2_K: _deq_q2_k, QT.Q4_K: _deq_q4_k, QT.IQ2_XXS: _deq_iq2_xxs}


def dequantize_blocks(data: mx.array, qtype: QT) -> mx.array:
    """Decode GGUF block bytes ``(..., row_bytes)`` uint8 → float32 ``(..., n_weights_per_row)``."""
    qtype = QT(qtype)
    if qtype not in _DECODERS:
        raise NotImplementedError(f"no MLX decoder for {qtype.name}")
    bs, ts = GGML_QUANT_SIZES[qtype]
    if data.dtype != mx.uint8 or data.shape[-1] % ts:
        raise ValueError(f"{qtype.name}: expected uint8 (..., k·{ts}) bytes, got {data.dtype} {data.shape}")
    lead = data.shape[:-1]
    nb = data.shape[-1] // ts
    w = _DECODERS[qtype](data.reshape(-1, ts))  # (n_blocks, bs)
    return w.reshape(*lead, nb * bs)


def plain_to_float32(data: mx.array, qtype: QT) -> mx.array:
    """F32/F16/BF16 storage (native dtype, or BF16 as uint16) → float32, exactly."""
    qtype = QT(qtype)
    if qtype == QT.BF16 and data.dtype == mx.uint16:
        data = data.view(mx.bfloat16)
    return data.astype(mx.float32)


def dequantize(data: mx.array, qtype: QT) -> mx.array:
    """Any supported storage → float32 (block types from uint8 rows, plain types from their element arrays)."""
    qtype = QT(qtype)
    if qtype in PLAIN_TYPES:
        return plain_to_float32(data, qtype)
    return dequantize_blocks(data, qtype)


# --- random valid blocks (docs/quants.md §5.2), for tests and benchmarks ---------------------------------------

# Byte offsets of the f16 fields that must hold finite values; every other bit pattern is legal.
F16_FIELDS = {QT.Q8_0: (0,), QT.Q2_K: (80, 82), QT.Q4_K: (0, 2), QT.IQ2_XXS: (0,)}
# Fields that quantizers keep non-negative (dmin).
NONNEG_FIELDS = {QT.Q2_K: (82,), QT.Q4_K: (2,)}


def random_blocks(rng: np.random.Generator, qtype: QT, shape: Sequence[int], scale=(1e-4, 5e-2)) -> np.ndarray:
    """Random but valid GGUF bytes for a weight of row-major ``shape``: uint8 ``(*shape[:-1], row_bytes)``.

    Uniform random bytes, then finite f16 ``d`` (random sign, |d| log-uniform in ``scale``) and ``dmin`` ≥ 0.
    """
    qtype = QT(qtype)
    bs, ts = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape[:-1])) * (shape[-1] // bs)
    b = rng.integers(0, 256, size=(n_blocks, ts), dtype=np.uint8)
    for o in F16_FIELDS[qtype]:
        mag = np.exp(rng.uniform(np.log(scale[0]), np.log(scale[1]), n_blocks))
        sign = 1.0 if o in NONNEG_FIELDS.get(qtype, ()) else rng.choice([-1.0, 1.0], n_blocks)
        b[:, o : o + 2] = (sign * mag).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b.reshape(*shape[:-1], row_bytes(qtype, shape[-1]))
