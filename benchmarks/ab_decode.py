"""Decode speed of this tree against other trees of the project, side by side on one device.

    # here: the other tree, with this tree's model.py (for --quick)
    git archive OLD ds4_mlx custom_kernels convert benchmarks pyproject.toml | tar -x -C .ab/old
    cp benchmarks/model.py .ab/old/benchmarks/
    # on the GPU
    python benchmarks/ab_decode.py .ab/old [.ab/older ...] [--rounds 2] [--prefill 2048] [--decode 24] [--json out.json]

Each round runs ``benchmarks/model.py --quick`` at the full shape from this tree, then from each other one,
each child importing its own tree's ``ds4_mlx`` (benchmarks/mlx_cuda_env.py's runner), so drift of the host
hits both alike. Reported: the median pipelined decode ms/token of each and the ratio, as RESULTS.md asks.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mlx_cuda_env import ROOT, add_model_args, round_robin, run_child  # noqa: E402


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("others", type=Path, nargs="+", help="other trees (their benchmarks/model.py must know --quick)")
    add_model_args(ap)
    args = ap.parse_args(argv)
    runs = {"this tree": partial(run_child, args, None, ROOT)}
    for other in (o.resolve() for o in args.others):
        if not (other / "benchmarks" / "model.py").is_file() or not (other / "ds4_mlx").is_dir():
            raise SystemExit(f"{other}: not a ds4-mlx tree with benchmarks/model.py")
        runs[f"other: {other.name}"] = partial(run_child, args, None, other)
    summary = round_robin(runs, args.rounds)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
