"""One version, full shape, no reserve: decode across the ratio-4 growth at position 2048 (crash check)."""
import sys, time
import numpy as np
import mlx.core as mx
from ds4_mlx.random_model import shape_config, random_weights
from ds4_mlx.model.model import Model
from ds4_mlx.session import Session
import importlib; generate = importlib.import_module("ds4_mlx.generate"); from ds4_mlx import sampling

cfg = shape_config(sys.argv[3] if len(sys.argv) > 3 else "full", None)
t0 = time.perf_counter()
m = Model(cfg, random_weights(cfg, "q2", 0))
prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, int(sys.argv[1]) - 1).tolist()
s = Session(m, reserve=0)
s.prefill(prompt)
print(f"setup {time.perf_counter()-t0:.1f}s", flush=True)
caps = lambda: sorted({(c.ratio, c.comp.shape[0]) for c in s.caches if getattr(c, 'comp', None) is not None})
print("caps", caps(), flush=True)
sampler = sampling.Sampler(sampling.DEFAULT_PARAMS, seed=0)
t = time.perf_counter()
for i, (tok, _) in enumerate(generate.decode_tokens(s, sampler, int(sys.argv[2]), encode_thread={'0': False, '1': True}.get(__import__('os').environ.get('ENC', ''), None))):
    now = time.perf_counter()
    print(f"pos {len(prompt) + i} tok {tok} {1e3*(now-t):.1f} ms", flush=True)
    t = now
print("caps", caps(), "done", flush=True)
