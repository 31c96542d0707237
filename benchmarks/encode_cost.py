"""What MLX-CUDA's host encode of one custom-kernel launch costs, by the launch's form (H200 or any CUDA GPU).

    python benchmarks/encode_cost.py [--reps 400]

Each row chains ``--reps`` launches of a trivial 256-element kernel (each reads the previous output) and
times, per launch (launch_cost.py's ``chain_cost``): building the graph (Python), ``mx.async_eval`` (MLX
encoding the ops into CUDA graphs: the host's share of a decode step) and the whole evaluation. Rows vary one thing:
the number of inputs, of outputs, template arguments against the same constants in the source, a view
after the launch, 12 KB of header text, and a real ds4 matvec launch (Q8_0 1024x1024) as the model makes it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gguf import GGMLQuantizationType as QT  # noqa: E402

from ds4_mlx.random_model import random_block_bytes  # noqa: E402
from ds4_mlx.weights import QuantWeight, kernel_backend  # noqa: E402
from launch_cost import chain_cost  # noqa: E402

SRC = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < 256) y[i] = x[i] * 1.0001f;"
LAUNCH = dict(grid=(256, 1, 1), threadgroup=(256, 1, 1))


def kernel(n_in: int = 1, n_out: int = 1, source: str = SRC, header: str = "", name: str = "k"):
    return mx.fast.cuda_kernel(name=f"{name}_{n_in}_{n_out}", input_names=["x"] + [f"d{i}" for i in range(n_in - 1)],
                               output_names=["y"] + [f"z{i}" for i in range(n_out - 1)], source=source, header=header)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=400)
    args = ap.parse_args(argv)
    if kernel_backend() != "cuda":
        raise SystemExit("encode_cost.py measures MLX-CUDA's encode: run it where MLX has a CUDA GPU")
    dummies = [mx.zeros((8,), mx.float32) for _ in range(8)]
    x0 = mx.random.normal((256,))
    mx.eval(dummies, x0)
    out1 = dict(output_shapes=[(256,)], output_dtypes=[mx.float32], **LAUNCH)
    rows = {}
    for n in (1, 3, 6):
        k = kernel(n)
        rows[f"kernel, {n} inputs"] = lambda x, k=k, n=n: k(inputs=[x] + dummies[: n - 1], **out1)[0]
    k3 = kernel(1, 3)
    rows["kernel, 3 outputs (2 unused)"] = lambda x: k3(inputs=[x], output_shapes=[(256,)] * 3,
                                                        output_dtypes=[mx.float32] * 3, **LAUNCH)[0]
    k = kernel()
    consts = [("A", 1), ("B", 2), ("C", 3), ("D", True), ("E", 5), ("F", 0)]
    rows["kernel, 6 template args"] = lambda x: k(inputs=[x], template=consts, **out1)[0]
    kc = kernel(source="".join(f"constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {str(v).lower()};"
                               for n, v in consts) + "\n" + SRC, name="kconst")
    rows["kernel, the 6 constants in its source"] = lambda x: kc(inputs=[x], **out1)[0]
    rows["kernel + a reshape"] = lambda x: k(inputs=[x], output_shapes=[(16, 16)], output_dtypes=[mx.float32],
                                             **LAUNCH)[0].reshape(256)
    rows["kernel + a slice"] = lambda x: k(inputs=[x], output_shapes=[(512,)], output_dtypes=[mx.float32],
                                           **LAUNCH)[0][:256]
    kb = kernel(header="// " + "x" * 12000 + "\n", name="kbig")
    rows["kernel, 12 KB header"] = lambda x: kb(inputs=[x], **out1)[0]
    rows["mx multiply"] = lambda x: x * 1.0001
    res = {name: chain_cost(step, x0, args.reps) for name, step in rows.items()}
    qw = QuantWeight(random_block_bytes(QT.Q8_0, (1024, 1024), 0.02), QT.Q8_0, (1024, 1024))
    xq = mx.random.normal((1, 1024))
    mx.eval(qw.data, xq)
    res["ds4 matvec, Q8_0 1024x1024"] = chain_cost(qw.matmul, xq, args.reps)
    for name, (b, e, t) in res.items():
        print(f"{name:40s} build {b:6.2f} us  encode {e:6.2f} us  encode+run {t:6.2f} us per launch")
    return res


if __name__ == "__main__":
    main()
