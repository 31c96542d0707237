"""How far prefill logits on the GPU are from the exact forward pass, and what explains the gap.

    python benchmarks/prefill_precision.py [--tokens 45 9 8] [--numerics hf]

The tiny random model (``ds4_mlx.testing.make_tiny_gguf``) is run on the CPU device in f32 (the exact
reference, which equals transformers in the tests). Then, on any machine, the same pass with the operands of
the routed experts' products of more than ``MV_MAX_TOKENS`` tokens rounded to f16: what the prefill kernel's
tiles do (``mm.body``, docs/quants.md §8 ruling 2). With a GPU, also the GPU's own prefill, with the kernels and
with MLX alone (``DS4_MLX_KERNELS=fallback``, whose f32 products may use TF32), and one-token decode steps.
Reported per run: max |logit difference| over all positions, relative to the largest exact logit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4_mlx import quants  # noqa: E402
from ds4_mlx import weights as W  # noqa: E402
from ds4_mlx.kernels import MV_MAX_TOKENS  # noqa: E402
from ds4_mlx.loader import load  # noqa: E402
from ds4_mlx.session import Session  # noqa: E402
from ds4_mlx.testing import make_tiny_gguf  # noqa: E402


def _f16(a: mx.array) -> mx.array:
    return a.astype(mx.float16).astype(mx.float32)


class F16RoutedOperands:
    """CPU fallback: the routed experts' products of more than MV_MAX_TOKENS tokens with both operands rounded
    to f16 (the MLX path: chunks shorter than ``host.MIN_TOKENS``)."""

    def __enter__(self):
        self.saved = (W.QuantWeight.gather_matmul, quants.dequantize)
        gather_matmul, dequantize = self.saved

        def rounded(w, x, ids, out_shape=None):
            if ids.shape[0] <= MV_MAX_TOKENS:
                return gather_matmul(w, x, ids, out_shape)
            quants.dequantize = lambda data, qtype: _f16(dequantize(data, qtype))
            try:
                return gather_matmul(w, _f16(x), ids, out_shape)
            finally:
                quants.dequantize = dequantize

        W.QuantWeight.gather_matmul = rounded
        return self

    def __exit__(self, *exc):
        W.QuantWeight.gather_matmul, quants.dequantize = self.saved


def rel_err(got: np.ndarray, ref: np.ndarray, scale: float) -> float:
    return float(np.abs(got - ref).max() / scale)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[45, 9, 8], help="prompt lengths (one chunk each)")
    ap.add_argument("--numerics", default="hf", choices=["hf", "ds4"])
    args = ap.parse_args(argv)

    path = make_tiny_gguf(Path(tempfile.mkdtemp()) / "tiny.gguf", experts="q2", hca_ratio=16, seed=0, layers=6)
    model, _ = load(path, numerics=args.numerics)
    tokens = [0] + np.random.default_rng(0).integers(2, 512, max(args.tokens) - 1).tolist()
    gpu = mx.default_device() == mx.gpu
    mx.set_default_device(mx.cpu)
    exact = np.array(model(tokens, 0, model.make_cache(), all_logits=True))
    scale = float(np.abs(exact).max())
    res: dict[str, float] = {}
    for T in args.tokens:
        with F16RoutedOperands():
            sim = np.array(model(tokens[:T], 0, model.make_cache(), all_logits=True))
        res[f"T={T} cpu, routed f16 operands"] = rel_err(sim, exact[:T], scale)
    if gpu:
        mx.set_default_device(mx.gpu)
        saved = os.environ.get("DS4_MLX_KERNELS")
        for T in args.tokens:
            for kernels in ("auto", "fallback"):
                os.environ["DS4_MLX_KERNELS"] = kernels
                got = np.array(model(tokens[:T], 0, model.make_cache(), all_logits=True))
                res[f"T={T} gpu prefill, kernels {kernels}"] = rel_err(got, exact[:T], scale)
        os.environ.pop("DS4_MLX_KERNELS") if saved is None else os.environ.update(DS4_MLX_KERNELS=saved)
        s = Session(model)
        steps = np.stack([np.array(s.step(t)) for t in tokens])
        res["gpu decode steps"] = rel_err(steps, exact, scale)
    for k, v in res.items():
        print(f"{k:40s} max rel err {v:.2e}", flush=True)
    return res


if __name__ == "__main__":
    main()
