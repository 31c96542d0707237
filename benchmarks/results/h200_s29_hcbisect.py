"""Scratch (twenty-ninth session): where hc_mix_pre's tail spends its time, variants of hc_pre.body cut short
(under ncu). Written for the first version of h200_s29_hc_mix_pre.patch, whose hc_pre.body ran the gates before the
collapse; the saved patch reorders them, so its cut markers need updating before it runs again."""
import sys, time
from dataclasses import replace
import numpy as np, mlx.core as mx
sys.path.insert(0, "tests")
from ds4_mlx.kernels import fused
from test_fused_kernels import HCfg, hc_inputs, hc_post_inputs
K = sys.modules["ds4_mlx.kernels"]

raw = (K.SOURCE_DIR / "hc_pre.body").read_text()
cuts = {
    "full": raw,
    "sums": raw.replace("// 3-7. Gates and Sinkhorn", "return;\n// 3-7. Gates and Sinkhorn", 1),
    "gates": raw.replace("if (!collapse) return;", "return;", 1),
    "nonorm": raw.replace("  if (NORM) {\n    ss = DS_SIMD_SUM(ss);", "  if (false) {\n    ss = DS_SIMD_SUM(ss);", 1),
}
assert all(v != raw for k, v in cuts.items() if k != "full")
cfg, E = HCfg(), 4096
S, fn, scale, base = hc_inputs(1, E, seed=1)
y, post, comb = hc_post_inputs(1, E, seed=2)
nw = mx.array(np.random.default_rng(3).uniform(0.5, 1.5, E).astype(np.float32))
orig_read = fused._read
for i, (name, text) in enumerate(cuts.items()):
    fused._read = lambda n, t=text: K.minify(t) if n == "hc_pre.body" else orig_read(n)
    fused.SPECS[f"hc_mix_pre_xq"] = replace(fused.SPECS["hc_mix_pre_xq"])
    fused.get_fused_kernel.cache_clear()
    # a distinct kernel name per variant, so MLX does not serve the first build
    K_build = K.build
    fused.build = lambda name_, *a, v=name: K_build(name_ + "_" + v, *a)
    for merge in (True, False):
        s = S
        for _ in range(4):
            got = fused.hc_post_pre(s, y, post, comb, fn, scale, base, cfg, norm=nw, quantize=True, cols=True, merge=merge)
            mx.eval(getattr(got[1], "a", got[1]))
    print("ran", name, flush=True)
