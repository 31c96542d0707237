"""Decode ms/token and prefill tokens/s of the assembled model, next to the docs/model.md §10 bandwidth floor.

Weights are random but valid GGUF blocks in the published q2 layout (IQ2_XXS gate/up, Q2_K down, Q8_0
attention/shared/LM head, F16 HC/router/compressor/indexer), generated directly in device memory: no
file. Every tensor is its own buffer (nothing is shared between layers), so caches do not flatter the
numbers; at the full shape that is ~87 GB of weights.

    python benchmarks/model.py --shape full            # 43 layers, 4096 wide, 256 experts (H200)
    python benchmarks/model.py --shape tiny            # the docs/model.md §9 test shape (CPU ok)

Decode is timed four ways from the same state: synchronous steps, token ids read back one or two steps late
(greedy, argmax on the device), and the package's own generation loop (``generate.decode_tokens``: ds4's
default sampler on the device, two steps queued), which is what ``ds4-mlx generate`` runs.

The floor is (bytes one decoded token reads, ``layout.decode_bytes_per_token``) / (copy bandwidth
measured in the same run, bytes read + written per second). The per-component breakdown times each
component alone over all layers at the decode position (attention incl. compressor/indexer, MoE incl.
router and shared expert, the 86 HC pre/post pairs, the output head), each next to its own floor.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4_mlx.generate import DEFAULT_LAG, decode_tokens  # noqa: E402
from ds4_mlx.layout import EXPERT_VARIANTS, decode_bytes_per_token  # noqa: E402
from ds4_mlx.model.model import Model, hc_post, hc_pre  # noqa: E402  (the HC functions the model uses)
from ds4_mlx.session import Session  # noqa: E402
from ds4_mlx.random_model import random_weights, shape_config  # noqa: E402
from ds4_mlx.sampling import DEFAULT_PARAMS, Sampler  # noqa: E402
from ds4_mlx.backend import kernel_backend  # noqa: E402

def tensor_bytes(weights: dict) -> dict[str, int]:
    return {k: int(v.nbytes) for k, v in weights.items()}


# ---- timing helpers ------------------------------------------------------------------------------------


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` (which must evaluate its work) over ``reps`` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def copy_bandwidth(nbytes: int) -> float:
    """Bytes (read + written) per second of a large device copy."""
    a = mx.random.uniform(shape=(nbytes // 4,))
    mx.eval(a)
    t = timed(lambda: mx.eval(a + 1.0), 5)
    bw = 2 * a.nbytes / t
    del a
    mx.clear_cache()  # give the test buffers back before the model runs
    return bw


def component_times(model: Model, sess: Session, reps: int) -> dict[str, float]:
    """Seconds per decoded token of each component alone, over all layers, at the session's position."""
    cfg, pos = model.cfg, sess.pos
    x0 = mx.random.normal((1, cfg.n_embd))
    S0 = mx.random.normal((1, cfg.n_hc, cfg.n_embd))
    tok = mx.array([int(sess.tokens[-1])], dtype=mx.int32)
    mx.eval(x0, S0)

    def attention():
        x = x0
        for layer, c in zip(model.layers, sess.caches):
            x = x + 0.0 * layer.attn(x, pos, c.snapshot())  # chained like the real graph; state untouched
        mx.eval(x)

    def moe():
        x = x0
        for layer in model.layers:
            x = x + 0.0 * layer.ffn(x, tok)
        mx.eval(x)

    def hc():
        S = S0
        for layer in model.layers:
            for w in (layer.hc_attn, layer.hc_ffn):
                x, post, comb = hc_pre(S, *w, cfg)
                S = hc_post(S, x, post, comb)
        mx.eval(S)

    def head():
        mx.eval(model.head(S0))

    return {name: timed(f, reps) for name, f in
            [("attention", attention), ("moe", moe), ("hc", hc), ("output head", head)]}


def decode_seconds(sess: Session, n: int, pipelined: bool, lag: int = 1) -> tuple[float, dict[str, float]]:
    """Mean seconds per token of ``n`` greedy decode steps, and the host's ms per token in each part.

    Pipelined (mlx-lm style): the next step's graph is built while the device runs this one and the token
    ids are read back ``lag`` steps late, as a streaming generator would (mlx-lm: 1). Otherwise each step waits
    for its token. With ``lag=1`` the host, done encoding step k+1, waits ~2.5 ms a step on the H200 for token k;
    ``lag=2`` keeps one more step queued and removed that wait (why the device falls behind with one step queued
    is not traced).
    The parts (meaningful when pipelined): ``build`` (Python and the compiled steps' trace replay), ``encode``
    (inside ``mx.async_eval``, where MLX turns every op into launches) and ``wait`` (for the previous token).
    A wait near zero means the device idles on the host, not the other way round.
    """
    spent = {"build": 0.0, "encode": 0.0, "wait": 0.0}
    queue_work = sess.queue_work

    def timed(work):
        t = time.perf_counter()
        queue_work(work)
        spent["encode"] += time.perf_counter() - t

    sess.queue_work = timed  # how Session.step queues a pipelined step
    try:
        lazy = mx.argmax(sess.logits)
        t0 = time.perf_counter()
        toks = [lazy]  # lazy token ids; toks[-1] feeds the next step
        for _ in range(n):
            t = time.perf_counter()
            toks.append(mx.argmax(sess.step(toks[-1] if pipelined else int(toks[-1].item()))))
            spent["build"] += time.perf_counter() - t
            if pipelined and len(toks) > lag:
                t = time.perf_counter()
                toks[-1 - lag].item()
                spent["wait"] += time.perf_counter() - t
        toks[-1].item()
        total = time.perf_counter() - t0
    finally:
        sess.queue_work = queue_work
    spent["build"] -= spent["encode"]
    return total / n, {k: v / n * 1e3 for k, v in spent.items()}


def warm_steps(cfg) -> int:
    """Steps that run every kind of decode step once: one past the longest compress ratio's window."""
    return max(cfg.compress_ratios) + 1


def generate_seconds(sess: Session, n: int) -> float:
    """Mean seconds per token of ``n`` decode steps through the package's own generation loop
    (``generate.decode_tokens``: ds4's default sampler on the device, ``DEFAULT_LAG`` steps queued, the steps
    queued past the end rewound), from the session's state, which goes on by ``n`` tokens."""
    t0 = time.perf_counter()
    for _ in decode_tokens(sess, Sampler(DEFAULT_PARAMS, seed=0), n + 1):  # n + 1 ids, n steps
        pass
    return (time.perf_counter() - t0) / n


def graph_build_seconds(model: Model, sess: Session, reps: int) -> float:
    """Median Python time to build one decode step's graph (no evaluation), on copies of the state."""
    tok, ctx, builds = int(sess.tokens[-1]), sess.pos, []
    for _ in range(reps):
        caches = [c.snapshot() for c in sess.caches]
        t0 = time.perf_counter()
        logits = model([tok], ctx, caches)
        builds.append(time.perf_counter() - t0)
        mx.eval(logits)
    return float(np.median(builds))


# floor components (layout.decode_bytes_per_token labels) grouped like the timed components
FLOOR_GROUPS = {
    "attention": ("attention projections", "attention compressors", "indexer q_b + proj", "indexer compressors",
                  "kv cache"),
    "moe": ("routed experts", "shared experts", "router"),
    "hc": ("hc, norms, embedding row",),
    "output head": ("lm head",),
}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("full", "tiny"), default="full")
    ap.add_argument("--experts", choices=tuple(EXPERT_VARIANTS), default="q2")
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens (default 1024 full / 64 tiny)")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk size")
    ap.add_argument("--decode", type=int, default=None,
                    help="decoded tokens timed, synchronous and again pipelined (default 32 full / 8 tiny)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each component timing")
    ap.add_argument("--copy-gib", type=float, default=None, help="size of the bandwidth copy test")
    ap.add_argument("--layers", type=int, default=None, help="override the layer count (quick smoke runs)")
    ap.add_argument("--numerics", default="ds4")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    ap.add_argument("--quick", action="store_true",
                    help="prefill and decode only: skip the op-by-op decode, the build timing and the components")
    args = ap.parse_args(argv)
    full = args.shape == "full"
    n_prefill = args.prefill or (1024 if full else 64)
    n_decode = args.decode or (32 if full else 8)
    copy_bytes = int((args.copy_gib or (4.0 if full else 0.25)) * 2**30)

    cfg = shape_config(args.shape, args.layers)
    print(f"device {mx.default_device()}, kernels {kernel_backend()}, shape {args.shape}, experts {args.experts}, "
          f"numerics {args.numerics}", flush=True)
    t0 = time.perf_counter()
    weights = random_weights(cfg, args.experts)
    sizes = tensor_bytes(weights)
    print(f"built {len(weights)} tensors, {sum(sizes.values()) / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s; "
          f"active {mx.get_active_memory() / 1e9:.2f} GB", flush=True)
    model = Model(cfg, weights, args.numerics)
    bw = copy_bandwidth(copy_bytes)

    rng = np.random.default_rng(0)
    prompt = [0] + rng.integers(2, cfg.n_vocab, n_prefill - 1).tolist()
    # Warm-up on a throwaway session: the first prefill JIT-compiles every kernel (NVRTC on CUDA), which
    # must not be counted as prefill time.
    Session(model, chunk_size=args.chunk).prefill(prompt[: min(len(prompt), args.chunk)])
    sess = Session(model, chunk_size=args.chunk)
    t0 = time.perf_counter()
    sess.prefill(prompt)
    t_prefill = time.perf_counter() - t0

    # Warm-up: kernel JIT, the compiled steps' traces and MLX-CUDA's CUDA graphs. Every kind of step (a
    # completing window of each compress ratio) runs at least once, both on this thread's stream and from the
    # generation loop's encoder thread (its own stream, so its own graph cache; the sampler's kernel too): each
    # kind's first step costs its graphs' instantiation (1-3 ms each). The timed steps then go on from there,
    # each over positions never decoded before, as a real generation does (positions decoded again can hit
    # CUDA graphs MLX-CUDA cached for them and run faster than a real generation).
    decode_seconds(sess, warm_steps(cfg), pipelined=False)
    generate_seconds(sess, warm_steps(cfg))
    t_decode_sync, _ = decode_seconds(sess, n_decode, pipelined=False)
    t_decode, split = decode_seconds(sess, n_decode, pipelined=True)
    ctx = sess.pos
    t_gen = generate_seconds(sess, n_decode)
    t_decode2, split2 = decode_seconds(sess, n_decode, pipelined=True, lag=2)
    assert bool(mx.all(mx.isfinite(sess.logits)).item()), "non-finite logits"
    t_decode_ops = t_build = None
    if not args.quick:
        # Side by side in the same run: the same pipelined decode with the steps built op by op (not compiled).
        model.set_compile_decode(False)
        decode_seconds(sess, 2, pipelined=True)
        t_decode_ops, _ = decode_seconds(sess, n_decode, pipelined=True)
        model.set_compile_decode(True)
        t_build = graph_build_seconds(model, sess, max(3, args.reps))

    floor_bytes = decode_bytes_per_token(cfg, sizes, ctx)
    total_bytes = sum(floor_bytes.values())
    floor = total_bytes / bw
    comps = {} if args.quick else component_times(model, sess, args.reps)

    res = {
        "shape": args.shape, "experts": args.experts, "device": str(mx.default_device()),
        "kernels": kernel_backend(), "prefill_tokens": n_prefill, "chunk": args.chunk,
        "prefill_tok_s": n_prefill / t_prefill, "decode_ms": t_decode * 1e3, "decode_sync_ms": t_decode_sync * 1e3,
        "decode_lag2_ms": t_decode2 * 1e3, "decode_lag2_host_split_ms": split2, "decode_generate_ms": t_gen * 1e3,
        "decode_uncompiled_ms": t_decode_ops and t_decode_ops * 1e3, "decode_ctx": ctx,
        "decode_graph_build_ms": t_build and t_build * 1e3, "decode_host_split_ms": split,
        "copy_bw_GBs": bw / 1e9, "bytes_per_token": total_bytes, "floor_ms": floor * 1e3,
        "floor_ratio": floor / t_decode, "floor_ratio_lag2": floor / t_decode2, "floor_ratio_generate": floor / t_gen,
        "components_ms": {k: v * 1e3 for k, v in comps.items()},
        "components_floor_ms": {k: sum(floor_bytes.get(c, 0) for c in cs) / bw * 1e3 for k, cs in FLOOR_GROUPS.items()},
        "kv_bytes": sess.kv_bytes, "peak_memory_GB": mx.get_peak_memory() / 1e9,
    }
    print(f"prefill: {n_prefill} tokens (chunk {args.chunk}) in {t_prefill:.2f} s = {res['prefill_tok_s']:.1f} tok/s")
    print(f"decode:  {res['decode_ms']:.2f} ms/token at ctx {ctx} ({1e3 / res['decode_ms']:.1f} tok/s), pipelined;"
          f" {res['decode_sync_ms']:.2f} ms synchronous (one step at a time)")
    if not args.quick:
        print(f"         op by op (DS4_MLX_COMPILE=0): {res['decode_uncompiled_ms']:.2f} ms/token, "
              f"compiled steps {res['decode_uncompiled_ms'] / res['decode_ms']:.2f}x faster")
        print(f"         building one step's graph (compiled steps: replaying their traces) takes "
              f"{res['decode_graph_build_ms']:.2f} ms")
    print("         pipelined step on the host: " + ", ".join(f"{k} {v:.2f} ms" for k, v in split.items()))
    print(f"         tokens read back 2 steps late: {res['decode_lag2_ms']:.2f} ms/token "
          f"({100 * res['floor_ratio_lag2']:.1f}% of the floor); host: "
          + ", ".join(f"{k} {v:.2f} ms" for k, v in split2.items()))
    print(f"         generation loop (ds4's default sampler on the device, {DEFAULT_LAG} steps queued): "
          f"{res['decode_generate_ms']:.2f} ms/token ({100 * res['floor_ratio_generate']:.1f}% of the floor)")
    print(f"floor:   {total_bytes / 1e9:.3f} GB/token / {bw / 1e9:.0f} GB/s copy bandwidth = {res['floor_ms']:.2f} ms"
          f"  -> decode at {100 * res['floor_ratio']:.1f}% of the floor")
    if comps:
        print(f"{'component':<14}{'measured ms':>12}{'floor ms':>10}{'% floor':>9}")
        for k, v in res["components_ms"].items():
            f = res["components_floor_ms"][k]
            print(f"{k:<14}{v:>12.2f}{f:>10.2f}{100 * f / v:>8.1f}%")
        print(f"{'sum':<14}{sum(res['components_ms'].values()):>12.2f}   (whole decode step {res['decode_ms']:.2f})")
    print(f"kv state {sess.kv_bytes / 1e6:.1f} MB, peak memory {res['peak_memory_GB']:.2f} GB")
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
