"""GPU time of the q_b matvecs with the RMSNorm prologue (``mv`` epilogue ``MV_RMS``) against MLX's rms_norm
followed by the plain matvec, under NVIDIA Nsight Compute (CUDA only).

    ncu --profile-from-start off --metrics gpu__time_duration.sum --csv python benchmarks/qb_prologue.py > qb.csv

Two decode shapes of the full model: the attention's q_b (Q8_0, 32768 x 1024) and the indexer's q_b (F16,
8192 x 1024), one activation row. Each variant is warmed up, then launched 5 times between
``cuProfilerStart``/``cuProfilerStop``, so the log holds only those launches, in the order printed. Run it
from two trees (each with its own ``PYTHONPATH``) to compare kernel versions side by side in one device call.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import mlx.core as mx
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4_mlx.random_model import random_block_bytes  # noqa: E402
from ds4_mlx.weights import QuantWeight  # noqa: E402

SHAPES = ((QT.Q8_0, (32768, 1024)), (QT.F16, (8192, 1024)))
EPS = 1e-6


def main() -> None:
    cuda = ctypes.CDLL("libcuda.so.1")  # the profiler switch; MLX has made the context current
    for qt, shape in SHAPES:
        if qt == QT.F16:
            data = (mx.random.normal(shape) * 0.02).astype(mx.float16)
        else:
            data = random_block_bytes(qt, shape, 0.02)
        w = QuantWeight(data, qt, shape)
        x, nw = mx.random.normal((1, shape[1])), mx.random.uniform(0.5, 1.5, (shape[1],))
        mx.eval(w.data, x, nw)
        variants = {
            "prologue (one launch)": lambda: w.matmul_rms(x, nw, EPS),
            "rms_norm + plain matvec": lambda: w.matmul(mx.fast.rms_norm(x, nw, EPS)),
        }
        for name, run in variants.items():
            for _ in range(3):
                mx.eval(run())
            mx.synchronize()
            cuda.cuProfilerStart()
            for _ in range(5):
                mx.eval(run())
            mx.synchronize()
            cuda.cuProfilerStop()
            print(f"{qt.name} {shape}: {name}", flush=True)


if __name__ == "__main__":
    main()
