"""Hit rates of the streamed experts' cache (ds4_mlx.streaming.ExpertCache) on synthetic routing traffic.

    python benchmarks/expert_cache_hits.py          # 8 layers of V4 Flash's 256 experts, 6 a token
    python benchmarks/expert_cache_hits.py --repeats 0,0.5 --half-lives 0,256 --json cpu_expert_cache_hits.json
    python benchmarks/expert_cache_hits.py --repeats 0.5 --shares 0.25,0.5 --first 50   # cold vs preloaded starts

The cache itself runs (its eviction, slots and reads) over a scratch file of small Q8_0 experts in the real counts,
so what it measures is the policy, not the disk. Traffic: in every layer each expert has a popularity drawn from a
Zipf law of exponent ``s`` over a random order of the experts (s = 0: uniform routing, the worst case); a token
keeps each expert the token before it chose in that layer with probability ``--repeats`` (real traffic repeats
experts from token to token; how often was not measured here) and draws the rest without replacement in proportion
to the popularity. ``--half-lives`` are the cache's eviction half-lives (0: least recently used). Decode only: one
token a step through every layer, ``--warm`` steps before the ``--steps`` counted ones. Reported per case: the hit
rate, the experts read a token and layer, and what that reads a token over the q2 model's 43 layers (an expert's
gate, up and down are 7.08 MB there); with ``--first N``, the hit rate over the first N steps of a new start on
the same traffic, with an empty cache and with one preloaded from the run's use counts (what
``--ssd-streaming-profile`` gives the next start).
"""

from __future__ import annotations

import argparse
import itertools
import json
import tempfile
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from ds4_mlx.streaming import DEFAULT_HALF_LIFE, ExpertCache, StreamedTensor

ROWS, COLS = 32, 32  # one small Q8_0 matrix an expert: the policy does not depend on the width
Q2_EXPERT_BYTES, Q2_LAYERS = 7_077_888, 43  # the q2 model's IQ2_XXS gate and up and Q2_K down of one expert


def scratch_experts(folder: Path, layers: int, n_expert: int) -> dict[int, tuple[StreamedTensor, ...]]:
    """Every layer's (gate, up, down) as :class:`StreamedTensor` over one file of random bytes."""
    probe = StreamedTensor("probe", QT.Q8_0, (n_expert, ROWS, COLS), folder, 0)
    size = probe.expert_bytes * n_expert
    path = folder / "experts.bin"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, layers * 3 * size, dtype=np.uint8).tobytes())
    return {il: tuple(StreamedTensor(f"blk.{il}.ffn_{k}_exps.weight", QT.Q8_0, (n_expert, ROWS, COLS), path,
                                     (3 * il + j) * size) for j, k in enumerate(("gate", "up", "down")))
            for il in range(layers)}  # fmt: skip


def popularity(rng: np.random.Generator, n_expert: int, s: float) -> np.ndarray:
    """A Zipf law of exponent ``s`` over a random order of the experts (probabilities)."""
    p = 1.0 / np.arange(1, n_expert + 1) ** s
    return (p / p.sum())[rng.permutation(n_expert)]


def choose(rng: np.random.Generator, p: np.ndarray, k: int, before: np.ndarray | None, repeat: float) -> np.ndarray:
    """A token's ``k`` experts: each of the token before's kept with probability ``repeat``, the rest drawn from
    ``p`` without replacement."""
    kept = np.zeros(0, np.int64) if before is None else before[rng.random(k) < repeat]
    if len(kept) == k:
        return kept
    q = p.copy()
    q[kept] = 0.0
    return np.concatenate([kept, rng.choice(len(p), k - len(kept), replace=False, p=q / q.sum())])


def _decode(cache: ExpertCache, rng: np.random.Generator, probs: list, k: int, repeat: float, steps: int) -> None:
    """``steps`` decode tokens through every layer of ``cache``."""
    before: dict[int, np.ndarray | None] = dict.fromkeys(cache.experts)
    for _ in range(steps):
        for il, p in zip(cache.experts, probs):
            before[il] = choose(rng, p, k, before[il], repeat)
            cache.fetch(il, before[il][None, :])


def hit_rate(experts: dict, n_expert: int, k: int, share: float, s: float, steps: int, warm: int,
             repeat: float = 0.0, half_life: float = 0.0, first: int = 0, seed: int = 0) -> dict:  # fmt: skip
    """Decode ``warm + steps`` tokens through a cache of ``share`` of all experts -> the counted steps' figures.
    ``first``: then the hit rates of the first ``first`` steps of a new start on the same traffic, with an empty
    cache and with one preloaded from the run's use counts (``--ssd-streaming-profile``)."""
    rng = np.random.default_rng(seed)
    probs = [popularity(rng, n_expert, s) for _ in experts]
    unit = sum(t.expert_bytes for t in next(iter(experts.values())))

    def new_cache() -> ExpertCache:
        return ExpertCache(experts, int(share * len(experts) * n_expert) * unit, min_slots=k, half_life=half_life)

    cache = new_cache()
    try:
        _decode(cache, rng, probs, k, repeat, warm)
        hits0, misses0 = cache.hits, cache.misses
        _decode(cache, rng, probs, k, repeat, steps)
        hits, misses = cache.hits - hits0, cache.misses - misses0
    finally:
        cache.close()
    per_layer = misses / steps / len(experts)
    row = {"zipf_s": s, "repeat": repeat, "half_life": half_life, "cache_share": share, "slots": cache.slots,
           "hit_rate": round(hits / (hits + misses), 4), "experts_read_per_layer": round(per_layer, 3),
           "q2_mb_read_per_token": round(per_layer * Q2_LAYERS * Q2_EXPERT_BYTES / 1e6, 1)}
    for label, uses in [("cold", None), ("preloaded", cache.uses)] if first else []:
        start = new_cache()
        try:
            if uses is not None:
                start.uses[:] = uses
                start.preload()
            _decode(start, np.random.default_rng(seed + 1), probs, k, repeat, first)
            row[f"first_{label}"] = round(start.hits / (start.hits + start.misses), 4)
        finally:
            start.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("-k", type=int, default=6, help="experts a token")
    ap.add_argument("--shares", default="0.1,0.25,0.5,1.0", help="cache sizes as shares of all experts")
    ap.add_argument("--zipf", default="0,0.6,1.0,1.4", help="popularity exponents")
    ap.add_argument("--repeats", default="0",
                    help="chances that a token keeps each expert of the token before it in the same layer")
    ap.add_argument("--half-lives", default=str(DEFAULT_HALF_LIFE),
                    help="the cache's eviction half-lives in decode steps (0: least recently used)")
    ap.add_argument("--first", type=int, default=0,
                    help="also the hit rate over the first N steps of a new start, cold and preloaded from the "
                         "run's use counts")
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--warm", type=int, default=1000)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    shares, exponents, repeats, half_lives = ([float(v) for v in a.split(",")]
                                              for a in (args.shares, args.zipf, args.repeats, args.half_lives))
    if (min(shares) <= 0 or max(shares) > 1 or min(exponents) < 0 or min(args.steps, args.warm + 1, args.k) < 1
            or min(repeats) < 0 or max(repeats) > 1 or min(half_lives) < 0):
        ap.error("shares in (0, 1], exponents >= 0, repeats in [0, 1], half-lives >= 0, --steps and -k at least 1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        experts = scratch_experts(Path(tmp), args.layers, args.experts)
        print(f"{args.layers} layers x {args.experts} experts, {args.k} a token; {args.steps} decode steps after "
              f"{args.warm}")  # fmt: skip
        print(f"{'zipf s':>6} {'repeat':>6} {'half-life':>9} {'cache':>6} {'hit rate':>9} "
              f"{'read a token and layer':>23} {'q2 MB a token':>14}"
              + (f" {'first steps: cold':>18} {'preloaded':>10}" if args.first else ""))
        for s, rep, hl, share in itertools.product(exponents, repeats, half_lives, shares):
            r = hit_rate(experts, args.experts, args.k, share, s, args.steps, args.warm, rep, hl, args.first)
            rows.append(r)
            first = f" {r['first_cold']:>18.3f} {r['first_preloaded']:>10.3f}" if args.first else ""
            print(f"{s:>6} {rep:>6} {hl:>9g} {share:>6.0%} {r['hit_rate']:>9.3f} {r['experts_read_per_layer']:>23.2f} "
                  f"{r['q2_mb_read_per_token']:>14.0f}{first}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"layers": args.layers, "experts": args.experts, "k": args.k,
                                         "steps": args.steps, "warm": args.warm, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
