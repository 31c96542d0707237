"""Scratch (thirtieth session): the indexer's decode top-k launch (fused.top_k_rows, K = 512) at n = 525, 700, 850
and 2000 visible rows of random scores, five launches each, for Nsight Compute:

    ncu --clock-control none --kernel-name regex:topk --metrics gpu__time_duration.sum --csv \\
        python3 benchmarks/results/h200_s30_topkbench.py

Run from the repo root with and without h200_s30_next_topk_early_exit.patch (or with PYTHONPATH at another tree)."""
import sys

import mlx.core as mx
import numpy as np

from ds4_mlx.kernels import fused

print(fused.__file__, file=sys.stderr)
rng = np.random.default_rng(0)
for n in (525, 700, 850, 2000):
    s = mx.array((rng.standard_normal((1, 4096)) * 3).astype(np.float32))
    counts = fused.kernel_counts(n, 512)
    for _ in range(5):
        mx.eval(fused.top_k_rows(s, counts, 512))
