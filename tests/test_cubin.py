"""CUDA cubins compiled once and cached on disk (custom_kernels/cubin.py): the units it renders, the cache's
keys and files, the fallback to MLX's own compile; on a CUDA machine, a kernel of each weight type compiled by
NVRTC and launched, against MLX's compile of the same text (the other GPU kernel tests launch through cubins
too)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels as kernels
from ds4_mlx.kernels import cubin
from kernel_util import BACKEND, make_weight

on_cuda = pytest.mark.skipif(BACKEND != "cuda", reason="needs MLX's CUDA backend")


def _kernel(tmp_path, jit=None) -> cubin.CubinKernel:
    return cubin.CubinKernel("ds_deq", ["w", "params"], ["y"], kernels.render_header("deq", "cuda", False),
                             kernels.render_source("deq", "cuda"), tmp_path, jit or (lambda: None))  # fmt: skip


def test_each_specialization_renders_its_own_unit(tmp_path):
    k = _kernel(tmp_path)
    u8, i32, f32 = mx.uint8, mx.int32, mx.float32
    entry, text = k.render([u8, i32], [f32], [("QT", 8)])
    assert entry.startswith("ds_deq_") and f'extern "C" __global__ void {entry}(' in text
    assert "const uint8_t* w, const int32_t* params, float* y" in text and "constexpr int QT = 8;" in text
    assert text.startswith(cubin.PROLOGUE)
    assert k.render([u8, i32], [f32], [("QT", 8)]) == (entry, text)  # stable: the cache key
    others = {k.render([u8, i32], [f32], [("QT", 10)])[0], k.render([u8, i32], [mx.float16], [("QT", 8)])[0]}
    assert entry not in others and len(others) == 2
    assert "constexpr bool B = true;" in k.render([u8, i32], [f32], [("B", np.bool_(True))])[1]


def test_cubins_are_compiled_once_and_read_back(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(cubin, "compile_cubin", lambda text, arch: calls.append(arch) or f"{arch}:{text}".encode())
    monkeypatch.setattr(cubin, "architecture", lambda: "sm_90a")
    assert cubin.cached_cubin("unit", tmp_path) == b"sm_90a:unit"
    assert cubin.cached_cubin("unit", tmp_path) == b"sm_90a:unit" and calls == ["sm_90a"]  # from the file
    assert len(list(tmp_path.glob("*.cubin"))) == 1 and not list(tmp_path.glob("*.tmp"))
    monkeypatch.setattr(cubin, "architecture", lambda: "sm_100a")  # another device: its own file
    assert cubin.cached_cubin("unit", tmp_path) == b"sm_100a:unit" and calls == ["sm_90a", "sm_100a"]
    blocked = tmp_path / "file"
    blocked.write_text("")  # a cache folder that cannot be made still gives the cubin
    assert cubin.cached_cubin("unit", blocked / "sub") == b"sm_100a:unit"


def test_a_unit_that_does_not_compile_launches_through_mlx(tmp_path, monkeypatch):
    def fail(text, folder):
        raise RuntimeError("NVRTC: NVRTC_ERROR_COMPILATION\nerror: identifier undefined")

    monkeypatch.setattr(cubin, "cached_cubin", fail)
    launched = []

    def jit():
        return lambda **kw: launched.append(kw["template"]) or [mx.zeros(1)]

    k = _kernel(tmp_path, jit)
    call = dict(inputs=[mx.zeros(4, dtype=mx.uint8), mx.zeros(2, dtype=mx.int32)], output_shapes=[(1,)],
                output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1))  # fmt: skip
    with pytest.warns(UserWarning, match="MLX compiles it instead"):
        k(**call, template=[("QT", 8)])
    k(**call, template=[("QT", 8)])  # decided once: no second warning, no second compile
    assert launched == [[("QT", 8)], [("QT", 8)]]
    (log,) = tmp_path.glob("*.log")
    assert "identifier undefined" in log.read_text() and "extern \"C\"" in log.read_text()
    with pytest.raises(ValueError, match="expected 2 inputs"):
        k(**{**call, "inputs": call["inputs"][:1]}, template=[("QT", 8)])


def test_the_switch_turns_cubins_off(monkeypatch):
    monkeypatch.setenv("DS4_MLX_CUBIN", "0")
    assert not cubin.enabled()


@on_cuda
def test_cubins_give_mlx_compiles_results(tmp_path):
    """The weight decoder of every type as a cached cubin, against MLX's compile of the same text."""
    rng = np.random.default_rng(0)
    for qt in kernels.KERNEL_TYPES:
        qw, _ = make_weight(rng, qt, (64, 256))
        header, source = kernels.render_header("deq", "cuda", True), kernels.render_source("deq", "cuda")
        jit = mx.fast.cuda_kernel(name="ds_deq", input_names=["w", "params"], output_names=["y"], source=source,
                                  header=header)  # fmt: skip
        k = cubin.CubinKernel("ds_deq", ["w", "params"], ["y"], header, source, tmp_path, lambda: jit)
        wb = kernels.weight_bytes(qw)
        call = dict(inputs=[wb, kernels._params(256, 64, wb.shape[-1])], template=list(kernels.deq_template(qt)),
                    grid=(64 * 16, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(64, 256)],
                    output_dtypes=[mx.float32])  # fmt: skip
        assert k.specialization([a.dtype for a in call["inputs"]], [mx.float32], call["template"]) is not None
        np.testing.assert_array_equal(np.array(k(**call)[0]), np.array(jit(**call)[0]))
