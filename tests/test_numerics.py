"""ds4 rounding simulations vs direct NumPy implementations of docs/model.md §4.1 (table search, explicit tie rule)."""

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.numerics import (
    PROFILES,
    Numerics,
    f16r,
    fp4_e2m1_round_trip,
    fp8_e4m3_round_trip,
    get_numerics,
    hadamard128,
    indexer_qat,
)

# --- NumPy references, written from the spec text ---------------------------------------------------------


def e4m3_table() -> np.ndarray:
    """E4M3FN values of codes 0..126: exp=i>>3, man=i&7."""
    vals = []
    for i in range(127):
        e, m = i >> 3, i & 7
        vals.append(m * 2.0**-9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


FP4_TABLE = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def nearest_with_tie(a: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Nearest table entry to each |v|; upper neighbour only if strictly closer or (tie and upper index even)."""
    out = np.empty_like(a)
    for n, v in enumerate(a.ravel()):
        hi = int(np.searchsorted(table, v, side="left"))  # table[hi] >= v
        if hi < len(table) and table[hi] == v:
            out.flat[n] = v
            continue
        lo = hi - 1
        if hi >= len(table):
            out.flat[n] = table[-1]
            continue
        d_lo, d_hi = v - table[lo], table[hi] - v
        take_hi = d_hi < d_lo or (d_hi == d_lo and hi % 2 == 0)
        out.flat[n] = table[hi] if take_hi else table[lo]
    return out


def np_block_round_trip(x: np.ndarray, block: int, vmax: float, floor: float, table: np.ndarray) -> np.ndarray:
    x = x.astype(np.float32)
    xb = x.reshape(-1, block)
    out = np.empty_like(xb)
    for b in range(xb.shape[0]):
        amax = np.float32(max(float(np.abs(xb[b]).max()), floor))
        t = np.float32(amax / np.float32(vmax))
        scale = np.float32(2.0 ** math.ceil(math.log2(float(t))))
        v = np.clip(xb[b] / scale, -vmax, vmax).astype(np.float64)
        out[b] = (np.sign(v) * nearest_with_tie(np.abs(v), table) * scale).astype(np.float32)
    return out.reshape(x.shape)


def np_fp8(x: np.ndarray, n_nope: int) -> np.ndarray:
    y = x.astype(np.float32).copy()
    rows = y.reshape(-1, y.shape[-1])
    for r in rows:
        r[:n_nope] = np_block_round_trip(r[:n_nope], 64, 448.0, 1e-4, e4m3_table())
    return rows.reshape(y.shape)


def np_fp4(x: np.ndarray) -> np.ndarray:
    return np_block_round_trip(x, 32, 6.0, 7.052966104933725e-38, FP4_TABLE)


def np_fwht128(x: np.ndarray) -> np.ndarray:
    """ds4's butterfly: strides 1,2,..,64, (a,b)->(a+b,a-b), then * 1/sqrt(128), in float32."""
    y = x.astype(np.float32).reshape(-1, 128).copy()
    h = 1
    while h < 128:
        for i in range(0, 128, 2 * h):
            a = y[:, i : i + h].copy()
            b = y[:, i + h : i + 2 * h].copy()
            y[:, i : i + h] = a + b
            y[:, i + h : i + 2 * h] = a - b
        h *= 2
    return (y * np.float32(0.08838834764831845)).reshape(x.shape)


def mx_np(f, x, *args):
    return np.array(f(mx.array(x), *args))


# --- tests ------------------------------------------------------------------------------------------------


def test_profiles():
    assert get_numerics() == PROFILES["ds4"]
    assert get_numerics("hf") == Numerics(False, False, False)
    ds4 = get_numerics("ds4")
    assert ds4.fp8_kv and ds4.indexer_qat and ds4.f16_cache and not ds4.rope_recurrence
    custom = Numerics(fp8_kv=False, indexer_qat=False, f16_cache=True, rope_recurrence=True)
    assert get_numerics(custom) is custom
    with pytest.raises(ValueError):
        get_numerics("nope")


def test_e4m3_table_matches_spec():
    t = e4m3_table()
    assert t[-1] == 448.0 and t[1] == 2.0**-9 and np.all(np.diff(t) > 0)


@pytest.mark.parametrize("scale", [1e-3, 0.3, 1.0, 37.0, 5e3])
def test_fp8_random(scale):
    rng = np.random.default_rng(int(scale * 1000))
    x = (rng.standard_normal((6, 512)) * scale).astype(np.float32)
    x[1, :64] *= 1e-6  # a block below the 1e-4 amax floor
    x[2, 64:128] = 0.0  # an all-zero block
    got = mx_np(fp8_e4m3_round_trip, x, 448)
    want = np_fp8(x, 448)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, 448:], x[:, 448:])  # RoPE dims untouched
    assert not np.array_equal(got[:, :448], x[:, :448])  # it does round


def test_fp8_exact_midpoints():
    t = e4m3_table()
    mids = (t[:-1] + t[1:]) / 2  # 126 exact midpoints, f32-representable
    rows = []
    for start in range(0, len(mids), 63):
        block = np.full(64, 0.0, np.float32)
        chunk = mids[start : start + 63]
        block[: len(chunk)] = chunk * np.where(np.arange(len(chunk)) % 2, -1, 1)
        block[63] = 448.0  # amax 448 -> scale exactly 1
        rows.append(block)
    x = np.concatenate(rows + [np.zeros(64, np.float32)]).reshape(1, -1).astype(np.float32)  # 3 blocks + pad
    x = np.concatenate([x, np.ones((1, 64), np.float32)], axis=1)  # + 64 "rope" dims
    n_nope = x.shape[1] - 64
    got = mx_np(fp8_e4m3_round_trip, x, n_nope)
    want = np_fp8(x, n_nope)
    np.testing.assert_array_equal(got, want)
    # Spot-check the tie rule by hand: midpoint of codes 8 (2^-6) and 9 goes to 8 (even), of 9 and 10 to 10.
    m89, m910 = (t[8] + t[9]) / 2, (t[9] + t[10]) / 2
    probe = np.array([[m89, m910] + [0.0] * 61 + [448.0]], np.float32)
    np.testing.assert_array_equal(mx_np(fp8_e4m3_round_trip, probe, 64)[0, :2], [t[8], t[10]])


def test_fp4_random_and_midpoints():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((8, 128)) * rng.uniform(0.01, 50, (8, 1))).astype(np.float32)
    np.testing.assert_array_equal(mx_np(fp4_e2m1_round_trip, x), np_fp4(x))
    mids = (FP4_TABLE[:-1] + FP4_TABLE[1:]) / 2  # .25 .75 1.25 1.75 2.5 3.5 5
    block = np.zeros(32, np.float32)
    block[: len(mids)] = mids
    block[len(mids) : 2 * len(mids)] = -mids
    block[31] = 6.0
    got = mx_np(fp4_e2m1_round_trip, block[None])
    np.testing.assert_array_equal(got, np_fp4(block[None]))
    np.testing.assert_array_equal(got[0, :7], [0, 1, 1, 2, 2, 4, 4])  # even-index ties


def test_hadamard128():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 3, 128)).astype(np.float32)
    got = mx_np(hadamard128, x)
    np.testing.assert_allclose(got, np_fwht128(x), rtol=0, atol=2e-6)
    # H is orthonormal and an involution: H(Hx) = x
    np.testing.assert_allclose(np.array(hadamard128(hadamard128(mx.array(x)))), x, atol=2e-6)


def test_indexer_qat():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 128)).astype(np.float32)
    got = mx_np(indexer_qat, x)
    want = np_fp4(np_fwht128(x))
    np.testing.assert_array_equal(got, want)


def test_f16r():
    rng = np.random.default_rng(4)
    x = (rng.standard_normal(4096) * 100).astype(np.float32)
    # exact f16 midpoints round to even mantissa
    x[:4] = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, 2048 + 1, 2048 + 3], np.float32)
    got = mx_np(f16r, x)
    np.testing.assert_array_equal(got, x.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(got[:4], [1.0, 1 + 2 * 2.0**-10, 2048, 2052])
