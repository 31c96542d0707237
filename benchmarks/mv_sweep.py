"""Device time of the model's own decode matvec launches under several (NR, NSG, KS) configs, under Nsight Compute
(and of the one-token attention under several simdgroup counts a head).

    ncu --clock-control none --kernel-name regex:"ds_(mv|attn_one)" --metrics gpu__time_duration.sum --csv \
        python benchmarks/mv_sweep.py labels.json > ncu.csv        # on the GPU (CUDA only)
    python benchmarks/mv_sweep.py --summarize ncu.csv labels.json  # anywhere
    ncu --set full python benchmarks/mv_sweep.py labels.json --default --only q_b out_b  # why a launch is slow
    ncu --clock-control none --kernel-name regex:ds_mv --csv --metrics <OCCUPANCY_METRICS, comma-joined> \
        python benchmarks/mv_sweep.py labels.json --default > occ.csv  # registers, stage, occupancy
    python benchmarks/mv_sweep.py --occupancy occ.csv labels.json

The launches are the full-shape decode step's (one token): q_b and q_a+kv with the RMSNorm prologue, out_b,
the grouped out_a, the ratio-4 layers' stacked F16 projections, the ratio-128 compressor's and the indexer's q_b,
the router (256 rows: a few threadgroups, so pure latency), the LM head and the routed experts' two launches with
and without the shared expert inside (``mv`` ``shared``); "direct" launches run as mv_reg.body instead (configs
``(NR, NSG[, RG])``). ``attn`` is ``fused.attend_one`` at V4 Flash's ratio-4 layer (64 heads of 512, a full raw
window and the indexer's 512 of 700 rows), its config ``(NSG,)``. Each config of each launch runs twice unmeasured
(JIT, caches), then three times; ``--summarize`` takes the median of the three per config and prints the fastest
configs per launch (``default`` marks the dispatcher's own pick, ``kernels.mv_config``). Configs whose staged rows
would not fit CUDA's 48 KB of static shared memory are skipped. ``BUDGET`` (seconds, default 300) stops starting
new configs, so a device call's limit cuts the sweep at a config boundary.
"""

from __future__ import annotations

import argparse
import collections
import functools
import itertools
import json
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRIORITY = ["gateup+sh", "gateup", "down+sh", "down", "q_b rms", "q_b", "qa+kv rms", "out_b", "out_a g8",
            "f16 r4 stack", "idx q_b f16", "gateup+sh xq", "gateup+sh xq direct", "down+sh direct", "q_b rms direct",
            "out_b direct", "qa+kv rms direct", "out_a g8 direct", "router f16 direct", "f16 r4 stack direct",
            "idx q_b f16 direct", "f16 r128 comp direct", "idx q_b rms f16", "idx q_b rms f16 direct", "down+sh xq",
            "gateup+sh xq qy direct", "down+sh xq direct",
            "router f16", "f16 r128 comp", "attn", "lm head", "lm head direct"]


def configs(qt: str, nw: int = 1, shared: str | None = None, nrs=(1, 2, 4), nsgs=(2, 4, 8), kss=None, ks_max=8):
    """(NR, NSG, KS) candidates whose double-buffered stage (2 x NSG x NR x nw rows x the span pitch) fits.
    A span is 32 units of 32 weights (mv.body); the pitch is the wider of the launch's two types."""
    from gguf import GGMLQuantizationType as QT

    from ds4_mlx.kernels import MV_SPAN
    from ds4_mlx.quants import row_bytes

    pitch = max(row_bytes(QT[t], MV_SPAN) for t in (qt, shared or qt))
    out = []
    for nr, nsg in itertools.product(nrs, nsgs):
        for ks in kss or sorted({1, max(1, nsg // 2), nsg}):
            if ks <= nsg and nsg % ks == 0 and ks <= ks_max and 2 * nsg * nr * nw * pitch + 2048 * (qt == "IQ2_XXS") <= 46000:
                out.append((nr, nsg, ks))
    return out


#: (NR, NSG, RG) of the dense and grouped launches as mv_reg.body (``None``: kernels.reg_config's).
REG_DENSE = [None, (2, 1, 1), (4, 1, 1), (8, 1, 1), (4, 1, 4), (2, 2, 1), (4, 2, 1), (2, 4, 1), (4, 4, 1), (8, 4, 1),
             (4, 8, 1)]


def cases(only: list[str] | None = None, default: bool = False, given: list[tuple] | None = None):
    """[(launch name, config, call)] at the full V4 Flash shape, random weights and activations on the device:
    the launches named in ``only`` (all by default), each at its dispatcher's config only with ``default``, or
    at the ``given`` configs ((NR, NSG, KS) tuples) instead of the sweep's."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType as QT

    from ds4_mlx.random_model import random_quant_weight
    from ds4_mlx.backend import kernel_backend
    from ds4_mlx.weights import _kernels

    K, b = _kernels(), kernel_backend()

    def weight(qt: str, shape):
        w = random_quant_weight(QT[qt], shape, 0.02)
        mx.eval(w.data)
        return w

    qb, qakv, outb = weight("Q8_0", (32768, 1024)), weight("Q8_0", (1536, 4096)), weight("Q8_0", (4096, 8192))
    outa, f16r4, iqb = weight("Q8_0", (8, 1024, 4096)), weight("F16", (2112, 4096)), weight("F16", (8192, 1024))
    router, f16r128 = weight("F16", (256, 4096)), weight("F16", (1024, 4096))
    lm_head = functools.lru_cache(None)(lambda: weight("Q8_0", (129280, 4096)))
    gate, up = weight("IQ2_XXS", (256, 2048, 4096)), weight("IQ2_XXS", (256, 2048, 4096))
    down, sgu, sd = weight("Q2_K", (256, 4096, 2048)), weight("Q8_0", (4096, 4096)), weight("Q8_0", (4096, 2048))
    x1k, x4k, x8k, x8 = (mx.random.normal(s) for s in ((1, 1024), (1, 4096), (1, 8192), (8, 4096)))
    nw1k, nw4k = mx.random.uniform(0.5, 1.5, (1024,)), mx.random.uniform(0.5, 1.5, (4096,))
    ids, rw = mx.array([[3, 17, 40, 99, 180, 250]], dtype=mx.int32), mx.random.uniform(shape=(1, 6))
    mid7, mid6, gids = mx.random.normal((7, 2048)), mx.random.normal((6, 2048)), mx.arange(8, dtype=mx.int32)
    x4k_q, mid7_q = K.quantize_x(x4k), K.quantize_x(mid7)
    mx.eval(x4k_q, mid7_q)
    moe = dict(ids=ids, k_slots=6)
    staged, reg = partial(K.mv, direct=False), partial(K.mv, direct=True)  # mv.body's launch, mv_reg.body's
    from ds4_mlx.kernels import fused as F
    q, raw = mx.random.normal((1, 64, 512)), mx.random.normal((128, 512)).astype(mx.float16)
    comp, sel = mx.random.normal((2048, 512)).astype(mx.float16), mx.random.randint(0, 700, (1, 512)).astype(mx.int32)
    sinks, (rc, rs), counts = mx.random.normal((64,)), (mx.ones((1, 512)), mx.zeros((1, 512))), F.kernel_counts(128, 512)
    plans = [
        ("q_b rms", configs("Q8_0", nrs=(1, 2, 4, 8), kss=(1, 2)),
         lambda c: staged(qb, x1k, b, config=c, epi=K.MV_RMS, aux=nw1k, clamp=1e-6)),
        ("q_b", [None, (2, 4, 1), (8, 2, 1), (2, 8, 1)], lambda c: staged(qb, x1k, b, config=c)),
        ("qa+kv rms", configs("Q8_0"), lambda c: staged(qakv, x4k, b, config=c, epi=K.MV_RMS, aux=nw4k, clamp=1e-6)),
        ("out_b", configs("Q8_0"), lambda c: staged(outb, x8k, b, config=c)),
        ("out_a g8", configs("Q8_0", nsgs=(2, 4), ks_max=4),
         lambda c: staged(outa, x8, b, ids=gids, k_slots=8, config=c)),
        ("f16 r4 stack", configs("F16"), lambda c: staged(f16r4, x4k, b, config=c)),
        ("idx q_b f16", configs("F16"), lambda c: staged(iqb, x1k, b, config=c)),
        ("router f16", configs("F16"), lambda c: staged(router, x4k, b, config=c)),
        ("f16 r128 comp", configs("F16"), lambda c: staged(f16r128, x4k, b, config=c)),
        ("attn", [(4,), (8,), (16,), (32,)],
         lambda c: F.attend_one(q, raw, comp, sel, counts, sinks, rc, rs, 0.044, nsg=c and c[0], backend=b)),
        ("gateup+sh", configs("IQ2_XXS", 2, "Q8_0", nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(gate, x4k, b, **moe, epi=K.MV_SWIGLU, w2=up, aux=rw, clamp=10.0, shared=sgu, config=c)),
        ("gateup", configs("IQ2_XXS", 2, nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(gate, x4k, b, **moe, epi=K.MV_SWIGLU, w2=up, aux=rw, clamp=10.0, config=c)),
        ("down+sh", configs("Q2_K", 1, "Q8_0", nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(down, mid7, b, **moe, epi=K.MV_SUM, shared=sd, config=c)),
        ("down", configs("Q2_K", nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(down, mid6, b, **moe, epi=K.MV_SUM, config=c)),
        # x quantized beforehand (kernels.quantize_x; the model's HC pre writes it), int8 dots (mv.body XQ)
        ("gateup+sh xq", configs("IQ2_XXS", 2, "Q8_0", nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(gate, x4k_q, b, **moe, epi=K.MV_SWIGLU, w2=up, aux=rw, clamp=10.0, shared=sgu, config=c,
                          xq=True)),
        # the same as mv_reg.body (weights straight into registers; CUDA's default): configs (NR, NSG[, RG])
        ("gateup+sh xq direct", [None, (4, 2, 2), (4, 2, 4), (8, 2), (2, 4), (4, 4)],
         lambda c: reg(gate, x4k_q, b, **moe, epi=K.MV_SWIGLU, w2=up, aux=rw, clamp=10.0, shared=sgu, config=c,
                       xq=True)),
        ("down+sh direct", [None, (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (2, 4), (4, 4), (2, 8), (4, 8)],
         lambda c: reg(down, mid7, b, **moe, epi=K.MV_SUM, shared=sd, config=c)),
        # the model's pair where both run as mv_reg.body: gate+up writes mid quantized (mv quantize_y), the down
        # launch dots it in integers; configs (NR, NSG, RG), NR·RG = 8 for gate+up
        ("gateup+sh xq qy direct", [None, (4, 2, 2), (4, 4, 2), (2, 2, 4), (8, 2, 1), (8, 4, 1)],
         lambda c: reg(gate, x4k_q, b, **moe, epi=K.MV_SWIGLU, w2=up, aux=rw, clamp=10.0, shared=sgu, config=c,
                       xq=True, quantize_y=True)),
        ("down+sh xq direct", [None, (2, 1), (4, 1), (8, 1), (2, 2), (4, 2), (8, 2), (2, 4), (4, 4), (2, 8), (4, 8)],
         lambda c: reg(down, mid7_q, b, **moe, epi=K.MV_SUM, shared=sd, config=c, xq=True)),
        # the dense and grouped Q8_0 launches as mv_reg.body: configs (NR, NSG, RG)
        ("q_b rms direct", REG_DENSE, lambda c: reg(qb, x1k, b, config=c, epi=K.MV_RMS, aux=nw1k, clamp=1e-6)),
        ("out_b direct", REG_DENSE, lambda c: reg(outb, x8k, b, config=c)),
        ("qa+kv rms direct", REG_DENSE,
         lambda c: reg(qakv, x4k, b, config=c, epi=K.MV_RMS, aux=nw4k, clamp=1e-6)),
        ("out_a g8 direct", REG_DENSE, lambda c: reg(outa, x8, b, ids=gids, k_slots=8, config=c)),
        ("router f16 direct", REG_DENSE, lambda c: reg(router, x4k, b, config=c)),
        ("f16 r4 stack direct", REG_DENSE, lambda c: reg(f16r4, x4k, b, config=c)),
        ("idx q_b f16 direct", REG_DENSE, lambda c: reg(iqb, x1k, b, config=c)),
        ("f16 r128 comp direct", REG_DENSE, lambda c: reg(f16r128, x4k, b, config=c)),
        # the indexer's q_b as the model runs it: F16 with the RMSNorm prologue
        ("idx q_b rms f16", configs("F16"),
         lambda c: staged(iqb, x1k, b, config=c, epi=K.MV_RMS, aux=nw1k, clamp=1e-6)),
        ("idx q_b rms f16 direct", REG_DENSE,
         lambda c: reg(iqb, x1k, b, config=c, epi=K.MV_RMS, aux=nw1k, clamp=1e-6)),
        ("down+sh xq", configs("Q2_K", 1, "Q8_0", nsgs=(1, 2, 4), ks_max=2),
         lambda c: staged(down, mid7_q, b, **moe, epi=K.MV_SUM, shared=sd, config=c, xq=True)),
        # the LM head, Q8_0 129280 × 4096 (its weight made only when asked for: 0.56 GB)
        ("lm head", configs("Q8_0"), lambda c: staged(lm_head(), x4k, b, config=c)),
        ("lm head direct", REG_DENSE, lambda c: reg(lm_head(), x4k, b, config=c)),
    ]
    plans = [(name, [None] if default else given or cs, f) for name, cs, f in plans if not only or name in only]
    out = [(name, c, (lambda f=f, c=c: f(c))) for name, cs, f in plans for c in cs]
    return sorted(out, key=lambda t: (PRIORITY.index(t[0]), t[1] is not None))


def run(labels_path: Path, only: list[str] | None = None, default: bool = False, given: list[tuple] | None = None) -> None:
    import mlx.core as mx

    budget, t0 = float(os.environ.get("BUDGET", "300")), time.time()
    labels = []
    for name, c, call in cases(only, default, given):
        if time.time() - t0 > budget:
            print("budget reached", flush=True)
            break
        try:
            for _ in range(5):  # 2 unmeasured + 3 measured launches (ncu sees all five)
                mx.eval(call())
        except Exception as e:  # a config the kernel rejects: no launch was made
            print("FAIL", name, c, e, flush=True)
            continue
        labels.append((name, c))
        print(f"{time.time() - t0:.1f}", name, c, flush=True)
    labels_path.write_text(json.dumps(labels))


#: What limits a launch's warps, for ``--occupancy``.
OCCUPANCY_METRICS = {
    "gpu__time_duration.sum": "ns", "launch__registers_per_thread": "registers",
    "launch__shared_mem_per_block_static": "stage bytes", "launch__block_size": "threads",
    "launch__occupancy_limit_registers": "blocks/SM (registers)",
    "launch__occupancy_limit_shared_mem": "blocks/SM (shared mem)",
    "sm__warps_active.avg.pct_of_peak_sustained_active": "warps active %",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed": "DRAM %",
}


def occupancy(ncu_csv: Path, labels_path: Path) -> dict:
    """OCCUPANCY_METRICS of each (launch, config) from an ncu log of those metrics: the third of its five launches."""
    import csv

    rows = list(csv.reader(line for line in ncu_csv.read_text().splitlines() if line.startswith('"')))
    head = rows[0]
    id_i, name_i, val_i = head.index("ID"), head.index("Metric Name"), head.index("Metric Value")
    launches: dict[str, dict] = {}
    for r in rows[1:]:
        if len(r) > val_i:
            launches.setdefault(r[id_i], {})[r[name_i]] = r[val_i].replace(",", "")
    labels, ids = json.loads(labels_path.read_text()), list(launches)
    if len(ids) != 5 * len(labels):
        raise SystemExit(f"{ncu_csv}: {len(ids)} launches, expected 5 per config ({len(labels)} configs)")
    out = {}
    print(" | ".join(["launch", *OCCUPANCY_METRICS.values()]))
    for i, (name, c) in enumerate(labels):
        m = launches[ids[5 * i + 2]]
        key = f"{name} {'default' if c is None else tuple(c)}"
        out[key] = {label: m.get(metric) for metric, label in OCCUPANCY_METRICS.items()}
        print(" | ".join([key, *(str(v) for v in out[key].values())]))
    return out


def summarize(ncu_csv: Path, labels_path: Path, top: int = 6) -> dict:
    """Median µs of each (launch, config) from the ncu log; prints the fastest configs per launch."""
    from kernel_profile import kernel_times

    labels = json.loads(labels_path.read_text())
    us = [t for _, t in kernel_times(ncu_csv)]
    if len(us) != 5 * len(labels):
        raise SystemExit(f"{ncu_csv}: {len(us)} launches, expected 5 per config ({len(labels)} configs)")
    by = collections.defaultdict(list)
    for i, (name, c) in enumerate(labels):
        by[name].append((statistics.median(us[5 * i + 2 : 5 * i + 5]), "default" if c is None else tuple(c)))
    for name, v in by.items():
        v.sort(key=lambda tc: tc[0])
        print(f"{name:<13}" + "  ".join(f"{c}: {t:.1f}" for t, c in v[:top]) + f"   (slowest {v[-1][0]:.1f})")
    return {name: [(c, round(t, 2)) for t, c in v] for name, v in by.items()}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("labels", type=Path, help="where to write (run) or read (--summarize) the config list")
    ap.add_argument("--summarize", type=Path, metavar="NCU_CSV", help="an ncu --csv log of a run of this script")
    ap.add_argument("--occupancy", type=Path, metavar="NCU_CSV", help="the same, of OCCUPANCY_METRICS")
    ap.add_argument("--only", nargs="+", choices=PRIORITY, help="these launches only")
    ap.add_argument("--default", action="store_true",
                    help="each launch at the dispatcher's config only (e.g. for ncu --set full: stall reasons)")
    ap.add_argument("--config", action="append", type=lambda s: tuple(int(v) for v in s.split(",")),
                    metavar="NR,NSG,KS", help="run these configs instead of the sweep's (repeatable)")
    args = ap.parse_args()
    if args.summarize:
        summarize(args.summarize, args.labels)
    elif args.occupancy:
        occupancy(args.occupancy, args.labels)
    else:
        run(args.labels, args.only, args.default, args.config)
