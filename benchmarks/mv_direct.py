"""A candidate kernel for the routed experts' gate+up decode launch, timed against the package's (CUDA only).

    python benchmarks/mv_direct.py --check                        # on the GPU: agrees with the package's launch?
    ncu --clock-control none --kernel-name regex:ds_mv --metrics gpu__time_duration.sum --csv \
        python benchmarks/mv_direct.py labels.json > ncu.csv       # on the GPU
    python benchmarks/mv_sweep.py labels.json --summarize ncu.csv  # anywhere: median µs per (launch, config)

``mv_direct.body`` reads each thread's weight bytes straight into registers instead of staging spans in shared
memory (why: its header comment). Not used by the package: it is kept here until the H200 shows it faster.
At the V4 Flash shape (256 experts of 2048 × 4096, IQ2_XXS, 6 a token) ``--check`` compares it with the
package's launch (``kernels.mv`` with x quantized, no shared expert); a timing run launches both five times
each: ``mv xq`` at the dispatcher's config, ``direct`` at each ``(NR, TPB)`` of ``CONFIGS``.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import lru_cache
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402

from ds4_mlx import kernels as K  # noqa: E402

BODY = Path(__file__).resolve().with_name("mv_direct.body")
CONFIGS = [(2, 128), (4, 128), (4, 64), (8, 128), (2, 256), (4, 256)]


@lru_cache(maxsize=None)
def _kernel(backend: str):
    if backend not in ("cuda", "sim"):
        raise ValueError(f"mv_direct: CUDA text, no {backend!r} build")
    source = K.minify(K.CUDA_PROLOGUE) + BODY.read_text()
    return K.build("ds_mv_direct", ["w", "w2", "x", "ids", "aux", "params"], ["y"],
                   K.render_header("mv", backend, True), source, backend)  # fmt: skip


def gate_up(gate, up, xq: mx.array, ids: mx.array, route_w: mx.array, clamp: float, k_slots: int, *,
            nr: int = 4, tpb: int = 128, backend: str = "cuda") -> mx.array:  # fmt: skip
    """``silu(min(g, c)) * clamp(u, ±c) * route_w`` of each (token, expert) pair -> ``[P, out]``: IQ2_XXS
    ``gate``/``up`` ``[E, out, in]``, ``xq`` quantized x ``[T, 5·in/8]``, ``ids``/``route_w`` ``[T, k_slots]``."""
    _, n_out, n_in = gate.shape
    P = ids.size
    if tpb % 32 or n_in % 256 or xq.shape[-1] != 5 * n_in // 8 or ids.shape[-1] != k_slots:
        raise ValueError("mv_direct: TPB a multiple of 32, whole IQ2_XXS blocks, quantized x of the rows, k ids a token")
    wg, wu = K.weight_bytes(gate), K.weight_bytes(up)
    clamp_bits = int(np.array(clamp, dtype=np.float32).view(np.int32))
    return _kernel(backend)(
        inputs=[wg, wu, xq, ids.reshape(-1).astype(mx.int32), route_w.reshape(-1).astype(mx.float32),
                K._params(n_in, n_out, wg.shape[-1], k_slots, clamp_bits)],
        template=[("NR", nr), ("TPB", tpb)],
        grid=(-(-n_out // nr) * tpb, 1, P),
        threadgroup=(tpb, 1, 1),
        output_shapes=[(P, n_out)],
        output_dtypes=[mx.float32],
    )[0]  # fmt: skip


def main(labels_path: Path | None) -> None:
    from gguf import GGMLQuantizationType as QT

    from ds4_mlx.random_model import random_quant_weight

    gate, up = (random_quant_weight(QT.IQ2_XXS, (256, 2048, 4096), 0.02) for _ in range(2))
    x = mx.random.normal((1, 4096))
    xq, ids, rw = K.quantize_x(x), mx.array([[3, 17, 40, 99, 180, 250]], dtype=mx.int32), mx.random.uniform(shape=(1, 6))
    mx.eval(gate.data, up.data, xq, rw)

    def package():
        return K.mv(gate, xq, "cuda", ids=ids.reshape(-1), k_slots=6, epi=K.MV_SWIGLU, w2=up, aux=rw.reshape(-1),
                    clamp=10.0, xq=True)  # fmt: skip

    if labels_path is None:  # --check
        want = np.array(package())
        for nr, tpb in CONFIGS:
            got = np.array(gate_up(gate, up, xq, ids, rw, 10.0, 6, nr=nr, tpb=tpb))
            err = float(np.abs(got - want).max() / np.abs(want).max())
            print(f"direct ({nr}, {tpb}): max error {err:.2e} of the package's", flush=True)
            if not err <= 1e-5:
                raise SystemExit("mv_direct disagrees with the package's launch")
        return
    labels = []
    for name, c, call in [("mv xq", None, package)] + [
            ("direct", c, lambda c=c: gate_up(gate, up, xq, ids, rw, 10.0, 6, nr=c[0], tpb=c[1])) for c in CONFIGS]:
        for _ in range(5):  # 2 unmeasured + 3 measured (mv_sweep.py --summarize takes the last three)
            mx.eval(call())
        labels.append((name, c))
    labels_path.write_text(json.dumps(labels))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("labels", type=Path, nargs="?", help="where to write the launch list for mv_sweep.py --summarize")
    ap.add_argument("--check", action="store_true", help="compare with the package's launch instead of timing")
    args = ap.parse_args()
    if not args.check and args.labels is None:
        ap.error("a labels path, or --check")
    main(None if args.check else args.labels)
