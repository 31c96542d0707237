"""ds4-bench's speed curve (docs/serving.md §7): prefill and decode tokens/s at growing context frontiers.

The method, exactly as ds4-bench: load once; walk one fixed token sequence to each frontier with incremental
prefill (a row times only the newly added interval); at each frontier snapshot the session (not timed),
time ``gen_tokens`` greedy decode steps choosing the argmax **excluding EOS** (never stopping), restore the
snapshot (not timed) and continue. The decode steps run in the loop ``generate`` and ``serve`` run
(:func:`~ds4_mlx.generate.decode_tokens`: ids drawn on the device, steps queued ahead), so the figure is what a
user gets. The CSV has ds4-bench's columns and number formats, so curves from ds4.c and ds4-mlx compare
directly (``ds4-mlx bench plot``).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import platform
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import mlx.core as mx
import numpy as np

from .config import ModelConfig
from .generate import decode_tokens
from .memory import available_memory, kv_bytes_estimate, scratch_bytes_estimate  # noqa: F401 (public here too)
from .sampling import GREEDY_PARAMS, Sampler
from .session import DEFAULT_CHUNK, Session

CSV_COLUMNS = ("ctx_tokens", "prefill_tokens", "prefill_tps", "gen_tokens", "gen_tps", "kvcache_bytes")


class BenchError(ValueError):
    """Bad bench parameters (frontiers, prompt too short, context that cannot fit in memory)."""


# ---- frontiers -------------------------------------------------------------------------------------------


def frontiers(ctx_start: int, ctx_max: int, step_incr: int | None = None, step_mul: float | None = None) -> list[int]:
    """The context frontiers ds4-bench walks: ``ctx_start``, then ``+ step_incr`` or ``ceil(cur * step_mul)``,
    while ``<= ctx_max``."""
    if ctx_start < 1 or ctx_max < ctx_start:
        raise BenchError(f"need 1 <= --ctx-start <= --ctx-max, got {ctx_start} and {ctx_max}")
    if (step_incr is None) == (step_mul is None):
        raise BenchError("give exactly one of --step-incr and --step-mul")
    if step_incr is not None and step_incr < 1:
        raise BenchError(f"--step-incr must be >= 1, got {step_incr}")
    if step_mul is not None and not step_mul > 1:
        raise BenchError(f"--step-mul must be > 1, got {step_mul}")
    out, f = [], ctx_start
    while f <= ctx_max:
        out.append(f)
        nxt = f + step_incr if step_incr is not None else math.ceil(f * step_mul)
        f = max(nxt, f + 1)  # ceil(f * 1.0001) == f for small f: always advance
    return out


# ---- the token sequence -----------------------------------------------------------------------------------


def generated_tokens(n: int, n_vocab: int, exclude: Sequence[int] = (), seed: int = 0) -> list[int]:
    """``n`` deterministic pseudo-random token ids in ``[0, n_vocab)`` minus ``exclude`` (BOS/EOS/...)."""
    allowed = np.setdiff1d(np.arange(n_vocab), np.asarray(list(exclude), dtype=np.int64))
    return allowed[np.random.default_rng(seed).integers(0, len(allowed), n)].tolist()


def special_ids(tokenizer) -> list[int]:
    """The tokenizer's special token ids (kept out of generated sequences); none without a tokenizer."""
    if tokenizer is None:
        return []
    ids = (getattr(tokenizer, a, None) for a in ("bos_id", "eos_id", "user_id", "assistant_id", "think_id",
                                                  "think_end_id", "dsml_id"))
    return sorted({int(i) for i in ids if i is not None and i >= 0})


# ---- memory --------------------------------------------------------------------------------------------------


@dataclass
class MemoryPlan:
    weights: int
    kv: int
    scratch: int
    available: int
    source: str

    @property
    def needed(self) -> int:
        # the live KV plus one more copy: the generation probe runs on the snapshot's arrays while the
        # capacity buffers may be re-grown
        return self.weights + 2 * self.kv + self.scratch

    def check(self, ctx: int) -> None:
        if self.needed > self.available:
            raise BenchError(
                f"--ctx-max {ctx} cannot fit: weights {self.weights / 1e9:.2f} GB + KV state "
                f"{2 * self.kv / 1e9:.2f} GB (x2 for the snapshot) + prefill scratch {self.scratch / 1e9:.2f} GB "
                f"= {self.needed / 1e9:.2f} GB > {self.available / 1e9:.2f} GB available ({self.source})")


def memory_plan(cfg: ModelConfig, weights_bytes: int, ctx: int, chunk: int) -> MemoryPlan:
    avail, source = available_memory()
    return MemoryPlan(weights_bytes, kv_bytes_estimate(cfg, ctx), scratch_bytes_estimate(cfg, chunk), avail, source)


# ---- the system line -----------------------------------------------------------------------------------------


def git_commit() -> str:
    """Short commit of the ds4-mlx source checkout this package runs from (``+dirty`` with local changes):
    ``$DS4_MLX_COMMIT`` if set (a copy whose git metadata is stale), else git's answer when the package's folder
    sits in ds4-mlx's own checkout (not an installed copy inside some other repository), else ``unknown``."""
    if os.environ.get("DS4_MLX_COMMIT"):
        return os.environ["DS4_MLX_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        if "ds4-mlx" not in (root / "pyproject.toml").read_text(encoding="utf-8"):
            return "unknown"
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        if not top or Path(top).resolve() != root:
            return "unknown"
        out = subprocess.run(["git", "-C", str(root), "describe", "--always", "--dirty=+dirty", "--abbrev=10"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def process_device_memory() -> int | None:
    """Device memory this process holds as the driver counts it (``nvidia-smi``; CUDA only), or None: MLX's
    peak counts its live arrays, not the buffers its cache keeps."""
    if not _is_cuda():
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()) and used.strip().isdigit():
            return int(used) * 2**20
    return None


def system_info(model_desc: str, quant: str) -> dict:
    from .backend import kernel_backend

    info = mx.device_info() if hasattr(mx, "device_info") else {}
    name = info.get("device_name") or info.get("architecture") or platform.processor() or platform.machine()
    from . import __version__

    return {
        "ds4_mlx": __version__,
        "device": f"{mx.default_device()} {name}".strip(),
        "backend": f"mlx-{'cuda' if _is_cuda() else ('metal' if mx.metal.is_available() else 'cpu')} kernels {kernel_backend()}",
        "mlx": mx.__version__,
        "model": model_desc,
        "quant": quant,
        "commit": git_commit(),
        "host": platform.node(),
    }


def _is_cuda() -> bool:
    return bool(getattr(mx, "cuda", None) and mx.cuda.is_available())


def system_line(info: dict) -> str:
    return (f"ds4-mlx bench: ds4-mlx {info.get('ds4_mlx', '?')} commit {info['commit']}; device {info['device']}; "
            f"backend {info['backend']}; mlx {info['mlx']}; model {info['model']}; quant {info['quant']}")


# ---- the walk ------------------------------------------------------------------------------------------------


@dataclass
class BenchRow:
    ctx_tokens: int
    prefill_tokens: int
    prefill_tps: float
    gen_tokens: int
    gen_tps: float
    kvcache_bytes: int
    prefill_s: float = 0.0
    gen_s: float = 0.0
    peak_memory_bytes: int = 0  # MLX's peak of live arrays
    process_memory_bytes: int | None = None  # what the process holds on the device (nvidia-smi), at the row's end

    def csv_fields(self) -> list[str]:
        """The row as ds4-bench prints it: ``%d,%d,%.2f,%d,%.2f,%llu``."""
        return [str(self.ctx_tokens), str(self.prefill_tokens), f"{self.prefill_tps:.2f}", str(self.gen_tokens),
                f"{self.gen_tps:.2f}", str(self.kvcache_bytes)]


@dataclass
class BenchResult:
    rows: list[BenchRow]
    system: dict
    params: dict = field(default_factory=dict)
    warmup_s: float = 0.0
    load_s: float = 0.0

    def csv_text(self) -> str:
        return "\n".join([",".join(CSV_COLUMNS)] + [",".join(r.csv_fields()) for r in self.rows]) + "\n"

    def to_json(self) -> dict:
        rows = [asdict(r) for r in self.rows]
        summary = {}
        if self.rows:
            summary = {
                "frontiers": len(self.rows),
                "prefill_tps_min": min(r.prefill_tps for r in self.rows),
                "prefill_tps_max": max(r.prefill_tps for r in self.rows),
                "gen_tps_first": self.rows[0].gen_tps,
                "gen_tps_last": self.rows[-1].gen_tps,
                "kvcache_bytes_last": self.rows[-1].kvcache_bytes,
                "peak_memory_bytes": max(r.peak_memory_bytes for r in self.rows),
                "process_memory_bytes_max": max((r.process_memory_bytes or 0 for r in self.rows), default=0) or None,
            }
        return {"system": self.system, "system_line": system_line(self.system), "params": self.params,
                "load_s": self.load_s, "warmup_s": self.warmup_s, "columns": list(CSV_COLUMNS), "rows": rows,
                "summary": summary}


def time_decode(session: Session, sampler: Sampler, steps: int) -> float:
    """Seconds for ``steps`` decode steps in the generation loop (:func:`~ds4_mlx.generate.decode_tokens`), from the
    session's logits: ``steps + 1`` ids are taken, the last of them never evaluated into the KV."""
    t0 = time.perf_counter()
    for _ in decode_tokens(session, sampler, steps + 1):
        pass
    return time.perf_counter() - t0


def run_bench(
    model,
    tokens: Sequence[int],
    ctx_points: Sequence[int],
    gen_tokens: int,
    *,
    eos_id: int | None = None,
    chunk: int = DEFAULT_CHUNK,
    warmup: bool = True,
    system: dict | None = None,
    on_row: Callable[[BenchRow], None] | None = None,
    on_frontier: Callable[[int, Session], None] | None = None,
) -> BenchResult:
    """Walk ``tokens`` to each of ``ctx_points``; see the module docstring for the method.

    ``on_frontier(f, session)`` is called at each frontier after its prefill and before the generation
    probe; ``on_row(row)`` after each row is measured (progress display).
    """
    tokens = [int(t) for t in tokens]
    if not ctx_points or list(ctx_points) != sorted(set(ctx_points)):
        raise BenchError("frontiers must be increasing")
    if len(tokens) < ctx_points[-1]:
        raise BenchError(f"the prompt has {len(tokens)} tokens, the last frontier needs {ctx_points[-1]}")
    # greedy, EOS excluded (ds4-bench never stops)
    sampler = Sampler(GREEDY_PARAMS, banned=() if eos_id is None else (eos_id,))

    # KV buffers sized for the whole walk up front (as ds4-bench allocates its context): they never grow, so
    # no generation probe pays a retrace of the compiled decode steps (with doubling buffers, the probes at
    # 2K, 4K, 8K and 16K on the H200 did, at 5.6-7.3 against 12-15 tok/s between them).
    reserve = ctx_points[-1] + gen_tokens
    warmup_s = 0.0
    if warmup:
        # The first calls JIT-compile every kernel (NVRTC on CUDA, Metal library builds) and trace the compiled
        # decode steps: not a speed. Decode 4 tokens (a ratio-4 window completes) just below 4 x indexer_top_k
        # tokens and again past it, so the steps with and without the indexer's selection are all traced and the
        # selection's prefill path is compiled too: without it the H200 run's first gen row (2048) and second
        # prefill row (4096) paid the compile (2.3 / 259 t/s), and with only the mark past it, the 2048 row still
        # paid the tracing of the steps without selection (16.9 against 24.1 t/s at 4096).
        t0 = time.perf_counter()
        ws = Session(model, chunk_size=chunk, reserve=reserve)
        k4 = 4 * model.cfg.indexer_top_k
        for mark in sorted({min(ctx_points[-1], max(1, k4 - 8)), min(ctx_points[-1], k4 + chunk)}):
            if mark > ws.pos:
                ws.prefill(tokens[ws.pos : mark])
            time_decode(ws, sampler, 4)
        del ws
        mx.clear_cache()
        warmup_s = time.perf_counter() - t0

    sess = Session(model, chunk_size=chunk, reserve=reserve)
    rows: list[BenchRow] = []
    for f in ctx_points:
        mx.reset_peak_memory()
        start = sess.pos
        t0 = time.perf_counter()
        sess.prefill(tokens[start:f])  # evaluates every chunk: the clock stops when the work is done
        t_prefill = time.perf_counter() - t0
        if on_frontier is not None:
            on_frontier(f, sess)
        snap = sess.snapshot()
        kv = sess.kv_bytes
        t_gen = 0.0
        if gen_tokens > 0:
            t_gen = time_decode(sess, sampler, gen_tokens)
            sess.restore(snap)
        del snap
        row = BenchRow(
            ctx_tokens=f, prefill_tokens=f - start, prefill_tps=(f - start) / t_prefill, gen_tokens=gen_tokens,
            gen_tps=gen_tokens / t_gen if t_gen > 0 else 0.0, kvcache_bytes=kv, prefill_s=t_prefill, gen_s=t_gen,
            peak_memory_bytes=int(mx.get_peak_memory()), process_memory_bytes=process_device_memory(),
        )
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return BenchResult(rows, system or {}, warmup_s=warmup_s)


# ---- reading CSVs (ours and ds4's: BOM and CRLF tolerated) -------------------------------------------------------


def read_csv(path: str | os.PathLike) -> list[dict]:
    """Rows of a ds4-bench CSV as dicts of numbers (ctx_tokens, prefill_tps, gen_tps, ...), sorted by context."""
    text = Path(path).read_text(encoding="utf-8-sig")
    reader = csv.DictReader(io.StringIO(text))
    missing = {"ctx_tokens", "prefill_tps", "gen_tps"} - set(reader.fieldnames or ())
    if missing:
        raise BenchError(f"{path}: not a ds4-bench CSV (missing columns: {', '.join(sorted(missing))})")
    rows = []
    for r in reader:
        rows.append({k: (float(v) if "." in v else int(v)) for k, v in r.items() if k in CSV_COLUMNS and v})
    if not rows:
        raise BenchError(f"{path}: no rows")
    return sorted(rows, key=lambda r: r["ctx_tokens"])


def ratios(ours: list[dict], base: list[dict]) -> list[dict]:
    """Per-frontier speed ratios ``ours / base`` at the contexts both runs measured."""
    by_ctx = {r["ctx_tokens"]: r for r in base}
    out = []
    for r in ours:
        b = by_ctx.get(r["ctx_tokens"])
        if b is None:
            continue
        out.append({"ctx_tokens": r["ctx_tokens"],
                    "prefill_ratio": r["prefill_tps"] / b["prefill_tps"] if b["prefill_tps"] else float("nan"),
                    "gen_ratio": r["gen_tps"] / b["gen_tps"] if b["gen_tps"] else float("nan")})
    return out


def write_outputs(result: BenchResult, csv_path: Path | None, json_path: Path | None) -> list[Path]:
    """Write the CSV (exactly ds4-bench's bytes), its ``.system.txt`` sidecar, and the JSON summary."""
    written = []
    if csv_path is not None:
        csv_path.write_text(result.csv_text(), encoding="utf-8")
        side = csv_path.with_suffix(".system.txt")
        side.write_text(system_line(result.system) + "\n" + json.dumps(result.params) + "\n", encoding="utf-8")
        written += [csv_path, side]
    if json_path is not None:
        json_path.write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
        written.append(json_path)
    return written


# ---- plotting (optional extra: pip install 'ds4-mlx[plot]') ----------------------------------------------------


def plot_curves(paths: Sequence[str | os.PathLike], out: str | os.PathLike, labels: Sequence[str] | None = None,
                title: str | None = None, dashed: Sequence[int] = ()) -> Path:
    """Prefill and decode t/s against context for several ds4-bench CSVs, on one figure (SVG/PNG/PDF by suffix).

    Each run is one line in each panel; the lines carry the SVG ids ``run-<i>-prefill`` / ``run-<i>-gen``.
    Runs whose index is in ``dashed`` (e.g. a baseline) are drawn dashed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise BenchError("plotting needs matplotlib: pip install 'ds4-mlx[plot]'") from None
    labels = list(labels) if labels else [Path(p).stem for p in paths]
    runs = [read_csv(p) for p in paths]
    fig, (ax_p, ax_g) = plt.subplots(1, 2, figsize=(12, 4.8), constrained_layout=True)
    for i, (rows, label) in enumerate(zip(runs, labels)):
        ctx = [r["ctx_tokens"] for r in rows]
        ls = "--" if i in dashed else "-"
        (lp,) = ax_p.plot(ctx, [r["prefill_tps"] for r in rows], ls=ls, marker="o", ms=3, label=label)
        (lg,) = ax_g.plot(ctx, [r["gen_tps"] for r in rows], ls=ls, marker="o", ms=3, label=label,
                          color=lp.get_color())
        lp.set_gid(f"run-{i}-prefill")
        lg.set_gid(f"run-{i}-gen")
    for ax, what in ((ax_p, "prefill t/s (new interval)"), (ax_g, "decode t/s (greedy)")):
        ax.set_xlabel("context tokens")
        ax.set_ylabel(what)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    ax_g.legend(fontsize="small")
    fig.suptitle(title or "ds4-bench speed curves")
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out
