"""``ds4-mlx serve``: the command (a plain function with typer options) and :func:`run_server`."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from ..chat import ThinkMode
from ..cli_common import (CACHE_LIMIT_HELP, PREFILL_CHUNK_HELP, LayersOpt, ParallelOpt, SsdCacheOpt, SsdPreloadOpt,
                          SsdProfileOpt, SsdStreamingOpt, check_sampling, expert_streaming, parallel_group)
from ..kvstore import CachePolicy
from ..session import DEFAULT_CHUNK
from .common import DEFAULT_MAX_BODY_MB
from .worker import DEFAULT_PREFILL_QUANTUM, GenParams

DEFAULT_MODEL = Path("ds4flash.gguf")


def _tracer(path: Path | None) -> Callable[[str], None] | None:
    if path is None:
        return None
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)  # it holds every prompt: owner only
    os.fchmod(fd, 0o600)
    f = open(fd, "a", encoding="utf-8", errors="replace")
    lock = threading.Lock()

    def trace(s: str) -> None:
        with lock:
            f.write(f"[{time.strftime('%H:%M:%S')}] {s}\n")
            f.flush()

    return trace


def model_loader(path: Path, ctx: int, chunk: int | None = None, cache_limit_gb: float | None = None,
                 streaming: dict | None = None, group: Any = None, parallel: str | None = None,
                 layers: str | None = None) -> Callable[[], tuple[Any, Any]]:  # fmt: skip
    """A loader for the worker thread: ``load(path)`` -> a live :class:`Session` and the tokenizer. The session's
    KV buffers are sized for ``ctx`` tokens, as ds4 sizes its KV for ``--ctx``: within the context they never
    grow, so no generation stops for a buffer copy, a retrace and (on GPUs) kernel JITs at the new shapes.
    ``chunk``: the prefill chunk (default the session's); MLX's buffer cache is limited for the model's size
    (:func:`~ds4_mlx.memory.set_memory_limits`, ``cache_limit_gb`` to choose); ``streaming``: stream the
    routed experts (load's keywords, :func:`~ds4_mlx.cli_common.expert_streaming`). ``group``, ``parallel``,
    ``layers``: rank 0's part of a model over several ranks, which drives the others (:mod:`ds4_mlx.distributed`)."""

    def load():
        from ..loader import load as load_gguf
        from ..memory import set_memory_limits
        from ..session import DEFAULT_CHUNK, Session

        model, tokenizer = load_gguf(path, group=group, parallel=parallel or "pipeline", layers=layers,
                                     **(streaming or {}))  # fmt: skip
        if tokenizer is None:
            raise RuntimeError(f"{path}: no usable tokenizer in the GGUF")
        set_memory_limits(model.weights_bytes, cache_gb=cache_limit_gb)
        return Session(model, chunk_size=chunk or DEFAULT_CHUNK, reserve=ctx), tokenizer

    return load


def run_server(load: Callable[[], tuple[Any, Any]], *, host: str = "127.0.0.1", port: int = 8000, ctx: int = 32768,
               default_max_tokens: int = 393216, default_mode: ThinkMode = ThinkMode.HIGH,
               sampling: GenParams | None = None, api_key: str | None = None, cors: bool = False,
               trace: Path | None = None, keepalive: float = 5.0, any_model: bool = False,
               tool_memory_max_ids: int = 100_000, log_level: str = "warning", banner: str = "",
               kv_dir: Path | None = None, kv_policy: CachePolicy | None = None,
               max_body_mb: int = DEFAULT_MAX_BODY_MB, sessions: int = 1,
               prefill_quantum: int = DEFAULT_PREFILL_QUANTUM) -> None:
    """Start the worker (it loads the model in its own thread) and serve until SIGINT or SIGTERM; return once the
    worker has finished its job, written the shutdown save of the live session (§4.9) and exited. A second
    signal while it finishes raises :class:`KeyboardInterrupt`. ``sessions``: live sessions served at once (their
    decode steps batched), ``prefill_quantum``: prefill tokens between two of their decode steps."""
    import uvicorn

    from .app import ServerConfig, create_app
    from .worker import Worker

    tracer = _tracer(trace)
    cfg = ServerConfig(ctx=ctx, default_max_tokens=default_max_tokens, default_mode=default_mode,
                       sampling=sampling or GenParams(), api_key=api_key, cors=cors, keepalive=keepalive,
                       max_body_bytes=max_body_mb << 20, any_model=any_model, tool_memory_max_ids=tool_memory_max_ids)
    worker = Worker(load, ctx=ctx, default_max_tokens=default_max_tokens, trace=tracer,
                    kv_dir=str(kv_dir) if kv_dir else None, kv_policy=kv_policy, sessions=sessions,
                    prefill_quantum=prefill_quantum)
    worker.start()
    app = create_app(worker, cfg, tracer, stop_worker=True)
    host = "127.0.0.1" if host == "localhost" else host
    kv = f", kv cache {kv_dir}" if kv_dir else ""
    batched = f", {sessions} batched sessions" if sessions > 1 else ""
    print(f"ds4-mlx serve: http://{host}:{port}/v1 {banner}(ctx {ctx}{kv}{batched})", file=sys.stderr, flush=True)
    if threading.current_thread() is threading.main_thread():
        # uvicorn shuts down gracefully on either signal, then raises it again: as KeyboardInterrupt for both
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                      timeout_graceful_shutdown=3)).run()
    except KeyboardInterrupt:
        pass
    worker.stop(timeout=None)  # already stopped by the lifespan unless its save outlasted the lifespan's wait


def _model_bytes(path: Path) -> int:
    """Bytes of a GGUF file, or of every file of a converted directory (about what its weights take loaded)."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size


def _exit(code: int) -> None:
    """Leave without running the interpreter's finalization: MLX aborts the process ("terminate called without
    an active exception") when it frees, at exit, arrays and streams the worker thread made. Everything that
    matters is done by now (worker joined, shutdown save written); flush what is buffered and go."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(
    model: Optional[Path] = typer.Option(None, "-m", "--model", help="DS4 GGUF or converted directory to serve (default ./ds4flash.gguf)."),
    demo: bool = typer.Option(False, "--demo", help="Serve the built-in tiny random-weight demo model."),
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8000, "--port", help="Port to bind."),
    ctx: int = typer.Option(32768, "-c", "--ctx", help="Context size in tokens (prompt + output); the KV buffers are sized for it at their first write."),
    tokens: int = typer.Option(393216, "-n", "--tokens", help="Default max output tokens when a request sets none."),
    api_key: Optional[str] = typer.Option(None, "--api-key", envvar="DS4_MLX_API_KEY",
                                          help="Require this key (Bearer or x-api-key)."),
    cors: bool = typer.Option(False, "--cors", help="Add permissive CORS headers to every response."),
    trace: Optional[Path] = typer.Option(None, "--trace", help="Append requests, prompts, cache decisions and "
                                                                "generated text to FILE."),
    temp: float = typer.Option(1.0, "--temp", help="Default temperature (non-thinking requests)."),
    top_p: float = typer.Option(1.0, "--top-p", help="Default top-p."),
    top_k: int = typer.Option(0, "--top-k", help="Default top-k (0 = off)."),
    min_p: float = typer.Option(0.05, "--min-p", help="Default min-p."),
    think: str = typer.Option("high", "--think", help="Default thinking when a request does not say: "
                                                       "none, high or max."),
    keepalive: float = typer.Option(5.0, "--keepalive", help="Seconds of silence before an SSE keepalive event."),
    max_body_mb: int = typer.Option(DEFAULT_MAX_BODY_MB, "--max-body-mb", min=1,
                                    help="Largest request body in MiB (larger ones get 413 before any parsing)."),
    any_model: bool = typer.Option(False, "--any-model", help="Accept any model name (ds4 behaviour) instead of "
                                                              "answering 404 for unknown ones."),
    tool_memory_max_ids: int = typer.Option(100_000, "--tool-memory-max-ids",
                                            help="Tool ids remembered for exact DSML replay."),
    disable_exact_dsml_tool_replay: bool = typer.Option(False, "--disable-exact-dsml-tool-replay",
                                                        help="Re-render tool calls canonically instead."),
    kv_disk_dir: Optional[Path] = typer.Option(None, "--kv-disk-dir", help="Directory of the disk KV cache "
                                                                         "(off when not given)."),
    kv_disk_space_mb: int = typer.Option(4096, "--kv-disk-space-mb", help="Disk cache budget in MiB."),
    kv_cache_min_tokens: int = typer.Option(512, "--kv-cache-min-tokens", help="Shortest prefix worth a file."),
    kv_cache_cold_max_tokens: int = typer.Option(30000, "--kv-cache-cold-max-tokens",
                                                 help="Longest prompt saved cold (0 = no cold saves)."),
    kv_cache_continued_interval_tokens: int = typer.Option(10000, "--kv-cache-continued-interval-tokens",
                                                           help="Save every this many live tokens (0 = off)."),
    kv_cache_boundary_trim_tokens: int = typer.Option(32, "--kv-cache-boundary-trim-tokens",
                                                      help="Cold save: tokens trimmed off the prompt end."),
    kv_cache_boundary_align_tokens: int = typer.Option(2048, "--kv-cache-boundary-align-tokens",
                                                       help="Cold/continued saves align to this (0 = off)."),
    kv_cache_reject_different_quant: bool = typer.Option(False, "--kv-cache-reject-different-quant",
                                                         help="Only load files written with the same expert quant."),
    prefill_chunk: int = typer.Option(DEFAULT_CHUNK, "--prefill-chunk", help=PREFILL_CHUNK_HELP),
    cache_limit_gb: Optional[float] = typer.Option(None, "--cache-limit-gb", help=CACHE_LIMIT_HELP),
    ssd_streaming: bool = SsdStreamingOpt,
    ssd_streaming_cache_experts: Optional[str] = SsdCacheOpt,
    ssd_streaming_preload_experts: Optional[int] = SsdPreloadOpt,
    ssd_streaming_profile: Optional[Path] = SsdProfileOpt,
    batched_session: int = typer.Option(1, "--batched-session", help="Live sessions served at once, each with its "
                                        "own KV state; their decode steps run as one batch (0 = as many as memory "
                                        "holds at --ctx, at most 8; 1 = one request at a time)."),
    mixed_prefill_quantum: int = typer.Option(DEFAULT_PREFILL_QUANTUM, "--mixed-prefill-quantum",
                                              help="With --batched-session: prompt tokens prefilled between two "
                                                   "decode steps of the other sessions."),
    parallel: Optional[str] = ParallelOpt,
    layers: Optional[str] = LayersOpt,
) -> None:
    """Serve the model over HTTP: OpenAI (chat, completions, responses) and Anthropic (messages) APIs."""
    if think not in ("none", "high", "max"):
        raise typer.BadParameter("--think must be none, high or max")
    if ctx < 16:
        raise typer.BadParameter(f"{ctx} is below 16 tokens", param_hint="'-c' / '--ctx'")
    if not 0 <= port <= 65535:
        raise typer.BadParameter(f"{port} is not a TCP port (0..65535)", param_hint="'--port'")
    if tokens < 1:
        raise typer.BadParameter(f"{tokens} is not a positive token count", param_hint="'-n' / '--tokens'")
    if prefill_chunk < 1:
        raise typer.BadParameter(f"{prefill_chunk} is not a positive token count", param_hint="'--prefill-chunk'")
    if cache_limit_gb is not None and not cache_limit_gb >= 0:
        raise typer.BadParameter(f"{cache_limit_gb} is not a size in GiB (>= 0)", param_hint="'--cache-limit-gb'")
    if batched_session < 0:
        raise typer.BadParameter(f"{batched_session} is not a session count (>= 0; 0 = as many as fit)",
                                 param_hint="'--batched-session'")
    if mixed_prefill_quantum < 1:
        raise typer.BadParameter(f"{mixed_prefill_quantum} is not a positive token count",
                                 param_hint="'--mixed-prefill-quantum'")
    check_sampling(temp, top_p, top_k, min_p)
    kv_policy = CachePolicy(kv_disk_space_mb, kv_cache_min_tokens, kv_cache_cold_max_tokens,
                            kv_cache_continued_interval_tokens, kv_cache_boundary_trim_tokens,
                            kv_cache_boundary_align_tokens, kv_cache_reject_different_quant)
    try:
        kv_policy.validate()
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    if demo:
        from ..demo import demo_model_path

        model = demo_model_path()
    model = model or DEFAULT_MODEL
    if not model.exists():
        typer.echo(f"error: model file {model} not found (pass -m PATH, or --demo for the built-in tiny model)",
                   err=True)
        raise typer.Exit(2)
    try:  # validate before binding the port: a bad file is a clear error, not a server that answers 503
        from ..gguf_file import DS4FormatError
        from ..mlx_dir import check_model

        cfg = check_model(model)  # a GGUF file or a directory written by `ds4-mlx convert`
        streaming = expert_streaming(ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_preload_experts,
                                     ssd_streaming_profile)
        expert_cache = streaming.get("expert_cache")
        if expert_cache is not None:
            from ..loader import check_expert_cache

            check_expert_cache(model, expert_cache, streaming["expert_profile"])
    except (DS4FormatError, ValueError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2)
    group = None
    if parallel is not None:
        for flag, on in [("--batched-session", batched_session != 1), ("--ssd-streaming", expert_cache is not None)]:
            if on:
                typer.echo(f"error: {flag} is not available with --parallel", err=True)
                raise typer.Exit(2)
        group = parallel_group(parallel, layers)
        if group.rank() > 0:
            _follow_rank_0(model, group, parallel, layers)
    sessions = 1
    if batched_session != 1:  # the live sessions' KV at --ctx must fit beside the weights
        from ..memory import plan_sessions

        try:
            sessions = plan_sessions(batched_session, cfg, ctx, _model_bytes(model), prefill_chunk)
        except ValueError as e:
            typer.echo(f"error: {e} (lower --batched-session or --ctx)", err=True)
            raise typer.Exit(2)
    try:
        run_server(model_loader(model, ctx, prefill_chunk, cache_limit_gb, streaming, group, parallel, layers),
                   host=host, port=port, ctx=ctx, default_max_tokens=tokens,
                   default_mode=ThinkMode(think), sampling=GenParams(temp, top_p, top_k, min_p), api_key=api_key,
                   cors=cors, trace=trace, keepalive=keepalive, any_model=any_model,
                   tool_memory_max_ids=0 if disable_exact_dsml_tool_replay else tool_memory_max_ids,
                   banner=f"model {model} " + (f"{parallel} parallel over {group.size()} ranks " if group else ""),
                   kv_dir=kv_disk_dir, kv_policy=kv_policy, max_body_mb=max_body_mb,
                   sessions=sessions, prefill_quantum=mixed_prefill_quantum)
    except KeyboardInterrupt:  # a second Ctrl+C while the worker was finishing: leave without waiting
        _exit(130)
    _exit(0)


def _follow_rank_0(path: Path, group: Any, parallel: str, layers: str | None) -> None:
    """A rank after the first of ``serve --parallel``: load its part, serve rank 0's commands until rank 0's
    server stops, and exit (a lost rank ends it with an error, :func:`~ds4_mlx.cli_common.follow`)."""
    from ..cli_common import fail, follow
    from ..loader import load

    try:
        follower, _ = load(path, group=group, parallel=parallel, layers=layers)
    except ValueError as e:
        fail(str(e))
    follow(follower)
    _exit(0)


def main(argv: list[str] | None = None) -> None:
    """Run ``serve`` as a stand-alone command (until it is registered in ``ds4_mlx.cli``)."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(serve)
    app(args=argv if argv is not None else sys.argv[1:], prog_name="ds4-mlx serve")


if __name__ == "__main__":
    main()
