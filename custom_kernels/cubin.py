"""CUDA kernels compiled once with NVRTC and kept on disk as cubins, launched through
``mx.fast.precompiled_cuda_kernel``.

``mx.fast.cuda_kernel`` compiles every specialization with NVRTC in every process and keeps the result in memory
only, so a fresh process pays for each kernel again before it runs at speed (benchmarks/RESULTS.md, "A GGUF file
of the real width"). Here each specialization's translation unit is compiled once into a cubin for the device's
architecture, stored in the package's cache folder under a hash of its text, the architecture and the NVRTC
version, and read back by later processes.

:class:`CubinKernel` is called like ``mx.fast.cuda_kernel``'s result. Where NVRTC cannot be found, or a unit does
not compile here, it launches through ``mx.fast.cuda_kernel`` instead (same source, same results) and says so
once; ``DS4_MLX_CUBIN=0`` chooses that path from the start.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import threading
import warnings
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from .entry import checked_inputs, constants, parameters

#: What each unit starts with. NVRTC has no C library headers: the fixed-width integers and INFINITY are defined
#: as libcu++ defines them under NVRTC; the half types and wmma come from the CUDA headers MLX compiles against.
PROLOGUE = """\
typedef signed char int8_t; typedef unsigned char uint8_t; typedef short int16_t; typedef unsigned short uint16_t;
typedef int int32_t; typedef unsigned int uint32_t; typedef long long int64_t; typedef unsigned long long uint64_t;
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
"""


def enabled() -> bool:
    """Whether CUDA launches use cached cubins: ``$DS4_MLX_CUBIN`` (default on) and NVRTC found."""
    return os.environ.get("DS4_MLX_CUBIN", "1").strip() not in ("0", "off", "false") and _nvrtc() is not None


def _loaded_library(stem: str) -> str | None:
    """Path of a shared library this process has already mapped (MLX-CUDA links NVRTC and the driver)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rsplit(" ", 1)[-1].strip()
                if f"/{stem}.so" in path:
                    return path
    except OSError:
        pass
    return None


def _open(stem: str, names: tuple[str, ...]) -> ctypes.CDLL | None:
    for name in (_loaded_library(stem), *names):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    return None


@lru_cache(maxsize=None)
def _nvrtc() -> ctypes.CDLL | None:
    lib = _open("libnvrtc", ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"))
    if lib is None:
        return None
    P = ctypes.c_void_p
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int, P, P]
    lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for f in ("nvrtcGetProgramLogSize", "nvrtcGetCUBINSize"):
        getattr(lib, f).argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
    for f in ("nvrtcGetProgramLog", "nvrtcGetCUBIN"):
        getattr(lib, f).argtypes = [P, ctypes.c_char_p]
    lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
    return lib


@lru_cache(maxsize=None)
def architecture() -> str:
    """The device's ``sm_XY`` (with Hopper's and later ``a`` suffix, as MLX builds its own kernels)."""
    cuda = _open("libcuda", ("libcuda.so.1", "libcuda.so"))
    if cuda is None:
        raise RuntimeError("the CUDA driver library is not loaded")
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    cuda.cuInit(0)
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) or cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev) \
            or cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev):  # fmt: skip
        raise RuntimeError("could not read the device's compute capability")
    return f"sm_{major.value}{minor.value}{'a' if major.value >= 9 else ''}"


@lru_cache(maxsize=None)
def include_dirs() -> tuple[str, ...]:
    """Where the CUDA headers are, looked up as MLX-CUDA looks them up: the ``nvidia`` Python package beside
    ``mlx``, else ``$CUDA_HOME`` / ``$CUDA_PATH``, else ``/usr/local/cuda``."""
    site = Path(mx.__file__).resolve().parent.parent
    dirs = [site / "nvidia" / v / "include" for v in ("cu13", "cuda_runtime")]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    dirs.append(Path(home) / "include")
    return tuple(str(d) for d in dirs if (d / "cuda_fp16.h").is_file())


def compile_cubin(text: str, arch: str) -> bytes:
    """``text`` compiled by NVRTC into a cubin for ``arch``; RuntimeError with the compiler's log on failure."""
    lib = _nvrtc()
    if lib is None:
        raise RuntimeError("NVRTC is not available")
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc:
            raise RuntimeError(f"{what}: {lib.nvrtcGetErrorString(rc).decode()}")

    check(lib.nvrtcCreateProgram(ctypes.byref(prog), text.encode(), b"ds4_kernel.cu", 0, None, None),
          "nvrtcCreateProgram")
    try:
        opts = [f"--gpu-architecture={arch}", "--std=c++17", *(f"--include-path={d}" for d in include_dirs())]
        argv = (ctypes.c_char_p * len(opts))(*(o.encode() for o in opts))
        rc = lib.nvrtcCompileProgram(prog, len(opts), argv)
        if rc:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            message = log.value.decode(errors="replace")[-4000:]
            raise RuntimeError(f"NVRTC: {lib.nvrtcGetErrorString(rc).decode()}\n{message}")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
        out = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, out), "nvrtcGetCUBIN")
        return out.raw
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@lru_cache(maxsize=None)
def _nvrtc_version() -> str:
    lib = _nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib is not None:
        lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def cached_cubin(text: str, folder: Path) -> bytes:
    """The cubin of ``text`` for this device: from ``folder`` when an earlier process made it, else compiled and
    written there (atomically; a folder that cannot be written only costs the compile again next time)."""
    arch = architecture()
    key = hashlib.sha256(f"{arch}\n{_nvrtc_version()}\n{text}".encode()).hexdigest()[:32]
    path = folder / f"{key}.cubin"
    try:
        return path.read_bytes()
    except OSError:
        pass
    cubin = compile_cubin(text, arch)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(cubin)
        os.replace(tmp, path)
    except OSError:
        pass
    return cubin


class CubinKernel:
    """A callable like ``mx.fast.cuda_kernel``'s result whose specializations are cached cubins."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], header: str, source: str,
                 folder: Path, jit: Callable[[], Any]):  # fmt: skip
        """``jit`` makes the ``mx.fast.cuda_kernel`` of the same text, for specializations that do not compile."""
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.header, self.source, self.folder, self._make_jit = header, source, folder, jit
        self._built: dict[tuple, tuple[str, bytes] | None] = {}
        self._jit = None

    def render(self, in_dtypes, out_dtypes, template) -> tuple[str, str]:
        """(entry point name, translation unit) of one specialization."""
        params = parameters(self.input_names, self.output_names, in_dtypes, out_dtypes)
        body = f"({params}) {{\n{constants(template)}{self.source}\n}}\n"
        entry = f"{self.name}_{hashlib.sha256((self.header + body).encode()).hexdigest()[:16]}"
        return entry, f'{PROLOGUE}{self.header}\nextern "C" __global__ void {entry}{body}'

    def specialization(self, in_dtypes, out_dtypes, template) -> tuple[str, bytes] | None:
        """(entry point, cubin) of a specialization, built or read once per process; None where it does not
        compile here (the launch then goes through ``mx.fast.cuda_kernel``)."""
        key = (tuple(in_dtypes), tuple(out_dtypes), tuple(template))
        if key not in self._built:
            entry, text = self.render(in_dtypes, out_dtypes, template)
            try:
                self._built[key] = (entry, cached_cubin(text, self.folder))
            except RuntimeError as e:
                log = self.folder / f"{entry}.log"
                try:
                    self.folder.mkdir(parents=True, exist_ok=True)
                    log.write_text(f"{e}\n\n{text}")
                except OSError:
                    pass
                warnings.warn(f"{self.name}: no cubin ({str(e).splitlines()[0]}; see {log}); MLX compiles it instead",
                              stacklevel=3)  # fmt: skip
                self._built[key] = None
        return self._built[key]

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None,
                 verbose=False, stream=None) -> list[mx.array]:  # fmt: skip
        inputs = checked_inputs(self.name, self.input_names, self.output_names, inputs, output_shapes)
        built = self.specialization([a.dtype for a in inputs], list(output_dtypes), template)
        if built is None:
            self._jit = self._jit or self._make_jit()
            return self._jit(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes, grid=grid,
                             threadgroup=threadgroup, template=template, init_value=init_value, stream=stream)
        entry, cubin = built
        return mx.fast.precompiled_cuda_kernel(
            name=entry, compiled_source=cubin, inputs=inputs, output_shapes=output_shapes,
            output_dtypes=output_dtypes, scalars=[], grid=grid, threadgroup=threadgroup, init_value=init_value,
            ensure_row_contiguous=True, stream=stream,  # as cuda_kernel does: the bodies index rows densely
        )  # fmt: skip
