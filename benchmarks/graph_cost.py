"""Host cost of one decode step on the GPU code path, measured on any machine (the CPU is enough).

    python benchmarks/graph_cost.py [--layers 43] [--ctx 600] [--profile] [--steps N]

On MLX-CUDA the host pays for every node of a decode step's graph: ~10 µs to encode a kernel launch and ~5 µs
for each array a launch writes (benchmarks/RESULTS.md). These costs depend on the graph's structure, not on the
widths, so they can be measured here: a narrow model with the real layer pattern (``--layers`` layers of
ratios 0, 0, 4, 128, 4, ...) runs the GPU dispatch path with every custom-kernel launch replaced by a constant
output of the right shape (the wrappers' Python still runs). Reported: Python time to build one step's graph,
the arrays the kernel launches write and read (MLX's encode of a launch grows with both; ``by_kernel``:
launches and arrays written per kernel), and the step's op count split into kernel launches, compute ops and
view ops (reshape, slice, broadcast, ...: no device work, but MLX still replays and encodes each one).

``--steps N`` then decodes N steps onward, over new positions, and counts the distinct shapes of the graphs they
queue (their launching ops in order, ``resident`` copies made as on CUDA), in all and per kind of step (which
windows complete, whether a row buffer grew). MLX-CUDA keys its cached CUDA graphs by their topology, so a
shape seen for the first time cannot hit that cache: each new CUDA graph cost 1-3 ms to instantiate on the H200,
and steps of one kind must share one shape.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import functools
import io
import json
import pstats
import re
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4_mlx import weights as W  # noqa: E402
from ds4_mlx.model import fused as graph_ops  # noqa: E402
from ds4_mlx.model.model import Model  # noqa: E402
from ds4_mlx.random_model import random_weights  # noqa: E402
from ds4_mlx.session import Session  # noqa: E402
from ds4_mlx.testing import flash_config, tiny_config  # noqa: E402

# Ops that move no data on the GPU (views and metadata); the rest are launches.
VIEW_OPS = {"Reshape", "Slice", "Broadcast", "View", "ExpandDims", "Squeeze", "Flatten", "Unflatten",
            "Transpose", "AsStrided", "Full", "StopGradient"}


def narrow_config(layers: int):
    """The tiny widths with the real layer pattern (hash layers, ratio 0/4/R alternation) of ``layers`` layers."""
    t, f = tiny_config(), flash_config()
    ratios = tuple(min(r, 16) if r > 4 else r for r in (f.compress_ratios * 2)[:layers])
    return replace(t, n_layer=layers, compress_ratios=ratios, swiglu_clamp=(10.0,) * layers,
                   n_hash_layer=min(f.n_hash_layer, layers))


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A materialized stand-in output (no graph nodes of its own, so the view count is the model's)."""
    z = mx.zeros(shape, dtype)
    mx.eval(z)
    return z


class FakeKernels:
    """Swap every custom-kernel launch for one ``Depends`` node: outputs of the right shape (zeros) that
    depend on the launch's inputs, so the graph (compiled or not) keeps everything upstream of a kernel.
    ``launches`` / ``outputs`` count, by kernel, the launches built and the arrays they write (a compiled step
    builds its launches only when it is traced)."""

    def __init__(self):
        from ds4_mlx.weights import _kernels

        self.K = _kernels()
        self.F = self.K.fused
        self.launches: collections.Counter = collections.Counter()
        self.outputs: collections.Counter = collections.Counter()

    def _fake(self, kind, backend, *variant):
        def launch(*, inputs, output_shapes, output_dtypes, **_):
            self.launches[kind] += 1
            self.outputs[kind] += len(output_shapes)
            return mx.depends([_zeros(tuple(s), d) for s, d in zip(output_shapes, output_dtypes)], list(inputs))

        return launch

    def __enter__(self):
        self.saved = (W.kernel_backend, graph_ops.kernel_backend, self.F.get_fused_kernel, self.K.get_kernel)
        W.kernel_backend = graph_ops.kernel_backend = lambda: "cuda"
        self.F.get_fused_kernel = self.K.get_kernel = self._fake
        return self

    def __exit__(self, *exc):
        W.kernel_backend, graph_ops.kernel_backend, self.F.get_fused_kernel, self.K.get_kernel = self.saved


def graph_dot(outputs: list[mx.array]) -> tuple[str, list[str]]:
    """MLX's dot export of the graph behind ``outputs`` and its nodes' primitive names, in export order."""
    f = io.StringIO()
    mx.export_to_dot(f, *outputs)
    dot = f.getvalue()
    return dot, re.findall(r'label\s*=\s*"([A-Za-z_0-9]+)', dot)


def op_counts(outputs: list[mx.array]) -> collections.Counter:
    """Graph nodes by primitive name, plus ``kernel outputs`` / ``kernel inputs``: the arrays the kernel launches
    (``Depends`` stand-ins) write and read. MLX's encode of a launch grows with both (benchmarks/RESULTS.md)."""
    dot, labels = graph_dot(outputs)
    counts = collections.Counter(labels)
    launches = set(re.findall(r'(\d+) \[label ="Depends"', dot))
    outs = sum(1 for a in re.findall(r'^(\d+) -> "', dot, re.M) if a in launches)
    ins = sum(1 for b in re.findall(r'^"\w+" -> (\d+)$', dot, re.M) if b in launches)
    counts["kernel outputs"], counts["kernel inputs"] = outs, ins - outs  # a stand-in also reads its zeros
    return counts


def step_shapes(sess: Session, tok: mx.array, n: int) -> dict:
    """Decode ``n`` steps onward (kernels faked) and count the distinct shapes of the graphs they queue: the ops
    that launch work, in the order MLX exports them, with ``fused.resident`` taking its CUDA path. Also per kind
    of step (the compress ratios whose windows it completes, whether a row buffer grew): MLX-CUDA caches CUDA
    graphs by topology, so steps of one kind must share one shape (``kind_shapes`` all 1) or they miss that cache."""
    from ds4_mlx.weights import _kernels

    fused, seen, kinds = _kernels().fused, [], []
    on_cuda, queue_work = fused._on_cuda, sess.queue_work
    ratios = sorted({c.ratio for c in sess.caches if c.ratio})

    def capacity() -> int:
        return sum(a.shape[0] for c in sess.caches for a in (c.comp, c.index) if a is not None)

    def capture(work):
        _, labels = graph_dot([a for w in work for a in (w if isinstance(w, list) else [w])])
        seen.append(tuple(a for a in labels if a not in VIEW_OPS))  # views launch nothing on the device
        mx.eval(work)

    fused._on_cuda, sess.queue_work = (lambda: True), capture
    try:
        for _ in range(n):
            pos, cap = sess.pos, capacity()
            sess.step(tok)
            kinds.append((tuple(r for r in ratios if (pos + 1) % r == 0), capacity() != cap))
    finally:
        fused._on_cuda, sess.queue_work = on_cuda, queue_work
    first, per_kind = {}, collections.defaultdict(set)
    for i, (s, k) in enumerate(zip(seen, kinds)):
        first.setdefault(s, i)
        per_kind[f"complete {'/'.join(map(str, k[0])) or '-'}{', grew' if k[1] else ''}"].add(s)
    return {"steps": n, "step_shapes": len(first), "step_shape_first_seen": sorted(first.values()),
            "kind_shapes": {k: len(v) for k, v in sorted(per_kind.items())}}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--ctx", type=int, default=600, help="tokens prefilled before the measured step")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="also print the top Python hot spots")
    ap.add_argument("--no-compile", action="store_true", help="build the step op by op (DS4_MLX_COMPILE=0)")
    ap.add_argument("--steps", type=int, default=0, help="then decode this many steps onward, counting step shapes")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    cfg = narrow_config(args.layers)
    model = Model(cfg, random_weights(cfg, "q2"))
    sess = Session(model)
    sess.prefill([0] + np.random.default_rng(0).integers(2, cfg.n_vocab, args.ctx - 1).tolist())
    tok = mx.array([int(mx.argmax(sess.logits).item())], dtype=mx.int32)

    model.set_compile_decode(not args.no_compile)
    with FakeKernels() as fake:
        def build():
            caches = [c.snapshot() for c in sess.caches]
            logits = model(tok, sess.pos, caches)
            return [logits] + [a for c in caches for a in c.decode_state().values()]

        build()  # warm caches (rope tables, params) and trace the compiled steps
        ts = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            build()
            ts.append(time.perf_counter() - t0)
        # On the CPU backend mx.fast.rms_norm is built from ~6 ops; on the GPU it is one: count it as one.
        rms_norm = mx.fast.rms_norm
        mx.fast.rms_norm = lambda x, w, eps: mx.erf(x)
        try:
            model.set_compile_decode(not args.no_compile)  # trace again: a compiled step replays its first trace
            fake.launches.clear()
            fake.outputs.clear()
            counts = op_counts(build())
        finally:
            mx.fast.rms_norm = rms_norm
        calls = counts.pop("Depends", 0)
        k_out, k_in = counts.pop("kernel outputs"), counts.pop("kernel inputs")
        if args.profile:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(3):
                build()
            pr.disable()
            pstats.Stats(pr).sort_stats("tottime").print_stats(25)
        shapes = step_shapes(sess, tok, args.steps) if args.steps else {}
    views = sum(v for k, v in counts.items() if k in VIEW_OPS)
    compute = sum(counts.values()) - views
    res = {
        "layers": args.layers, "ctx": sess.pos, "compiled": not args.no_compile, "build_ms": float(np.median(ts)) * 1e3,
        "kernel_launches": calls, "kernel_outputs": k_out, "kernel_inputs": k_in, "compute_ops": compute,
        "view_ops": views,
        "launches_per_layer": (calls + compute) / args.layers,  # what the GPU runs (views run nothing there)
        "top_compute_ops": dict(collections.Counter({k: v for k, v in counts.items() if k not in VIEW_OPS}).most_common(12)),
        # [launches, arrays written] a step by kernel, most arrays first: each array costs an allocation
        "by_kernel": {k: [fake.launches[k], n] for k, n in fake.outputs.most_common()},
        **shapes,
    }
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
