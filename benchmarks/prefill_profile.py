"""Where a prefill chunk's time goes: each piece of one layer timed alone (synced), at a chosen context.

    python benchmarks/prefill_profile.py                        # full width, T 2048 at contexts 2K and 32K, GPU
    python benchmarks/prefill_profile.py --shape tiny --tokens 64 --ctx 64 512 --reps 1
    python benchmarks/prefill_profile.py --json profile.json

Four full-width layers with random q2 weights (ratios 0, 0, 4, 128: a dense, a ratio-4 and a ratio-128 layer).
A chunk of T tokens ends at each context C: the layer's cache is filled with random rows for the C - T tokens
before it (raw window, compressed and indexer rows), so the attention, the indexer's scores and top-k see what
they see at that depth. Each line is the median of ``--reps`` synced runs (``mx.eval`` after the piece), in ms,
with its arithmetic rate; the closing table scales each layer kind by its count in the 43-layer model
(2 dense, 21 ratio-4, 20 ratio-128) into the time of one chunk and its tokens/s.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

import ds4_mlx.kernels as kernels
from ds4_mlx.backend import kernel_backend
from ds4_mlx.model.attention import LayerCache
from ds4_mlx.model.compressor import CompressorState
from ds4_mlx.model.model import Model, hc_post, hc_post_pre, hc_pre
from ds4_mlx.random_model import random_weights, shape_config

LAYER_COUNT = {0: 2, 4: 21, 128: 20}  # the full model's layers by compression ratio


def timed(fn, reps: int) -> float:
    """Median wall seconds of ``fn()`` (which evaluates its work) over ``reps`` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def filled_cache(model: Model, il: int, pos: int, rows_for: int) -> LayerCache:
    """Layer ``il``'s cache after ``pos`` tokens, with the compressed rows of ``rows_for`` tokens (the chunk's own
    rows too, which its compressors would append), all random (timing only: the values do not matter)."""
    cfg, attn = model.cfg, model.layers[il].attn
    cache = model.make_cache()[il]
    r, D = cache.ratio, cfg.head_dim
    if pos:
        cache = replace(cache, pos=pos, raw=mx.random.normal((min(pos, cfg.n_swa), D)).astype(attn.kv_dtype))
    if r and rows_for // r:
        cache = replace(cache, comp=mx.random.normal((rows_for // r, D)).astype(attn.kv_dtype), n_comp=rows_for // r)
    if cache.index is not None and rows_for // 4:
        cache = replace(cache, index=mx.random.normal((rows_for // 4, cfg.indexer_head_dim)), n_index=rows_for // 4)
    mx.eval([a for a in (cache.raw, cache.comp, cache.index) if a is not None])
    return cache


def layer_flops(model: Model, il: int, T: int, pos: int) -> dict[str, float]:
    """Multiply-adds x 2 of the pieces of layer ``il`` for a chunk of T tokens ending at ``pos + T``."""
    cfg, attn = model.cfg, model.layers[il].attn
    E, H, D = cfg.n_embd, cfg.n_head, cfg.head_dim
    dense_attn = attn.attn_q_a_kv.out_features * E + attn.attn_q_b.out_features * attn.q_lora
    dense_attn += attn.attn_output_a.out_features * attn.attn_output_a.in_features + E * attn.attn_output_b.in_features
    f = {"q_a+kv, q_b": 2 * T * (attn.attn_q_a_kv.out_features * E + attn.attn_q_b.out_features * attn.q_lora),
         "output a + b": 2 * T * (attn.attn_output_a.out_features * attn.attn_output_a.in_features
                                  + E * attn.attn_output_b.in_features),
         "routed gate+up+down": 2 * T * cfg.n_expert_used * 3 * cfg.n_ff_exp * E,
         "shared": 2 * T * 3 * cfg.n_ff_exp * E}
    r = attn.ratio
    keys = min(pos + T, cfg.n_swa)  # raw keys a query sees (at most the window)
    if r:
        seen = (pos + T) // r
        keys += min(seen, cfg.indexer_top_k) if attn.indexer is not None else seen
        if attn.indexer is not None:
            f["indexer scores"] = 2 * T * cfg.n_indexer_head * cfg.indexer_head_dim * seen
    f["attention core"] = 4 * T * H * D * keys
    return f


def profile(model: Model, T: int, ctx: int, reps: int) -> list[dict]:
    """One chunk of T tokens ending at ``ctx``, every layer kind: rows of (layer, piece, ms, TFLOP/s)."""
    cfg, pos = model.cfg, ctx - T
    rng = np.random.default_rng(0)
    x = mx.random.normal((T, cfg.n_embd))
    S = mx.random.normal((T, cfg.n_hc, cfg.n_embd))
    toks = mx.array(rng.integers(0, cfg.n_vocab, T).astype(np.int32))
    mx.eval(x, S, toks)
    rows = []
    for il in sorted({next(i for i in range(cfg.n_layer) if cfg.compress_ratio(i) == r) for r in LAYER_COUNT
                      if any(cfg.compress_ratio(i) == r for i in range(cfg.n_layer))}):  # fmt: skip
        layer, attn, ffn = model.layers[il], model.layers[il].attn, model.layers[il].ffn
        ratio = cfg.compress_ratio(il)
        flops = layer_flops(model, il, T, pos)
        cache = filled_cache(model, il, pos, pos)  # as the chunk finds it
        deep = filled_cache(model, il, pos, ctx)  # with the chunk's compressed rows: what its attention reads

        def t(piece: str, fn, part_of: str | None = None) -> None:
            ms = 1e3 * timed(lambda: mx.eval(fn()), reps)
            fl = flops.get(piece)
            rows.append({"ctx": ctx, "tokens": T, "layer": il, "ratio": ratio, "piece": piece, "part_of": part_of,
                         "ms": ms, "tflops": fl / ms / 1e9 if fl else None})
            rate = f"{fl / ms / 1e9:8.1f} TFLOP/s" if fl else ""
            print(f"ctx {ctx:>6} L{il} r{ratio:<3} {'  ' if part_of else ''}{piece:30s} {ms:9.2f} ms {rate}",
                  flush=True)

        n = mx.fast.rms_norm(x, attn.attn_norm, cfg.rms_eps)
        mx.eval(n)
        t("attention", lambda: attn.forward(n, pos, cache.snapshot()))
        t("q_a+kv, q_b", lambda: attn.attn_q_b.matmul(attn.attn_q_a_kv.matmul(n)[:, : attn.q_lora]), "attention")
        o = mx.random.normal((T, cfg.n_head, cfg.head_dim))
        t("output a + b", lambda: attn.attn_output_b.matmul(attn._grouped_output_a(o)), "attention")
        if attn.compressor is not None:
            t("compressor", lambda: attn.compressor(n, pos, cache.comp_state)[0], "attention")
        if attn.indexer is not None:
            t("indexer compressor", lambda: attn.indexer.compressor(n, pos, cache.index_state)[0], "attention")
        rC, rS = attn.rope.tables(pos + np.arange(T), attn.head_dim)
        qa, q, kv = attn._project(n, rC, rS)
        mx.eval(qa, q, kv)
        t("projections and q/kv rows", lambda: attn._project(n, rC, rS)[1], "attention")
        if attn.indexer is not None and deep.n_index > cfg.indexer_top_k:
            Ci, Si = attn.rope.tables(pos + np.arange(T), attn.indexer.head_dim)
            hw = attn.indexer.head_weights(n)
            mx.eval(Ci, Si, hw)
            t("indexer scores", lambda: attn.indexer.scores(qa, hw, Ci, Si, deep.index[: deep.n_index]), "attention")
            t("indexer scores + top-k", lambda: attn._selected_rows(qa, n, pos, deep), "attention")
        if hasattr(kernels, "attention_chunk") and kernel_backend() != "fallback":
            keep = min(cache.n_raw, cfg.n_swa - 1)
            raw_keys = mx.concatenate([cache.raw[cache.n_raw - keep :], kv]) if keep else kv
            idx = attn._selected_rows(qa, n, pos, deep)
            mx.eval(raw_keys, *([] if idx is None else [idx]))
            k = attn.indexer.top_k if attn.indexer is not None else 0
            t("attention core (one launch)", lambda: kernels.attention_chunk(
                q, raw_keys, deep.comp if ratio else None, idx, attn.attn_sinks, keep=keep, window=cfg.n_swa,
                pos=pos, ratio=ratio, top_k=k, scale=attn.scale, C=rC, S=rS, groups=attn.n_group,
                backend=kernel_backend()).a, "attention")  # fmt: skip
        t("moe", lambda: ffn.forward(n, toks))
        sel, w = ffn.route(n, toks)
        mx.eval(sel, w)
        t("router", lambda: ffn.route(n, toks), "moe")
        t("routed gate+up+down", lambda: ffn.routed(n, sel, w), "moe")
        t("shared", lambda: ffn.shared(n), "moe")

        def hc():
            nn, post, comb = hc_pre(S, *layer.hc_attn, cfg, norm=attn.attn_norm)
            S2, nn, post, comb, _ = hc_post_pre(S, nn, post, comb, *layer.hc_ffn, cfg, norm=ffn.ffn_norm)
            return hc_post(S2, nn, post, comb)

        t("hc pre/post x2", hc)
    return rows


def chunk_table(rows: list[dict]) -> list[dict]:
    """Per context: the whole-layer pieces times their layer counts, the model's chunk time and tokens/s."""
    out = []
    for ctx in sorted({r["ctx"] for r in rows}):
        here = [r for r in rows if r["ctx"] == ctx and r["part_of"] is None]
        T = here[0]["tokens"]
        by_piece: dict[str, float] = {}
        for r in here:
            by_piece[r["piece"]] = by_piece.get(r["piece"], 0.0) + r["ms"] * LAYER_COUNT[r["ratio"]]
        total = sum(by_piece.values())
        out.append({"ctx": ctx, "tokens": T, "chunk_ms": total, "tok_s": T / total * 1e3,
                    "ms_by_piece": by_piece})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("full", "tiny"), default="full")
    ap.add_argument("--tokens", type=int, default=2048, help="chunk size T")
    ap.add_argument("--ctx", type=int, nargs="+", default=[2048, 32768], help="contexts the chunk ends at")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path, help="write the rows and the chunk table here")
    args = ap.parse_args()
    cfg = shape_config(args.shape, 4)
    model = Model(cfg, random_weights(cfg))
    rows = []
    for ctx in args.ctx:
        if ctx < args.tokens:
            sys.exit(f"--ctx {ctx} is shorter than the chunk ({args.tokens} tokens)")
        rows += profile(model, args.tokens, ctx, args.reps)
    table = chunk_table(rows)
    print("\n43-layer chunk estimate (each layer kind x its count):")
    for c in table:
        parts = ", ".join(f"{k} {v:.0f}" for k, v in sorted(c["ms_by_piece"].items(), key=lambda kv: -kv[1]))
        print(f"  ctx {c['ctx']:>6}: {c['chunk_ms']:8.1f} ms a {c['tokens']}-token chunk = {c['tok_s']:7.0f} tok/s "
              f"({parts} ms)")
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()), "rows": rows, "chunks": table},
                                        indent=1) + "\n")


if __name__ == "__main__":
    main()
