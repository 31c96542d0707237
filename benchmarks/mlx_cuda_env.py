"""MLX-CUDA runtime settings vs decode speed: one ``benchmarks/model.py --quick`` child per setting, in rounds.

    python benchmarks/mlx_cuda_env.py [--layers 43] [--prefill 2048] [--rounds 2] [--only NAME ...] [--json out.json]

MLX's CUDA backend records ops into a CUDA graph and launches it (a "commit") once it holds
``MLX_MAX_OPS_PER_BUFFER`` ops or its inputs reach ``MLX_MAX_MB_PER_BUFFER`` MB; it keeps
``MLX_CUDA_GRAPH_CACHE_SIZE`` instantiated graphs to update instead of re-instantiating. One V4 Flash decode
step is ~1800 small ops, and every routed-expert gather reads a ~0.5-0.7 GB expert tensor, so under the MB cap
each of them ends a graph. The settings are process-wide and read once, so each runs in its own child; the
children run round-robin (``--rounds``) so host drift hits every setting alike. On a CUDA machine "default" is the
package's setting (``ds4_mlx.CUDA_GRAPH_BATCHING``: 100 ops a graph, no MB cap), which any MLX_* setting of the
environment replaces; "MLX's defaults" is MLX's own 20 ops and MB cap. Reported per setting: the
median over rounds of the pipelined decode ms/token, and its ratio to the first setting.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

SETTINGS = {
    "default": {},  # the package's (ds4_mlx.CUDA_GRAPH_BATCHING) on a CUDA machine
    "MLX's defaults": {"MLX_MAX_OPS_PER_BUFFER": "20"},  # any MLX setting turns the package's off
    "no cuda graphs": {"MLX_USE_CUDA_GRAPHS": "0"},
    "100 ops/graph": {"MLX_MAX_OPS_PER_BUFFER": "100"},
    "no MB cap": {"MLX_MAX_MB_PER_BUFFER": "1000000"},
    "no MB cap, 50 ops/graph": {"MLX_MAX_MB_PER_BUFFER": "1000000", "MLX_MAX_OPS_PER_BUFFER": "50"},
    "no MB cap, 100 ops/graph": {"MLX_MAX_MB_PER_BUFFER": "1000000", "MLX_MAX_OPS_PER_BUFFER": "100"},
    "no MB cap, 250 ops/graph": {"MLX_MAX_MB_PER_BUFFER": "1000000", "MLX_MAX_OPS_PER_BUFFER": "250"},
    "no MB cap, 1000 ops/graph": {"MLX_MAX_MB_PER_BUFFER": "1000000", "MLX_MAX_OPS_PER_BUFFER": "1000"},
    "graph cache 1000": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000"},
    "graph cache 1000, no MB cap, 100 ops/graph": {"MLX_CUDA_GRAPH_CACHE_SIZE": "1000", "MLX_MAX_MB_PER_BUFFER": "1000000",
                                                   "MLX_MAX_OPS_PER_BUFFER": "100"},
}
MLX_KEYS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER", "MLX_CUDA_GRAPH_CACHE_SIZE")


def run_child(args: argparse.Namespace, env: dict[str, str] | None = None, tree: Path = ROOT) -> dict:
    """``benchmarks/model.py --quick`` (full shape by default) from ``tree`` (its own ``ds4_mlx``) with MLX settings
    ``env`` (any other MLX_* batching setting removed) -> the decode and prefill figures, or ``{"error"}``."""
    e = {k: v for k, v in os.environ.items() if k not in MLX_KEYS}  # exactly the listed setting
    e.update(env or {})
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(tree), e.get("PYTHONPATH", "")) if p)
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "r.json"
        cmd = [sys.executable, str(tree / "benchmarks/model.py"), "--quick", "--shape", args.shape, "--prefill",
               str(args.prefill), "--decode", str(args.decode), "--json", str(out)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        r = subprocess.run(cmd, env=e, cwd=tree, capture_output=True, text=True)
        if r.returncode or not out.exists():
            return {"error": r.stderr[-600:]}
        res = json.loads(out.read_text())
    keys = ("decode_ms", "decode_lag2_ms", "decode_generate_ms", "decode_sync_ms", "decode_host_split_ms",
            "decode_lag2_host_split_ms", "floor_ratio", "prefill_tok_s")
    return {k: res[k] for k in keys if k in res}  # an older tree's model.py may not report every figure


def round_robin(runs: dict[str, Callable[[], dict]], rounds: int) -> dict:
    """Run every entry once per round, in order, so host drift hits all alike; print each result, then the
    median pipelined decode ms/token of each entry and its ratio to the first."""
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for rnd in range(rounds):
        for name, run in runs.items():
            results[name].append(run())
            print(f"round {rnd} {name:28s} {json.dumps(results[name][-1])}", flush=True)
    summary = {}
    for name, rs in results.items():
        ms = [r["decode_ms"] for r in rs if "decode_ms" in r]
        ms2 = [r["decode_lag2_ms"] for r in rs if "decode_lag2_ms" in r]
        gen = [r["decode_generate_ms"] for r in rs if "decode_generate_ms" in r]
        summary[name] = {"decode_ms": float(np.median(ms)) if ms else None,
                         "decode_lag2_ms": float(np.median(ms2)) if ms2 else None,
                         "decode_generate_ms": float(np.median(gen)) if gen else None, "runs": rs}
    first = next(iter(summary))
    base = summary[first]["decode_ms"]
    for name, v in summary.items():
        ms = v["decode_ms"]
        ratio = f"{base / ms:.2f}x vs {first}" if ms and base else "failed"
        lag2, gen = v["decode_lag2_ms"], v["decode_generate_ms"]
        print(f"{name:28s} median pipelined decode {ms or float('nan'):7.2f} ms/token  {ratio}"
              + (f"  (tokens read 2 steps late: {lag2:.2f})" if lag2 else "")
              + (f"  (generation loop: {gen:.2f})" if gen else ""))
    return summary


def add_model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--shape", choices=("full", "tiny"), default="full", help="tiny: a CPU smoke run")
    ap.add_argument("--layers", type=int, default=None, help="layer count (default: all 43)")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--decode", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(ap)
    ap.add_argument("--only", nargs="*", default=None, help="setting names to run (default: all), first = baseline")
    args = ap.parse_args(argv)
    names = args.only or list(SETTINGS)
    summary = round_robin({n: partial(run_child, args, SETTINGS[n]) for n in names}, args.rounds)
    for n in names:
        summary[n]["env"] = SETTINGS[n]
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary

if __name__ == "__main__":
    main()
