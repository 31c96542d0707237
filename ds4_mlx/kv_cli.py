"""``ds4-mlx kv``: look at and tidy a disk KV cache directory (the server's ``--kv-disk-dir``).

    ds4-mlx kv ls DIR                  files: tokens, size, save reason, age, hits, a preview of the cached text
    ds4-mlx kv show NAME [--dir DIR]   one file: header, payload dimensions, text head and tail, tool ids
    ds4-mlx kv rm NAME… [--dir DIR]    delete files
    ds4-mlx kv prune DIR --max-mb N    evict the least useful files until the directory fits (docs/serving.md §5.7)

NAME is a file, or the start of a file name (what ``ls`` prints) looked up in ``--dir`` (default: the folder
NAME names, else the current one). Registered by the main CLI as ``app.add_typer(kv_app, name="kv")``.
Nothing here loads a model. Bad input: one ``error:`` line, exit status 2.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import List, Optional

import typer

from .cli_common import fail
from .kvstore import PAYLOAD_HEAD, KVCacheError, evict_dir, list_entries, read_kv_file, score

kv_app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
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
        fail(f"{directory} is not a directory")


def _resolve(target: str, directory: Optional[Path]) -> Path:
    """A cache file from a path, or from the start of its name (``ls`` prints the first 12 characters) looked
    up in ``directory`` (default: the folder the target names, else the current one)."""
    p = Path(target)
    if p.is_file():
        if not p.name.endswith(".kv"):
            fail(f"{target}: not a .kv file")
        return p
    folder = directory if directory is not None else p.parent
    _check_dir(folder)
    prefix = p.name if directory is None else target
    matches = sorted(f for f in folder.glob("*.kv") if f.name.startswith(prefix) and f.is_file())
    if len(matches) > 1:
        fail(f"{target}: {len(matches)} files in {folder} start with {prefix!r}")
    if not matches:
        hint = "" if directory is not None else " (pass the cache directory with --dir DIR, or the file's path)"
        fail(f"{target}: no file in {folder} starts with {prefix!r}{hint}")
    return matches[0]


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
    typer.echo(f"{len(entries)} files, {_size(total)}" + (f"; {len(bad)} unreadable:" if bad else "")
               + (f"   (one in full: ds4-mlx kv show NAME --dir {directory})" if entries and not bad else ""))
    for name, why in bad:
        typer.echo(f"  {name}: {why}")


@kv_app.command("show")
def show(name: str = typer.Argument(..., help="A .kv file, or the start of its name as `kv ls` prints it."),
         directory: Optional[Path] = typer.Option(None, "--dir", help="The cache directory NAME is looked up in."),
         chars: int = typer.Option(200, "--chars", min=0, help="Characters of text shown from each end.")) -> None:
    """Show one file: header, payload dimensions, cached text (head and tail), tool ids."""
    path = _resolve(name, directory)
    try:
        kf = read_kv_file(path)
    except KVCacheError as e:
        fail(f"{path}: {e}")
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
def rm(targets: List[str] = typer.Argument(..., help="Files, or the start of their names as `kv ls` prints them."),
       directory: Optional[Path] = typer.Option(None, "--dir", help="The cache directory names are looked up in.")) -> None:
    """Delete cache files (every name is resolved before any file is deleted)."""
    for p in dict.fromkeys(_resolve(t, directory) for t in targets):
        p.unlink()
        typer.echo(f"removed {p}")


@kv_app.command("prune")
def prune(directory: Path = typer.Argument(..., help="The cache directory."),
          max_mb: float = typer.Option(..., "--max-mb", help="Keep at most this many MiB (least useful go first).")
          ) -> None:
    """Evict files by usefulness until the directory fits in --max-mb (the server's eviction rule)."""
    if not max_mb >= 0:  # NaN too
        fail(f"--max-mb must be >= 0, got {max_mb}")
    _check_dir(directory)
    removed = evict_dir(directory, int(max_mb * (1 << 20)))
    for e in removed:
        typer.echo(f"removed {e.name} ({e.header.tokens} tokens, {_size(e.size)}, hits {e.header.hits})")
    left = list_entries(directory)
    typer.echo(f"{len(removed)} removed; {len(left)} files, {_size(sum(e.size for e in left))} left")
