"""What a fresh process pays before it runs at full speed: each stage timed as a user meets it.

    python benchmarks/first_use.py [--shape tiny|full] [--layers N] [-m FILE] [--chunk N] [--json FILE]

Stages, in one process: load (a GGUF, or the random model built in memory), three prefill chunks (the first
compiles the prefill kernels; the second crosses 4 x indexer top-k where there is one, so the indexer's selection
path runs for the first time; the third has the shapes of the second), then two rounds of decode steps in the
generation loop (the first compiles and traces the steps). A stage much slower than the next one of its kind is
a first-use cost. Run it twice in a row to see what a second process keeps: MLX's own kernels are cached on disk
(``$MLX_PTX_CACHE_DIR``, else ``/tmp/mlx/<version>/ptx``), its custom kernels are not.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.bench import time_decode
from ds4_mlx.loader import load
from ds4_mlx.random_model import random_model
from ds4_mlx.sampling import GREEDY_PARAMS, Sampler
from ds4_mlx.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, help="a DS4 GGUF (default: the random model of --shape)")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "full"], help="random model shape (no -m)")
    ap.add_argument("--layers", type=int, help="truncate the random model to this many layers")
    ap.add_argument("--chunk", type=int, help="prefill chunk (default 2048 at the full width, 4 x indexer top-k)")
    ap.add_argument("--steps", type=int, default=8, help="decode steps a round")
    ap.add_argument("--json", type=Path, help="write the stages here too")
    args = ap.parse_args()

    stages: list[tuple[str, float]] = []
    t0 = time.perf_counter()
    model, _ = load(args.model) if args.model else random_model(args.shape, layers=args.layers)
    mx.eval(mx.zeros(1))
    stages.append(("load" if args.model else "build the random model", time.perf_counter() - t0))

    chunk = args.chunk or 4 * model.cfg.indexer_top_k
    tokens = np.random.default_rng(0).integers(2, model.cfg.n_vocab, 3 * chunk).tolist()
    session = Session(model, chunk_size=chunk, reserve=3 * chunk + 2 * args.steps + 2)
    for i in range(3):
        t = time.perf_counter()
        session.prefill(tokens[i * chunk : (i + 1) * chunk])
        mx.eval(session.logits)
        stages.append((f"prefill chunk {i + 1} ({chunk} tokens at {i * chunk})", time.perf_counter() - t))
    sampler = Sampler(GREEDY_PARAMS)
    for i in range(2):
        stages.append((f"decode round {i + 1} ({args.steps} steps)", time_decode(session, sampler, args.steps)))

    width = max(len(name) for name, _ in stages)
    for name, s in stages:
        print(f"{name:<{width}}  {s:8.3f} s")
    print(f"{'total':<{width}}  {sum(s for _, s in stages):8.3f} s  ({mx.default_device()})")
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "chunk": chunk,
                                         "stages": [{"stage": n, "seconds": round(s, 4)} for n, s in stages]},
                                        indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
