"""What the parallel modes' messages cost on the link at hand, without the model: under ``mlx.launch``, the ranks
time MLX's ``all_sum`` of a float32 ``[T, 4096]`` (the split modes' sums, T = 1 for a decoded token, T = a prefill
chunk) and a pipeline hop's state ``[T, 4, 4096]`` (half a round trip between ranks 0 and 1), then rank 0 prints
the time a decoded token and a prefill chunk spend in messages in each mode (43 sums with the experts split, 86
with the heads too, one hop per rank of a pipeline).

    mlx.launch -n 2 --backend ring -- python benchmarks/collectives.py [--chunk 2048] [--reps 200] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx

N_LAYER, N_EMBD, N_HC = 43, 4096, 4  # V4 Flash


def _timed(fn, reps: int) -> float:
    """Seconds per call of ``fn`` (which evaluates its own result), after a warm-up of a tenth of ``reps``."""
    for _ in range(max(1, reps // 10)):
        fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=2048, help="prefill tokens a model call")
    ap.add_argument("--reps", type=int, default=200, help="timed calls of the one-token messages")
    ap.add_argument("--json", help="rank 0 writes its figures here")
    args = ap.parse_args()
    group = mx.distributed.init()
    rank, size = group.rank(), group.size()
    if size < 2:
        raise SystemExit("start it with mlx.launch -n 2 (or more)")
    out = {"ranks": size, "chunk": args.chunk, "device": str(mx.default_device())}
    for label, T, reps in (("token", 1, args.reps), ("chunk", args.chunk, max(3, args.reps // 50))):
        x = mx.ones((T, N_EMBD), mx.float32)
        out[f"all_sum_{label}_us"] = 1e6 * _timed(lambda: mx.eval(mx.distributed.all_sum(x, group=group)), reps)
        state = mx.ones((T, N_HC, N_EMBD), mx.float32)

        def round_trip():  # ranks 0 and 1 send the state to each other in turn (a send waits for its receive)
            if rank == 0:
                mx.eval(mx.distributed.send(state, 1, group=group))
                mx.eval(mx.distributed.recv_like(state, 1, group=group))
            elif rank == 1:
                mx.eval(mx.distributed.recv_like(state, 0, group=group))
                mx.eval(mx.distributed.send(state, 0, group=group))

        out[f"hop_{label}_us"] = 1e6 * _timed(round_trip, reps) / 2
    if rank != 0:
        return
    out["ms_per_token"] = {"pipeline": size * out["hop_token_us"] / 1e3,
                           "expert": N_LAYER * out["all_sum_token_us"] / 1e3,
                           "tensor": 2 * N_LAYER * out["all_sum_token_us"] / 1e3}
    out["ms_per_chunk"] = {"pipeline": out["hop_chunk_us"] / 1e3,
                           "expert": N_LAYER * out["all_sum_chunk_us"] / 1e3,
                           "tensor": 2 * N_LAYER * out["all_sum_chunk_us"] / 1e3}
    print(f"{size} ranks on {out['device']}: all_sum [1, {N_EMBD}] {out['all_sum_token_us']:.0f} us, "
          f"[{args.chunk}, {N_EMBD}] {out['all_sum_chunk_us'] / 1e3:.1f} ms; a hop [1, {N_HC}, {N_EMBD}] "
          f"{out['hop_token_us']:.0f} us, [{args.chunk}, {N_HC}, {N_EMBD}] {out['hop_chunk_us'] / 1e3:.1f} ms")
    for mode in ("pipeline", "expert", "tensor"):
        print(f"  {mode:<9} messages: {out['ms_per_token'][mode]:7.2f} ms a decoded token, "
              f"{out['ms_per_chunk'][mode]:8.1f} ms a {args.chunk}-token chunk")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
