"""The ``ds4-mlx`` command line (typer). Each subcommand is a thin shell over the library.

Bad input (a missing or non-DS4 file, a truncated GGUF, a bad flag, an output path that cannot be written...)
prints one ``error:`` line on stderr and exits with status 2 — never a traceback. Results go to stdout; what
the command is doing (building the demo model, loading, bars for a load or a prefill that takes more than ~2 s)
goes to stderr.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Optional

import typer
from gguf import GGMLQuantizationType
from rich.console import Console
from rich.table import Table

from .cli_common import (CACHE_LIMIT_HELP, PREFILL_CHUNK_HELP, ErrorLineGroup, LayersOpt, ParallelOpt, SsdCacheOpt,
                         SsdPreloadOpt, SsdProfileOpt, SsdStreamingOpt, check_output_file, check_sampling,
                         expert_streaming, fail, follow, lead, parallel_group, say)
from .distributed import Follower
from .chat import DEFAULT_SYSTEM, ThinkMode, repl_prefix_tokens, repl_turn_tokens, resolve_think_mode
from .generate import DEFAULT_CTX, prompt_tokens, stats_text, stream_generate
from .gguf_file import DS4FormatError, open_gguf
from .layout import decode_bytes_per_token, expected_tensors, optional_tensors, tensor_nbytes
from .sampling import SamplingParams
from .session import DEFAULT_CHUNK, Session

app = typer.Typer(
    name="ds4-mlx",
    help="DeepSeek V4 Flash on MLX: run, serve, inspect and test DS4 GGUF models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # click's plain help: wraps long option names at 80 columns, flags without a type
    cls=ErrorLineGroup,
    context_settings={"help_option_names": ["-h", "--help"]},
)
console = Console()


@app.command("make-tiny")
def make_tiny(
    out: Path = typer.Argument(..., help="Where to write the GGUF (e.g. tiny.gguf)."),
    seed: int = typer.Option(0, help="Random seed; the same seed writes identical bytes."),
    experts: str = typer.Option("q2", help="Routed-expert layout: q2 (IQ2_XXS/Q2_K), q4 (Q4_K) or f16."),
    hca_ratio: int = typer.Option(16, "--hca-ratio", help="Compression ratio R of the HCA layers (16 or 128; tiny)."),
    layers: Optional[int] = typer.Option(None, help="Number of layers (tiny: default 6, 3..64; full: 1..43)."),
    shape: str = typer.Option(
        "tiny", help="tiny (width 256, MB) or full (V4 Flash's real width, ~2 GB a layer with q2 experts, written "
                     "tensor by tensor: the real-size loading path without the 81 GB download)."),
    router_skew: float = typer.Option(
        0.0, "--router-skew", metavar="S",
        help="Skewed routing: each layer picks its expert of popularity rank r about as often as (r+1)^-S (a Zipf "
             "law; 1.0 is strongly skewed), through the routers' bias and the hash layers' tables, for expert "
             "streaming benchmarks. 0 (default): unbiased random routing."),
) -> None:
    """Write a random-weight DS4 GGUF in the exact published layout (for tests, demos and load tests)."""
    from .testing import make_full_width_gguf, make_tiny_gguf

    if experts not in ("q2", "q4", "f16"):
        fail(f"--experts must be q2, q4 or f16, got {experts!r}")
    if not 0 <= router_skew <= 4:
        fail(f"--router-skew must be 0..4 (a Zipf exponent; 0 is unbiased), got {router_skew}")
    if shape not in ("tiny", "full"):
        fail(f"--shape must be tiny or full, got {shape!r}")
    if shape == "full":
        if experts == "f16":
            fail("--shape full takes q2 or q4 experts (f16 experts would be ~25 GB a layer)")
        if layers is None or not 1 <= layers <= 43:
            fail(f"--shape full needs --layers 1..43 (the real model has 43), got {layers}")
    else:
        layers = 6 if layers is None else layers
        if not 8 <= hca_ratio <= 1024:
            fail(f"--hca-ratio must be 8..1024 (V4 Flash uses 128), got {hca_ratio}")
        if not 3 <= layers <= 64:
            fail(f"--layers must be 3..64, got {layers}")
    check_output_file(out, "OUT")
    try:
        if shape == "full":
            path = _write_with_bar(lambda bar: make_full_width_gguf(out, layers=layers, seed=seed, experts=experts,
                                                                    router_skew=router_skew, progress=bar))  # fmt: skip
        else:
            path = make_tiny_gguf(out, seed=seed, experts=experts, hca_ratio=hca_ratio, layers=layers,
                                  router_skew=router_skew)  # fmt: skip
    except OSError as e:
        fail(f"{out}: cannot write ({e.strerror or e})")
    what = f"{layers} full-width layers" if shape == "full" else f"HCA ratio {hca_ratio}"
    what += f", router skew {router_skew:g}" if router_skew else ""
    console.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {experts} experts, {what})")


def _write_with_bar(write):
    """Run ``write(progress)`` with a bar of the bytes written, on stderr."""
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn

    with Progress(TextColumn("writing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
                  console=Console(stderr=True)) as bar:  # fmt: skip
        task = bar.add_task("write", total=None)
        return write(lambda done, total: bar.update(task, completed=done, total=total))


@app.command()
def inspect(
    model: Path = typer.Argument(..., help="A DS4 GGUF file or a directory written by `ds4-mlx convert`."),
    ctx: list[int] = typer.Option([2048, 32768], min=1, help="Context sizes for the bytes-per-token estimate."),
) -> None:
    """Validate a DS4 model and summarize it: config, tensor bytes by type and component, decode bytes/token.

    It runs every check that loading runs, without reading the large weights.
    """
    try:
        cfg, tensors = _tensor_table(model)
    except DS4FormatError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{model}: cannot read ({e.strerror or e})")
    console.print(f"[bold]{model}[/]  {cfg.name or '(unnamed)'}")
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
    for name, (qtype, nbytes) in tensors.items():
        for key, table in ((qtype, by_type), (specs[name].component, by_comp)):
            entry = table.setdefault(key, [0, 0])
            entry[0] += 1
            entry[1] += nbytes
    total = sum(nbytes for _, nbytes in tensors.values())
    for title, table in (("type", by_type), ("component", by_comp)):
        out = Table(title=f"tensors by {title}", title_justify="left")
        out.add_column(title)
        out.add_column("tensors", justify="right")
        out.add_column("bytes", justify="right")
        for key, (n, b) in sorted(table.items(), key=lambda kv: -kv[1][1]):
            out.add_row(key, str(n), _fmt_bytes(b))
        out.add_row("[bold]total", f"[bold]{len(tensors)}", f"[bold]{_fmt_bytes(total)}")
        console.print(out)

    sizes = {name: nbytes for name, (_, nbytes) in tensors.items()}
    per_ctx = {c: decode_bytes_per_token(cfg, sizes, c) for c in ctx}
    out = Table(title="bytes read per decoded token (docs/model.md §10)", title_justify="left")
    out.add_column("component")
    for c in ctx:
        out.add_column(f"ctx {c}", justify="right")
    keys = list(dict.fromkeys(k for b in per_ctx.values() for k in b))
    for k in keys:
        out.add_row(k, *(_fmt_bytes(per_ctx[c].get(k, 0)) for c in ctx))
    out.add_row("[bold]total", *(f"[bold]{_fmt_bytes(sum(per_ctx[c].values()))}" for c in ctx))
    console.print(out)


def _tensor_table(model: Path):
    """(config, {tensor name: (GGML type name, bytes)}) of a GGUF file or a converted directory, validated."""
    if model.is_dir():
        from .mlx_dir import check_model, read_index

        cfg = check_model(model)
        index = read_index(model)["tensors"]
        return cfg, {n: (t["qtype"], tensor_nbytes(tuple(t["shape"]), GGMLQuantizationType[t["qtype"]]))
                     for n, t in index.items()}
    m = open_gguf(model)
    return m.config, {n: (t.qtype.name, t.nbytes) for n, t in m.tensors.items()}


# ---- generate / chat ---------------------------------------------------------------------------------

DEFAULT_MODEL = Path("ds4flash.gguf")  # like ds4: the model file in the current directory
DEFAULT_TOKENS = 50000  # ds4's -n
DEMO_TOKENS = 100  # the demo model's text is random: keep its default short

ModelOpt = typer.Option(None, "-m", "--model", help=f"DS4 GGUF or converted directory (default ./{DEFAULT_MODEL}).")
DemoOpt = typer.Option(False, "--demo", help="Use the built-in tiny random-weight demo model (built once, cached).")
SystemOpt = typer.Option(DEFAULT_SYSTEM, "-sys", "--system", help="System prompt ('' for none).")
TokensOpt = typer.Option(None, "-n", "--tokens", help=f"Max new tokens (default {DEFAULT_TOKENS}; {DEMO_TOKENS} with --demo).")
CtxOpt = typer.Option(DEFAULT_CTX, "-c", "--ctx", help="Context size in tokens.")
TempOpt = typer.Option(1.0, "--temp", help="Sampling temperature (0 = greedy).")
TopPOpt = typer.Option(1.0, "--top-p", help="Nucleus sampling mass (1 = off).")
TopKOpt = typer.Option(0, "--top-k", help="Keep the k most likely tokens (0 = off).")
MinPOpt = typer.Option(0.05, "--min-p", help="Drop tokens below min_p x the top probability.")
SeedOpt = typer.Option(None, "--seed", help="Random seed (default: time based).")
ThinkOpt = typer.Option(False, "--think", help="Thinking mode (the default).")
NoThinkOpt = typer.Option(False, "--nothink", help="Non-thinking mode: answer directly.")
ThinkMaxOpt = typer.Option(False, "--think-max", help="Think Max (needs --ctx >= 393216, else normal thinking).")
ChunkOpt = typer.Option(DEFAULT_CHUNK, "--prefill-chunk", help=PREFILL_CHUNK_HELP)
CacheLimitOpt = typer.Option(None, "--cache-limit-gb", help=CACHE_LIMIT_HELP)
def _model_path(model: Optional[Path], demo: bool) -> Path:
    if demo:
        from .demo import demo_model_path

        return demo_model_path()
    path = model or DEFAULT_MODEL
    if not path.exists():
        fail(
            f"no model at {path}. Pass -m MODEL.gguf (a DeepSeek V4 Flash GGUF, e.g. from ds4's download_model.sh, "
            "or a directory written by `ds4-mlx convert`), "
            "or try --demo (a tiny random-weight model), or write one with: ds4-mlx make-tiny tiny.gguf"
        )
    return path


def _load(model: Optional[Path], demo: bool, cache_limit_gb: Optional[float] = None, streaming: dict | None = None,
          parallel: Optional[str] = None, layers: Optional[str] = None):  # fmt: skip
    """The model and tokenizer, with a bar for a long load; MLX's memory limits set for its size. ``streaming``:
    stream the routed experts (load's keywords from :func:`ds4_mlx.cli_common.expert_streaming`).
    ``parallel``: this rank's part of a model over several ranks (:mod:`ds4_mlx.distributed`); on a rank after
    the first the model is a :class:`~ds4_mlx.distributed.Follower` (see :func:`~ds4_mlx.cli_common.follow`)."""
    from .loader import load
    from .memory import set_memory_limits

    path = _model_path(model, demo)
    group = parallel_group(parallel, layers)
    quiet = group is not None and group.rank() > 0  # the other ranks follow quietly
    if not quiet:
        say(f"loading {path}…" if group is None else f"loading {path}: {parallel} parallel over {group.size()} ranks…")
    bar = _DelayedBar("loading", bytes_=True)
    progress = None if quiet else lambda stage, done, total: bar(done, total, stage)
    try:
        m, tok = load(path, progress=progress, group=group, layers=layers, parallel=parallel or "pipeline",
                      **(streaming or {}))  # fmt: skip
        set_memory_limits(m.weights_bytes, cache_gb=cache_limit_gb)
        if m.expert_cache is not None:
            c = m.expert_cache
            say(f"streaming the routed experts: a cache of {c.slots} of {c.n_units} ({c.nbytes / 2**30:.2f} GiB)"
                + (f", {c.preloaded} read at start" if c.preloaded else ""))
        return m, tok
    except ValueError as e:  # a bad --cache-limit-gb or expert cache size
        fail(str(e))
    except DS4FormatError as e:
        fail(str(e))
    except OSError as e:
        fail(f"{path}: cannot read ({e.strerror or e})")
    finally:
        bar.close()


def _think_mode(think: bool, nothink: bool, think_max: bool, ctx: int) -> ThinkMode:
    if think + nothink + think_max > 1:
        fail("choose one of --think, --nothink, --think-max")
    mode = ThinkMode.NONE if nothink else ThinkMode.MAX if think_max else ThinkMode.HIGH
    return resolve_think_mode(mode, ctx, warn=True)


def _check_positive(**values: Optional[float]) -> None:
    for name, v in values.items():
        if v is not None and v <= 0:
            fail(f"--{name.replace('_', '-')} must be > 0, got {v}")


class _Printer:
    """Streams generated text to stdout: reasoning grey on a terminal, a newline after it, no markers."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.in_reasoning = False
        self.at_line_start = True

    def write(self, text: str, reasoning: bool) -> None:
        if reasoning != self.in_reasoning:
            if self.tty and reasoning:
                sys.stdout.write("\x1b[90m")
            if not reasoning:
                if self.tty:
                    sys.stdout.write("\x1b[0m")
                if not self.at_line_start:
                    sys.stdout.write("\n")
            self.in_reasoning = reasoning
        if text:
            sys.stdout.write(text)
            self.at_line_start = text.endswith("\n")
        sys.stdout.flush()

    def close(self) -> None:
        self.write("", False)
        if not self.at_line_start:
            sys.stdout.write("\n")
        sys.stdout.flush()


class _DelayedBar:
    """A ``progress(done, total[, label])`` callback: a bar on stderr once the work has run ``delay`` seconds
    (on a terminal; elsewhere the closing stats give the speeds). A timer thread shows it, so a long step still
    shows its elapsed time before its next progress call. ``bytes_``: amounts are bytes (else tokens)."""

    def __init__(self, label: str, delay: float = 2.0, bytes_: bool = False) -> None:
        self.label, self.delay, self.bytes = label, delay, bytes_
        self.done = self.total = 0
        self.console = Console(stderr=True)
        self.lock = threading.Lock()
        self.bar = self.task = self.timer = None
        self.closed = False

    def __call__(self, done: int, total: int, label: str | None = None) -> None:
        with self.lock:
            self.done, self.total, self.label = done, total, label or self.label
            if self.timer is None and self.console.is_terminal:
                self.timer = threading.Timer(self.delay, self._show)
                self.timer.daemon = True
                self.timer.start()
            if self.bar is not None:
                self.bar.update(self.task, completed=done, total=total, description=self.label)

    def _show(self) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        amount = DownloadColumn() if self.bytes else TextColumn("{task.completed}/{task.total} tokens")
        with self.lock:
            if self.closed:
                return
            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), amount,
                                TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True)
            self.task = self.bar.add_task(self.label, total=self.total, completed=self.done)
            self.bar.start()

    def close(self) -> None:
        """Stop the timer and take the bar off the screen (the work is over)."""
        with self.lock:
            self.closed = True
            if self.timer is not None:
                self.timer.cancel()
            if self.bar is not None:
                self.bar.stop()
                self.bar = None


def _run_generation(model, tok, ids: list[int], session, *, n: int, params, seed, ctx: int, printer: _Printer):
    """Stream one generation to stdout; returns (generated ids, last response)."""
    bar = _DelayedBar("prefill")
    out, last = [], None
    try:
        for last in stream_generate(model, tok, ids, max_tokens=n, sampling=params, seed=seed, ctx=ctx,
                                    session=session, prefill_chunk=session.chunk_size, progress=bar):
            bar.close()
            if last.token is not None:
                out.append(last.token)
            printer.write(last.text, last.reasoning)
    finally:
        bar.close()
        printer.close()
    return out, last


@app.command()
def generate(
    prompt: Optional[str] = typer.Option(None, "-p", "--prompt", help="Prompt text (one-shot)."),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="Read the prompt from a file."),
    model: Optional[Path] = ModelOpt,
    demo: bool = DemoOpt,
    system: str = SystemOpt,
    tokens: Optional[int] = TokensOpt,
    ctx: int = CtxOpt,
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    think: bool = ThinkOpt,
    nothink: bool = NoThinkOpt,
    think_max: bool = ThinkMaxOpt,
    dump_tokens: bool = typer.Option(False, "--dump-tokens", help="Print the prompt's token ids (specials recognized) and exit."),
    dump_logprobs: Optional[Path] = typer.Option(None, "--dump-logprobs", help="Write a greedy continuation's top log-probs as JSON."),
    logprobs_top_k: int = typer.Option(20, "--logprobs-top-k", help="Alternatives per step in --dump-logprobs (max 128)."),
    prefill_chunk: int = ChunkOpt,
    cache_limit_gb: Optional[float] = CacheLimitOpt,
    ssd_streaming: bool = SsdStreamingOpt,
    ssd_streaming_cache_experts: Optional[str] = SsdCacheOpt,
    ssd_streaming_preload_experts: Optional[int] = SsdPreloadOpt,
    ssd_streaming_profile: Optional[Path] = SsdProfileOpt,
    parallel: Optional[str] = ParallelOpt,
    layers: Optional[str] = LayersOpt,
) -> None:
    """Generate a continuation of one prompt, rendered as a DS4 chat turn (like `ds4 -p`).

    The text streams to stdout; prefill/decode speed and peak memory go to stderr at the end. Over several
    machines: mlx.launch -n 2 --hostfile hosts.json -- ds4-mlx generate --parallel pipeline|expert|tensor -m FILE -p ...
    """
    if (prompt is None) == (prompt_file is None):
        fail("give exactly one of -p/--prompt or --prompt-file")
    if prompt_file is not None:
        if not prompt_file.is_file():
            fail(f"no such prompt file: {prompt_file}")
        prompt = prompt_file.read_text(encoding="utf-8", errors="surrogateescape")
    _check_positive(tokens=tokens, ctx=ctx, logprobs_top_k=logprobs_top_k, prefill_chunk=prefill_chunk)
    if logprobs_top_k > 128:
        fail(f"--logprobs-top-k must be <= 128, got {logprobs_top_k}")
    if dump_logprobs is not None:
        check_output_file(dump_logprobs, "--dump-logprobs")
    else:
        check_sampling(temp, top_p, top_k, min_p)
    if dump_tokens:
        _dump_tokens(_model_path(model, demo), prompt)
        return
    mode = _think_mode(think, nothink, think_max, ctx)
    n = tokens or (DEMO_TOKENS if demo else DEFAULT_TOKENS)
    streaming = expert_streaming(ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_preload_experts,
                                 ssd_streaming_profile)
    m, tok = _load(model, demo, cache_limit_gb, streaming, parallel, layers)
    if isinstance(m, Follower):
        return follow(m)
    with lead(m):
        ids = prompt_tokens(tok, prompt, system=system, think=mode)
        if len(ids) >= ctx:
            fail(f"the prompt is {len(ids)} tokens, which does not fit --ctx {ctx}")
        if dump_logprobs is not None:
            _dump_logprobs(m, tok, ids, dump_logprobs, n=n, ctx=ctx, top_k=logprobs_top_k)
            return
        params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
        session = Session(m, chunk_size=prefill_chunk, reserve=min(ctx, len(ids) + n))
        _, last = _run_generation(m, tok, ids, session, n=n, params=params, seed=seed, ctx=ctx, printer=_Printer())
    Console(stderr=True).print(stats_text(last), highlight=False)
    if m.expert_cache is not None:
        say(m.expert_cache.describe())


def _dump_tokens(path: Path, prompt: str) -> None:
    """ds4's --dump-tokens: the prompt as written, specials recognized, then one line per token."""
    from .tokenizer import Tokenizer

    from .mlx_dir import open_tokenizer_data

    try:
        tok = Tokenizer.from_gguf(open_tokenizer_data(path))
    except DS4FormatError as e:
        fail(str(e))
    ids = tok.encode_chat(prompt)
    print("[" + ", ".join(map(str, ids)) + "]")
    for i in ids:
        print(f"{i:6d}  {tok.tokens[i]}")


def _dump_logprobs(model, tok, ids: list[int], out: Path, *, n: int, ctx: int, top_k: int) -> None:
    """ds4's --dump-logprobs: greedy continuation, top-k log-softmax (float64) per step, as JSON."""
    import json

    import numpy as np

    def token_json(t: int) -> dict:
        raw = tok.token_bytes(t)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = "".join(chr(b) if b < 0x80 else f"\\u00{b:02x}" for b in raw)
        return {"id": t, "text": text, "bytes": list(raw)}

    session = Session(model)
    logits = session.prefill(ids)
    steps = []
    for step in range(min(n, ctx - len(ids) - 1)):
        x = np.asarray(logits, dtype=np.float64)
        lp = x - (x.max() + np.log(np.exp(x - x.max()).sum()))
        order = np.lexsort((np.arange(x.size), -x))[:top_k]
        selected = int(order[0])
        steps.append({"step": step, "selected": token_json(selected),
                      "top_logprobs": [{"token": token_json(int(t)), "logit": float(x[t]), "logprob": float(lp[t])} for t in order]})
        if selected == tok.eos_id:
            break
        logits = session.step(selected)
    doc = {"source": "ds4-mlx", "prompt_tokens": len(ids), "ctx": ctx, "top_k": top_k, "steps": steps}
    out.write_text(json.dumps(doc, indent=1) + "\n")
    Console(stderr=True).print(f"wrote {len(steps)} steps to {out}")


CHAT_HELP = """commands: /think  /nothink  /think-max  /ctx N (new session)  /read FILE  /help  /quit (or /exit)
Ctrl+C stops a generation; Ctrl+D quits."""


@app.command()
def chat(
    model: Optional[Path] = ModelOpt,
    demo: bool = DemoOpt,
    system: str = SystemOpt,
    tokens: Optional[int] = TokensOpt,
    ctx: int = CtxOpt,
    temp: float = TempOpt,
    top_p: float = TopPOpt,
    top_k: int = TopKOpt,
    min_p: float = MinPOpt,
    seed: Optional[int] = SeedOpt,
    think: bool = ThinkOpt,
    nothink: bool = NoThinkOpt,
    think_max: bool = ThinkMaxOpt,
    prefill_chunk: int = ChunkOpt,
    cache_limit_gb: Optional[float] = CacheLimitOpt,
    ssd_streaming: bool = SsdStreamingOpt,
    ssd_streaming_cache_experts: Optional[str] = SsdCacheOpt,
    ssd_streaming_preload_experts: Optional[int] = SsdPreloadOpt,
    ssd_streaming_profile: Optional[Path] = SsdProfileOpt,
    parallel: Optional[str] = ParallelOpt,
    layers: Optional[str] = LayersOpt,
) -> None:
    """Interactive chat (REPL) that streams tokens and keeps the conversation in the live KV cache.

    Over several machines: mlx.launch -n 2 --hostfile hosts.json -- ds4-mlx chat --parallel pipeline|expert|tensor
    -m FILE (mlx.launch passes the terminal's input on; rank 0 reads it and prints the replies).
    """
    _check_positive(tokens=tokens, ctx=ctx, prefill_chunk=prefill_chunk)
    check_sampling(temp, top_p, top_k, min_p)
    mode = _think_mode(think, nothink, think_max, ctx)
    n = tokens or (DEMO_TOKENS if demo else DEFAULT_TOKENS)
    streaming = expert_streaming(ssd_streaming, ssd_streaming_cache_experts, ssd_streaming_preload_experts,
                                 ssd_streaming_profile)
    m, tok = _load(model, demo, cache_limit_gb, streaming, parallel, layers)
    if isinstance(m, Follower):
        return follow(m)
    params = SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p)
    with lead(m):
        _chat_loop(m, tok, Session(m, chunk_size=prefill_chunk), system=system, mode=mode, ctx=ctx, n=n,
                   params=params, seed=seed)  # fmt: skip


def _chat_loop(m, tok, session: Session, *, system: str, mode: ThinkMode, ctx: int, n: int, params: SamplingParams,
               seed: Optional[int]) -> None:  # fmt: skip
    """The chat REPL: reads lines until /quit or end of input, keeping the conversation in ``session``."""
    try:
        import readline

        history = Path.home() / ".ds4_mlx_history"
        if history.exists():
            readline.read_history_file(history)
    except (ImportError, OSError):
        readline = None
    transcript = repl_prefix_tokens(tok, system=system, mode=mode)
    err = Console(stderr=True, soft_wrap=True)
    err.print(f"ds4-mlx chat: {m.cfg.name or 'model'}, ctx {ctx}, mode {mode.value}. /help for commands.", highlight=False)
    while True:
        try:
            line = input("ds4> ")
        except EOFError:
            print()
            break
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        if text.startswith("/"):
            cmd, _, arg = text.partition(" ")
            if cmd in ("/quit", "/exit"):
                break
            if cmd == "/help":
                print(CHAT_HELP)
                continue
            if cmd in ("/think", "/nothink", "/think-max"):
                new = {"/think": ThinkMode.HIGH, "/nothink": ThinkMode.NONE, "/think-max": ThinkMode.MAX}[cmd]
                new = resolve_think_mode(new, ctx, warn=True)
                if (new is ThinkMode.MAX) != (mode is ThinkMode.MAX):  # the prefix after BOS changes
                    transcript = repl_prefix_tokens(tok, system=system, mode=new)
                mode = new
                print(f"mode: {mode.value}")
                continue
            if cmd == "/ctx":
                if not arg.strip().isdigit() or int(arg) <= 0:
                    print("usage: /ctx N (N > 0)")
                    continue
                ctx = int(arg)
                session.reset()
                transcript = repl_prefix_tokens(tok, system=system, mode=mode)
                print(f"new session, ctx {ctx}")
                continue
            if cmd == "/read":
                try:
                    text = Path(arg.strip()).expanduser().read_text(encoding="utf-8", errors="surrogateescape")
                except OSError as e:
                    print(f"cannot read {arg.strip()!r}: {e}")
                    continue
            else:
                print(f"unknown command {cmd}; /help lists them")
                continue
        turn = repl_turn_tokens(tok, text, mode=mode)
        if len(transcript) + len(turn) >= ctx:
            print(f"the conversation would exceed --ctx {ctx}; use /ctx N to start a new session")
            continue
        try:
            generated, last = _run_generation(m, tok, transcript + turn, session, n=n, params=params, seed=seed,
                                              ctx=ctx, printer=_Printer())
            err.print(f"[dim]prompt {last.prompt_tokens} tokens ({last.cached_tokens} cached), "
                      f"prefill {last.prompt_tps:.1f} t/s, generation {last.generation_tokens} tokens at "
                      f"{last.generation_tps:.1f} t/s[/]", highlight=False)
        except KeyboardInterrupt:  # keep what was generated; with nothing generated, roll the turn back (ds4)
            generated = session.tokens[len(transcript) + len(turn):]
            print("[interrupted]")
            if not generated:
                continue
        transcript = transcript + turn + generated + [tok.eos_id]
    if readline is not None:
        try:
            readline.write_history_file(history)
        except OSError:
            pass


def _register_subcommands() -> None:
    from .bench_cli import bench_app
    from .convert.cli import convert_cmd
    from .kv_cli import kv_app
    from .server.cli import serve

    app.command("serve")(serve)
    app.command("convert")(convert_cmd)
    app.add_typer(bench_app, name="bench")
    app.add_typer(kv_app, name="kv")


_register_subcommands()


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def main(argv: Optional[list[str]] = None) -> None:
    """Console-script entry point."""
    app(args=argv if argv is not None else sys.argv[1:], prog_name="ds4-mlx")
