"""What every ``ds4-mlx`` subcommand shares: bad input ends in one ``error:`` line on stderr and exit status 2,
output paths are checked before any work starts, sampling flags are checked the way ds4 clamps them."""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path
from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

try:  # typer >= 0.2x parses with its own copy of click
    from typer._click import exceptions as click_errors
except ImportError:
    from click import exceptions as click_errors

USAGE_ERROR = 2  # every kind of bad input: a flag, a path, a file that is not a usable model
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(message: str) -> NoReturn:
    """Print one error line and exit with status 2 (bad input)."""
    stderr.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(USAGE_ERROR)


def warn(message: str) -> None:
    """One warning line on stderr; the command goes on."""
    stderr.print(f"[yellow]warning:[/] {escape(message)}")


def say(message: str) -> None:
    """A status line on stderr (what the command is doing while it does it); stdout keeps the results."""
    stderr.print(f"[dim]{escape(message)}[/]")


def check_output_file(path: Path, option: str) -> None:
    """Fail unless ``path`` can be written as a file: its folder exists and is writable, it is no directory.
    Run before the work whose result goes there, so a typo in the path loses nothing."""
    if path.is_dir():
        fail(f"{option} {path}: is a directory, expected a file name")
    folder = path.parent
    if not folder.is_dir():
        fail(f"{option} {path}: the folder {folder} does not exist")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        fail(f"{option} {path}: not writable")


def check_sampling(temp: float, top_p: float, top_k: int, min_p: float) -> None:
    """Sampling flags: a non-finite number is an error; a value ds4's sampler clamps gets a warning saying what
    is used instead (docs/serving.md §3: top-p outside (0, 1] is 1, min-p < 0 is 0, top-k <= 0 is off and > 1024
    is 1024; temperature <= 0 is greedy)."""
    for flag, v in (("--temp", temp), ("--top-p", top_p), ("--min-p", min_p)):
        if not math.isfinite(v):
            fail(f"{flag} must be a finite number, got {v}")
    if temp < 0:
        warn(f"--temp {temp:g} is negative: sampling is greedy, as with --temp 0")
    if not 0 < top_p <= 1:
        warn(f"--top-p {top_p:g} is outside (0, 1]: using 1 (off), as ds4 does")
    if min_p < 0:
        warn(f"--min-p {min_p:g} is negative: using 0 (off), as ds4 does")
    elif min_p > 1:
        warn(f"--min-p {min_p:g} is above 1: no token passes it, so sampling is greedy")
    if top_k < 0:
        warn(f"--top-k {top_k} is negative: top-k is off, as with 0")
    elif top_k > 1024:
        warn(f"--top-k {top_k} is above 1024: using 1024, as ds4 does")


class ErrorLineGroup(TyperGroup):
    """A typer group whose usage errors (an unknown option, a bad number, a missing argument) print one
    ``error:`` line like the commands' own checks, instead of a usage block; exit status 2 either way."""

    def main(self, *args, standalone_mode: bool = True, **kwargs):
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except click_errors.ClickException as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as click shows it
                e.show()
            else:
                hint = f" (see: {e.ctx.command_path} -h)" if isinstance(e, click_errors.UsageError) and e.ctx else ""
                stderr.print(f"[bold red]error:[/] {escape(e.format_message())}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:
            print("Aborted!", file=sys.stderr)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


# Help texts of options every command has, whose defaults live in heavier modules than this one (each command
# builds the option with its default).
PREFILL_CHUNK_HELP = "Prompt tokens per model call (ds4 uses 2048; 8192 prefills long prompts faster where memory allows)."
CACHE_LIMIT_HELP = "MLX buffer cache limit in GiB (default: 5% of the weights, at most 4; 0 = none)."

SsdStreamingOpt = typer.Option(
    False, "--ssd-streaming",
    help="Leave the routed experts in the GGUF and read them on demand into a device cache of fixed size "
         "(for machines with less memory than the model; slower).")  # fmt: skip
SsdCacheOpt = typer.Option(
    None, "--ssd-streaming-cache-experts", metavar="N|N%|NGB",
    help="Size of the streamed experts' cache: N experts (one layer's gate, up and down each), a share of all "
         "of them, or GiB (default 50%; implies --ssd-streaming).")  # fmt: skip


SsdPreloadOpt = typer.Option(
    None, "--ssd-streaming-preload-experts", metavar="N", min=0,
    help="Experts read into the cache at start: the most used in --ssd-streaming-profile first, then expert 0 of "
         "every layer, expert 1... (default: fill the cache when the profile holds uses, else none; implies "
         "--ssd-streaming).")  # fmt: skip
SsdProfileOpt = typer.Option(
    None, "--ssd-streaming-profile", metavar="FILE",
    help="Every expert's uses, read at start (created when missing) and kept up to date while the model runs, so "
         "the next start fills the cache with the experts your traffic uses most (implies --ssd-streaming).")


def expert_streaming(ssd_streaming: bool, cache_experts: str | None, preload: int | None = None,
                     profile: Path | None = None) -> dict:  # fmt: skip
    """:func:`ds4_mlx.loader.load`'s expert-streaming keywords from the streaming flags (``{}``: the experts stay
    resident); a profile that cannot be written fails here, before the model loads."""
    if cache_experts is None and not ssd_streaming and preload is None and profile is None:
        return {}
    if profile is not None:
        check_output_file(profile, "--ssd-streaming-profile")
    return {"expert_cache": "50%" if cache_experts is None else cache_experts, "expert_preload": preload,
            "expert_profile": profile}


# ---- model parallel (mlx.launch) ------------------------------------------------------------------------------

LOST_RANK = 1  # exit status of a rank that lost another rank

ParallelOpt = typer.Option(
    None, "--parallel", help="Over the ranks started by mlx.launch: 'pipeline' splits the layers (each rank reads "
    "only its layers' tensors); 'expert' splits each layer's routed experts by id and the shared expert by width; "
    "'tensor' splits the attention heads as well (two sums a layer instead of one). Rank 0 tokenizes, samples and "
    "prints; the others follow it.")
LayersOpt = typer.Option(
    None, "--layers", help="With --parallel pipeline: each rank's layers, one A:B per rank, e.g. 0:20,20:43 "
    "(default: an even split).")


def parallel_group(parallel: str | None, layers: str | None):
    """The ``mx.distributed`` group for ``--parallel`` (``None`` without it); bad flags fail. Under ``mlx.launch``
    the launcher's environment names the ranks; a process started alone is a group of one, which is refused."""
    if layers is not None and parallel != "pipeline":
        fail("--layers splits the model over the ranks of --parallel pipeline")
    if parallel is None:
        return None
    from .distributed import PARALLEL_MODES

    if parallel not in PARALLEL_MODES:
        fail(f"--parallel {parallel!r}: the modes are {', '.join(map(repr, PARALLEL_MODES))}")
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        fail(f"--parallel {parallel} needs several ranks: start it with mlx.launch -n N [--hostfile FILE] -- "
             "ds4-mlx ...")  # fmt: skip
    return group


def lost_rank(rank: int, error: BaseException) -> NoReturn:
    """Print why this rank's work ended and exit with :data:`LOST_RANK`."""
    stderr.print(f"[bold red]error:[/] rank {rank}: {escape(str(error))} (another rank exited or "
                 "disconnected)")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(LOST_RANK)  # not through interpreter shutdown: MLX's communication threads may still be waiting


def follow(follower) -> None:
    """Run a :class:`~ds4_mlx.distributed.Follower` until rank 0 releases it."""
    try:
        follower.run()
    except RuntimeError as e:
        if not lost_peer(e):
            raise
        lost_rank(follower.rank, e)


def lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is MLX's communication backend reporting a lost rank (the ring backend's "connection to a
    peer was lost", a closed socket)."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(w in text for w in ("peer", "connection", "socket"))


class lead:
    """A command's work on rank 0 of a model over several ranks, or in one process (where it does nothing):
    releases the other ranks at the end, whatever ends it, and turns a lost rank into :func:`lost_rank`."""

    def __init__(self, model) -> None:
        self.model = model

    def __enter__(self):
        return self.model

    def __exit__(self, kind, error, tb) -> bool:
        close = getattr(self.model, "close", None)
        if error is not None and close is not None and lost_peer(error):
            lost_rank(0, error)
        if close is not None:
            close()
        return False
