"""QuantWeight (fallback backend) vs gguf-py dequant + float64 numpy matmul (docs/quants.md §5.3)."""

import gguf
import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import backend, quants, weights
from ds4_mlx.weights import QuantWeight
from kernel_util import make_weight

F32_TOL = 1e-6  # f32 weights × f32 x, f32 accumulation: max err / Σ|w·x|
if backend.on_cuda_gpu():
    # MLX-CUDA runs float32 GEMMs (N > 1) through TF32 tensor cores (10-bit mantissa inputs): seen 2.1e-4 on
    # the H200. The fallback is the CPU path; the GPU path is the custom kernels (tests/test_kernels.py).
    F32_TOL = 1e-3


@pytest.fixture(autouse=True)
def _fallback_backend():
    backend.set_kernel_backend("fallback")
    yield
    backend.set_kernel_backend(None)


def rel_err(y: np.ndarray, x: np.ndarray, w: np.ndarray, einsum: str) -> float:
    """max |y − y64| / Σ|w·x| per output."""
    y64 = np.einsum(einsum, x.astype(np.float64), w)
    scale = np.einsum(einsum, np.abs(x.astype(np.float64)), np.abs(w))
    return float(np.max(np.abs(y.astype(np.float64) - y64) / scale))


ALL_TYPES = quants.BLOCK_TYPES + quants.PLAIN_TYPES


def _in_dim(qt, k):
    return k * 256 if qt in (QT.Q2_K, QT.Q4_K, QT.IQ2_XXS) else k * 32 + (32 if qt == QT.Q8_0 else 5)


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("out,k,lead", [(7, 3, (1,)), (33, 8, (5,)), (16, 1, (2, 3))])
def test_matmul(qt, out, k, lead):
    rng = np.random.default_rng(11)
    n_in = _in_dim(qt, k)
    w, ref = make_weight(rng, qt, (out, n_in))
    assert w.shape == (out, n_in) and w.qtype == qt
    x = rng.standard_normal((*lead, n_in)).astype(np.float32)
    y = np.array(w.matmul(mx.array(x)))
    assert y.shape == (*lead, out) and y.dtype == np.float32
    assert rel_err(y, x, ref, "...i,oi->...o") <= F32_TOL


def test_matmul_chunked_rows(monkeypatch):
    """The fallback splits big weights into row slabs; the seams must not show."""
    rng = np.random.default_rng(12)
    w, ref = make_weight(rng, QT.Q8_0, (37, 128))
    monkeypatch.setattr(weights, "FALLBACK_MAX_ELEMS", 5 * 128)
    x = rng.standard_normal((3, 128)).astype(np.float32)
    assert rel_err(np.array(w.matmul(mx.array(x))), x, ref, "ni,oi->no") <= F32_TOL


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
def test_dequantize_and_nbytes(qt):
    rng = np.random.default_rng(13)
    shape = (3, 9, _in_dim(qt, 2))
    w, ref = make_weight(rng, qt, shape)
    got = np.array(w.dequantize())
    assert got.shape == shape and np.array_equal(got + 0.0, ref.astype(np.float32) + 0.0)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    assert w.nbytes == np.prod(shape) // bs * ts


@pytest.mark.parametrize("qt", [QT.F16, QT.Q8_0, QT.Q4_K], ids=lambda q: q.name)
def test_rows(qt):
    rng = np.random.default_rng(14)
    w, ref = make_weight(rng, qt, (40, 256))
    ids = np.array([[3, 39, 3], [0, 17, 22]], dtype=np.int32)
    got = np.array(w.rows(mx.array(ids)))
    assert got.shape == (2, 3, 256)
    np.testing.assert_array_equal(got + 0.0, ref[ids].astype(np.float32) + 0.0)


IDS_CASES = {
    "repeated_unsorted": np.array([[5, 1, 5, 9], [9, 9, 0, 3], [2, 8, 1, 5]]),
    "one_expert": np.full((5, 4), 7),
    "extremes": np.array([[0, 9, 0, 9]]),
}


@pytest.mark.parametrize("qt", ALL_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("case", list(IDS_CASES))
@pytest.mark.parametrize("per_slot", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_gather_matmul(qt, case, per_slot, chunked, monkeypatch):
    rng = np.random.default_rng(15)
    E, out = 10, 12
    n_in = _in_dim(qt, 2)
    w, ref = make_weight(rng, qt, (E, out, n_in))
    ids = IDS_CASES[case].astype(np.int32)
    N, k = ids.shape
    if chunked:  # force the sort-by-expert path, two experts per chunk
        monkeypatch.setattr(weights, "FALLBACK_MAX_ELEMS", 2 * out * n_in)
    x = rng.standard_normal((N, k, n_in) if per_slot else (N, n_in)).astype(np.float32)
    y = np.array(w.gather_matmul(mx.array(x), mx.array(ids)))
    assert y.shape == (N, k, out) and y.dtype == np.float32
    xs = x if per_slot else np.broadcast_to(x[:, None], (N, k, n_in))
    assert rel_err(y, xs, ref[ids], "nki,nkoi->nko") <= F32_TOL


@pytest.mark.parametrize("chunked", [False, True])
def test_gather_matmul_never_reads_unselected(chunked, monkeypatch):
    """Poison every unselected expert with NaN scales: the result must stay finite and correct."""
    rng = np.random.default_rng(16)
    E, out, n_in = 12, 8, 512
    raw = quants.random_blocks(rng, QT.IQ2_XXS, (E, out, n_in))
    ids = np.array([[4, 1], [1, 10], [4, 4]], dtype=np.int32)
    ref = gguf.quants.dequantize(raw, QT.IQ2_XXS).astype(np.float64)
    poisoned = raw.copy()
    for e in set(range(E)) - set(ids.ravel().tolist()):
        blocks = poisoned[e].reshape(-1, 66)
        blocks[:, 0:2] = np.array([np.nan], dtype=np.float16).view(np.uint8)
    if chunked:
        monkeypatch.setattr(weights, "FALLBACK_MAX_ELEMS", out * n_in)
    w = QuantWeight.from_numpy(poisoned, QT.IQ2_XXS, (E, out, n_in))
    x = rng.standard_normal((3, n_in)).astype(np.float32)
    y = np.array(w.gather_matmul(mx.array(x), mx.array(ids)))
    assert np.all(np.isfinite(y))
    xs = np.broadcast_to(x[:, None], (3, 2, n_in))
    assert rel_err(y, xs, ref[ids], "nki,nkoi->nko") <= F32_TOL


@pytest.mark.parametrize("bad", [4, -1])
def test_gather_matmul_rejects_out_of_range_ids(bad):
    w, _ = make_weight(np.random.default_rng(18), QT.Q8_0, (4, 8, 64))
    x = mx.array(np.ones((3, 64), np.float32))
    with pytest.raises(IndexError, match="out of range"):
        w.gather_matmul(x, mx.array(np.array([[0, bad], [1, 2], [3, 3]], np.int32)))


def test_from_gguf_reader(tmp_path):
    """Tensors exactly as GGUFReader hands them over (uint8 rows for blocks, element arrays otherwise)."""
    rng = np.random.default_rng(17)
    path = tmp_path / "w.gguf"
    writer = gguf.GGUFWriter(str(path), "test")
    refs = {}
    for qt in ALL_TYPES:
        shape = (2, 6, 256) if qt in (QT.IQ2_XXS, QT.Q2_K) else (6, 256)
        w, ref = make_weight(rng, qt, shape)
        raw = np.array(w.data.view(mx.uint16) if qt == QT.BF16 else w.data)
        writer.add_tensor(qt.name, raw, raw_shape=raw.shape if qt in quants.BLOCK_TYPES else None, raw_dtype=qt)
        refs[qt.name] = (qt, shape, ref)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        qt, shape, ref = refs[t.name]
        assert tuple(int(d) for d in reversed(t.shape)) == shape
        w = QuantWeight.from_numpy(t.data, t.tensor_type, shape)
        assert w.shape == shape
        assert np.array_equal(np.array(w.dequantize()) + 0.0, ref.astype(np.float32) + 0.0)


def test_backend_selection(monkeypatch):
    backend.set_kernel_backend(None)
    monkeypatch.setenv("DS4_MLX_KERNELS", "fallback")
    assert backend.kernel_backend() == "fallback"
    monkeypatch.setenv("DS4_MLX_KERNELS", "bogus")
    with pytest.raises(ValueError):
        backend.kernel_backend()
    monkeypatch.delenv("DS4_MLX_KERNELS")
    expected = "fallback"
    if mx.default_device() == mx.gpu:
        expected = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else "fallback"
    assert backend.kernel_backend() == expected
    with pytest.raises(ValueError):
        backend.set_kernel_backend("opencl")
    backend.set_kernel_backend("fallback")
    monkeypatch.setenv("DS4_MLX_KERNELS", "bogus")  # the setter wins over the env var
    assert backend.kernel_backend() == "fallback"
    # QuantWeight reads the same choice, and the setter stays importable from ds4_mlx.weights
    assert weights.kernel_backend is backend.kernel_backend
    assert weights.set_kernel_backend is backend.set_kernel_backend


def test_shape_validation():
    rng = np.random.default_rng(18)
    w, _ = make_weight(rng, QT.Q8_0, (4, 64))
    with pytest.raises(ValueError):
        w.matmul(mx.zeros((2, 32)))
    with pytest.raises(ValueError):
        w.gather_matmul(mx.zeros((1, 64)), mx.zeros((1, 2), dtype=mx.int32))
    e, _ = make_weight(rng, QT.Q2_K, (3, 4, 256))
    with pytest.raises(ValueError):
        e.gather_matmul(mx.zeros((2, 256)), mx.zeros((3, 2), dtype=mx.int32))
    with pytest.raises(ValueError):
        QuantWeight(mx.zeros((4, 35), dtype=mx.uint8), QT.Q8_0, (4, 32))


@pytest.mark.parametrize("qt", [QT.Q8_0, QT.F16, QT.Q2_K])
def test_stack_rows(qt):
    """Stacked rows hold the same values in the same encoding: one matvec gives each weight's product."""
    rng = np.random.default_rng(int(qt))
    n_in = _in_dim(qt, 1)
    parts = [make_weight(rng, qt, (rows, n_in)) for rows in (3, 5, 2)]
    s = QuantWeight.stack_rows([w for w, _ in parts])
    assert s.qtype == qt and s.shape == (10, n_in)
    ref = np.concatenate([r for _, r in parts])
    np.testing.assert_array_equal(np.array(s.dequantize()), ref.astype(np.float32))
    x = mx.random.normal((2, n_in), key=mx.random.key(1))
    y, at = np.array(s.matmul(x)), 0
    for w, _ in parts:
        np.testing.assert_allclose(y[:, at : at + w.out_features], np.array(w.matmul(x)), rtol=1e-6, atol=1e-6)
        at += w.out_features
    back = s.split_rows([3, 5, 2])  # the inverse: views of the stacked rows
    for b, (w, r) in zip(back, parts):
        assert b.qtype == qt and b.shape == w.shape
        np.testing.assert_array_equal(np.array(b.dequantize()), r.astype(np.float32))
        np.testing.assert_array_equal(np.array(b.matmul(x)), np.array(w.matmul(x)))
    with pytest.raises(ValueError, match="do not split"):
        s.split_rows([3, 5])


def test_stack_rows_rejects_mismatches():
    rng = np.random.default_rng(0)
    a, _ = make_weight(rng, QT.Q8_0, (4, 64))
    for other in (make_weight(rng, QT.F16, (4, 64))[0], make_weight(rng, QT.Q8_0, (4, 96))[0],
                  make_weight(rng, QT.Q8_0, (2, 4, 64))[0]):
        with pytest.raises(ValueError, match="does not stack"):
            QuantWeight.stack_rows([a, other])
