"""GPU time of every kernel of one decode step or one prefill chunk, under NVIDIA Nsight Compute (CUDA only).

    ncu --graph-profiling node --metrics gpu__time_duration.sum --csv \
        python benchmarks/kernel_profile.py [--layers 4] [--ctx 2100] [--steps 1] [--batch B] > ncu.csv
    python benchmarks/kernel_profile.py --summarize ncu.csv

The run builds ``--layers`` full-width layers (random q2 weights), prefills ``--ctx`` tokens in one chunk,
decodes a few warm-up tokens, then ``--steps`` measured tokens, each between two launches of a marker kernel
(``ds4_marker``). ``--summarize`` keeps the kernels between the last two markers and sums their GPU time by
kernel name: what the device itself spends on a decode step, without the host's launch cost. ``--batch B``
measures instead one step of B sessions decoded together (:func:`~ds4_mlx.session.step_batch`, as
``serve --batched-session`` runs them), each holding the same ``--ctx`` tokens. ``--prefill T`` measures
instead the last chunk of a ``--ctx``-token prefill in chunks of T (the device's time per kernel of a chunk, where
``benchmarks/prefill_profile.py`` times each piece alone with the host's launches in it).

``--mv`` instead launches the decode matvec once per projection shape (``DECODE_SHAPES`` without the LM head),
each after a marker; ``--compare-mv NEW.csv OLD.csv`` prints each shape's GPU time in two such logs (two kernel
versions profiled in one device run) and the ratio.
"""

from __future__ import annotations

import argparse
import collections
import csv
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MARKER = "ds4_marker"

DECODE_SHAPES = [  # (label, qtype name, shape, gathered pairs (0 = dense))
    ("q_a", "Q8_0", (1024, 4096), 0), ("q_b", "Q8_0", (32768, 1024), 0), ("kv", "Q8_0", (512, 4096), 0),
    ("out_a (8 groups)", "Q8_0", (8, 1024, 4096), 8), ("out_b", "Q8_0", (4096, 8192), 0),
    ("shared gate", "Q8_0", (2048, 4096), 0), ("shared down", "Q8_0", (4096, 2048), 0),
    ("lm head", "Q8_0", (129280, 4096), 0), ("compressor r4", "F16", (1024, 4096), 0),
    ("indexer q_b", "F16", (8192, 1024), 0), ("router", "F16", (256, 4096), 0),
    ("routed gate", "IQ2_XXS", (256, 2048, 4096), 6), ("routed down", "Q2_K", (256, 4096, 2048), 6),
]


def marker() -> None:
    k = mx.fast.cuda_kernel(name=MARKER, input_names=["x"], output_names=["out"],
                            source="if (threadIdx.x == 0) out[0] = x[0];")
    mx.eval(k(inputs=[mx.ones((1,))], grid=(1, 1, 1), threadgroup=(1, 1, 1), output_shapes=[(1,)],
              output_dtypes=[mx.float32])[0])


def run(layers: int, ctx: int, steps: int = 1, batch: int = 1, prefill: int = 0) -> None:
    from ds4_mlx.model.model import Model
    from ds4_mlx.random_model import random_weights, shape_config
    from ds4_mlx.session import Session, step_batch

    if prefill and not 0 < prefill <= ctx:  # before the model's minutes of set-up
        raise SystemExit(f"--prefill {prefill}: a chunk of 1 to --ctx ({ctx}) tokens")
    cfg = shape_config("full", layers)
    model = Model(cfg, random_weights(cfg, "q2"))
    prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, ctx - 1).tolist()
    if prefill:
        run_prefill_chunk(model, prompt, prefill)
        return
    sess = Session(model, chunk_size=ctx)
    sess.prefill(prompt)
    if batch == 1:
        def step(tok: list[int]) -> list[int]:
            return [int(mx.argmax(sess.step(tok[0])).item())]
    else:
        snap = sess.snapshot()
        sessions = [Session(model, chunk_size=ctx, reserve=ctx + steps + 8) for _ in range(batch)]
        for s in sessions:
            s.restore(snap)

        def step(tok: list[int]) -> list[int]:
            return [int(mx.argmax(lg).item()) for lg in step_batch(sessions, tok)]
    tok = [int(mx.argmax(sess.logits).item())] * batch
    for _ in range(4):
        tok = step(tok)
    for _ in range(steps):  # each measured step between two markers
        marker()
        tok = step(tok)
    marker()


def run_prefill_chunk(model, prompt: list[int], chunk: int) -> None:
    """``prompt`` in chunks of ``chunk``, twice (the first warms the JIT up); the second's last chunk between two
    markers."""
    from ds4_mlx.session import Session

    ctx = len(prompt)
    Session(model, chunk_size=chunk).prefill(prompt)
    sess = Session(model, chunk_size=chunk, reserve=ctx)
    if ctx > chunk:
        sess.prefill(prompt[: ctx - chunk])
    mx.eval(sess.state_arrays())
    marker()
    mx.eval(sess.prefill(prompt[ctx - chunk :]))
    marker()


def mv_shapes() -> list:
    return [s for s in DECODE_SHAPES if s[0] != "lm head"]  # 563 MB; the other Q8_0 shapes run the same kernel


def run_mv() -> None:
    """One launch of every decode matvec shape (``mv_shapes``), for ncu's full sections."""
    from gguf import GGMLQuantizationType as QT

    from ds4_mlx.random_model import random_quant_weight
    from ds4_mlx.backend import kernel_backend
    from ds4_mlx.weights import _kernels

    K, backend = _kernels(), kernel_backend()
    for label, qname, shape, pairs in mv_shapes():
        qt = QT[qname]
        w = random_quant_weight(qt, shape, 0.02)
        x = mx.random.normal((pairs if pairs == 8 else 1, shape[-1]))
        ids = mx.array(np.arange(8) if pairs == 8 else [3, 17, 40, 99, 180, 250][:pairs], dtype=mx.int32) if pairs else None
        mx.eval(w.data, x)
        call = lambda: K.mv(w, x, backend, ids=ids, k_slots=pairs) if pairs else K.mv(w, x, backend)  # noqa: E731
        mx.eval(call())
        marker()
        mx.eval(call())
        print(label, qname, shape, flush=True)


def kernel_times(path: Path) -> list[tuple[str, float]]:
    """(kernel name, µs) of every launch in an ``ncu --csv`` log, in launch order."""
    rows = list(csv.reader(line for line in path.read_text().splitlines() if line.startswith('"')))
    if not rows:
        raise SystemExit(f"{path}: no ncu CSV rows")
    head = rows[0]
    name_i, val_i, unit_i = head.index("Kernel Name"), head.index("Metric Value"), head.index("Metric Unit")
    scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    return [(r[name_i], float(r[val_i].replace(",", "")) * scale[r[unit_i]]) for r in rows[1:] if len(r) > val_i]


def summarize(path: Path) -> None:
    """Per-kernel GPU time of the last marked step (or prefill chunk); with several marked steps (``--steps``), first
    each step's total and its slowest launches, to tell one-off stalls from launches that are slow in every step."""
    times = kernel_times(path)
    marks = [i for i, (n, _) in enumerate(times) if MARKER in n]
    if len(marks) < 2:
        raise SystemExit(f"{path}: fewer than two {MARKER} kernels; was it written by ncu --csv around run()?")
    if len(marks) > 2:
        for s, (a, b) in enumerate(zip(marks, marks[1:])):
            seg = times[a + 1 : b]
            top = sorted(((us, i, n.split("(")[0]) for i, (n, us) in enumerate(seg)), reverse=True)[:3]
            print(f"step {s}: {len(seg)} kernels, {sum(us for _, us in seg):.0f} us; slowest: "
                  + ", ".join(f"#{i} {n[:40]} {us:.0f} us" for us, i, n in top))
    step = times[marks[-2] + 1 : marks[-1]]
    by = collections.defaultdict(lambda: [0, 0.0])
    for n, us in step:
        key = n.split("(")[0][:70]
        by[key][0] += 1
        by[key][1] += us
    total = sum(us for _, us in step)
    print(f"{len(step)} kernels, {total:.0f} us of GPU time between the last two markers")
    print(f"{'kernel':<72}{'count':>6}{'us':>10}{'%':>7}")
    for k, (c, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:40]:
        print(f"{k:<72}{c:>6}{us:>10.1f}{100 * us / total:>6.1f}%")


def after_markers(path: Path) -> list[float]:
    """µs of the launch right after each marker (the measured one of ``--mv``)."""
    times = kernel_times(path)
    return [times[i + 1][1] for i, (n, _) in enumerate(times[:-1]) if MARKER in n]


def compare_mv(new: Path, old: Path) -> None:
    a, b = after_markers(new), after_markers(old)
    shapes = mv_shapes()
    if not (len(a) == len(b) == len(shapes)):
        raise SystemExit(f"expected {len(shapes)} measured launches per log, got {len(a)} and {len(b)}")
    print(f"{'projection':<18}{'type':<9}{'shape':<22}{'old us':>8}{'new us':>8}{'old/new':>9}")
    for (label, qname, shape, _), ta, tb in zip(shapes, a, b):
        print(f"{label:<18}{qname:<9}{str(shape):<22}{tb:>8.1f}{ta:>8.1f}{tb / ta:>9.2f}")
    print(f"{'sum':<49}{sum(b):>8.1f}{sum(a):>8.1f}{sum(b) / sum(a):>9.2f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ctx", type=int, default=2100)
    ap.add_argument("--steps", type=int, default=1, help="measured decode steps, each between two markers")
    ap.add_argument("--batch", type=int, default=1, help="sessions decoded together in each step")
    ap.add_argument("--prefill", type=int, default=0, metavar="T",
                    help="instead: the last T-token chunk of a --ctx-token prefill in chunks of T")
    ap.add_argument("--mv", action="store_true", help="instead: one launch of each decode matvec shape")
    ap.add_argument("--summarize", type=Path, default=None, help="an ncu --csv log of a decode step to summarize")
    ap.add_argument("--compare-mv", type=Path, nargs=2, metavar=("NEW", "OLD"), help="two ncu --csv logs of --mv")
    a = ap.parse_args()
    if a.summarize:
        summarize(a.summarize)
    elif a.compare_mv:
        compare_mv(*a.compare_mv)
    else:
        run_mv() if a.mv else run(a.layers, a.ctx, a.steps, a.batch, a.prefill)
