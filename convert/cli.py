"""``ds4-mlx convert``: the typer command (registered by ``ds4_mlx.cli``)."""

from __future__ import annotations

from pathlib import Path

import typer


def convert_cmd(
    model: Path = typer.Argument(..., help="Source DS4 GGUF file."),
    out_dir: Path = typer.Argument(..., help="Output model directory (created; a partial one is resumed)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the shard plan and sizes; write nothing."),
    shard_gb: float = typer.Option(5.0, "--shard-gb", help="Maximum shard size in GB (10^9 bytes)."),
    no_load_check: bool = typer.Option(
        False, "--no-load-check", help="Skip timing the load of the GGUF vs the directory at the end (loads both)."
    ),
    verify: bool = typer.Option(False, "--verify", help="Only verify OUT_DIR: shard sizes and sha256 checksums."),
) -> None:
    """Convert a DS4 GGUF into an MLX model directory (config.json, tokenizer.json, safetensors shards).

    Lossless: every tensor keeps its GGUF bytes and name. Loading the directory (``-m OUT_DIR``) gives
    bit-identical logits to the GGUF.
    """
    from ds4_mlx.gguf_file import DS4FormatError
    from ds4_mlx.mlx_dir import read_dir_config, verify_dir

    try:
        if verify:
            read_dir_config(out_dir)
            verify_dir(out_dir)
            typer.echo(f"{out_dir}: OK (every shard's size and sha256 match the index)")
            return
        from .gguf_to_mlx import convert

        convert(model, out_dir, dry_run=dry_run, shard_bytes=shard_gb * 1e9, progress=True,
                measure_load=not (dry_run or no_load_check))
    except DS4FormatError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
