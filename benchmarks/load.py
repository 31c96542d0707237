"""Time to first token from process start: GGUF vs converted MLX directory (same run, warm page cache).

Each measurement is a fresh ``python`` process that imports ds4_mlx, loads the model (``ds4_mlx.load``),
runs a 16-token prompt and takes the argmax of the last logits; the parent times spawn → exit. Both forms
are run alternately ``--reps`` times after one warm-up each (so both read from the page cache); the median is
reported. Models: the tiny q2 test model and a synthetic ~``--big-gb`` GB model (tiny config with f16 experts
and many of them, the cheapest way to a large file in the real layout).

    python benchmarks/load.py [--big-gb 2] [--reps 3] [--workdir /tmp/ds4-load-bench] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

CHILD = r"""
import sys, time
t0 = time.perf_counter()
import mlx.core as mx
from ds4_mlx.loader import load
t_import = time.perf_counter()
model, tok = load(sys.argv[1])
t_load = time.perf_counter()
ids = mx.array([0] + [(7 * i + 3) % (model.cfg.n_vocab - 2) + 2 for i in range(15)], dtype=mx.int32)
first = int(mx.argmax(model(ids, 0, model.make_cache())).item())
t_tok = time.perf_counter()
print(f"{first} {t_import - t0:.4f} {t_load - t_import:.4f} {t_tok - t_load:.4f}")
"""


def ttft(path: Path) -> dict:
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t
    if r.returncode:
        raise RuntimeError(f"child failed on {path}:\n{r.stderr}")
    tok, imp, load, fwd = r.stdout.split()
    return {"wall_s": wall, "token": int(tok), "import_s": float(imp), "load_s": float(load), "first_token_s": float(fwd)}


def bench(name: str, gguf: Path, out: Path, reps: int) -> dict:
    from ds4_mlx.convert.gguf_to_mlx import convert

    t = time.perf_counter()
    rep = convert(gguf, out, progress=False, log=lambda *a: None)
    conv_s = time.perf_counter() - t
    runs: dict[str, list[dict]] = {"gguf": [], "dir": []}
    ttft(gguf), ttft(out)  # warm-up: page cache, MLX/python caches
    for _ in range(reps):
        runs["gguf"].append(ttft(gguf))
        runs["dir"].append(ttft(out))
    tokens = {r["token"] for v in runs.values() for r in v}
    assert len(tokens) == 1, f"first token differs between GGUF and directory: {tokens}"

    def med(form: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[form])

    res = {
        "model": name, "gguf_bytes": gguf.stat().st_size, "convert_s": conv_s, "convert_written": len(rep["written"]),
        **{f"{form}_{k}": med(form, k) for form in runs for k in ("wall_s", "import_s", "load_s", "first_token_s")},
    }
    res["ratio_wall"] = res["gguf_wall_s"] / res["dir_wall_s"]
    res["ratio_load"] = res["gguf_load_s"] / res["dir_load_s"]
    return res


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big-gb", type=float, default=2.0, help="size of the synthetic large model (0 = skip)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    from ds4_mlx.testing import make_tiny_gguf

    work = args.workdir or Path(tempfile.mkdtemp(prefix="ds4-load-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    models = [("tiny q2", work / "tiny.gguf", lambda p: make_tiny_gguf(p, experts="q2"))]
    if args.big_gb > 0:
        # f16 experts: 3 matrices of n_ff_exp x n_embd (256 x 256) x 2 bytes per expert per layer
        n_expert = max(16, int(args.big_gb * 1e9 / (6 * 3 * 256 * 256 * 2)))
        models.append((f"synthetic f16 experts x{n_expert}", work / f"big{n_expert}.gguf",
                       lambda p, n=n_expert: make_tiny_gguf(p, experts="f16", n_expert=n, layers=6)))
    results = []
    for name, path, make in models:
        if not path.exists():
            make(path)
        res = bench(name, path, path.with_suffix(".mlx"), args.reps)
        results.append(res)
        print(f"{name:32s} {res['gguf_bytes'] / 1e9:6.2f} GB  time to first token (process start): "
              f"GGUF {res['gguf_wall_s']:.2f} s, dir {res['dir_wall_s']:.2f} s -> {res['ratio_wall']:.2f}x; "
              f"load() GGUF {res['gguf_load_s']:.3f} s, dir {res['dir_load_s']:.3f} s -> {res['ratio_load']:.2f}x; "
              f"first token GGUF {res['gguf_first_token_s']:.3f} s, dir {res['dir_first_token_s']:.3f} s; "
              f"convert {res['convert_s']:.1f} s", flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
