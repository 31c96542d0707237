"""Where a pipelined decode step's wall time goes on the GPU, from an NVIDIA Nsight Systems timeline (CUDA).

    nsys profile --capture-range=cudaProfilerApi --cuda-graph-trace=node -t cuda,nvtx,osrt \
        --export sqlite -o tl python benchmarks/timeline.py run [--layers 43] [--steps 12]
    python benchmarks/timeline.py analyze tl.sqlite

``run`` builds the model at the full shape (random q2 weights, as benchmarks/model.py), prefills ``--ctx``
tokens, warms the decode up, then times ``--steps`` pipelined decode steps twice: once untraced, once between
``cuProfilerStart`` and ``cuProfilerStop`` (the capture range). ``analyze`` reads the capture and reports:
the device's busy time (the union of its kernels, copies and sets) against the wall time, each kernel's share
of it (every instant split among the kernels running then), the idle gaps
between them by size, and for each gap whether the host was late (the API call that queued the next work
began after the device had gone idle: the device waited on the host) or not (device-side latency: graph
launch, dependency resolution, memory faults). Also the CUDA graphs launched, instantiated and updated in place
(a step that instantiates is one whose topology MLX-CUDA had not cached), the host's CUDA API and MLX's NVTX
ranges by total time.

On the lent H200 the Nsight Systems CLI is the one inside Nsight Compute
(``/opt/nvidia/nsight-compute/<version>/host/target-linux-x64/nsys``); it writes only a ``.qdstrm``, which that
install's ``host/linux-desktop-glibc_2_11_3-x64/QdstrmImporter -i tl.qdstrm`` turns into ``tl.nsys-rep`` once it
finds ``libdw.so.1`` (Debian's libdw1 and libelf1, via ``LD_LIBRARY_PATH``); then ``nsys export --type sqlite``.
Tracing slows the host (every CUDA API call is intercepted), so the traced steps are longer than untraced ones;
the device's own times are not affected.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import sqlite3
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def run(layers: int | None, ctx: int, steps: int) -> None:
    import mlx.core as mx
    import numpy as np

    from model import decode_seconds
    from ds4_mlx.model.model import Model
    from ds4_mlx.random_model import random_weights, shape_config
    from ds4_mlx.session import Session

    cfg = shape_config("full", layers)
    model = Model(cfg, random_weights(cfg, "q2"), "ds4")
    prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, ctx - 1).tolist()
    sess = Session(model, chunk_size=512)
    sess.prefill(prompt)
    decode_seconds(sess, 8, pipelined=False)
    decode_seconds(sess, 8, pipelined=True)
    plain, split = decode_seconds(sess, steps, pipelined=True)
    # printed before the capture: nsys ends the process at cuProfilerStop unless --capture-range-end=stop
    print(f"{cfg.n_layer} layers, ctx {sess.pos}: pipelined decode {plain * 1e3:.2f} ms/token untraced "
          f"(build/encode/wait ms {split['build']:.1f}/{split['encode']:.1f}/{split['wait']:.1f})", flush=True)
    cuda = ctypes.CDLL("libcuda.so.1")  # the driver's profiler switch; MLX made the context current
    mx.synchronize()
    cuda.cuProfilerStart()
    t0 = time.perf_counter()
    traced, _ = decode_seconds(sess, steps, pipelined=True)
    mx.synchronize()
    wall = time.perf_counter() - t0
    cuda.cuProfilerStop()
    print(f"{traced * 1e3:.2f} ms/token traced; capture {wall * 1e3:.1f} ms for {steps} steps", flush=True)


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def attributed(acts: list[tuple]) -> collections.Counter:
    """Each activity name's share of the device's busy time: every instant split evenly among the activities
    running then, so the shares sum to the busy time (a kernel that overlaps another costs half while they do)."""
    edges = sorted([(a[0], 1, i) for i, a in enumerate(acts)] + [(a[1], -1, i) for i, a in enumerate(acts)])
    share: collections.Counter = collections.Counter()
    running: set[int] = set()
    last = edges[0][0]
    for t, kind, i in edges:
        if running and t > last:
            for j in running:
                share[acts[j][3]] += (t - last) / len(running)
        last = t
        (running.add if kind == 1 else running.discard)(i)
    return share


def analyze(path: Path, steps: int | None, top: int) -> None:
    db = sqlite3.connect(path)
    tables = _tables(db)
    names = dict(db.execute("SELECT id, value FROM StringIds"))
    # (start, end, kind, name, correlationId)
    acts: list[tuple[int, int, str, str, int]] = []
    kcols = _columns(db, "CUPTI_ACTIVITY_KIND_KERNEL")
    name_col = "shortName" if "shortName" in kcols else "demangledName"
    for s, e, n, c in db.execute(f"SELECT start, end, {name_col}, correlationId FROM CUPTI_ACTIVITY_KIND_KERNEL"):
        acts.append((s, e, "kernel", names.get(n, str(n)), c))
    for table, kind in (("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"), ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
        if table in tables:
            for s, e, c in db.execute(f"SELECT start, end, correlationId FROM {table}"):
                acts.append((s, e, kind, kind, c))
    acts.sort()
    if not acts:
        raise SystemExit(f"{path}: no device activity in the capture")
    api: dict[int, tuple[int, str]] = {}
    api_total: collections.Counter = collections.Counter()
    api_count: collections.Counter = collections.Counter()
    for table in ("CUPTI_ACTIVITY_KIND_RUNTIME", "CUPTI_ACTIVITY_KIND_DRIVER"):
        if table in tables:
            for s, e, n, c in db.execute(f"SELECT start, end, nameId, correlationId FROM {table}"):
                name = names.get(n, str(n))
                api[c] = (s, name)
                api_total[name] += e - s
                api_count[name] += 1

    t_first, t_last = acts[0][0], max(a[1] for a in acts)
    wall = t_last - t_first
    busy, gaps, end, prev = 0, [], t_first, None  # prev: the activity that ends the busy time so far
    for a in acts:
        s, e = a[0], a[1]
        if prev is not None and s > end:
            launch = api.get(a[4])
            late = launch is not None and launch[0] > end
            gaps.append((s - end, prev[3], a[3], late, launch[1] if launch else "?"))
        if e > end:
            busy += e - max(s, end)
            end, prev = e, a
    per = f" ({wall / steps / 1e6:.2f} ms a step)" if steps else ""
    print(f"capture: {wall / 1e6:.2f} ms wall{per}, {len(acts)} device activities "
          f"({sum(a[2] == 'kernel' for a in acts)} kernels)")
    print(f"device busy {busy / 1e6:.2f} ms ({100 * busy / wall:.1f} %), idle {(wall - busy) / 1e6:.2f} ms in "
          f"{len(gaps)} gaps")
    late = sum(g[0] for g in gaps if g[3])
    print(f"  idle while the host was late (next work queued after the device went idle): {late / 1e6:.2f} ms "
          f"in {sum(g[3] for g in gaps)} gaps; device-side: {(wall - busy - late) / 1e6:.2f} ms")
    edges = (0, 2_000, 5_000, 10_000, 50_000, 200_000, 10**15)
    print("  gaps by size:  size          count   idle ms   host-late ms")
    for lo, hi in zip(edges, edges[1:]):
        sel = [g for g in gaps if lo <= g[0] < hi]
        label = f"{lo / 1e3:g}-{hi / 1e3:g} us" if hi < 10**15 else f">{lo / 1e3:g} us"
        print(f"    {label:18s} {len(sel):7d} {sum(g[0] for g in sel) / 1e6:9.2f} "
              f"{sum(g[0] for g in sel if g[3]) / 1e6:12.2f}")
    print(f"\nlargest {top} gaps: us, before -> after, host late?, the call that queued the next work")
    for g in sorted(gaps, reverse=True)[:top]:
        print(f"  {g[0] / 1e3:8.1f}  {g[1][:45]} -> {g[2][:45]}  {'late' if g[3] else '-'}  {g[4]}")
    pair = collections.Counter()
    for g in gaps:
        pair[(g[1][:40], g[2][:40])] += g[0]
    print("\nidle time by (before, after) pair, top 15: ms")
    for (b, a), t in pair.most_common(15):
        print(f"  {t / 1e6:7.2f}  {b} -> {a}")

    ktime, kcount, share = collections.Counter(), collections.Counter(), attributed(acts)
    for a in acts:
        ktime[a[3]] += a[1] - a[0]
        kcount[a[3]] += 1
    div = steps or 1
    print(f"\ndevice time by kernel, top 30 ({'ms a step' if steps else 'ms'}): 'shared' splits each instant among the "
          f"activities running then (sums to the busy time, {busy / div / 1e6:.2f}); 'span' is start to end "
          f"(sum {sum(ktime.values()) / div / 1e6:.2f}: a CUDA graph runs independent kernels side by side)")
    for k, t in share.most_common(30):
        print(f"  {t / div / 1e6:7.3f} shared {ktime[k] / div / 1e6:7.3f} span {kcount[k] / div:7.1f}x  "
              f"{ktime[k] / kcount[k] / 1e3:7.1f} us each  {k[:70]}")
    # MLX-CUDA launches a cached CUDA graph after updating it in place (~0.1 ms) when the topology is one it has
    # seen; a new topology is instantiated (1-3 ms on the H200)
    graph = {op: [(n, t) for n, t in api_total.items() if n.startswith(f"cudaGraph{op}")]
             for op in ("Launch", "Instantiate", "ExecUpdate")}
    line = ", ".join(f"{op} {sum(api_count[n] for n, _ in v)}x {sum(t for _, t in v) / 1e6:.2f} ms"
                     for op, v in graph.items())
    inst = sum(api_count[n] for n, _ in graph["Instantiate"])
    print(f"\nCUDA graphs: {line}" + (f" ({inst / steps:.2f} instantiations a step)" if steps else ""))
    print("\nhost CUDA API by total time, top 15")
    for k, t in api_total.most_common(15):
        print(f"  {t / 1e6:7.2f} ms {api_count[k]:7d}x  {k}")
    if "NVTX_EVENTS" in tables:
        nv, nvc = collections.Counter(), collections.Counter()
        for s, e, text, tid in db.execute("SELECT start, end, text, textId FROM NVTX_EVENTS WHERE end IS NOT NULL"):
            key = text or names.get(tid, "?")
            nv[key] += e - s
            nvc[key] += 1
        print("\nMLX NVTX ranges by total time, top 10")
        for k, t in nv.most_common(10):
            print(f"  {t / 1e6:7.2f} ms {nvc[k]:7d}x  {k}")
    for table in sorted(t for t in tables if "PAGE_FAULT" in t):
        n = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
        print(f"\n{table}: {n} events")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="the traced workload (under nsys)")
    r.add_argument("--layers", type=int, default=None, help="override the layer count (default: all 43)")
    r.add_argument("--ctx", type=int, default=2048, help="prompt tokens before decoding")
    r.add_argument("--steps", type=int, default=12, help="pipelined decode steps in the capture")
    a = sub.add_parser("analyze", help="summarize an nsys sqlite export")
    a.add_argument("sqlite", type=Path)
    a.add_argument("--steps", type=int, default=None, help="decode steps in the capture (for ms a step)")
    a.add_argument("--top", type=int, default=25, help="largest gaps listed")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.layers, args.ctx, args.steps)
    else:
        analyze(args.sqlite, args.steps, args.top)


if __name__ == "__main__":
    main()
