"""Is the pipelined decode step bound by the host or by the device? Variants of one loop, in rounds, same context.

    python benchmarks/pipeline_depth.py [--shape full|narrow] [--layers N] [--decode 32] [--rounds 2] [--onward]

Each variant restores the same session snapshot (prefill 1024 + warm-up) and decodes ``--decode`` greedy tokens
(``--onward``: continues from where the last run stopped, over positions never decoded before, as a real
generation does; before the twentieth session's fix MLX-CUDA ran revisited positions faster, benchmarks/RESULTS.md)
with the token ids fed lazily (mlx-lm style), reading token k back after building step k + lag:
``lag1`` (what benchmarks/model.py headlines), ``lag1+3ms`` / ``lag1+6ms`` (the host made slower by a sleep per
step), ``lag2`` and ``nowait`` (read back only at the end). If the host were the only limit, a sleep would add its
whole length to the step and a deeper queue would change nothing; if the device were, the sleep would vanish
into the host's wait. Then what the package's generation loop adds to ``lag2``: ids drawn by ds4's default
sampler on the device (``lag2 sampler``), a rewind point per queued step (``lag2 snapshots``:
``Session.rewind_point``), both, and ``decode_tokens`` itself (at its defaults: on CUDA, from an encoder thread).
``lag2 thread`` / ``lag1 thread`` / ``lag3 thread`` / ``nowait thread`` queue the bare loop's steps from a
``StepEncoder`` thread, so MLX's encode of a step overlaps the Python that builds the next; ``lag2 thread
sampler`` / ``snapshots`` / both add what ``decode_tokens`` adds. Reported per variant: ms/token, the host's
ms/token spent waiting for a token (not split out for ``decode_tokens``; with a thread, the wait includes the
encoder's), and the CPU ms/token of the calling thread and of the encoder thread (waits excluded).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import model as bench  # noqa: E402  (benchmarks/model.py: the shapes, weights and warm-up it times with)
from ds4_mlx.sampling import DEFAULT_PARAMS, Sampler  # noqa: E402
from ds4_mlx.session import Session, StepEncoder  # noqa: E402

VARIANTS = {"lag1": dict(lag=1), "lag1+3ms": dict(lag=1, delay=0.003), "lag1+6ms": dict(lag=1, delay=0.006),
            "lag2": dict(lag=2), "nowait": dict(lag=None),
            "lag2 sampler": dict(lag=2, sampler=True), "lag2 snapshots": dict(lag=2, snapshots=True),
            "lag2 sampler+snapshots": dict(lag=2, sampler=True, snapshots=True),
            "decode_tokens": dict(lag=2, loop=True),  # at generate.DEFAULT_LAG (2)
            "lag2 thread": dict(lag=2, thread=True), "lag1 thread": dict(lag=1, thread=True),
            "lag3 thread": dict(lag=3, thread=True), "nowait thread": dict(lag=None, thread=True),
            "lag2 thread sampler": dict(lag=2, thread=True, sampler=True),
            "lag2 thread snapshots": dict(lag=2, thread=True, snapshots=True),
            "lag2 thread sampler+snapshots": dict(lag=2, thread=True, sampler=True, snapshots=True)}


def run(sess: Session, start, n: int, lag: int | None, delay: float = 0.0, sampler: bool = False,
        snapshots: bool = False, loop: bool = False, thread: bool = False) -> tuple[float, ...]:
    """(ms/token, wait ms/token, host CPU ms/token, encoder CPU ms/token) of ``n`` steps from ``start`` (None:
    from the session's current state, kept); ``lag=None`` reads tokens back only at the end.
    ``sampler``: ids drawn by ds4's default sampler on the device instead of argmax; ``snapshots``: a session
    rewind point kept for each of the last ``lag`` steps (as ``decode_tokens`` does); ``loop``: the package's
    own loop (``generate.decode_tokens`` at its defaults, timed by ``model.generate_seconds``); ``thread``: the
    steps queued from a ``StepEncoder`` thread. CPU times are thread times (waits excluded): the calling thread's
    build (and, without a thread, encode) and the encoder thread's encode; a period well above both is the
    device's."""
    if start is not None:
        sess.restore(start)
    if loop:
        return bench.generate_seconds(sess, n) * 1e3, float("nan"), float("nan"), float("nan")
    with StepEncoder(sess) if thread else contextlib.nullcontext() as enc:
        pick = Sampler(DEFAULT_PARAMS, seed=0).draw if sampler else mx.argmax
        toks, snaps, queued = [pick(sess.logits)], [], []  # queued[j]: step j (which takes toks[j]) is queued
        wait, t0, c0 = 0.0, time.perf_counter(), time.thread_time()
        for _ in range(n):
            if snapshots:
                snaps = (snaps + [sess.rewind_point()])[-lag:]
            toks.append(pick(sess.step(toks[-1])))
            if enc:
                queued.append(enc.last)
            if delay:
                time.sleep(delay)
            if lag is not None and len(toks) > lag:
                t = time.perf_counter()
                if enc:
                    enc.wait(queued[len(toks) - 1 - lag])
                toks[-1 - lag].item()
                wait += time.perf_counter() - t
        if enc:
            enc.drain()
        toks[-1].item()
        cpu, enc_cpu = time.thread_time() - c0, enc.cpu_seconds if enc else 0.0
    return (time.perf_counter() - t0) / n * 1e3, wait / n * 1e3, cpu / n * 1e3, enc_cpu / n * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("full", "tiny", "narrow"), default="full",
                    help="narrow: the tiny widths with the full layer pattern (graph_cost.narrow_config), so the host "
                         "does a full step's work and the device almost none")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--only", nargs="+", choices=tuple(VARIANTS), default=None, help="these variants only")
    ap.add_argument("--onward", action="store_true",
                    help="each run continues from where the last one stopped (positions never decoded before, as in "
                         "a real generation) instead of restoring the snapshot")
    args = ap.parse_args(argv)

    if args.shape == "narrow":
        from graph_cost import narrow_config

        cfg = narrow_config(args.layers or 43)
    else:
        cfg = bench.shape_config(args.shape, args.layers)
    model = bench.Model(cfg, bench.random_weights(cfg, "q2"))
    prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, args.prefill - 1).tolist()
    Session(model).prefill(prompt[:512])  # kernel JIT
    sess = Session(model)
    sess.prefill(prompt)
    start = sess.snapshot()
    # warm-up: every kind of step on this thread's stream and from an encoder thread (benchmarks/model.py)
    bench.decode_seconds(sess, bench.warm_steps(cfg), pipelined=False)
    bench.generate_seconds(sess, bench.warm_steps(cfg))
    res: dict[str, list] = {}
    for rnd in range(args.rounds):
        for name, kw in VARIANTS.items():
            if args.only and name not in args.only:
                continue
            ms, wait, cpu, enc_cpu = run(sess, None if args.onward else start, args.decode, **kw)
            res.setdefault(name, []).append((round(ms, 2), round(wait, 2), round(cpu, 2), round(enc_cpu, 2)))
            print(f"round {rnd} {name:24s} {ms:7.2f} ms/token  wait {wait:5.2f}  host cpu {cpu:5.2f}"
                  f"  encoder cpu {enc_cpu:5.2f}", flush=True)
    print(json.dumps(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
