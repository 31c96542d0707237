"""Kernel benchmark at real V4 Flash shapes (docs/quants.md §5.4): decode matvec, 6-expert gathered matvec, dense prefill.

Run on a GPU backend (``python benchmarks/kernel_speed.py [--quick] [--json out.json]``). Random valid quant bytes
are built on the device. Every timed loop rotates over weight copies or fresh expert ids so the 60 MB L2 of
an H200 does not serve the weights. Reports effective GB/s (weight bytes / time), % of the device copy rate
measured in the same run (bytes read + written, as docs/quants.md §6 counts it), and time ratios against MLX's own
``quantized_matmul`` / ``gather_qmm`` (affine 4-bit g64 and 8-bit g32) and a bf16 product of the same
logical shape. Prefill rows report TFLOP/s as a share of the bf16 dense matmul's rate at the same shape.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gguf import GGMLQuantizationType as QT  # noqa: E402

from ds4_mlx import quants  # noqa: E402
from ds4_mlx.weights import QuantWeight, _kernels  # noqa: E402

K = _kernels()
BACKEND = "cuda"  # set in main() from ds4_mlx.weights.kernel_backend()
L2_ROTATE_BYTES = 8 * 60e6  # rotate over at least ~8 L2s worth of weights


def device_blocks(qt: QT, shape) -> mx.array:
    """Random valid blocks built on the device: uniform bytes, finite f16 d (and dmin ≥ 0)."""
    if qt == QT.F16:
        out = (mx.random.normal(tuple(shape)) * 0.05).astype(mx.float16)
        mx.eval(out)
        return out
    bs, ts = quants.block_size(qt), quants.type_size(qt)
    n = int(np.prod(shape[:-1])) * (shape[-1] // bs)
    b = mx.random.randint(0, 256, (n, ts)).astype(mx.uint8)
    cols = []
    pos = 0
    for o in quants.F16_FIELDS[qt]:
        sign = 1.0 if o in quants.NONNEG_FIELDS.get(qt, ()) else mx.where(mx.random.uniform(shape=(n, 1)) < 0.5, -1.0, 1.0)
        d = (sign * mx.exp(mx.random.uniform(math.log(1e-4), math.log(5e-2), (n, 1)))).astype(mx.float16)
        cols += [b[:, pos:o], d.view(mx.uint8).reshape(n, 2)]
        pos = o + 2
    cols.append(b[:, pos:])
    out = mx.concatenate(cols, axis=1).reshape(*shape[:-1], quants.row_bytes(qt, shape[-1]))
    mx.eval(out)
    return out


def affine(shape, bits: int, group: int):
    *lead, o, i = shape
    w = mx.random.randint(0, 2**31, (*lead, o, i * bits // 32)).astype(mx.uint32)
    s = (mx.random.uniform(shape=(*lead, o, i // group)) * 0.01).astype(mx.float16)
    b = (mx.random.uniform(shape=(*lead, o, i // group)) * -0.01).astype(mx.float16)
    mx.eval(w, s, b)
    return w, s, b


def nbytes(*arrays) -> int:
    return sum(a.nbytes for a in arrays)


def timeit(make, n: int, warm: int = 3) -> float:
    """Seconds per call: ``make(i)`` builds call i's output. Calls are queued back to back (async) and each
    output is dropped once queued, so the allocator reuses buffers instead of allocating n outputs."""
    for i in range(warm):
        mx.eval(make(i))
    mx.synchronize()
    t0 = time.perf_counter()
    for i in range(n):
        mx.async_eval(make(i))
    mx.synchronize()
    return (time.perf_counter() - t0) / n


def safe(fn):
    """Run one baseline measurement; a baseline that fails on this backend is reported, not fatal."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        print(f"  baseline failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
        return float("nan")


def copy_rate() -> float:
    """Device copy, bytes read + written per second."""
    a = mx.random.randint(0, 2**31, (1 << 29,)).astype(mx.uint32)  # 2 GiB
    mx.eval(a)
    t = timeit(lambda i: a + 1, 20)
    return 2 * a.nbytes / t


def copies(nb: int) -> int:
    return max(2, math.ceil(L2_ROTATE_BYTES / nb))


ROWS: list[dict] = []


def report(section, qtype, shape, kernel, t, nbytes_=None, flops=None, **ratios):
    row = dict(section=section, type=qtype, shape=shape, kernel=kernel, us=t * 1e6)
    if nbytes_ is not None:
        row["GB/s"] = nbytes_ / t / 1e9
        row["%copy"] = 100 * nbytes_ / t / COPY
    if flops is not None:
        row["TFLOP/s"] = flops / t / 1e12
    row.update(ratios)
    ROWS.append(row)
    extra = " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                     if k not in ("section", "type", "shape", "kernel"))
    print(f"{section:9s} {qtype:8s} {str(shape):22s} {kernel:14s} {extra}", flush=True)


# --- decode: dense matvec (N = 1) ---------------------------------------------------------------------------


def bench_dense_decode(qt: QT, o: int, i: int, baselines: bool = True):
    nb = o * quants.row_bytes(qt, i)
    ws = [QuantWeight(device_blocks(qt, (o, i)), qt, (o, i)) for _ in range(copies(nb))]
    x = mx.random.normal((1, i))
    n = len(ws) * 4
    t = timeit(lambda j: K.mv(ws[j % len(ws)], x, BACKEND), n)
    ratios = {}
    if baselines:
        if qt == QT.Q8_0:
            aff = [K.q8_0_affine(w) for w in ws]
            ta = timeit(lambda j: mx.quantized_matmul(x, *aff[j % len(aff)], transpose=True, group_size=32, bits=8), n)
            report("decode", qt.name, (o, i), "mlx-q8-repack", ta, nbytes(*aff[0]))
            ratios["vs_q8repack"] = ta / t
        q4 = [affine((o, i), 4, 64) for _ in range(copies(o * i // 2))]
        t4 = timeit(lambda j: mx.quantized_matmul(x, *q4[j % len(q4)], transpose=True, group_size=64, bits=4), n)
        report("decode", qt.name, (o, i), "mlx-q4", t4, nbytes(*q4[0]))
        q8 = [affine((o, i), 8, 32) for _ in range(copies(o * i))]
        t8 = timeit(lambda j: mx.quantized_matmul(x, *q8[j % len(q8)], transpose=True, group_size=32, bits=8), n)
        report("decode", qt.name, (o, i), "mlx-q8", t8, nbytes(*q8[0]))
        bf = [mx.random.normal((o, i)).astype(mx.bfloat16) for _ in range(copies(o * i * 2))]
        xb = x.astype(mx.bfloat16)
        tb = timeit(lambda j: xb @ bf[j % len(bf)].T, n)
        report("decode", qt.name, (o, i), "bf16", tb, o * i * 2)
        ratios.update(vs_q4=t4 / t, vs_q8=t8 / t, vs_bf16=tb / t)
        del q4, q8, bf
    report("decode", qt.name, (o, i), "ds4 mv", t, nb, **ratios)


# --- decode: 6-expert gathered matvec (N tokens × 6 slots, fresh random ids each call) ----------------------


def bench_gather_decode(qt: QT, E: int, o: int, i: int, n_tok: int = 1, k: int = 6, baselines: bool = True):
    w = QuantWeight(device_blocks(qt, (E, o, i)), qt, (E, o, i))
    rb = quants.row_bytes(qt, i)
    rng = np.random.default_rng(0)
    n = 64
    id_sets = [np.stack([rng.choice(E, k, replace=False) for _ in range(n_tok)]).astype(np.int32) for _ in range(n)]
    ids = [mx.array(s) for s in id_sets]
    flat = [a.reshape(-1) for a in ids]
    mean_experts = np.mean([len(np.unique(s)) for s in id_sets])
    x = mx.random.normal((n_tok, i))
    t = timeit(lambda j: K.mv(w, x, BACKEND, ids=flat[j], k_slots=k), n)
    nb = mean_experts * o * rb
    ratios = {}
    if baselines:
        q4 = affine((E, o, i), 4, 64)
        xe = x[:, None, None, :]
        t4 = timeit(lambda j: mx.gather_qmm(xe, *q4, rhs_indices=ids[j], transpose=True, group_size=64, bits=4), n)
        report("gather-mv", qt.name, (n_tok, k, o, i), "mlx-q4", t4, mean_experts * o * i * (0.5 + 4 / 64))
        del q4
        q8 = affine((E, o, i), 8, 32)
        t8 = timeit(lambda j: mx.gather_qmm(xe, *q8, rhs_indices=ids[j], transpose=True, group_size=32, bits=8), n)
        report("gather-mv", qt.name, (n_tok, k, o, i), "mlx-q8", t8, mean_experts * o * i * (1 + 4 / 32))
        del q8
        bf = mx.random.normal((E, o, i)).astype(mx.bfloat16)
        xb = xe.astype(mx.bfloat16)
        tb = safe(lambda: timeit(lambda j: mx.gather_mm(xb, bf.swapaxes(-1, -2), rhs_indices=ids[j]), n))
        report("gather-mv", qt.name, (n_tok, k, o, i), "bf16", tb, mean_experts * o * i * 2)
        del bf
        ratios.update(vs_q4=t4 / t, vs_q8=t8 / t, vs_bf16=tb / t)
    report("gather-mv", qt.name, (n_tok, k, o, i), "ds4 mv_id", t, nb, **ratios)


def bench_moe_epilogues(E: int = 256, F: int = 2048, D: int = 4096, k: int = 6, clamp: float = 10.0):
    """The MoE decode sublayer's products, one token, as the model ran them before the matvec epilogues (the
    plain launches plus MLX's swiglu / sum / add) and with them (fused.expert_swiglu / expert_down_sum).
    Calls are queued back to back, so each time is the larger of the host's encode and the GPU's run."""
    from ds4_mlx.model import fused
    from ds4_mlx.model.ops import swiglu

    gate, up = (QuantWeight(device_blocks(QT.IQ2_XXS, (E, F, D)), QT.IQ2_XXS, (E, F, D)) for _ in range(2))
    down = QuantWeight(device_blocks(QT.Q2_K, (E, D, F)), QT.Q2_K, (E, D, F))
    sg, su = (QuantWeight(device_blocks(QT.Q8_0, (F, D)), QT.Q8_0, (F, D)) for _ in range(2))
    sgu = QuantWeight.stack_rows([sg, su])
    rng, n = np.random.default_rng(0), 64
    ids = [mx.array(rng.choice(E, k, replace=False)[None].astype(np.int32)) for _ in range(n)]
    x, rw = mx.random.normal((1, D)), mx.random.uniform(shape=(1, k))
    mid, add = mx.random.normal((1, k, F)) * 0.1, mx.random.normal((1, D))
    mx.eval(x, rw, mid, add)
    rows = [
        ("routed gate+up+swiglu", 3, 1,
         lambda j: swiglu(K.mv(gate, x, BACKEND, ids=ids[j].reshape(-1), k_slots=k),
                          K.mv(up, x, BACKEND, ids=ids[j].reshape(-1), k_slots=k), clamp) * rw.reshape(k, 1),
         lambda j: fused.expert_swiglu(gate, up, x, clamp, ids[j], rw, backend=BACKEND)),
        ("routed down+sum+add", 3, 1,
         lambda j: K.mv(down, mid.reshape(k, F), BACKEND, ids=ids[j].reshape(-1), k_slots=k).sum(axis=0) + add,
         lambda j: fused.expert_down_sum(down, mid, ids[j], add, backend=BACKEND)),
        ("shared gate+up+swiglu", 2, 1,
         lambda j: (lambda gu: swiglu(gu[:, :F], gu[:, F:], clamp))(K.mv(sgu, x, BACKEND)),
         lambda j: fused.expert_swiglu(sg, su, x, clamp, backend=BACKEND)),
    ]
    for name, ops_old, ops_new, old, new in rows:
        t_old, t_new = timeit(old, n), timeit(new, n)
        report("moe-epi", "q2", (1, k, F, D), name, t_new, ops=f"{ops_old}->{ops_new}", us_before=t_old * 1e6,
               speedup=t_old / t_new)


# --- prefill: a dense product of 512 tokens (the weight decoded, then MLX's matmul) --------------------------


def bf16_rate(M: int, o: int, i: int) -> float:
    a = mx.random.normal((M, i)).astype(mx.bfloat16)
    bs = [mx.random.normal((o, i)).astype(mx.bfloat16) for _ in range(copies(o * i * 2))]
    t = timeit(lambda j: a @ bs[j % len(bs)].T, 2 * len(bs))
    return 2 * M * o * i / t


def bench_dense_prefill(qt: QT, o: int, i: int, M: int):
    nb = o * quants.row_bytes(qt, i)
    ws = [QuantWeight(device_blocks(qt, (o, i)), qt, (o, i)) for _ in range(copies(nb))]
    x = mx.random.normal((M, i))
    n = 2 * len(ws)
    t = timeit(lambda j: K.dense_matmul(ws[j % len(ws)], x, BACKEND), n)
    fl = 2 * M * o * i
    rate_bf16 = bf16_rate(M, o, i)
    q4 = [affine((o, i), 4, 64) for _ in range(copies(o * i // 2))]
    t4 = timeit(lambda j: mx.quantized_matmul(x, *q4[j % len(q4)], transpose=True, group_size=64, bits=4), n)
    report("prefill", qt.name, (M, o, i), "mlx-q4", t4, flops=fl)
    ratios = dict(vs_q4=t4 / t)
    if qt == QT.Q8_0:
        aff = [K.q8_0_affine(w) for w in ws]
        ta = timeit(lambda j: mx.quantized_matmul(x, *aff[j % len(aff)], transpose=True, group_size=32, bits=8), n)
        report("prefill", qt.name, (M, o, i), "mlx-q8-repack", ta, flops=fl, pct_bf16=100 * fl / ta / rate_bf16)
        ratios["vs_q8repack"] = ta / t
    report("prefill", qt.name, (M, o, i), "ds4 mm", t, flops=fl, pct_bf16=100 * fl / t / rate_bf16,
           bf16_TFLOPs=rate_bf16 / 1e12, **ratios)


def main():
    global COPY
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--decode-only", action="store_true")
    ap.add_argument("--moe-only", action="store_true", help="only the MoE matvec epilogues against their op chains")
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script: tiny shapes, fallback kernels")
    args = ap.parse_args()
    global BACKEND
    if args.smoke:
        _smoke_setup()
    else:
        from ds4_mlx.backend import kernel_backend

        BACKEND = kernel_backend()
        if BACKEND == "fallback":
            sys.exit("no GPU kernel backend here (use --smoke for a CPU check of the script)")
    print(f"mlx {mx.__version__} device {mx.default_device()} kernels {K.source_digest()}", flush=True)
    COPY = copy_rate()
    print(f"copy rate (read+write) {COPY / 1e12:.3f} TB/s", flush=True)
    ROWS.append(dict(section="copy", kernel="a + 1 (2 GiB u32)", **{"TB/s": COPY / 1e12}))

    if args.moe_only:
        bench_moe_epilogues()
        if args.json:
            Path(args.json).write_text(json.dumps(dict(copy_TBps=COPY / 1e12, rows=ROWS), indent=1, default=str))
        return
    # Decode, dense: the Q8_0 projections, the LM head, and each expert type over a whole expert tensor.
    q8_shapes = [(1024, 4096), (32768, 1024), (2048, 4096), (4096, 8192), (129280, 4096)]
    if args.quick:
        q8_shapes = [(2048, 4096), (129280, 4096)]
    for o, i in q8_shapes:
        bench_dense_decode(QT.Q8_0, o, i)
    bench_dense_decode(QT.IQ2_XXS, 256 * 2048, 4096)
    bench_dense_decode(QT.Q2_K, 256 * 4096, 2048)
    bench_dense_decode(QT.Q4_K, 256 * 2048, 4096, baselines=not args.quick)
    bench_dense_decode(QT.F16, 8192, 1024, baselines=False)

    # Decode, 6 routed experts of 256 per token.
    bench_gather_decode(QT.IQ2_XXS, 256, 2048, 4096)
    bench_gather_decode(QT.Q2_K, 256, 4096, 2048)
    bench_gather_decode(QT.Q4_K, 256, 2048, 4096, baselines=not args.quick)
    bench_gather_decode(QT.IQ2_XXS, 256, 2048, 4096, n_tok=4, baselines=False)

    if args.decode_only:
        if args.json:
            Path(args.json).write_text(json.dumps(dict(copy_TBps=COPY / 1e12, rows=ROWS), indent=1, default=str))
        return
    # Dense prefill, 512 tokens (the routed experts' prefill launches: benchmarks/moe_prefill.py).
    for qt in (QT.Q8_0, QT.IQ2_XXS, QT.Q2_K, QT.Q4_K):
        bench_dense_prefill(qt, 2048, 4096, 512)

    if args.json:
        Path(args.json).write_text(json.dumps(dict(copy_TBps=COPY / 1e12, rows=ROWS), indent=1, default=str))


COPY = float("nan")


def _smoke_setup():
    """Shrink every shape and route the kernel calls to the fallback, so the script itself runs on a CPU."""
    global L2_ROTATE_BYTES
    L2_ROTATE_BYTES = 1
    K.mv = lambda w, x, b, ids=None, k_slots=1: (
        w._fallback_matmul(x) if ids is None else
        w._fallback_gather_matmul(x, ids.reshape(-1, k_slots)).reshape(-1, w.shape[-2]))
    K.dense_matmul = lambda w, x, b: w._fallback_matmul(x)
    shrink = {4096: 256, 2048: 256, 1024: 256, 8192: 512, 32768: 64, 129280: 96, 256 * 2048: 64, 256 * 4096: 64,
              256: 8, 512: 12}
    for name in ("bench_dense_decode", "bench_gather_decode", "bench_dense_prefill"):
        f = globals()[name]
        globals()[name] = (lambda f: lambda qt, *a, **kw: f(qt, *[shrink.get(v, v) for v in a], **kw))(f)
    globals()["copy_rate"] = lambda: 1e9

if __name__ == "__main__":
    main()
