"""MLX-CUDA runtime settings vs decode speed: one child process per setting, same model, same steps.

    python benchmarks/mlx_cuda_env.py [--layers 4] [--ctx 512] [--json out.json]

MLX's CUDA backend records every ``MLX_MAX_OPS_PER_BUFFER`` ops (default 20) into a CUDA graph and keeps
``MLX_CUDA_GRAPH_CACHE_SIZE`` (default 100) instantiated graphs. One V4 Flash decode step is thousands of
small ops, i.e. hundreds of graphs, so the settings decide how often a graph is re-instantiated. Each child
builds the first ``--layers`` layers at the full width (random q2 weights), prefills ``--ctx`` tokens and
times synchronous decode steps; the ratios to the default setting are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "default": {},
    "graph cache 4096": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096"},
    "no cuda graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "cache 4096, 100 ops/graph": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_MAX_OPS_PER_BUFFER": "100"},
    "cache 4096, 250 ops/graph": {"MLX_CUDA_GRAPH_CACHE_SIZE": "4096", "MLX_MAX_OPS_PER_BUFFER": "250"},
}

CHILD = r"""
import json, sys, time
import mlx.core as mx, numpy as np
from ds4_mlx.random_model import random_weights, shape_config
from ds4_mlx.model.model import Model
from ds4_mlx.session import Session
layers, ctx, steps = map(int, sys.argv[1:4])
cfg = shape_config("full", layers)
model = Model(cfg, random_weights(cfg, "q2"))
sess = Session(model)
sess.prefill([0] + np.random.default_rng(0).integers(2, 1000, ctx - 1).tolist())
tok = int(mx.argmax(sess.logits).item())
for _ in range(4):
    tok = int(mx.argmax(sess.step(tok)).item())
ts = []
for _ in range(steps):
    t0 = time.perf_counter()
    tok = int(mx.argmax(sess.step(tok)).item())
    ts.append(time.perf_counter() - t0)
x = mx.ones((4096,)); mx.eval(x)
def chain():
    y = x
    for _ in range(400):
        y = y * 1.0001
    mx.eval(y)
chain(); t0 = time.perf_counter(); chain(); op = (time.perf_counter() - t0) / 400
print("RESULT " + json.dumps({"step_ms": float(np.median(ts)) * 1e3, "op_us": op * 1e6}))
"""


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    results = {}
    for name, env in SETTINGS.items():
        e = dict(os.environ, **env)
        e["PYTHONPATH"] = os.pathsep.join(p for p in (e.get("PYTHONPATH", ""), str(ROOT)) if p)
        r = subprocess.run([sys.executable, "-c", CHILD, str(args.layers), str(args.ctx), str(args.steps)],
                           env=e, capture_output=True, text=True)
        line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
        results[name] = dict(env=env, **(json.loads(line[7:]) if line else {"error": r.stderr[-400:]}))
        base = results["default"].get("step_ms")
        res = results[name]
        ratio = f"  {base / res['step_ms']:.2f}x vs default" if base and "step_ms" in res else ""
        print(f"{name:28s} {json.dumps(res)}{ratio}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
