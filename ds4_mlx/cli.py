"""The ``ds4-mlx`` command line (typer). Each subcommand is a thin shell over the library.

Bad input (a missing or non-DS4 file, a truncated GGUF, ...) prints one ``error:`` line on stderr and
exits with status 2 — never a traceback.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from .gguf_file import DS4FormatError, open_gguf
from .layout import decode_bytes_per_token, expected_tensors, optional_tensors

app = typer.Typer(
    name="ds4-mlx",
    help="DeepSeek V4 Flash on MLX: run, serve, inspect and test DS4 GGUF models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()


def fail(message: str) -> None:
    """Print one error line and exit with status 2 (bad input)."""
    Console(stderr=True).print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


@app.command("make-tiny")
def make_tiny(
    out: Path = typer.Argument(..., help="Where to write the GGUF (e.g. tiny.gguf)."),
    seed: int = typer.Option(0, help="Random seed; the same seed writes identical bytes."),
    experts: str = typer.Option("q2", help="Routed-expert layout: q2 (IQ2_XXS/Q2_K), q4 (Q4_K) or f16."),
    hca_ratio: int = typer.Option(16, "--hca-ratio", help="Compression ratio R of the HCA layers (16 or 128)."),
    layers: int = typer.Option(6, help="Number of layers (>= 6 covers every layer kind)."),
) -> None:
    """Write a tiny random-weight DS4 GGUF in the exact published layout (for tests and demos)."""
    from .testing import make_tiny_gguf

    if experts not in ("q2", "q4", "f16"):
        fail(f"--experts must be q2, q4 or f16, got {experts!r}")
    if hca_ratio < 8 or hca_ratio == 4:
        fail(f"--hca-ratio must be >= 8 (and not the CSA ratio 4), got {hca_ratio}")
    if layers < 3:
        fail(f"--layers must be >= 3, got {layers}")
    path = make_tiny_gguf(out, seed=seed, experts=experts, hca_ratio=hca_ratio, layers=layers)
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {experts} experts, HCA ratio {hca_ratio})")


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="A DS4 GGUF file."),
    ctx: list[int] = typer.Option([2048, 32768], help="Context sizes for the bytes-per-token estimate."),
) -> None:
    """Validate a DS4 GGUF and summarize it: config, tensor bytes by type and component, decode bytes/token."""
    try:
        m = open_gguf(model)
    except DS4FormatError as e:
        fail(str(e))
    cfg = m.config
    console.print(f"[bold]{m.path}[/]  {cfg.name or '(unnamed)'}")
    ratios = sorted(set(cfg.compress_ratios))
    summary = Table(show_header=False, box=None, pad_edge=False)
    rows = [
        ("layers", f"{cfg.n_layer} (compress ratios {ratios}, hash layers {cfg.n_hash_layer})"),
        ("width", f"{cfg.n_embd} × {cfg.n_hc} HC streams, vocab {cfg.n_vocab}"),
        ("attention", f"{cfg.n_head} heads × {cfg.head_dim} (rope {cfg.n_rot}), q-LoRA {cfg.q_lora_rank}, "
                      f"{cfg.n_out_group} out groups × {cfg.o_lora_rank}, window {cfg.n_swa}"),
        ("indexer", f"{cfg.n_indexer_head} heads × {cfg.indexer_head_dim}, top-k {cfg.indexer_top_k}"),
        ("experts", f"{cfg.n_expert} routed ({cfg.n_expert_used} used) + {cfg.n_expert_shared} shared, "
                    f"width {cfg.n_ff_exp}, {cfg.experts_label} ({'/'.join(cfg.expert_types)})"),
        ("context", f"{cfg.context_length or '?'} (rope base {cfg.rope_freq_base:g}, compressed {cfg.compress_rope_freq_base:g}, "
                    f"YaRN ×{cfg.rope_scaling_factor:g})"),
    ]
    for k, v in rows:
        summary.add_row(f"[cyan]{k}[/]", v)
    console.print(summary)

    by_type: dict[str, list[int]] = {}
    by_comp: dict[str, list[int]] = {}
    specs = {**expected_tensors(cfg), **optional_tensors(cfg)}
    for t in m.tensors.values():
        for key, table in ((t.qtype.name, by_type), (specs[t.name].component, by_comp)):
            entry = table.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += t.nbytes
    for title, table in (("type", by_type), ("component", by_comp)):
        out = Table(title=f"tensors by {title}", title_justify="left")
        out.add_column(title)
        out.add_column("tensors", justify="right")
        out.add_column("bytes", justify="right")
        for key, (n, b) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            out.add_row(key, str(n), _fmt_bytes(b))
        out.add_row("[bold]total", f"[bold]{len(m.tensors)}", f"[bold]{_fmt_bytes(m.nbytes)}")
        console.print(out)

    sizes = {name: t.nbytes for name, t in m.tensors.items()}
    per_ctx = {c: decode_bytes_per_token(cfg, sizes, c) for c in ctx}
    out = Table(title="bytes read per decoded token (MODEL.md §10)", title_justify="left")
    out.add_column("component")
    for c in ctx:
        out.add_column(f"ctx {c}", justify="right")
    keys = list(dict.fromkeys(k for b in per_ctx.values() for k in b))
    for k in keys:
        out.add_row(k, *(_fmt_bytes(per_ctx[c].get(k, 0)) for c in ctx))
    out.add_row("[bold]total", *(f"[bold]{_fmt_bytes(sum(per_ctx[c].values()))}" for c in ctx))
    console.print(out)


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point."""
    app(args=argv if argv is not None else sys.argv[1:], prog_name="ds4-mlx")
