"""``ds4-mlx convert``: the typer command (registered by ``ds4_mlx.cli``)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

# Each shard keeps this much room for its safetensors header (see gguf_to_mlx.plan_shards).
MIN_SHARD_GB = 0.002


def convert_cmd(
    model: Path = typer.Argument(..., help="Source DS4 GGUF file (with --verify alone: the directory to check)."),
    out_dir: Optional[Path] = typer.Argument(None, help="Output model directory (created; a partial one is resumed)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the shard plan and sizes; write nothing."),
    shard_gb: float = typer.Option(5.0, "--shard-gb", help="Maximum shard size in GB (10^9 bytes)."),
    no_load_check: bool = typer.Option(
        False, "--no-load-check", help="Skip timing the load of the GGUF vs the directory at the end (loads both)."
    ),
    verify: bool = typer.Option(
        False, "--verify", help="Only verify a converted directory (convert --verify DIR): shard sizes and sha256."
    ),
) -> None:
    """Convert a DS4 GGUF into an MLX model directory (config.json, tokenizer.json, safetensors shards).

    Lossless: every tensor keeps its GGUF bytes and name, so loading the directory (-m OUT_DIR) gives
    bit-identical logits to the GGUF. ds4-mlx convert --verify DIR checks a finished directory.
    """
    from ds4_mlx.cli_common import fail
    from ds4_mlx.gguf_file import DS4FormatError
    from ds4_mlx.mlx_dir import check_model

    try:
        if verify:
            target = out_dir or model  # `convert --verify DIR`, or the full command line with --verify added
            if not target.is_dir():
                fail(f"{target}: not a directory (convert --verify DIR checks a converted model directory)")
            check_model(target, verify=True)
            typer.echo(f"{target}: OK (every shard's size and sha256 match the index; the model passes every load check)")
            return
        if out_dir is None:
            fail("missing OUT_DIR: convert MODEL.gguf OUT_DIR (or convert --verify DIR)")
        if not shard_gb >= MIN_SHARD_GB:  # NaN too
            fail(f"--shard-gb must be at least {MIN_SHARD_GB} (1 MB of each shard is kept for its header), got {shard_gb}")
        if out_dir.exists() and not out_dir.is_dir():
            fail(f"{out_dir}: exists and is not a directory (OUT_DIR is created, or a partial one resumed)")
        if not dry_run and not out_dir.exists() and not out_dir.parent.is_dir():
            fail(f"{out_dir}: the folder {out_dir.parent} does not exist")
        from .gguf_to_mlx import convert

        convert(model, out_dir, dry_run=dry_run, shard_bytes=shard_gb * 1e9, progress=True,
                measure_load=not (dry_run or no_load_check))
    except DS4FormatError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{e.filename or out_dir}: {e.strerror or e}")
