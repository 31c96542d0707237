"""Scratch: does thread placement explain the host's round-to-round noise? One narrow model; rounds alternate
CPU masks of the calling thread (the StepEncoder thread, made per decode_tokens call, inherits it)."""
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
from host_ab import version, run, narrow_config
import numpy as np
cfg = narrow_config(43)
v = version("ds4_mlx", cfg, int(sys.argv[2]) if len(sys.argv) > 2 else 512)
ALL = set(range(os.cpu_count()))
modes = {"all": ALL, "two": {2, 3}, "four": {2, 3, 4, 5}, "one": {2}}
res = {m: [] for m in modes}
t0 = time.perf_counter()
rnd = 0
while time.perf_counter() - t0 < float(sys.argv[1]):
    order = list(modes) if rnd % 2 == 0 else list(modes)[::-1]
    for m in order:
        os.sched_setaffinity(0, modes[m])
        res[m].append(round(run(v, 48), 3))
    os.sched_setaffinity(0, ALL)
    print(rnd, {m: res[m][-1] for m in modes}, flush=True)
    rnd += 1
for m, xs in res.items():
    print(m, "mean %.2f median %.2f min %.2f max %.2f sd %.2f" % (np.mean(xs), np.median(xs), min(xs), max(xs), np.std(xs)))
Path(os.environ["OUT"], "s25_affinity.json").write_text(json.dumps(res))
