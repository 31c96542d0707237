"""Scratch (twenty-ninth session): device time of one decode HC post+pre, two launches vs one. Needs
h200_s29_hc_mix_pre.patch applied; run from the repo root: python3 benchmarks/results/h200_s29_hcbench.py N.
(Its recorded runs also timed a count made by the GPU and a launch without HC pre's text, and passed a count made
from host data; it now times the patch's own counts, made in device memory.)"""
import sys, time
import numpy as np, mlx.core as mx
sys.path.insert(0, "tests")
from ds4_mlx.kernels import fused
from test_fused_kernels import HCfg, hc_inputs, hc_post_inputs

cfg, E = HCfg(), 4096
S, fn, scale, base = hc_inputs(1, E, seed=1)
y, post, comb = hc_post_inputs(1, E, seed=2)
nw = mx.array(np.random.default_rng(3).uniform(0.5, 1.5, E).astype(np.float32))
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
for name, merge in (("two", False), ("one", True)):
    s = S
    mx.synchronize()
    t = time.perf_counter()
    for i in range(n):
        got = fused.hc_post_pre(s, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=True, cols=True, merge=merge)
        s = got[0]
    mx.eval(s.a if hasattr(s, "a") else s)
    mx.synchronize()
    print(f"{name:10s} {(time.perf_counter() - t) / n * 1e6:8.1f} us per HC post+pre (chained, {n})", flush=True)
