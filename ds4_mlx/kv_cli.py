"""``ds4-mlx kv``: look at and tidy a disk KV cache directory (the server's ``--kv-disk-dir``).

    ds4-mlx kv ls DIR            files: tokens, size, save reason, age, hits, a preview of the cached text
    ds4-mlx kv show FILE         one file: header, payload dimensions, text head and tail, tool ids
    ds4-mlx kv rm FILE|PREFIX…   delete files (a name prefix is looked up in --dir)
    ds4-mlx kv prune DIR --max-mb N   evict the least useful files until the directory fits (SERVING.md §5.7)

Registered by the main CLI as ``app.add_typer(kv_app, name="kv")``. Nothing here loads a model.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import List, Optional

import typer

from .kvstore import PAYLOAD_HEAD, KVCacheError, evict_dir, list_entries, read_kv_file, score

kv_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                     help="Inspect and prune the disk KV cache (files written by `serve --kv-disk-dir`).")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _age(t: int, now: float) -> str:
    s = max(0, int(now - t))
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= n:
            return f"{s // n}{unit}"
    return f"{s}s"


def _preview(text: bytes, n: int) -> str:
    """The end of the cached text (the part that tells prefixes apart), one line, escaped."""
    t = text.decode("utf-8", "replace")
    t = t if len(t) <= n else "…" + t[-(n - 1):]
    return t.replace("\n", "\\n").replace("\t", "\\t")


def _check_dir(directory: Path) -> None:
    if not directory.is_dir():
        typer.echo(f"error: {directory} is not a directory", err=True)
        raise typer.Exit(2)


@kv_app.command("ls")
def ls(
    directory: Path = typer.Argument(..., help="The cache directory (--kv-disk-dir)."),
    as_json: bool = typer.Option(False, "--json", help="One JSON object per file."),
    width: int = typer.Option(48, "--preview", help="Characters of text preview."),
) -> None:
    """List cache files, most useful first."""
    _check_dir(directory)
    bad: list[tuple[str, str]] = []
    entries = list_entries(directory, lambda name, why: bad.append((name, why)))
    now = time.time()
    entries.sort(key=lambda e: score(e.header, e.size, now), reverse=True)
    if as_json:
        for e in entries:
            h = e.header
            kf = read_kv_file(e.path, with_payload=False)
            typer.echo(json.dumps({"file": e.name, "tokens": h.tokens, "bytes": e.size, "reason": h.reason_name,
                                   "hits": h.hits, "created": h.created, "last_used": h.last_used, "ctx": h.ctx,
                                   "quant_bits": h.quant_bits, "text_bytes": h.text_bytes,
                                   "preview": _preview(kf.text, width)}, ensure_ascii=False))
        return
    typer.echo(f"{'file':<14}{'tokens':>8}{'size':>11}  {'reason':<10}{'age':>6}{'used':>6}{'hits':>6}  text")
    for e in entries:
        h = e.header
        kf = read_kv_file(e.path, with_payload=False)
        typer.echo(f"{e.name[:12]:<14}{h.tokens:>8}{_size(e.size):>11}  {h.reason_name:<10}"
                   f"{_age(h.created, now):>6}{_age(h.last_used or h.created, now):>6}{h.hits:>6}  "
                   f"{_preview(kf.text, width)}")
    total = sum(e.size for e in entries)
    typer.echo(f"{len(entries)} files, {_size(total)}" + (f"; {len(bad)} unreadable:" if bad else ""))
    for name, why in bad:
        typer.echo(f"  {name}: {why}")


@kv_app.command("show")
def show(path: Path = typer.Argument(..., help="A .kv file."),
         chars: int = typer.Option(200, "--chars", help="Characters of text shown from each end.")) -> None:
    """Show one file: header, payload dimensions, cached text (head and tail), tool ids."""
    try:
        kf = read_kv_file(path)
    except KVCacheError as e:
        typer.echo(f"error: {path}: {e}", err=True)
        raise typer.Exit(1)
    h, now = kf.header, time.time()
    typer.echo(f"file        {path}")
    typer.echo(f"tokens      {h.tokens}   (saved: {h.reason_name}, ctx {h.ctx}, expert quant {h.quant_bits} bits)")
    typer.echo(f"size        {_size(path.stat().st_size)}: text {h.text_bytes} B, payload {h.payload_bytes} B"
               f" ({h.payload_bytes / h.tokens / 1024:.1f} KiB/token)")
    typer.echo(f"hits        {h.hits}   created {_age(h.created, now)} ago, last used "
               f"{_age(h.last_used or h.created, now)} ago, score {score(h, path.stat().st_size, now):.3g}")
    flags = [n for b, n in ((1, "tool-map"), (2, "responses-visible"), (4, "thinking-visible")) if h.flags & b]
    typer.echo(f"flags       {', '.join(flags) or '-'}   model fingerprint {h.model_id:#010x}")
    if len(kf.payload) >= PAYLOAD_HEAD.size:
        f = struct.unpack_from("<13I", kf.payload)
        typer.echo(f"payload     magic {f[0]:#x} v{f[1]}: ctx {f[2]}, prefill chunk {f[3]}, raw window {f[5]}, "
                   f"{f[8]} layers, head dim {f[9]}, indexer dim {f[10]}, vocab {f[11]}, {f[12]} raw rows")
    text = kf.text.decode("utf-8", "replace")
    typer.echo("text        " + (repr(text) if len(text) <= 2 * chars
                                 else f"{text[:chars]!r} … {text[-chars:]!r}"))
    if kf.tool_map:
        typer.echo(f"tool ids    {', '.join(sorted(kf.tool_map))}")


@kv_app.command("rm")
def rm(targets: List[str] = typer.Argument(..., help="Files, or name prefixes looked up in --dir."),
       directory: Optional[Path] = typer.Option(None, "--dir", help="Directory for name prefixes.")) -> None:
    """Delete cache files."""
    for t in targets:
        p = Path(t)
        if not p.exists() and directory is not None:
            matches = [e.path for e in list_entries(directory) if e.name.startswith(t)]
            if len(matches) != 1:
                typer.echo(f"error: {t}: {len(matches)} files match in {directory}", err=True)
                raise typer.Exit(1)
            p = matches[0]
        if not p.name.endswith(".kv") or not p.is_file():
            typer.echo(f"error: {t}: not a .kv file", err=True)
            raise typer.Exit(1)
        p.unlink()
        typer.echo(f"removed {p}")


@kv_app.command("prune")
def prune(directory: Path = typer.Argument(..., help="The cache directory."),
          max_mb: float = typer.Option(..., "--max-mb", help="Keep at most this many MiB (least useful go first).")
          ) -> None:
    """Evict files by usefulness until the directory fits in --max-mb (the server's eviction rule)."""
    _check_dir(directory)
    removed = evict_dir(directory, int(max_mb * (1 << 20)))
    for e in removed:
        typer.echo(f"removed {e.name} ({e.header.tokens} tokens, {_size(e.size)}, hits {e.header.hits})")
    left = list_entries(directory)
    typer.echo(f"{len(removed)} removed; {len(left)} files, {_size(sum(e.size for e in left))} left")
