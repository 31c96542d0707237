"""Prefill and decode speed of the built-in demo model on the CPU (what ``ds4-mlx generate --demo`` runs).

    python benchmarks/cpu_demo.py [--prompts 256,1024,4096] [--decode 64] [--json FILE]

Each prompt is random token ids prefilled into a fresh session (after one warm-up prefill); decode then runs
greedy steps after the longest prompt. The process's peak resident memory is reported with the speeds.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

import mlx.core as mx
import numpy as np

from ds4_mlx.demo import demo_model_path
from ds4_mlx.loader import load
from ds4_mlx.session import Session


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", default="256,1024,4096", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--decode", type=int, default=64, help="greedy decode steps after the longest prompt")
    ap.add_argument("--json", help="write the results here too")
    args = ap.parse_args()
    mx.set_default_device(mx.cpu)

    model, _ = load(demo_model_path())
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in args.prompts.split(",")]
    Session(model).prefill(rng.integers(0, model.cfg.n_vocab, 64).tolist())  # warm-up: first-use work
    rows = []
    for n in lengths:
        session = Session(model)
        prompt = rng.integers(0, model.cfg.n_vocab, n).tolist()
        t0 = time.perf_counter()
        logits = session.prefill(prompt)
        mx.eval(logits)
        dt = time.perf_counter() - t0
        rows.append({"prompt": n, "prefill_s": round(dt, 3), "prefill_tps": round(n / dt, 1)})
        print(f"prefill {n:6d} tokens: {dt:7.2f} s  {n / dt:8.1f} tok/s", flush=True)

    token = int(mx.argmax(logits).item())
    t0 = time.perf_counter()
    for _ in range(args.decode):
        token = int(mx.argmax(session.step(token)).item())
    dt = time.perf_counter() - t0
    decode_tps = args.decode / dt
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"decode {args.decode} tokens after {lengths[-1]}: {decode_tps:.1f} tok/s; peak RSS {peak_mb:.0f} MB")
    if args.json:
        result = {"prefill": rows, "decode_tps": round(decode_tps, 1), "decode_after": lengths[-1],
                  "peak_rss_mb": round(peak_mb)}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
