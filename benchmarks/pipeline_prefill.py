"""Prefill speed of a layer pipeline against one rank: a GGUF, a prompt of random ids prefilled in chunks into a
fresh session, the first round a warm-up. Run it alone for one rank, under ``mlx.launch`` for a pipeline:

    python benchmarks/pipeline_prefill.py MODEL.gguf [--tokens 2048] [--chunk 256] [--rounds 3]
    mlx.launch -n 2 --backend ring -- python benchmarks/pipeline_prefill.py MODEL.gguf ...

Rank 0 prints one line (and writes ``--json``); the other ranks follow it.
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.loader import load
from ds4_mlx.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up")
    ap.add_argument("--json", help="rank 0 writes its figures here")
    args = ap.parse_args()
    group = mx.distributed.init()
    model, _ = load(args.model, group=group if group.size() > 1 else None, parallel="pipeline")
    if group.size() > 1 and group.rank() > 0:
        model.run()
        return
    ids = [0] + np.random.default_rng(0).integers(2, 500, args.tokens - 1).tolist()
    rates = []
    for _ in range(1 + args.rounds):
        session = Session(model, chunk_size=args.chunk)
        t = time.perf_counter()
        mx.eval(session.prefill(ids))
        rates.append(args.tokens / (time.perf_counter() - t))
        del session
    if group.size() > 1:
        model.close()
    rates = rates[1:]
    print(f"{group.size()} rank(s), {args.tokens} tokens in chunks of {args.chunk}: prefill "
          f"{' '.join(f'{r:.0f}' for r in rates)} tok/s (median {np.median(rates):.0f})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ranks": group.size(), "tokens": args.tokens, "chunk": args.chunk, "tok_s": rates}, f)


if __name__ == "__main__":
    main()
