"""Disk KV cache: time to first token cold vs warm-from-disk vs warm-in-memory, and the size of the saved state.

A prompt of ``--tokens`` random ids is served three ways, each up to the first sampled token (argmax):

* cold: a fresh session prefills everything (chunks of ``--chunk`` on absolute boundaries);
* disk: a :class:`~ds4_mlx.kvstore.DiskCache` holding the prompt minus its last ``--suffix`` tokens is looked up
  (SHA1 of the byte prefix, header checks), the payload is read and restored, and the suffix is prefilled;
* memory: the same prefix restored from an in-memory snapshot, then the suffix.

It also reports the save time, the file size per 1K tokens and (``--shape full``) the payload against ds4's
``kvcache_bytes`` figure (52,184,460 B at 2048 tokens). Weights are random (``ds4_mlx.random_model``).

    python benchmarks/kvcache.py                              # tiny shape, CPU ok
    python benchmarks/kvcache.py --shape full --tokens 2048   # H200
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ds4_mlx.kvstore import CachePolicy, DiskCache, session_payload  # noqa: E402
from ds4_mlx.random_model import random_model  # noqa: E402
from ds4_mlx.session import Session  # noqa: E402

DS4_BYTES_2048 = 52_184_460  # docs/serving.md §5.4: ds4-bench kvcache_bytes at N = 2048 (full shape)
DS4_BYTES_PER_2048_MORE = 28_188_672


def prefill(session: Session, tokens: list[int], start: int, chunk: int) -> None:
    """Prefill ``tokens[start:]`` in chunks that end on absolute multiples of ``chunk`` (like the server)."""
    pos = start
    while pos < len(tokens):
        end = min(len(tokens), (pos // chunk + 1) * chunk)
        session.prefill(tokens[pos:end])
        pos = end


def first_token(session: Session) -> int:
    return int(mx.argmax(session.logits).item())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="tiny", choices=["tiny", "full"])
    ap.add_argument("--layers", type=int, default=None, help="truncate the layer count (full-width smoke runs)")
    ap.add_argument("--tokens", type=int, default=None, help="prompt length (default 192 tiny, 4096 full)")
    ap.add_argument("--suffix", type=int, default=16, help="new tokens after the cached prefix")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default: 512 tiny, 2048 full)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions of the warm paths (median)")
    ap.add_argument("--dir", type=Path, default=None, help="cache directory (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=None, help="also write the results as JSON here")
    args = ap.parse_args()
    N = args.tokens or (192 if args.shape == "tiny" else 4096)
    chunk = args.chunk or (512 if args.shape == "tiny" else 2048)
    P = N - args.suffix

    t0 = time.perf_counter()
    model, tok = random_model(args.shape, layers=args.layers)
    build_s = time.perf_counter() - t0
    tokens = [int(t) for t in np.random.default_rng(0).integers(0, 512, N)]

    warm = Session(model, chunk_size=chunk)  # JIT/graph warm-up so "cold" measures prefill, not compilation
    prefill(warm, tokens[: min(N, 2 * chunk)], 0, chunk)
    first_token(warm)
    del warm

    # cold
    s = Session(model, chunk_size=chunk)
    t0 = time.perf_counter()
    prefill(s, tokens, 0, chunk)
    cold_tok = first_token(s)
    cold_s = time.perf_counter() - t0

    # the cached prefix: save it
    s = Session(model, chunk_size=chunk)
    prefill(s, tokens[:P], 0, chunk)
    snap = s.snapshot()
    text = tok.decode_bytes(tokens[:P])
    prompt = tok.decode_bytes(tokens)
    ctx = max(32768, 2 * N)
    tmp = tempfile.TemporaryDirectory() if args.dir is None else None
    directory = Path(tmp.name) if tmp else args.dir
    dc = DiskCache(directory, model, ctx=ctx, chunk_size=chunk, policy=CachePolicy(min_tokens=1, space_mb=1 << 20))
    t0 = time.perf_counter()
    path = dc.store(s, text, "cold")
    save_s = time.perf_counter() - t0
    file_bytes = path.stat().st_size
    payload_bytes = len(session_payload(s, ctx=ctx))
    kv_bytes_live = s.kv_bytes
    del s

    def from_disk() -> tuple[float, float, int]:
        t0 = time.perf_counter()
        hit = dc.lookup(prompt)
        assert hit.hit, hit.reason
        r = Session(model, chunk_size=chunk)
        r.restore(hit.snapshot)
        t1 = time.perf_counter()
        prefill(r, tokens, P, chunk)
        tok_ = first_token(r)
        return time.perf_counter() - t0, t1 - t0, tok_

    def from_memory() -> tuple[float, int]:
        t0 = time.perf_counter()
        r = Session(model, chunk_size=chunk)
        r.restore(snap)
        prefill(r, tokens, P, chunk)
        tok_ = first_token(r)
        return time.perf_counter() - t0, tok_

    disk = [from_disk() for _ in range(args.reps)]
    mem = [from_memory() for _ in range(args.reps)]
    disk_s = float(np.median([d[0] for d in disk]))
    load_s = float(np.median([d[1] for d in disk]))
    mem_s = float(np.median([m[0] for m in mem]))
    same = all(d[2] == cold_tok for d in disk) and all(m[1] == cold_tok for m in mem)

    res = {
        "shape": args.shape, "layers": model.cfg.n_layer, "device": str(mx.default_device()),
        "prompt_tokens": N, "cached_prefix": P, "suffix": args.suffix, "chunk": chunk, "build_s": round(build_s, 2),
        "ttft_cold_s": round(cold_s, 4), "ttft_disk_s": round(disk_s, 4), "ttft_memory_s": round(mem_s, 4),
        "disk_lookup_load_s": round(load_s, 4), "save_s": round(save_s, 4),
        "speedup_disk_vs_cold": round(cold_s / disk_s, 2), "speedup_memory_vs_cold": round(cold_s / mem_s, 2),
        "disk_vs_memory": round(disk_s / mem_s, 2),
        "file_bytes": file_bytes, "file_bytes_per_1k_tokens": round(file_bytes / P * 1000),
        "payload_bytes": payload_bytes, "live_kv_bytes": kv_bytes_live,
        "first_token_identical": same,
    }
    if args.shape == "full" and args.layers is None:
        # ds4's payload at our prefix length from its two published points (linear in N past 2048 in steps of
        # 2048 compressed-row growth), for the bytes-per-token comparison
        res["ds4_bytes_at_2048"] = DS4_BYTES_2048
        if P == 2048:
            res["payload_equals_ds4_at_2048"] = payload_bytes == DS4_BYTES_2048
        res["payload_bytes_per_token"] = round(payload_bytes / P)
        res["ds4_bytes_per_token_at_2048"] = round(DS4_BYTES_2048 / 2048)
    print(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    if tmp:
        tmp.cleanup()


if __name__ == "__main__":
    main()
