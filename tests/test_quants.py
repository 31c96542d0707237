"""ds4_mlx.quants vs gguf-py's numpy dequantizers (docs/quants.md §1, §5.2, §5.3): exact values, golden blocks."""

import hashlib

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import quants

SPECIAL_D = [0.0, -0.0, -0.03125, 2.0**-20, 65504.0, -2.0**-24, 1e-4]


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal as values (+0.0 == -0.0, docs/quants.md §5.3); shapes must match too."""
    return a.shape == b.shape and np.array_equal(a + np.float32(0), b + np.float32(0))


def _deq(b: np.ndarray, qt: QT) -> np.ndarray:
    return np.array(quants.dequantize(mx.array(b), qt))


@pytest.mark.parametrize("qt", quants.BLOCK_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("shape", [(1, 256), (5, 768), (3, 4, 512)])
def test_random_blocks_match_gguf_py(qt, shape):
    rng = np.random.default_rng([int(qt), *shape])
    b = quants.random_blocks(rng, qt, shape)
    ref = gguf.quants.dequantize(b, qt)  # (..., n) float32
    got = _deq(b, qt)
    assert got.dtype == np.float32
    assert got.shape == tuple(shape)
    assert _same_values(got, ref)
    # The bits agree too, except possibly the sign of a zero.
    assert np.array_equal((got + np.float32(0)).view(np.uint32), (ref + np.float32(0)).view(np.uint32))


@pytest.mark.parametrize("qt", quants.BLOCK_TYPES, ids=lambda q: q.name)
def test_edge_case_f16_fields(qt):
    """d = 0, -0, negative, subnormal, max f16 (and the same for dmin) on otherwise random blocks."""
    rng = np.random.default_rng(1)
    b = quants.random_blocks(rng, qt, (len(SPECIAL_D) ** 2, 256))
    n = b.shape[0]
    for i in range(n):
        for j, o in enumerate(quants.F16_FIELDS[qt]):
            v = SPECIAL_D[i % len(SPECIAL_D)] if j == 0 else abs(SPECIAL_D[i // len(SPECIAL_D)])
            b[i, o : o + 2] = np.array([v], dtype=np.float16).view(np.uint8)
    assert _same_values(_deq(b, qt), gguf.quants.dequantize(b, qt))


def _edge_pattern(qt: QT) -> np.ndarray:
    """One block with every quant field at its maximum, per docs/quants.md §5.2."""
    b = np.full((1, quants.type_size(qt)), 0xFF, dtype=np.uint8)
    if qt == QT.Q8_0:
        b[0, 2:] = 0x80  # q = -128 everywhere
    for o in quants.F16_FIELDS[qt]:
        b[0, o : o + 2] = np.array([0.0371], dtype=np.float16).view(np.uint8)
    if qt == QT.IQ2_XXS:  # grid index 255, sign index 127, ls = 15 in every group
        assert b[0, 2:10].tobytes() == b"\xff" * 8
    return b


@pytest.mark.parametrize("qt", quants.BLOCK_TYPES, ids=lambda q: q.name)
def test_edge_case_all_max_fields(qt):
    b = _edge_pattern(qt)
    got, ref = _deq(b, qt), gguf.quants.dequantize(b, qt)
    assert _same_values(got, ref)
    assert np.all(np.isfinite(got)) and np.any(got != 0)


def test_q8_0_minus_128_golden():
    b = _edge_pattern(QT.Q8_0)
    d = float(np.array([0.0371], dtype=np.float16)[0])
    assert np.all(_deq(b, QT.Q8_0) == np.float32(d) * np.float32(-128))


def _f16_bytes(v: float) -> bytes:
    return np.array([v], dtype=np.float16).tobytes()


def test_q2_k_worked_example():
    """docs/quants.md §1.2."""
    b = np.zeros((1, 84), dtype=np.uint8)
    b[0, [0, 2, 4, 6]] = [0x21, 0x35, 0x0F, 0xF7]
    b[0, 16], b[0, 17] = 0xE4, 0xFF
    b[0, 80:82] = np.frombuffer(_f16_bytes(0.125), np.uint8)
    b[0, 82:84] = np.frombuffer(_f16_bytes(0.0625), np.uint8)
    assert bytes(b[0, 80:84]) == bytes([0x00, 0x30, 0x00, 0x2C])
    w = _deq(b, QT.Q2_K)[0]
    golden = {0: -0.125, 1: 0.25, 32: 0.4375, 64: 3.75, 96: 1.6875, 16: 0.0, 128: 0.0}
    for i, v in golden.items():
        assert w[i] == v, (i, w[i], v)
    assert _same_values(w, gguf.quants.dequantize(b, QT.Q2_K)[0])


def test_q4_k_worked_example():
    """docs/quants.md §1.3."""
    b = np.zeros((1, 144), dtype=np.uint8)
    b[0, 0:2] = np.frombuffer(_f16_bytes(0.5), np.uint8)
    b[0, 2:4] = np.frombuffer(_f16_bytes(0.25), np.uint8)
    b[0, 4:16] = [0x41, 0, 0, 0, 0x82, 0, 0, 0, 0x3A, 0, 0, 0]
    b[0, 16 + 0], b[0, 16 + 64] = 0x95, 0x7C
    w = _deq(b, QT.Q4_K)[0]
    assert w[0] == 2.0 and w[32] == 0.0 and w[128] == 147.25
    assert _same_values(w, gguf.quants.dequantize(b, QT.Q4_K)[0])


def test_iq2_xxs_worked_example():
    """docs/quants.md §1.4: the block that starts 00 2C 00 01 02 FF 80 C0 E0 5F, other groups all zero."""
    b = np.zeros((1, 66), dtype=np.uint8)
    b[0, :10] = [0x00, 0x2C, 0x00, 0x01, 0x02, 0xFF, 0x80, 0xC0, 0xE0, 0x5F]
    w = _deq(b, QT.IQ2_XXS)[0]
    a, c, e = 0.6875, 2.1484375, 3.6953125
    np.testing.assert_array_equal(w[0:8], [a] * 8)
    np.testing.assert_array_equal(w[8:16], [-e] + [a] * 6 + [-a])
    np.testing.assert_array_equal(w[16:24], [-c, -c] + [a] * 6)
    np.testing.assert_array_equal(w[24:32], [-a, -c, -a, -a, -c, -e, -e, -e])
    np.testing.assert_array_equal(w[32:], [0.0625] * 224)  # all-zero groups: 8 · d·0.5·0.25
    assert _same_values(w, gguf.quants.dequantize(b, QT.IQ2_XXS)[0])


def test_q8_0_golden():
    b = np.zeros((1, 34), dtype=np.uint8)
    b[0, 0:2] = np.frombuffer(_f16_bytes(-0.5), np.uint8)
    b[0, 2:] = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    np.testing.assert_array_equal(_deq(b, QT.Q8_0)[0], -0.5 * np.arange(-16, 16, dtype=np.float32))


def test_iq2_grid_pinned():
    grid = quants.iq2xxs_grid_bytes()
    assert grid.shape == (256, 8) and grid.dtype == np.uint8
    assert hashlib.sha256(grid.tobytes()).hexdigest() == quants.IQ2_GRID_SHA256
    assert set(np.unique(grid)) == {8, 25, 43}
    words = quants.iq2xxs_grid_u64()
    assert words[0] == 0x0808080808080808
    assert words[1] == 0x080808080808082B
    assert words[255] == 0x2B2B2B1908081908


def test_ksigns_parity():
    ks = quants.iq2xxs_ksigns()
    assert ks.shape == (128,)
    for s in range(128):
        assert ks[s] == s | ((bin(s).count("1") & 1) << 7)


@pytest.mark.parametrize("qt", quants.PLAIN_TYPES, ids=lambda q: q.name)
def test_plain_types(qt):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 33)).astype(np.float32)
    if qt == QT.F32:
        raw, arr = x, mx.array(x)
    elif qt == QT.F16:
        raw = x.astype(np.float16)
        arr = mx.array(raw)
    else:  # BF16 as its raw u16 bits, as a GGUF holds it
        raw = (x.view(np.uint32) >> 16).astype(np.uint16)
        arr = mx.array(raw)
    ref = gguf.quants.dequantize(raw.view(np.uint8) if qt == QT.BF16 else raw, qt).reshape(5, 33)
    got = np.array(quants.dequantize(arr, qt))
    assert got.dtype == np.float32 and _same_values(got, ref)


def test_random_blocks_valid():
    rng = np.random.default_rng(4)
    for qt in quants.BLOCK_TYPES:
        b = quants.random_blocks(rng, qt, (8, 512))
        assert b.shape == (8, quants.row_bytes(qt, 512)) and b.dtype == np.uint8
        fields = b.reshape(-1, quants.type_size(qt))
        for o in quants.F16_FIELDS[qt]:
            d = fields[:, o : o + 2].copy().view(np.float16)
            assert np.all(np.isfinite(d)) and np.all(np.abs(d) <= 5e-2)
        for o in quants.NONNEG_FIELDS.get(qt, ()):
            assert np.all(fields[:, o : o + 2].copy().view(np.float16) >= 0)


def test_rejects_bad_row_bytes():
    with pytest.raises(ValueError):
        quants.dequantize(mx.zeros((2, 35), dtype=mx.uint8), QT.Q8_0)
    with pytest.raises(ValueError):
        quants.row_bytes(QT.Q2_K, 300)
