"""What one launch of each kind of op costs on this device, host and device side (GPU).

    python benchmarks/launch_cost.py [--reps 300] [--json out.json]

Each row builds a chain of ``--reps`` dependent ops of one kind (each op reads the previous op's output),
then evaluates it once. Reported per op: the Python/graph building time, the encode time (``mx.async_eval``:
MLX turning the ops into launches, the host's share) and the evaluation time (what the device queue costs:
encoding + launch + the kernel). A decode step is such a chain of ~3500 ops, so these
numbers say which ops dominate it. Rows: an elementwise multiply (alone, and with three reshapes: what a view costs), ``mx.fast.rms_norm``, a trivial custom
kernel (a copy), the quant matvec kernel on a 4096x4096 Q8_0 weight (L2-resident: launch cost, not
bandwidth), attention-sized matmuls, ``mx.topk`` / ``mx.argpartition`` over 2048 scores, a gather.
Each row's name ends with its ops per chain step.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from ds4_mlx.random_model import random_block_bytes  # noqa: E402
from ds4_mlx.weights import QuantWeight, kernel_backend  # noqa: E402


def chain_cost(step, x0: mx.array, reps: int) -> tuple[float, float, float]:
    """(build, encode, eval) µs per op of ``reps`` chained ``step`` calls, best of 3 after a warm-up: building
    the graph (Python), ``mx.async_eval`` (MLX encoding the ops: the host's share) and the whole evaluation."""
    best = (float("inf"),) * 3
    for i in range(4):
        t0 = time.perf_counter()
        x = x0
        for _ in range(reps):
            x = step(x)
        t1 = time.perf_counter()
        mx.async_eval(x)
        t2 = time.perf_counter()
        mx.eval(x)
        t3 = time.perf_counter()
        if i:  # the first run compiles kernels
            best = min(best, tuple((b - a) / reps * 1e6 for a, b in ((t0, t1), (t1, t2), (t1, t3))),
                       key=lambda t: t[0] + t[2])  # fmt: skip
    return best


def copy_kernel(backend: str):
    """A trivial custom kernel: ``out[i] = x[i]`` (the launch floor of a custom kernel)."""
    if backend == "cuda":
        return mx.fast.cuda_kernel(
            name="ds4_copy", input_names=["x"], output_names=["out"],
            source="unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0]) out[i] = x[i];",
        )  # fmt: skip
    return mx.fast.metal_kernel(
        name="ds4_copy", input_names=["x"], output_names=["out"],
        source="uint i = thread_position_in_grid.x; if (i < x_shape[0]) out[i] = x[i];",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    backend = kernel_backend()
    E = 4096
    v = mx.random.normal((1, E))
    w = mx.random.normal((E,))
    q = mx.random.normal((64, 512))
    keys = mx.random.normal((128, 512))
    scores = mx.random.normal((1, 2048))
    table = mx.random.normal((2048, 512))
    table16 = table.astype(mx.float16)
    embd = mx.random.normal((129280, E)).astype(mx.float16)
    mx.eval(v, w, q, keys, scores, table, table16, embd)

    rows = {  # name (ops per chain step) -> (step, input)
        "elementwise multiply [4096] (1)": (lambda x: x * 1.0001, v),
        "elementwise multiply + 3 reshapes (1 + 3 views)": (
            lambda x: (x * 1.0001).reshape(64, 64).reshape(4096).reshape(1, E), v),
        "rms_norm [4096] (1)": (lambda x: mx.fast.rms_norm(x, w, 1e-6), v),
        "2 matmuls [64,512]x[512,128]x[128,512] + scale (3)": (lambda x: ((x @ keys.T) @ keys) * 1e-3, q),
        "softmax [64, 129] + add (2)": (lambda x: mx.softmax(x, axis=-1) + x, mx.random.normal((64, 129))),
        "topk 512 of [1, 2048] + min + add (3)": (lambda x: x + mx.topk(x, 512, axis=-1).min(), scores),
        "argpartition [1, 2048] + add (2)": (lambda x: x + mx.argpartition(x, 511, axis=-1)[:, :1], scores),
        "gather 512 of 2048 rows + sum + add (3)": (lambda x: x + table[(x[0, :512] > 0).astype(mx.int32)].sum(), scores),
        "f16 rows[idx [1,512]] of [2048, 512] + sum + add (3)": (
            lambda x: x + table16[(x[:, :512] > 0).astype(mx.int32)].sum(), scores),
        "f16 take(rows, idx [512]) of [2048, 512] + sum + add (3)": (
            lambda x: x + mx.take(table16, (x[0, :512] > 0).astype(mx.int32), axis=0).sum(), scores),
        "f16 embedding row of [129280, 4096] + sum + add (3)": (
            lambda x: x + embd[(x[:, :1] > 0).astype(mx.int32)].sum(), scores),
        "f16 embedding row, dynamic slice + sum + add (3)": (
            lambda x: x + mx.slice(embd, (x[0, :1] > 0).astype(mx.int32), (0,), (1, E)).sum(), scores),
    }
    if backend != "fallback":
        kern = copy_kernel(backend)
        rows["custom kernel: copy [4096] (1)"] = (
            lambda x: kern(inputs=[x.reshape(-1)], grid=(E, 1, 1), threadgroup=(256, 1, 1),
                           output_shapes=[(E,)], output_dtypes=[mx.float32])[0].reshape(1, E), v)  # fmt: skip
        qw = QuantWeight(random_block_bytes(QT.Q8_0, (E, E), 0.02), QT.Q8_0, (E, E))
        mx.eval(qw.data)
        rows["quant matvec Q8_0 4096x4096 + scale (2)"] = (lambda x: qw.matmul(x) * 0.05, v)

    out = {"device": str(mx.default_device()), "kernels": backend, "reps": args.reps, "us_per_op": {}}
    print(f"{'op':<52}{'build us':>10}{'encode us':>10}{'eval us':>10}")
    for name, (fn, x0) in rows.items():
        b, enc, e = chain_cost(fn, x0, args.reps)
        out["us_per_op"][name] = {"build": round(b, 2), "encode": round(enc, 2), "eval": round(e, 2)}
        print(f"{name:<52}{b:>10.2f}{enc:>10.2f}{e:>10.2f}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
