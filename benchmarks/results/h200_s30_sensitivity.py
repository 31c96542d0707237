"""Scratch (thirtieth session): which side paces the pipelined decode step, by its sensitivity to each.

    python3 benchmarks/results/h200_s30_sensitivity.py [--prefill 2100] [--decode 48] [--rounds 6]

The bare threaded loop (pipeline_depth.py's ``lag2 thread``) at the full shape, onward over new positions, with
one of two knobs turned per variant:
- host +D ms: the encoder thread sleeps D ms before each step's ``mx.async_eval`` (a longer encode);
- device +D ms: the step's logits go through one more launch (one block) that copies them and then spins D ms
  on the GPU's global timer before argmax takes the copy, so the next step's chain waits D ms more. ``dev +0``
  is the same launch without the spin (the launch's own host cost, the control for the device variants).
A side that paces the step passes its D on whole; a side with slack absorbs it. Variants run in turns within each
round, so they share the host's drift.
"""
import argparse, json, sys, time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import model as bench  # noqa: E402
import pipeline_depth as pdepth  # noqa: E402
from ds4_mlx.session import Session  # noqa: E402

SPIN = mx.fast.cuda_kernel(
    name="s30_spin", input_names=["x", "p"], output_names=["y"],
    source="""
    const int n = p[1];
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i];
    if (threadIdx.x == 0 && p[0] > 0) {
      unsigned long long t0, t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < (unsigned long long)p[0]);
    }
    """)


def spun(logits: mx.array, ns: int) -> mx.array:
    p = mx.array([ns, logits.size], dtype=mx.int32)
    return SPIN(inputs=[logits, p], grid=(1024, 1, 1), threadgroup=(1024, 1, 1),
                output_shapes=[logits.shape], output_dtypes=[logits.dtype])[0]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prefill", type=int, default=2100)
    ap.add_argument("--decode", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    cfg = bench.shape_config("full", None)
    model = bench.Model(cfg, bench.random_weights(cfg, "q2"))
    prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, args.prefill - 1).tolist()
    Session(model).prefill(prompt[:512])
    sess = Session(model)
    sess.prefill(prompt)
    bench.decode_seconds(sess, bench.warm_steps(cfg), pipelined=False)
    bench.generate_seconds(sess, bench.warm_steps(cfg))
    async_eval, argmax = mx.async_eval, mx.argmax
    variants = {"base": (0, None), "host +0.5": (0.5, None), "host +1": (1, None), "host +2": (2, None),
                "dev +0": (0, 0), "dev +0.5": (0, 0.5), "dev +1": (0, 1), "dev +2": (0, 2)}
    res: dict[str, list] = {}
    try:
        for rnd in range(args.rounds):
            for name, (host_ms, dev_ms) in variants.items():
                mx.async_eval = (lambda w, d=host_ms / 1e3: (time.sleep(d), async_eval(w))[1]) if host_ms else async_eval
                mx.argmax = argmax if dev_ms is None else (lambda a, *k, ns=int(dev_ms * 1e6), **kw: argmax(spun(a, ns), *k, **kw))
                ms, wait, cpu, enc = pdepth.run(sess, None, args.decode, lag=2, thread=True)
                res.setdefault(name, []).append(round(ms, 3))
                print(f"round {rnd} {name:10s} {ms:7.2f} ms/token  encoder cpu {enc:5.2f}", flush=True)
    finally:
        mx.async_eval, mx.argmax = async_eval, argmax
    base = np.array(res["base"])
    for name, v in res.items():
        d = np.array(v) - (np.array(res["dev +0"]) if name.startswith("dev") else base)
        print(f"{name:10s} mean {np.mean(v):6.2f}  paired delta vs {'dev +0' if name.startswith('dev') else 'base'}"
              f" {d.mean():+.2f} ± {d.std(ddof=1) / np.sqrt(len(d)):.2f} ms")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
