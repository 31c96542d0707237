"""The ``sim`` kernel backend: each kernel's CUDA text, compiled by the host C++ compiler against ``sim.h`` and
run on the CPU, one thread per fiber (see sim.h).

Kernel logic (indexing, barriers, shuffles, epilogues) can be checked without a GPU, against the pure-MLX
fallbacks, by the same tests that run the real kernels on a GPU. Not for speed: a launch runs its threads one
after another. Launches evaluate their inputs at once, so they cannot sit inside ``mx.compile`` (decode steps
compile unless ``DS4_MLX_COMPILE=0``). Outputs without an ``init_value`` start as NaN (integer outputs as
0xA5 bytes), so an element a kernel forgets to write shows up.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import numpy as np

from .entry import C_TYPES, checked_inputs, constants, parameters

SIM_HEADER = Path(__file__).resolve().parent / "sim.h"

#: numpy stand-ins for the buffers (bfloat16 travels as its bits).
NP_TYPES = {
    mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16, mx.int32: np.int32,
    mx.uint32: np.uint32, mx.int16: np.int16, mx.uint16: np.uint16, mx.int8: np.int8, mx.uint8: np.uint8,
    mx.int64: np.int64, mx.uint64: np.uint64, mx.bool_: np.bool_,
}  # fmt: skip

_LIBS: dict[str, ctypes.CDLL] = {}


def compiler() -> str | None:
    """The C++ compiler the simulator uses (``$CXX``, else ``g++``), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _library(text: str) -> ctypes.CDLL:
    """``text`` compiled to a shared library (cached on disk by content, and in memory)."""
    key = hashlib.sha256(text.encode()).hexdigest()[:24]
    lib = _LIBS.get(key)
    if lib is not None:
        return lib
    from . import kernel_cache_dir

    out = kernel_cache_dir() / "sim" / f"{key}.so"
    if not out.is_file():
        cxx = compiler()
        if cxx is None:
            raise RuntimeError("the sim kernel backend needs a C++ compiler (g++ or $CXX)")
        out.parent.mkdir(parents=True, exist_ok=True)
        src = out.with_suffix(".cc")
        src.write_text(text)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        r = subprocess.run([cxx, "-std=c++17", "-O1", "-w", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-o", str(tmp), str(src)],
                           capture_output=True, text=True)  # fmt: skip
        if r.returncode:
            raise RuntimeError(f"sim kernel failed to compile ({src}):\n{r.stderr[-4000:]}")
        os.replace(tmp, out)
    lib = ctypes.CDLL(str(out))
    lib.ds_sim_launch.restype = ctypes.c_char_p
    lib.ds_sim_launch.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint)]
    _LIBS[key] = lib
    return lib


class SimKernel:
    """A callable like ``mx.fast.cuda_kernel``'s result, running ``source`` on the CPU."""

    def __init__(self, name: str, input_names: list[str], output_names: list[str], header: str, source: str):
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.header, self.source = header, source

    def render(self, in_dtypes, out_dtypes, template) -> str:
        """The translation unit of one specialization: sim.h, the header, the kernel and its C entry point."""
        params = parameters(self.input_names, self.output_names, in_dtypes, out_dtypes)
        args = [f"({'const ' if i < len(in_dtypes) else ''}{C_TYPES[d]}*)b[{i}]"
                for i, d in enumerate(list(in_dtypes) + list(out_dtypes))]  # fmt: skip
        return (
            f'#include "{SIM_HEADER}"\n{self.header}\n'
            f"static void {self.name}({params}) {{\n{constants(template)}{self.source}\n}}\n"
            f'extern "C" const char* ds_sim_launch(void** b, const unsigned* d) {{\n'
            f"  return ds_sim::launch(uint3{{d[0], d[1], d[2]}}, uint3{{d[3], d[4], d[5]}},\n"
            f"                        [b] {{ {self.name}({', '.join(args)}); }});\n}}\n"
        )

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=(), init_value=None,
                 verbose=False, stream=None) -> list[mx.array]:  # fmt: skip
        inputs = checked_inputs(self.name, self.input_names, self.output_names, inputs, output_shapes)
        mx.eval(inputs)
        ins = [np.ascontiguousarray(np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)) for a in inputs]
        outs = []
        for shape, dt in zip(output_shapes, output_dtypes):
            o = np.empty(tuple(shape), NP_TYPES[dt])
            fill = np.nan if init_value is None and (dt == mx.bfloat16 or np.issubdtype(o.dtype, np.floating)) \
                else init_value
            if fill is None:
                o.view(np.uint8)[...] = 0xA5
            elif dt == mx.bfloat16:  # the value's bf16 bits (its f32 bits' high half: exact for NaN and init values)
                o[...] = np.array(fill, np.float32).view(np.uint32) >> 16
            else:
                o[...] = fill
            outs.append(o)
        text = self.render([a.dtype for a in inputs], list(output_dtypes), template)
        if verbose:
            print(text)
        lib = _library(text)
        blocks = [-(-int(g) // int(t)) for g, t in zip(grid, threadgroup)]
        ptrs = (ctypes.c_void_p * len(ins + outs))(*[a.ctypes.data for a in ins + outs])
        dims = (ctypes.c_uint * 6)(*blocks, *(int(t) for t in threadgroup))
        err = lib.ds_sim_launch(ptrs, dims)
        if err:
            raise RuntimeError(f"{self.name}: {err.decode()}")
        res = []
        for o, dt in zip(outs, output_dtypes):
            a = mx.array(o)
            res.append(a.view(mx.bfloat16) if dt == mx.bfloat16 else a)
        return res
