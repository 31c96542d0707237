"""Where a prefill chunk's time goes: each piece of one layer timed alone at full width (T tokens, synced).

    python benchmarks/prefill_profile.py --tokens 512           # full width, 4 layers (ratios 0,0,4,128), GPU
    python benchmarks/prefill_profile.py --shape tiny --tokens 64

Times are medians of synced runs (``mx.eval`` after each piece), in ms, next to the whole layer.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model import random_weights, timed  # noqa: E402  (benchmarks/model.py)

from ds4_mlx.model.model import Model, hc_post, hc_pre  # noqa: E402
from ds4_mlx.testing import flash_config, tiny_config  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=("full", "tiny"), default="full")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    cfg = flash_config() if args.shape == "full" else tiny_config()
    cfg = replace(cfg, n_layer=4, compress_ratios=cfg.compress_ratios[:4], swiglu_clamp=cfg.swiglu_clamp[:4])
    model = Model(cfg, random_weights(cfg))
    T = args.tokens
    x = mx.random.normal((T, cfg.n_embd))
    S = mx.random.normal((T, cfg.n_hc, cfg.n_embd))
    toks = mx.array(np.random.default_rng(0).integers(0, cfg.n_vocab, T).astype(np.int32))
    mx.eval(x, S, toks)
    rows = []

    def t(label, fn):
        ms = 1e3 * timed(lambda: mx.eval(fn()), args.reps)
        rows.append((label, ms))
        print(f"{label:38s} {ms:9.2f} ms", flush=True)

    for il in (0, 2, 3):
        layer, attn, ffn = model.layers[il], model.layers[il].attn, model.layers[il].ffn
        tag = f"L{il} r{cfg.compress_ratio(il)}"
        t(f"{tag} attention (whole)", lambda: attn(x, 0, model.make_cache()[il]))
        n = mx.fast.rms_norm(x, attn.attn_norm, cfg.rms_eps)
        t(f"{tag}   q_a+kv, q_b matmuls", lambda: attn.attn_q_b.matmul(attn.attn_q_a_kv.matmul(n)[:, : attn.q_lora]))
        o = mx.random.normal((T, cfg.n_head, cfg.head_dim))
        t(f"{tag}   output a (grouped) + b", lambda: attn.attn_output_b.matmul(attn._grouped_output_a(o)))
        if attn.compressor is not None:
            t(f"{tag}   compressor", lambda: attn.compressor(n, 0, model.make_cache()[il].comp_state)[0])
        if attn.indexer is not None:
            t(f"{tag}   indexer compressor", lambda: attn.indexer.compressor(n, 0, model.make_cache()[il].index_state)[0])
        t(f"{tag} moe (whole)", lambda: ffn(x, toks))
        nf = mx.fast.rms_norm(x, ffn.ffn_norm, cfg.rms_eps)
        t(f"{tag}   router", lambda: ffn.route(nf, toks))
        sel, w = ffn.route(nf, toks)
        mx.eval(sel, w)
        t(f"{tag}   routed gate+up+down", lambda: ffn.routed(nf, sel, w))
        t(f"{tag}   routed gate only", lambda: ffn.ffn_gate_exps.gather_matmul(nf, sel))
        t(f"{tag}   shared", lambda: ffn.shared(nf))
        t(f"{tag} hc pre+post x2", lambda: hc_post(S, hc_pre(S, *layer.hc_attn, cfg)[0], *hc_pre(S, *layer.hc_ffn, cfg)[1:]))
    print(f"(T={T}, {args.shape} width; multiply a layer's pieces by 43 layers for a chunk)")


if __name__ == "__main__":
    main()
