"""``ds4-mlx bench``: ds4-bench-compatible speed curves (docs/serving.md §7) and ``ds4-mlx bench plot``.

Registered by the main app with ``app.add_typer(bench_app, name="bench")``. Bad input prints one
``error:`` line on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer
from rich.console import Console
from rich.table import Table

from . import bench as B
from .cli_common import (CACHE_LIMIT_HELP, PREFILL_CHUNK_HELP, SsdCacheOpt, SsdPreloadOpt, SsdProfileOpt,
                         SsdStreamingOpt, check_output_file, expert_streaming, fail, follow, lead, parallel_group)
from .distributed import Follower
from .session import DEFAULT_CHUNK

bench_app = typer.Typer(
    help="ds4-bench speed curves: prefill and decode t/s at growing context; `bench plot` draws them.",
    invoke_without_command=True,
    no_args_is_help=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"help_option_names": ["-h", "--help"]},
)
err = Console(stderr=True, highlight=False, soft_wrap=True)


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return str(n)


@bench_app.callback()
def bench(
    ctx: typer.Context,
    model: Optional[Path] = typer.Option(None, "-m", "--model", help="A DS4 GGUF file."),
    random_weights: Optional[str] = typer.Option(
        None, "--random-weights", help="No file: random weights in memory at the 'tiny' or 'full' (V4 Flash) shape."),
    experts: str = typer.Option("q2", help="Routed-expert layout of --random-weights: q2 or q4."),
    layers: Optional[int] = typer.Option(None, help="Truncate --random-weights to this many layers (smoke runs)."),
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", help="Raw text (plain BPE, no BOS). Default: a deterministic generated token sequence."),
    ctx_start: int = typer.Option(2048, "--ctx-start", help="First frontier."),
    ctx_max: int = typer.Option(32768, "--ctx-max", help="Last frontier (at most)."),
    step_incr: Optional[int] = typer.Option(None, "--step-incr", help="Next frontier = current + K (default 2048)."),
    step_mul: Optional[float] = typer.Option(None, "--step-mul", help="Next frontier = ceil(current * X)."),
    gen_tokens: int = typer.Option(128, "-n", "--gen-tokens", help="Greedy decode steps timed at each frontier."),
    chunk: int = typer.Option(DEFAULT_CHUNK, "--prefill-chunk", "--chunk", help=PREFILL_CHUNK_HELP),
    csv_out: Optional[Path] = typer.Option(
        None, "--csv", help="Write the CSV here (ds4-bench's exact format; the system line goes to OUT.system.txt)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write a JSON summary here ('-' = stdout)."),
    seed: int = typer.Option(0, help="Seed of the random weights and of the generated token sequence."),
    numerics: str = typer.Option("ds4", help="Numeric profile: ds4 or hf."),
    cache_limit_gb: Optional[float] = typer.Option(None, "--cache-limit-gb", help=CACHE_LIMIT_HELP),
    ssd_streaming: bool = SsdStreamingOpt,
    ssd_streaming_cache_experts: Optional[str] = SsdCacheOpt,
    ssd_streaming_preload_experts: Optional[int] = SsdPreloadOpt,
    ssd_streaming_profile: Optional[Path] = SsdProfileOpt,
    parallel: Optional[str] = typer.Option(
        None, "--parallel", help="Over the ranks started by mlx.launch: 'pipeline' splits the layers evenly; 'expert' "
        "gives each rank a share of the routed and shared experts, 'tensor' of the attention heads too. Rank 0 "
        "measures, prints and writes the outputs; the others follow it."),
    no_warmup: bool = typer.Option(False, "--no-warmup", help="Skip the untimed warm-up (a throwaway session that decodes 4 steps just below 4 x indexer top-k tokens and 4 more after one chunk past it, so kernel compilation and the decode-step traces are not timed)."),
) -> None:
    """Measure prefill and decode speed at each context frontier, ds4-bench's way (docs/serving.md §7)."""
    if ctx.invoked_subcommand is not None:
        return
    if (model is None) == (random_weights is None):
        fail("give exactly one of -m/--model FILE and --random-weights {tiny,full}")
    streaming = expert_streaming(ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_preload_experts,
                                 ssd_streaming_profile)
    expert_cache = streaming.get("expert_cache")
    if expert_cache is not None and model is None:
        fail("--ssd-streaming reads the experts from a file: give -m FILE")
    if random_weights is not None and random_weights not in ("tiny", "full"):
        fail(f"--random-weights must be tiny or full, got {random_weights!r}")
    if experts not in ("q2", "q4"):
        fail(f"--experts must be q2 or q4, got {experts!r}")
    if gen_tokens < 1 or chunk < 1:
        fail("--gen-tokens and --chunk must be > 0")
    if parallel is not None and expert_cache is not None:
        fail(f"--ssd-streaming is not available with --parallel {parallel}")
    group = parallel_group(parallel, None)
    if group is not None and group.rank() > 0:  # the other ranks follow rank 0, quietly
        err.quiet, csv_out, json_out = True, None, None
    if step_incr is None and step_mul is None:
        step_incr = 2048
    if prompt_file is not None and not prompt_file.is_file():
        fail(f"--prompt-file {prompt_file}: no such file")
    if csv_out is not None:
        check_output_file(csv_out, "--csv")
    if json_out is not None and str(json_out) != "-":
        check_output_file(json_out, "--json")
    try:
        points = B.frontiers(ctx_start, ctx_max, step_incr, step_mul)
    except B.BenchError as e:
        fail(str(e))
    n_ctx = points[-1] + gen_tokens + 1  # ds4-bench's --ctx-alloc default

    # ---- plan memory before loading anything
    from .distributed import held_share, rank_share
    from .random_model import random_weights_bytes, shape_config

    def share(cfg):  # (cut, keep): this rank's part of the tensors, for the memory plan
        if group is None:
            return None, None
        try:
            _, keep, cut = rank_share(cfg, parallel, group.size(), group.rank())
        except ValueError as e:
            fail(str(e))
        return cut, keep

    if random_weights is not None:
        cfg = shape_config(random_weights, layers)
        weights_bytes = random_weights_bytes(cfg, experts, *share(cfg))
        desc = f"random {random_weights} shape ({cfg.n_layer} layers, seed {seed})"
        quant = f"{experts} experts"
    else:
        from .gguf_file import DS4FormatError, open_gguf

        try:
            g = open_gguf(model)
        except (DS4FormatError, OSError) as e:
            fail(str(e))
        cfg, (cut, keep) = g.config, share(g.config)
        weights_bytes = round(sum(t.nbytes * held_share(cut, n, t.shape, keep) for n, t in g.tensors.items()))
        if expert_cache is not None:
            from .loader import check_expert_cache

            try:
                cache_bytes, routed_bytes = check_expert_cache(model, expert_cache, streaming["expert_profile"])
            except ValueError as e:
                fail(str(e))
            weights_bytes += cache_bytes - routed_bytes
        desc = f"{model.name} ({cfg.name or 'DS4'})"
        quant = f"{cfg.experts_label} ({'/'.join(cfg.expert_types)})"
        del g
    if group is not None:
        desc += f"; {parallel} parallel over {group.size()} ranks"
    plan = B.memory_plan(cfg, weights_bytes, n_ctx, chunk)
    try:
        plan.check(n_ctx)
    except B.BenchError as e:
        fail(str(e))

    system = B.system_info(desc, quant)
    sline = B.system_line(system)
    err.print(sline)
    err.print(f"memory plan: weights {_fmt_bytes(plan.weights)}, KV at ctx {n_ctx} <= {_fmt_bytes(plan.kv)}, "
              f"scratch {_fmt_bytes(plan.scratch)}; {_fmt_bytes(plan.available)} available ({plan.source})")

    # ---- load once
    t0 = time.perf_counter()
    if random_weights is not None:
        from .random_model import random_model

        m, tok = random_model(random_weights, experts, seed=seed, numerics=numerics, layers=layers, group=group,
                              parallel=parallel or "expert")  # fmt: skip
    else:
        from .loader import load

        try:
            m, tok = load(model, numerics, group=group, parallel=parallel or "pipeline", **streaming)
        except ValueError as e:
            fail(str(e))
    if isinstance(m, Follower):
        return follow(m)  # rank 0 measures
    load_s = time.perf_counter() - t0
    from .memory import set_memory_limits

    try:
        limits = set_memory_limits(weights_bytes, plan.kv, cache_gb=cache_limit_gb)
    except ValueError as e:
        fail(str(e))
    err.print(f"loaded in {load_s:.1f} s; active memory {_fmt_bytes(_active())}; {limits.describe()}")

    # ---- the token sequence
    need = points[-1]
    if prompt_file is not None:
        if tok is None:
            fail("this model has no tokenizer: --prompt-file needs one (leave it out to use generated tokens)")
        ids = tok.encode(prompt_file.read_bytes())
        if len(ids) < need:
            fail(f"--prompt-file has {len(ids)} tokens, --ctx-max needs {need} (ds4-bench: the prompt must "
                  f"have >= ctx-max tokens)")
        prompt_desc = f"{prompt_file.name} ({len(ids)} tokens)"
    else:
        ids = B.generated_tokens(need, m.cfg.n_vocab, B.special_ids(tok), seed)
        prompt_desc = f"generated token ids (seed {seed})"
    eos = getattr(tok, "eos_id", None) if tok is not None else None
    params = {"ctx_start": ctx_start, "ctx_max": ctx_max, "step_incr": step_incr, "step_mul": step_mul,
              "gen_tokens": gen_tokens, "chunk": chunk, "frontiers": points, "prompt": prompt_desc,
              "numerics": numerics, "eos_excluded": eos, "cache_limit_bytes": limits.cache}
    err.print(f"prompt: {prompt_desc}; frontiers {points[0]}..{points[-1]} ({len(points)}), "
              f"{gen_tokens} generated tokens each, chunk {chunk}")

    # ---- the walk, one progress line per row
    header = (f"{'ctx':>8} {'prefill':>8} {'prefill t/s':>12} {'gen':>5} {'gen t/s':>9} {'kv cache':>11} "
              f"{'peak mem':>11} {'process mem':>12}")
    err.print(f"[bold]{header}[/]")

    if csv_out is not None:  # rows are appended as they are measured, so a run cut short keeps its rows
        csv_out.write_text(",".join(B.CSV_COLUMNS) + "\n", encoding="utf-8")
        csv_out.with_suffix(".system.txt").write_text(sline + "\n" + json.dumps(params) + "\n", encoding="utf-8")

    cache = m.expert_cache
    before_gen: dict = {}  # the streamed experts' counters when a row's generation starts
    gen_experts: list[dict] = []  # per row: what its generation asked of the cache

    def on_frontier(_f: int, _session) -> None:
        if cache is not None:
            before_gen.update(cache.stats())

    def on_row(r: B.BenchRow) -> None:
        if csv_out is not None:
            with csv_out.open("a", encoding="utf-8") as f:
                f.write(",".join(r.csv_fields()) + "\n")
        proc = "-" if r.process_memory_bytes is None else _fmt_bytes(r.process_memory_bytes)
        err.print(f"{r.ctx_tokens:>8} {r.prefill_tokens:>8} {r.prefill_tps:>12.2f} {r.gen_tokens:>5} "
                  f"{r.gen_tps:>9.2f} {_fmt_bytes(r.kvcache_bytes):>11} {_fmt_bytes(r.peak_memory_bytes):>11} "
                  f"{proc:>12}")
        if cache is not None and r.gen_tokens:
            now = cache.stats()
            d = {k: now[k] - before_gen[k] for k in ("hits", "misses", "bytes_read", "read_s")}
            d["hit_rate"] = round(d["hits"] / max(d["hits"] + d["misses"], 1), 4)
            gen_experts.append({"ctx": r.ctx_tokens, **d})
            err.print(f"{'':>8} decoding: expert hit rate {d['hit_rate']}, {d['bytes_read'] / r.gen_tokens / 1e6:.1f} "
                      f"MB read a token in {d['read_s'] / r.gen_tokens * 1e3:.1f} ms")  # fmt: skip

    try:
        with err.status("warming up (JIT) ..." if not no_warmup else "running ..."), lead(m):
            result = B.run_bench(m, ids, points, gen_tokens, eos_id=eos, chunk=chunk, warmup=not no_warmup,
                                 system=system, on_row=on_row, on_frontier=on_frontier)
    except B.BenchError as e:
        fail(str(e))
    result.params, result.load_s = params, load_s
    if cache is not None:
        result.params["experts"] = cache.stats()
        result.params["experts_decoding"] = gen_experts
        err.print(cache.describe())

    summary = Table(title="ds4-mlx bench", title_justify="left", caption=sline, caption_justify="left")
    for col in ("ctx", "prefill", "prefill t/s", "gen", "gen t/s", "kv bytes", "peak mem"):
        summary.add_column(col, justify="right")
    for r in result.rows:
        summary.add_row(*r.csv_fields(), _fmt_bytes(r.peak_memory_bytes))
    err.print(summary)

    json_path = None if json_out is None or str(json_out) == "-" else json_out
    for p in B.write_outputs(result, csv_out, json_path):
        err.print(f"wrote {p}")
    if json_out is not None and str(json_out) == "-":
        sys.stdout.write(json.dumps(result.to_json(), indent=2) + "\n")
    elif csv_out is None and not err.quiet:
        sys.stdout.write(result.csv_text())  # like ds4-bench without --csv: the CSV on stdout


def _active() -> int:
    import mlx.core as mx

    return mx.get_active_memory()


@bench_app.command("plot")
def plot(
    csvs: List[Path] = typer.Argument(..., help="ds4-bench CSVs (ours or ds4.c's)."),
    out: Path = typer.Option(Path("speed.svg"), "-o", "--output", help="Figure file (.svg, .png, .pdf)."),
    vs: Optional[Path] = typer.Option(None, "--vs", help="Baseline CSV: also plotted, and per-frontier ratios printed."),
    label: Optional[List[str]] = typer.Option(None, "--label", help="Legend label per CSV (default: file stem)."),
    title: Optional[str] = typer.Option(None, help="Figure title."),
) -> None:
    """Plot prefill and decode t/s against context for several runs on one figure."""
    for p in [*csvs, *([vs] if vs else [])]:
        if not p.is_file():
            fail(f"{p}: no such file")
    check_output_file(out, "-o/--output")
    labels = list(label) if label else [p.stem for p in csvs]
    if len(labels) != len(csvs):
        fail(f"give one --label per CSV ({len(csvs)}), got {len(labels)}")
    paths = list(csvs) + ([vs] if vs else [])
    labels += [f"{vs.stem} (baseline)"] if vs else []
    try:
        B.plot_curves(paths, out, labels, title, dashed=[len(csvs)] if vs else [])
        if vs:
            base = B.read_csv(vs)
            for p, lab in zip(csvs, labels):
                rs = B.ratios(B.read_csv(p), base)
                table = Table(title=f"{lab} vs {vs.stem}", title_justify="left")
                for c in ("ctx_tokens", "prefill ×", "decode ×"):
                    table.add_column(c, justify="right")
                for r in rs:
                    table.add_row(str(r["ctx_tokens"]), f"{r['prefill_ratio']:.2f}", f"{r['gen_ratio']:.2f}")
                if not rs:
                    table.add_row("(no common frontiers)", "", "")
                Console().print(table)
    except B.BenchError as e:
        fail(str(e))
    except ValueError as e:  # a malformed number in a CSV
        fail(f"bad CSV: {e}")
    err.print(f"wrote {out}")
