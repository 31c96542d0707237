"""Two versions of the package in one process, their decode loops (or prefills) timed round by round.

    python benchmarks/ab_in_process.py OTHER [--shape narrow|full|tiny] [--rounds 8] [--decode 48] [--json F]
    python benchmarks/ab_in_process.py OTHER --shape full --measure prefill --prefill 2048 --rounds 6

``OTHER`` is a folder with another version's ``ds4_mlx/`` and ``custom_kernels/`` (e.g. ``git archive REV
ds4_mlx custom_kernels | tar -x -C OTHER``). A copy of it is imported as ``ds4_mlx_ab``, every ``ds4_mlx`` in its
Python text renamed, so both versions build their own model and session in this process and run the package's
generation loop (``generate.decode_tokens`` at its defaults) in turns: this tree then the other in even rounds,
the other first in odd ones, each continuing its own generation onward. The two models share one set of random
weights (each wraps the same arrays in its own weight class), so the full shape fits once in device memory.

Why one process: on the H200 the host's speed drifts over seconds, by up to ~3 ms a token whatever the process or
the cores (benchmarks/RESULTS.md, Method), more than most changes are worth.
Rounds that alternate in one process compare under the same drift. The ``narrow`` shape (the full 43-layer
pattern at the tiny widths) gives the host a full step's work and the device almost none, so it compares host
costs only; ``full`` compares whole steps, the device's part included.

``--measure prefill`` times instead a fresh session's prefill of ``--prefill`` tokens each round (the same
prompt for both versions), through the package's own ``Session.prefill``. ``--batch B`` (B > 1) times instead
batched decode steps of B sessions, each prefilled with its own ``--prefill`` tokens (``session.step_batch``, each
session greedy on its own logits, read on the host every step as ``benchmarks/batched.py`` does): ms a step.

Reported: each round's ms/token per version, the mean of each, and the paired ratios (this / other) of the
rounds, with how many favour this tree.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from graph_cost import narrow_config  # noqa: E402

import ds4_mlx  # noqa: E402,F401  (this tree, imported before the other's copy)
from ds4_mlx.random_model import random_weights  # noqa: E402

OTHER_NAME = "ds4_mlx_ab"


def import_other(tree: Path, into: Path) -> str:
    """Copy ``tree``'s ``ds4_mlx`` and ``custom_kernels`` into ``into`` with the package renamed
    (:data:`OTHER_NAME`) and put ``into`` on the import path -> the package name."""
    for folder, name in (("ds4_mlx", OTHER_NAME), ("custom_kernels", "custom_kernels")):
        if not (tree / folder).is_dir():
            raise SystemExit(f"{tree} has no {folder}/ folder")
        shutil.copytree(tree / folder, into / name, ignore=shutil.ignore_patterns("__pycache__"))
    for py in into.rglob("*.py"):
        py.write_text(re.sub(r"\bds4_mlx\b", OTHER_NAME, py.read_text()))
    sys.path.insert(0, str(into))
    return OTHER_NAME


def version(pkg: str, cfg, weights: dict, prefill: int, reserve: int, seed: int = 0, batch: int = 1
            ) -> SimpleNamespace:  # fmt: skip
    """One version's model and session at ``cfg`` (this tree's config) over ``weights`` (this tree's random
    weights, rewrapped in the version's own weight class: the arrays are shared), prefilled and warmed (``batch``
    > 1: that many sessions of their own prompts, warmed by batched steps). The sessions' buffers are sized for
    ``reserve`` tokens, as ``generate`` sizes them: none grows while timed."""
    mod = {m: importlib.import_module(f"{pkg}.{m}") for m in ("config", "generate", "sampling", "session", "weights")}
    model_mod = importlib.import_module(f"{pkg}.model.model")
    cfg = mod["config"].ModelConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init})
    QW = mod["weights"].QuantWeight
    model = model_mod.Model(cfg, {k: QW(v.data, v.qtype, v.shape) if hasattr(v, "qtype") else v
                                  for k, v in weights.items()})  # fmt: skip
    prompts = [[0] + np.random.default_rng(seed + b).integers(2, cfg.n_vocab, prefill - 1).tolist()
               for b in range(batch)]  # fmt: skip
    sessions = [mod["session"].Session(model, reserve=reserve) for _ in prompts]
    for sess, prompt in zip(sessions, prompts):
        sess.prefill(prompt)
    v = SimpleNamespace(name=pkg, sess=sessions[0], mod=mod, model=model, prompt=prompts[0], ms=[], batch=sessions)
    (run if batch == 1 else run_batched)(v, max(cfg.compress_ratios) + 1)  # warm-up: every kind of step, JIT
    return v


def run_prefill(v: SimpleNamespace) -> float:
    """ms/token of a fresh session's prefill of the version's prompt."""
    sess = v.mod["session"].Session(v.model, reserve=len(v.prompt) + 1)
    t0 = time.perf_counter()
    sess.prefill(v.prompt)
    mx.synchronize()
    return (time.perf_counter() - t0) / len(v.prompt) * 1e3


def run(v: SimpleNamespace, n: int) -> float:
    """ms/token of ``n`` onward steps through the version's own generation loop."""
    sampler = v.mod["sampling"].Sampler(v.mod["sampling"].DEFAULT_PARAMS, seed=0)
    t0 = time.perf_counter()
    for _ in v.mod["generate"].decode_tokens(v.sess, sampler, n + 1):  # n + 1 ids, n steps
        pass
    return (time.perf_counter() - t0) / n * 1e3


def run_batched(v: SimpleNamespace, n: int) -> float:
    """ms a step of ``n`` batched steps of the version's sessions, each greedy on its own logits."""
    t0 = time.perf_counter()
    for _ in range(n):
        v.mod["session"].step_batch(v.batch, [int(mx.argmax(s.logits).item()) for s in v.batch])
    return (time.perf_counter() - t0) / n * 1e3


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("other", type=Path, help="folder with the other version's ds4_mlx/ and custom_kernels/")
    ap.add_argument("--shape", choices=("narrow", "tiny", "full"), default="narrow")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--prefill", type=int, default=1024)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--measure", choices=("decode", "prefill"), default="decode")
    ap.add_argument("--batch", type=int, default=1, help="decode: batched steps of this many sessions (ms a step)")
    ap.add_argument("--seconds", type=float, default=None, help="start no round after this long (set-up excluded)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    if args.batch < 1 or (args.batch > 1 and args.measure != "decode"):
        ap.error("--batch takes a count of at least 1, with --measure decode")

    from ds4_mlx.random_model import shape_config

    with tempfile.TemporaryDirectory() as tmp:
        other_pkg = import_other(args.other, Path(tmp))  # a wrong folder fails before the set-up
        cfg = narrow_config(args.layers or 43) if args.shape == "narrow" else shape_config(args.shape, args.layers)
        weights = random_weights(cfg, "q2", 0)
        reserve = args.prefill + max(cfg.compress_ratios) + 1 + args.rounds * (args.decode + 1)
        this = version("ds4_mlx", cfg, weights, args.prefill, reserve, batch=args.batch)
        other = version(other_pkg, cfg, weights, args.prefill, reserve, batch=args.batch)
        step = run if args.batch == 1 else run_batched
        timed = run_prefill if args.measure == "prefill" else lambda v: step(v, args.decode)
        unit = "ms/token" if args.batch == 1 else "ms/step"
        t_start = time.perf_counter()
        for rnd in range(args.rounds):
            if args.seconds and time.perf_counter() - t_start > args.seconds:
                break
            for v in (this, other) if rnd % 2 == 0 else (other, this):
                v.ms.append(round(timed(v), 4))
            print(f"round {rnd}: this {this.ms[-1]:8.3f}  other {other.ms[-1]:8.3f} {unit}", flush=True)
            res = summary(this.ms, other.ms)
            if args.json:  # every round: a crash or a device call's time limit loses nothing
                args.json.write_text(json.dumps(res, indent=1))
        print(f"this {res['this_mean']:.3f} ms/token, other {res['other_mean']:.3f}; median ratio "
              f"{res['median_ratio']:.3f}, this faster in {res['rounds_this_faster']} of {len(this.ms)} rounds",
              flush=True)
    return res


def summary(this: list[float], other: list[float]) -> dict:
    """Both versions' ms/token of each round, their means and the rounds' paired ratios (this / other)."""
    ratios = [a / b for a, b in zip(this, other)]
    return {"this": this, "other": other, "this_mean": float(np.mean(this)), "other_mean": float(np.mean(other)),
            "ratios": [round(r, 4) for r in ratios], "median_ratio": float(np.median(ratios)),
            "rounds_this_faster": sum(r < 1 for r in ratios)}


if __name__ == "__main__":
    main()
