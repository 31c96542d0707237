"""Where one decode step goes, per layer kind, at the full V4 Flash width (GPU; a few layers, not 43).

    python benchmarks/decode_profile.py [--ctx 2048] [--sweep] [--json out.json]

Builds the first ``--layers`` (default 6: ratios 0, 0, 4, 128, 4, 128) layers at the real shape with random
q2 weights, prefills ``--ctx`` tokens, then times, at the decode position, each piece of one layer as a
dependent chain of ``--reps`` calls inside one graph (as the real step queues them): the whole layer, HC
pre/post, the attention sublayer and its parts (projections, compressors, core, output), the MoE and its
parts (router, routed experts, shared expert). A 43-layer estimate weighs the layer kinds by their counts.
``--sweep`` also times the decode matvec launch shapes ``(NR, NSG, KS)`` on every decode projection shape.
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

from ds4_mlx.model.model import Model, hc_post, hc_pre  # noqa: E402
from ds4_mlx.random_model import random_weights, shape_config  # noqa: E402
from ds4_mlx.session import Session  # noqa: E402
from ds4_mlx.weights import _kernels, kernel_backend  # noqa: E402


def chain_us(step, x0: mx.array, reps: int) -> float:
    """µs per call of ``x -> step(x)`` (same shape) chained ``reps`` times in one graph; median of 3 runs."""

    def run():
        x = x0
        for _ in range(reps):
            x = step(x)
        mx.eval(x)

    run()
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts)) / reps * 1e6


def tie(x: mx.array, y: mx.array) -> mx.array:
    """``x`` made to depend on ``y`` (one scalar op): chains pieces whose outputs have other shapes."""
    return x + 0.0 * y.reshape(-1)[:1].astype(x.dtype)


def layer_pieces(model: Model, il: int, cache, pos: int, tok: mx.array) -> dict:
    """{name: step function x[1, E] -> x} for the pieces of layer ``il`` at the decode position."""
    cfg, L = model.cfg, model.layers[il]
    a, f = L.attn, L.ffn
    S0 = mx.random.normal((1, cfg.n_hc, cfg.n_embd))
    mx.eval(S0)
    pieces = {
        "layer": lambda x: L(tie(S0, x), tok, pos, cache.snapshot())[:, 0, :],
        "hc_pre": lambda x: hc_pre(tie(S0, x), *L.hc_attn, cfg)[0],
        "hc_pre one threadgroup": lambda x: hc_pre(tie(S0, x), *L.hc_attn, cfg, split=False)[0],
        "hc_post": lambda x: hc_post(tie(S0, x), x, mx.ones((1, cfg.n_hc)), mx.ones((1, cfg.n_hc, cfg.n_hc)))[:, 0, :],
        "attention": lambda x: a(x, pos, cache.snapshot()),
        "attn proj": lambda x: tie(x, a._project(x, *a.rope.tables([pos], a.head_dim))[1]),
        "attn output": lambda x: a.attn_output_b.matmul(
            a._grouped_output_a(tie(mx.ones((1, a.n_head, a.head_dim)), x))),
        "moe": lambda x: f(x, tok),
        "moe router": lambda x: tie(x, f.route(x, tok)[1]),
        "moe router+routed": lambda x: f.routed(x, *f.route(x, tok)),
        "moe shared": lambda x: f.shared(x),
        "scalar tie (overhead)": lambda x: tie(x, x),
    }
    if a.compressor is not None:
        pieces["compressor"] = lambda x: tie(x, a.compressor(x, pos, cache.comp_state)[1].kv)
    if a.indexer is not None:
        pieces["indexer compressor"] = lambda x: tie(x, a.indexer.compressor(x, pos, cache.index_state)[1].kv)
        if cache.n_index > a.indexer.top_k:
            idx = cache.index[: cache.n_index]
            Ci, Si = a.rope.tables([pos], a.indexer.head_dim)
            pieces["indexer scores"] = lambda x: tie(x, a.indexer.scores(x[:, : cfg.q_lora_rank], a.indexer.head_weights(x), Ci, Si, idx))
    return pieces


def op_overhead_us(reps: int = 400) -> float:
    """µs per dependent elementwise op on a [4096] f32 vector (the launch floor of one MLX op)."""
    x0 = mx.ones((4096,))
    mx.eval(x0)
    return chain_us(lambda x: x * 1.0001, x0, reps)


# --- matvec launch-shape sweep ------------------------------------------------------------------------------

DECODE_SHAPES = [  # (label, qtype name, shape, gathered pairs (0 = dense))
    ("q_a", "Q8_0", (1024, 4096), 0), ("q_b", "Q8_0", (32768, 1024), 0), ("kv", "Q8_0", (512, 4096), 0),
    ("out_a (8 groups)", "Q8_0", (8, 1024, 4096), 8), ("out_b", "Q8_0", (4096, 8192), 0),
    ("shared gate", "Q8_0", (2048, 4096), 0), ("shared down", "Q8_0", (4096, 2048), 0),
    ("lm head", "Q8_0", (129280, 4096), 0), ("compressor r4", "F16", (1024, 4096), 0),
    ("indexer q_b", "F16", (8192, 1024), 0), ("router", "F16", (256, 4096), 0),
    ("routed gate", "IQ2_XXS", (256, 2048, 4096), 6), ("routed down", "Q2_K", (256, 4096, 2048), 6),
]
SWEEP_CONFIGS = [None, (4, 2, 1), (4, 4, 1), (4, 4, 4), (2, 4, 4), (1, 4, 4), (2, 8, 8), (1, 8, 8), (4, 8, 8),
                 (2, 8, 4)]


def sweep(reps: int = 50) -> list[dict]:
    from gguf import GGMLQuantizationType as QT

    from ds4_mlx.random_model import random_quant_weight

    K = _kernels()
    backend = kernel_backend()
    rows = []
    for label, qname, shape, pairs in DECODE_SHAPES:
        qt = QT[qname]
        n_copies = max(2, int(4.8e8 // (np.prod(shape) * (1 if qt != QT.F16 else 2))))  # beat the 60 MB L2
        ws = []
        for _ in range(n_copies):
            ws.append(random_quant_weight(qt, shape, 0.02))
            mx.eval(ws[-1].data)
        x = mx.random.normal((pairs if pairs == 8 else 1, shape[-1]))
        ids = mx.array(np.arange(8) if pairs == 8 else np.zeros(pairs), dtype=mx.int32) if pairs else None
        res = {"shape": label, "type": qname}
        for cfg in SWEEP_CONFIGS:
            def call(i, cfg=cfg):
                w = ws[i % n_copies]
                if pairs == 6:
                    ids_i = mx.array(np.random.default_rng(i).choice(shape[0], 6, replace=False), dtype=mx.int32)
                    return K.mv(w, x, backend, ids=ids_i, k_slots=6, config=cfg)
                return K.mv(w, x, backend, ids=ids, k_slots=8, config=cfg) if pairs else K.mv(w, x, backend, config=cfg)

            try:
                mx.eval(call(0))
                t0 = time.perf_counter()
                y = None
                for i in range(reps):  # dependent: each call waits for the last, as in a decode step
                    y = call(i) if y is None else call(i) + 0.0 * y.reshape(-1)[0]
                    mx.eval(y)
                res[str(cfg or "auto")] = round((time.perf_counter() - t0) / reps * 1e6, 1)
            except Exception as e:  # noqa: BLE001 - a config the kernel cannot launch is reported
                res[str(cfg or "auto")] = f"error: {str(e)[:80]}"
        print(json.dumps(res), flush=True)
        rows.append(res)
        ws.clear()  # give the weight copies back before the next shape
        mx.clear_cache()
    return rows


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("full", "tiny"), default="full", help="tiny: a CPU smoke run")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    out: dict = {"device": str(mx.default_device()), "kernels": kernel_backend()}
    out["op_overhead_us"] = op_overhead_us()
    print(f"one dependent elementwise op: {out['op_overhead_us']:.1f} us", flush=True)
    if args.sweep:
        out["sweep"] = sweep()

    cfg = shape_config(args.shape, args.layers)
    model = Model(cfg, random_weights(cfg, "q2"))
    sess = Session(model)
    prompt = [0] + np.random.default_rng(0).integers(2, cfg.n_vocab, args.ctx - 1).tolist()
    sess.prefill(prompt)
    tok_id = int(mx.argmax(sess.logits).item())
    for _ in range(3):
        tok_id = int(mx.argmax(sess.step(tok_id)).item())
    t0 = time.perf_counter()
    for _ in range(10):
        tok_id = int(mx.argmax(sess.step(tok_id)).item())
    out["step_ms"] = (time.perf_counter() - t0) / 10 * 1e3
    print(f"decode step, {args.layers} layers at ctx {sess.pos}: {out['step_ms']:.2f} ms", flush=True)

    tok = mx.array([tok_id], dtype=mx.int32)
    x0 = mx.random.normal((1, cfg.n_embd))
    mx.eval(x0)
    kinds = {}
    for il in range(args.layers):
        r = cfg.compress_ratio(il)
        if r in kinds:
            continue
        times = {}
        for name, fn in layer_pieces(model, il, sess.caches[il], sess.pos, tok).items():
            times[name] = round(chain_us(fn, x0, args.reps), 1)
        # the same layer with the launch shapes of the previous commit (no K split, one-threadgroup HC pre)
        K, F = _kernels(), _kernels().fused
        saved = K.MV_KSPLIT_ALL, K.MV_KSPLIT_BELOW, F.HC_PRE_SPLIT_MAX_T
        K.MV_KSPLIT_ALL, K.MV_KSPLIT_BELOW, F.HC_PRE_SPLIT_MAX_T = 0, 0, 0
        try:
            times["layer, unsplit launches"] = round(chain_us(layer_pieces(model, il, sess.caches[il], sess.pos, tok)["layer"], x0, args.reps), 1)
        finally:
            K.MV_KSPLIT_ALL, K.MV_KSPLIT_BELOW, F.HC_PRE_SPLIT_MAX_T = saved
        kinds[r] = {"layer": il, "us": times}
        print(f"layer {il} (ratio {r}):", json.dumps(times), flush=True)
    out["kinds"] = kinds
    full = shape_config(args.shape)
    counts = {r: sum(full.compress_ratio(i) == r for i in range(full.n_layer)) for r in kinds}
    out["estimate_all_layers_ms"] = sum(counts[r] * kinds[r]["us"]["layer"] for r in kinds) / 1e3
    print(f"{full.n_layer}-layer estimate from per-kind layer times {counts}: {out['estimate_all_layers_ms']:.1f} ms",
          flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
