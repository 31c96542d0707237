"""Helpers shared by the kernel tests: random weights with their gguf-py reference, MLX's rendered Metal text."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

from ds4_mlx import quants
from ds4_mlx.weights import QuantWeight

ROOT = Path(__file__).resolve().parent.parent


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
