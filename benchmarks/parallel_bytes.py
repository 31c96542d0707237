"""What a rank of each parallel mode holds, reads per decoded token and sends, from the layout (nothing is run):
the full V4 Flash shape with q2 experts, ``layout.decode_bytes_per_token`` at a context, each tensor scaled by the
share a rank holds (``distributed.tensor_share``; the pipeline: the layers of rank 0 of an even split). Sent: a
pipeline rank's float32 hyper-connection state to the next rank; with the experts or heads split each float32
``all_sum`` of ``[T, E]``, of which a ring sends ``2 (N - 1) / N`` of the array from every rank.

    python benchmarks/parallel_bytes.py [--ctx 2048] [--chunk 2048] [--ranks 2 4 8] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

from ds4_mlx.distributed import held_share, rank_share
from ds4_mlx.layout import decode_bytes_per_token, expected_tensors, layout_sizes
from ds4_mlx.random_model import shape_config


def per_rank(mode: str, n: int, ctx: int, chunk: int) -> dict[str, float]:
    """GB rank 0 holds and reads per decoded token (rank 0 of a pipeline: its layers, the embedding), the messages
    a token takes (all-sums, or hops along the pipeline and the logits back), and the MB a rank sends for a
    decoded token and for a prefill chunk of ``chunk`` tokens."""
    cfg = shape_config("full")
    specs, sizes = expected_tensors(cfg), layout_sizes(cfg, "q2")
    _, keep, cut = rank_share(cfg, mode, n, 0)
    if mode == "pipeline":
        messages = n  # the state to each next rank, the logits back
        sent_per_token = cfg.n_hc * cfg.n_embd * 4  # the state of one token, on each hop
    else:
        messages = cfg.n_layer * (2 if mode == "tensor" else 1)
        sent_per_token = messages * 2 * (n - 1) / n * cfg.n_embd * 4
    held = {name: b * held_share(cut, name, specs[name].shape, keep) for name, b in sizes.items()}
    reads = decode_bytes_per_token(cfg, held, ctx)
    reads.pop("kv cache")  # replicated, or the stage's own: small at 2K either way
    return {"held_gb": sum(held.values()) / 1e9, "read_gb": sum(reads.values()) / 1e9, "messages": messages,
            "sent_mb_token": sent_per_token / 1e6, "sent_mb_chunk": sent_per_token * chunk / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens a model call")
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--json", help="write the table here as JSON")
    args = ap.parse_args()
    whole = per_rank("pipeline", 1, args.ctx, args.chunk)["read_gb"]  # one rank holds everything
    rows = []
    for mode in ("pipeline", "expert", "tensor"):
        for n in args.ranks:
            if mode == "tensor" and n > shape_config("full").n_out_group:
                continue
            row = {"mode": mode, "ranks": n, **per_rank(mode, n, args.ctx, args.chunk)}
            # decode's best speed-up from reads: a pipeline's ranks read one after another
            row["speedup"] = 1.0 if mode == "pipeline" else whole / row["read_gb"]
            rows.append(row)
    print(f"one rank reads {whole:.2f} GB a token at {args.ctx} positions")
    print(f"{'mode':<9} {'ranks':>5} {'held GB':>8} {'read GB/token':>14} {'speed-up':>9} {'messages/token':>15} "
          f"{'MB sent/token':>14} {f'MB sent/{args.chunk}-chunk':>20}")
    for r in rows:
        print(f"{r['mode']:<9} {r['ranks']:>5} {r['held_gb']:>8.1f} {r['read_gb']:>14.2f} {r['speedup']:>8.2f}x "
              f"{r['messages']:>15} {r['sent_mb_token']:>14.3f} {r['sent_mb_chunk']:>20.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ctx": args.ctx, "chunk": args.chunk, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
