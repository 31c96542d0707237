"""Micro-benchmark of the fused HC / compressor kernels against the pure-MLX graph code (same run, same GPU).

    python benchmarks/fused_kernels.py [--json PATH]

Real V4 shapes: E=4096, n_hc=4, head_dim 512; HC pre/post at T=1 (decode) and T=512 (prefill chunk);
compressor window pool at decode (ratio 4 frontier, ratio 128). Each timing is the mean wall time of one call
plus ``mx.eval`` (what an eager decode step pays), after warm-up.
"""

from __future__ import annotations

import json
import math
import sys
import time

import mlx.core as mx
import numpy as np
from gguf import GGMLQuantizationType as QT

from ds4_mlx.backend import kernel_backend
from ds4_mlx.weights import QuantWeight, _kernels

_kernels()
from ds4_mlx.model import fused  # noqa: E402
from ds4_mlx.model import hyper  # noqa: E402
from ds4_mlx.model.rope import Rope  # noqa: E402


class Cfg:
    n_hc, rms_eps, hc_eps, n_sinkhorn_iter = 4, 1e-6, 1e-6, 20


def bench(f, iters: int) -> float:
    for _ in range(5):
        mx.eval(f())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        mx.eval(f())
    mx.synchronize()
    return (time.perf_counter() - t0) / iters * 1e6  # µs


def main():
    b = kernel_backend()
    out = {"backend": b, "results": []}
    if b == "fallback":
        print("no GPU backend: nothing to benchmark")
        return
    rng = np.random.default_rng(0)
    E, n = 4096, 4
    mix = 2 * n + n * n
    fn = QuantWeight.from_numpy((rng.standard_normal((mix, n * E)) / math.sqrt(n * E)).astype(np.float16), QT.F16,
                                (mix, n * E))
    scale = mx.array(rng.uniform(0.5, 2, 3).astype(np.float32))
    base = mx.array(rng.standard_normal(mix).astype(np.float32))

    def rec(name, us_fused, us_mlx, **kw):
        r = dict(name=name, fused_us=round(us_fused, 2), mlx_us=round(us_mlx, 2), speedup=round(us_mlx / us_fused, 2), **kw)
        out["results"].append(r)
        print(json.dumps(r), flush=True)

    for T in (1, 512):
        iters = 300 if T == 1 else 100
        S = mx.array(rng.standard_normal((T, n, E)).astype(np.float32))
        mx.eval(S)
        t_mlx = bench(lambda: hyper.hc_pre(S, fn, scale, base, Cfg), iters)
        rec(f"hc_pre T={T}", bench(lambda: fused.hc_pre(S, fn, scale, base, Cfg), iters), t_mlx)
        if T > 1:
            for tpb in _kernels().fused.HC_PRE_TPB_CHOICES:
                rec(f"hc_pre T={T} tpb={tpb}", bench(lambda: fused.hc_pre(S, fn, scale, base, Cfg, tpb=tpb), iters), t_mlx)
        x, post, comb = hyper.hc_pre(S, fn, scale, base, Cfg)
        y = mx.array(rng.standard_normal((T, E)).astype(np.float32))
        mx.eval(x, post, comb, y)
        rec(f"hc_post T={T}", bench(lambda: fused.hc_post(S, y, post, comb), iters),
            bench(lambda: hyper.hc_post(S, y, post, comb), iters))
        # the pair, as one sublayer's HC overhead (the sublayer itself left out)
        rec(f"hc_pre+hc_post T={T}",
            bench(lambda: fused.hc_post(S, y, *fused.hc_pre(S, fn, scale, base, Cfg)[1:]), iters),
            bench(lambda: hyper.hc_post(S, y, *hyper.hc_pre(S, fn, scale, base, Cfg)[1:]), iters))

    rope = Rope(n_rot=64, base=160000.0, freq_scale=1 / 16, yarn=True, corr_low=15.0, corr_high=25.0)
    hd = 512
    norm = mx.array(rng.uniform(0.5, 1.5, hd).astype(np.float32))
    for ratio, lanes in ((4, 2), (128, 1)):
        shape = (1, lanes * ratio, lanes * hd)
        kv = mx.array(rng.standard_normal(shape).astype(np.float32))
        sc = mx.array(rng.standard_normal(shape).astype(np.float32))
        C, Sn = rope.tables([1024], hd)
        mx.eval(kv, sc, C, Sn)
        rec(f"compressor_pool decode ratio={ratio}",
            bench(lambda: fused.compressor_pool(kv, sc, norm, C, Sn, 1e-6, lanes=lanes), 300),
            bench(lambda: fused.compressor_pool(kv, sc, norm, C, Sn, 1e-6, lanes=lanes, backend="fallback"), 300))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
