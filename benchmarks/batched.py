"""Batched sessions (``serve --batched-session``): decode tokens/s of B sessions stepped together, and the time to
first token of a new prompt prefilled in quanta while other sessions decode.

    python benchmarks/batched.py [-m FILE | --shape tiny|full [--layers N]] [--ctx N] [--batches 1,2,4,8] [--steps N]
                                 [--ttft-prompt N] [--ttft-decoders N] [--quantum N] [--wait] [--csv FILE]

Decode: B sessions, each holding the same ``--ctx`` tokens (one prefill, restored into each), run ``--steps``
steps of one model call for all B, each session's id drawn greedily on the device, in the loop the batched server
runs (:func:`~ds4_mlx.generate.sample_and_step`: a step is queued before the host reads the ids it takes, so the
host's work overlaps the device's; ``--wait`` awaits every step). Reported per B: aggregate and per-session
tokens/s and their ratio to B = 1. TTFT: ``--ttft-decoders`` sessions decode while a new session prefills
``--ttft-prompt`` tokens, ``--quantum`` tokens between two of their steps (the server's scheduler): the new
prompt's time to first token against its prefill alone, and the decoders' inter-token latency meanwhile. ``--csv``
writes both tables.
"""

from __future__ import annotations

import argparse
import csv
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from ds4_mlx.generate import sample_and_step
from ds4_mlx.loader import load
from ds4_mlx.random_model import random_model
from ds4_mlx.sampling import GREEDY_PARAMS, Sampler, SamplingParams
from ds4_mlx.session import Session


def _prefilled(model, tokens: list[int], chunk: int, reserve: int) -> Session:
    s = Session(model, chunk_size=chunk, reserve=reserve)
    s.prefill(tokens)
    mx.eval(s.logits)
    return s


def _greedy(sessions: list[Session]) -> list[tuple[Sampler, SamplingParams]]:
    """Each session's draw for :func:`~ds4_mlx.generate.sample_and_step`: greedy."""
    return [(Sampler(GREEDY_PARAMS), GREEDY_PARAMS) for _ in sessions]


def decode_rates(model, ctx: int, batches: list[int], steps: int, chunk: int, wait: bool = False,
                 warmup: int = 3) -> list[dict]:  # fmt: skip
    """Per B: seconds of ``steps`` batched greedy steps of B sessions at ``ctx`` tokens, and tokens/s."""
    tokens = np.random.default_rng(0).integers(2, model.cfg.n_vocab, ctx).tolist()
    base = _prefilled(model, tokens, chunk, ctx + steps + warmup + 1).snapshot()
    rows = []
    for B in batches:
        sessions = [Session(model, chunk_size=chunk, reserve=ctx + steps + warmup + 1) for _ in range(B)]
        for s in sessions:
            s.restore(base)
        draws = _greedy(sessions)

        def run(n: int) -> float:
            t = time.perf_counter()
            for _ in range(n):
                sample_and_step(sessions, draws, wait=wait)
            mx.eval([s.logits for s in sessions])  # the last step's work counts too
            return time.perf_counter() - t

        run(warmup)  # traces and compiles the steps of this B
        sec = run(steps)
        rows.append({"batch": B, "ctx": ctx, "steps": steps, "seconds": round(sec, 4),
                     "aggregate_tps": round(B * steps / sec, 3), "session_tps": round(steps / sec, 3)})
    one = next((r for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["aggregate_x"] = round(r["aggregate_tps"] / one["aggregate_tps"], 3) if one else None
        r["session_share"] = round(r["session_tps"] / one["session_tps"], 3) if one else None
    return rows


def ttft_under_load(model, ctx: int, prompt: int, decoders: int, quantum: int, chunk: int, wait: bool = False
                    ) -> dict:  # fmt: skip
    """TTFT of a ``prompt``-token prefill in ``quantum``-token pieces between steps of ``decoders`` sessions, the
    same prefill alone, and the decoders' inter-token latency meanwhile (mean, max)."""
    rng = np.random.default_rng(1)
    tokens = rng.integers(2, model.cfg.n_vocab, prompt).tolist()
    for _ in range(2):  # the first run pays the prefill shapes' first-use costs: the second is timed
        alone = Session(model, chunk_size=chunk, reserve=prompt + 1)
        t = time.perf_counter()
        for i in range(0, prompt, quantum):
            alone.prefill(tokens[i : i + quantum])
        mx.eval(alone.logits)
        alone_s = time.perf_counter() - t

    base = _prefilled(model, rng.integers(2, model.cfg.n_vocab, ctx).tolist(), chunk, ctx + prompt).snapshot()
    running = [Session(model, chunk_size=chunk, reserve=ctx + prompt) for _ in range(decoders)]
    for s in running:
        s.restore(base)
    draws = _greedy(running)
    if running:  # trace and compile the decoders' steps first
        sample_and_step(running, draws, wait=wait)
    fresh = Session(model, chunk_size=chunk, reserve=prompt + 1)
    gaps, last = [], time.perf_counter()
    t = last
    for i in range(0, prompt, quantum):
        if running:  # as the server's scheduler: a decode step queued, then a prefill quantum
            sample_and_step(running, draws, wait=wait)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
        fresh.prefill(tokens[i : i + quantum])
        mx.eval(fresh.logits)
    ttft = time.perf_counter() - t
    return {"prompt": prompt, "decoders": decoders, "quantum": quantum, "ctx": ctx, "ttft_s": round(ttft, 4),
            "prefill_alone_s": round(alone_s, 4), "itl_mean_s": round(float(np.mean(gaps)), 4) if gaps else None,
            "itl_max_s": round(float(np.max(gaps)), 4) if gaps else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model", type=Path, help="a DS4 GGUF or converted directory (default: the random model)")
    ap.add_argument("--shape", default="tiny", choices=["tiny", "full"], help="random model shape (no -m)")
    ap.add_argument("--layers", type=int, help="truncate the random model to this many layers")
    ap.add_argument("--ctx", type=int, default=2048, help="tokens each decoding session holds")
    ap.add_argument("--batches", default="1,2,4,8", help="comma-separated session counts B")
    ap.add_argument("--steps", type=int, default=32, help="timed decode steps per B")
    ap.add_argument("--chunk", type=int, default=2048, help="prefill chunk of the sessions' first prefill")
    ap.add_argument("--ttft-prompt", type=int, default=8192, help="tokens of the new prompt (0: no TTFT run)")
    ap.add_argument("--ttft-decoders", type=int, default=3, help="sessions decoding during the new prefill")
    ap.add_argument("--quantum", type=int, default=128, help="prefill tokens between two decode steps")
    ap.add_argument("--sweeps", type=int, default=1,
                    help="run the B sweep this many times and keep the last (first uses of kernels and traces "
                         "land in the first)")  # fmt: skip
    ap.add_argument("--wait", action="store_true",
                    help="await every decode step before building the next (the loop without pipelining)")
    ap.add_argument("--csv", type=Path, help="write the tables here too")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    if not batches or min(batches) < 1 or min(args.ctx, args.steps, args.quantum, args.sweeps) < 1:
        ap.error("--batches, --ctx, --steps, --quantum and --sweeps must be positive")

    model, _ = load(args.model) if args.model else random_model(args.shape, layers=args.layers)
    for sweep in range(args.sweeps):
        rows = decode_rates(model, args.ctx, batches, args.steps, args.chunk, args.wait)
        print(f"sweep {sweep + 1} of {args.sweeps}: decode at {args.ctx} tokens of context, {args.steps} steps")
        print(f"{'B':>3} {'aggregate tok/s':>16} {'x B=1':>7} {'per session tok/s':>18} {'share of B=1':>13}")
        for r in rows:
            print(f"{r['batch']:>3} {r['aggregate_tps']:>16.2f} {r['aggregate_x'] or 0:>7.2f} "
                  f"{r['session_tps']:>18.2f} {r['session_share'] or 0:>13.2f}", flush=True)
    ttft = None
    if args.ttft_prompt:
        ttft = ttft_under_load(model, args.ctx, args.ttft_prompt, args.ttft_decoders, args.quantum, args.chunk,
                               args.wait)
        print(f"TTFT of a {ttft['prompt']}-token prompt beside {ttft['decoders']} decoding sessions "
              f"(quantum {ttft['quantum']}): {ttft['ttft_s']:.3f} s (its prefill alone {ttft['prefill_alone_s']:.3f} s); "
              f"their inter-token latency meanwhile: mean {ttft['itl_mean_s']} s, max {ttft['itl_max_s']} s")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
            if ttft:
                f.write("\n")
                w = csv.DictWriter(f, fieldnames=list(ttft))
                w.writeheader()
                w.writerow(ttft)


if __name__ == "__main__":
    main()
