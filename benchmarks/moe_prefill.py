"""The routed experts of one prefill chunk at the full V4 Flash width: each launch timed alone.

    python benchmarks/moe_prefill.py                       # T = 2048 and 4096 tokens, GPU
    python benchmarks/moe_prefill.py --tokens 512 --reps 5 --json moe_prefill.json

Random valid q2 weights (IQ2_XXS gate and up [256, 2048, 4096], Q2_K down [256, 4096, 2048]), uniform routing
(6 distinct experts a token), x ~ N(0, 1). Each line is the median of ``--reps`` synced runs in ms with its
arithmetic rate (2 x multiply-adds of the pairs). "sort" is the pairs sorted by expert and their token tiles,
"gate+up" the SwiGLU launch, "down" the down launch, "sum" the k slots' sum, "routed" the whole
``MoE.routed`` path as a layer runs it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_profile import timed  # noqa: E402

import ds4_mlx.kernels as K  # noqa: E402
from ds4_mlx.backend import kernel_backend  # noqa: E402
from ds4_mlx.random_model import random_quant_weight  # noqa: E402

E, F, D, KS = 256, 2048, 4096, 6  # experts, expert width, model width, experts a token


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    backend = kernel_backend()
    rng = np.random.default_rng(0)
    gate, up = (random_quant_weight(QT.IQ2_XXS, (E, F, D), 0.02) for _ in range(2))
    down = random_quant_weight(QT.Q2_K, (E, D, F), 0.02)
    rows = []
    for T in args.tokens:
        sel = mx.array(np.stack([rng.choice(E, KS, replace=False) for _ in range(T)]).astype(np.int32))
        w = mx.random.uniform(shape=(T, KS))
        x = mx.random.normal((T, D))
        flat = sel.reshape(-1)
        routes = K.routes_for(flat, E, backend)
        mid = K.mm_gather_swiglu(gate, up, x, flat, KS, 10.0, backend, route_w=w.reshape(-1), routes=routes)
        y = K.mm_gather(down, mid, flat, KS, backend, routes=routes)
        mx.eval(routes, mid, y)
        pair_flops = 2 * T * KS * F * D
        pieces = {
            "sort": (lambda: K.routes_for(flat, E, backend), 0),
            "gate+up": (lambda: K.mm_gather_swiglu(gate, up, x, flat, KS, 10.0, backend, route_w=w.reshape(-1),
                                                   routes=routes), 2 * pair_flops),  # fmt: skip
            "down": (lambda: K.mm_gather(down, mid, flat, KS, backend, routes=routes), pair_flops),
            "sum": (lambda: y.reshape(T, KS, D).sum(axis=1), 0),
        }
        for name, (fn, fl) in pieces.items():
            ms = 1e3 * timed(lambda: mx.eval(fn()), args.reps)
            rows.append({"tokens": T, "piece": name, "ms": ms, "tflops": fl / ms / 1e9 if fl else None})
            rate = f"{fl / ms / 1e9:7.1f} TFLOP/s" if fl else ""
            print(f"T {T:>5} {name:8s} {ms:8.3f} ms {rate}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "backend": backend, "rows": rows},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
