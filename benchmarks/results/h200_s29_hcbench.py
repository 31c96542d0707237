"""Scratch (twenty-ninth session): device time of one decode HC post+pre, two launches vs one. Needs
h200_s29_hc_mix_pre.patch applied; run from the repo root: python3 benchmarks/results/h200_s29_hcbench.py N."""
import sys, time
import numpy as np, mlx.core as mx
sys.path.insert(0, "tests")
from ds4_mlx.kernels import fused
from test_fused_kernels import HCfg, hc_inputs, hc_post_inputs

cfg, E = HCfg(), 4096
S, fn, scale, base = hc_inputs(1, E, seed=1)
y, post, comb = hc_post_inputs(1, E, seed=2)
nw = mx.array(np.random.default_rng(3).uniform(0.5, 1.5, E).astype(np.float32))
host_counter = mx.array(np.zeros(8, dtype=np.int32))
gpu_counter = mx.zeros((64,), dtype=mx.int32) + 0
mx.eval(host_counter, gpu_counter)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 200
from dataclasses import replace
full = fused.SPECS["hc_mix_pre_xq"]
for name, merge, counter in (("two", False, None), ("one", True, host_counter)):
    fused.SPECS["hc_mix_pre_xq"] = replace(full, then="") if name == "notail" else full
    fused.get_fused_kernel.cache_clear()
    if counter is not None:
        fused._hc_counter = lambda fn, c=counter: c
    s = S
    outs = []
    mx.synchronize()
    t = time.perf_counter()
    for i in range(n):
        got = fused.hc_post_pre(s, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=True, cols=True, merge=merge)
        s = got[0]
    mx.eval(s.a if hasattr(s, "a") else s)
    mx.synchronize()
    print(f"{name:10s} {(time.perf_counter() - t) / n * 1e6:8.1f} us per HC post+pre (chained, {n})", flush=True)
