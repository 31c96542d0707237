"""Where the host time of decode steps goes, from a py-spy ``--native`` profile of ``benchmarks/model.py``.

    py-spy record --native --idle -r 200 -f raw -o spy.txt -- python benchmarks/model.py --quick --decode 150
    python benchmarks/host_profile.py spy.txt

(py-spy is a pip wheel with a static binary; on the lent GPU it is carried as a wheel.) Only samples inside
``decode_seconds`` count. Each is put in one phase: ``encode`` (under ``mlx::core::eval_impl`` called from
``mx.async_eval``: MLX encoding a pipelined step's ops), ``eval, synchronous`` (the same from ``mx.eval``, which
also waits for the device), ``build`` (other samples under ``Session.step``: Python and the compiled steps'
replay) or ``other`` (reading the token back). Encode samples are then split by the primitive whose
``eval_gpu`` was running, and by its first three frames, which name the MLX or CUDA call that costs the time.
"""

from __future__ import annotations

import collections
import sys


def summarize(lines) -> dict[str, collections.Counter]:
    phase, prim, inner, leaf = (collections.Counter() for _ in range(4))
    for line in lines:
        stack, _, count = line.rstrip("\n").rpartition(" ")
        if not stack:
            continue
        frames, n = stack.split(";"), int(count)
        if not any(f.startswith("decode_seconds ") for f in frames):
            continue
        at = next((i for i, f in enumerate(frames) if f.startswith("mlx::core::eval_impl")), None)
        if at is not None and not any("async_eval" in f for f in frames):
            phase["eval, synchronous"] += n
        elif at is not None:
            phase["encode"] += n
            rest = [f for f in frames[at + 1 :] if not f.startswith("mlx::core::gpu::eval ")]
            prim[rest[0] if rest else "(eval_impl itself)"] += n
            inner[" > ".join(rest[:3]) if rest else "(eval_impl itself)"] += n
        elif any(f.startswith("Session.step") for f in frames):
            phase["build"] += n
        else:
            phase["other"] += n
        leaf[frames[-1]] += n
    return {"phase": phase, "primitive under eval_impl": prim, "first 3 frames under eval_impl": inner,
            "innermost frame": leaf}


def main(argv: list[str] | None = None) -> None:
    path = (argv or sys.argv[1:])[0]
    with open(path) as f:
        tables = summarize(f)
    for name, counts in tables.items():
        total = sum(counts.values())
        print(f"\n== {name} ({total} samples)")
        for key, n in counts.most_common(30):
            print(f"{100 * n / max(1, total):6.1f}%  {n:6d}  {key[:200]}")


if __name__ == "__main__":
    main()
