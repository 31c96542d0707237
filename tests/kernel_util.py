"""Helpers shared by the kernel tests: random weights with their gguf-py reference, MLX's rendered Metal text."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx import quants
from ds4_mlx.backend import kernel_backend, set_kernel_backend
from ds4_mlx.weights import QuantWeight

ROOT = Path(__file__).resolve().parent.parent


def kernel_test_backend() -> str:
    """Where the kernel tests run the kernels: the GPU backend if there is one, else ``sim`` (the CUDA text on
    the CPU, custom_kernels/sim.py) if a C++ compiler is found, else ``fallback`` (kernel tests skip)."""
    set_kernel_backend(None)
    try:
        b = kernel_backend()
    except Exception:
        b = "fallback"
    if b == "fallback":
        from ds4_mlx.kernels.sim import compiler

        b = "sim" if compiler() else "fallback"
    return b


#: The kernel tests' backend, and their marks: a test that needs some kernel backend (GPU or sim), and one too
#: large for the sim backend (it runs threads one by one).
BACKEND = kernel_test_backend()
needs_gpu = pytest.mark.skipif(BACKEND == "fallback", reason="no Metal/CUDA backend and no C++ compiler for sim")
gpu_only = pytest.mark.skipif(BACKEND == "sim", reason="too large for the sim backend (it runs threads one by one)")


@contextlib.contextmanager
def kernel_backend_set(name: str):
    """Every kernel call inside uses backend ``name`` (the public entry points too); automatic after."""
    set_kernel_backend(name)
    try:
        yield
    finally:
        set_kernel_backend(None)


def make_weight(rng, qt: QT, shape, ref_dtype=np.float64) -> tuple[QuantWeight, np.ndarray]:
    """A random valid weight and its reference values (gguf-py's dequantization) as ``ref_dtype``."""
    shape = tuple(shape)
    if qt in quants.BLOCK_TYPES:
        raw = quants.random_blocks(rng, qt, shape)
        ref = gguf.quants.dequantize(raw, qt)
    else:
        x = (rng.standard_normal(shape) * 0.05).astype(np.float32)
        raw = {QT.F32: x, QT.F16: x.astype(np.float16), QT.BF16: (x.view(np.uint32) >> 16).astype(np.uint16)}[qt]
        ref = gguf.quants.dequantize(raw.view(np.uint8) if qt == QT.BF16 else raw, qt).reshape(shape)
    return QuantWeight.from_numpy(raw, qt, shape), ref.astype(ref_dtype)


def quantize_x_octets(x: np.ndarray) -> np.ndarray:
    """x as the quantized-x matvec sees it (kernels.quantize_x), as float64: per 8 values, d = max|x| · (1/127),
    q = rint(x · (127 / max|x|)) and r = rint((x − q·d) · (128 · 127 / max|x|)), x̂ = d · (q + r / 128); every
    step in f32 as quantize_x computes it."""
    f32 = np.float32
    o = np.asarray(x, f32).reshape(*np.shape(x)[:-1], -1, 8)
    amax = np.abs(o).max(-1, keepdims=True)
    inv = np.where(amax > 0, f32(127) / np.where(amax > 0, amax, f32(1)), f32(0)).astype(f32)
    d = amax * f32(1 / 127)
    q = np.rint(o * inv)
    r = np.rint((o - q * d) * (f32(128) * inv))
    return (d.astype(np.float64) * (q.astype(np.float64) + r.astype(np.float64) / 128)).reshape(np.shape(x))


def render_metal_sources(script: str) -> dict[str, str]:
    """{tag: Metal source exactly as MLX prints it}: runs ``script`` (which calls kernels with ``verbose=True``
    under ``mx.export_function`` and prints ``@@@ tag`` before each) in a subprocess and parses its output."""
    r = subprocess.run([sys.executable, "-c", script, str(ROOT)], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    out = {}
    for chunk in r.stdout.split("@@@ ")[1:]:
        tag, rest = chunk.split("\n", 1)
        m = re.search(r"```\n(.*?)```", rest, re.S)
        assert m, f"no generated source printed for {tag}"
        out[tag] = m.group(1)
    return out


def gxx_metal_check(sources, tmp_path: Path, name: str = "metal") -> subprocess.CompletedProcess:
    """``g++ -fsyntax-only`` of Metal sources (each in its own namespace) against the Metal shim; skips without g++."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ not found: Metal syntax check not run")
    tu = tmp_path / f"{name}.cpp"
    tu.write_text("\n".join(f"namespace tu_{i} {{\n{src}\n}}\n" for i, src in enumerate(sources)))
    shim = ROOT / "custom_kernels" / "metal_shim.h"
    return subprocess.run([gxx, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-include", str(shim), str(tu)],
                          capture_output=True, text=True, timeout=300)


def nvcc_compile(source: str | list[str], tmp_path: Path, name: str = "cuda") -> subprocess.CompletedProcess:
    """``nvcc -arch=sm_90 -c`` of a CUDA translation unit, with ptxas stats on stderr; skips without nvcc. A list
    of units compiles side by side, one nvcc each (the machine's cores), into one joined result."""
    nvcc = shutil.which("nvcc") or (os.path.exists("/usr/local/cuda/bin/nvcc") and "/usr/local/cuda/bin/nvcc")
    if not nvcc:
        pytest.skip("nvcc not found on this machine: CUDA compile check not run")
    runs = []
    for i, unit in enumerate([source] if isinstance(source, str) else source):
        tu = tmp_path / f"{name}_{i}.cu"
        tu.write_text(unit)
        cmd = [nvcc, "-arch=sm_90", "-std=c++17", "-c", str(tu), "-o", str(tu.with_suffix(".o")), "-Xptxas", "-v"]
        log = tu.with_suffix(".log").open("w+")  # a file, not a pipe: a full pipe would stall the unit beside it
        runs.append((cmd, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True), log))
    try:
        codes = [p.wait(timeout=600) for _, p, _ in runs]
    finally:  # a unit past its time is stopped, as subprocess.run stops one
        for _, p, _ in runs:
            if p.poll() is None:
                p.kill()
    text = ""
    for _, _, log in runs:
        log.seek(0)
        text += log.read()
        log.close()
    return subprocess.CompletedProcess([c for c, _, _ in runs], max(codes), "", text)
