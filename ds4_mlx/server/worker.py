"""The single model worker (SERVING.md §4.9, §5.1-5.3, §3 stop rules).

One thread owns the model and its one live :class:`~ds4_mlx.session.Session`. Requests arrive as :class:`Job`
objects in a FIFO queue and run one at a time, never interleaved. For each job the worker

1. picks the longest reusable live state (§5.2): the live tokens as a token prefix of the fresh tokenization,
   else the thinking-visible binding (hidden reasoning kept in the KV), else the live text as a byte prefix of
   the rendered prompt (only the remaining bytes are tokenized), else a cold prefill;
2. prefills the rest in chunks that end on absolute multiples of the chunk size, checking for a cancelled job
   between chunks (the KV stays valid at every chunk boundary);
3. samples token by token with ds4's rules (thinking overrides the client's knobs; greedy inside DSML
   structure) until EOS, a stop string, ``max_tokens``, a full context, a closed tool block, or a disconnect.

Events go back to the request's event loop as tuples: ``("start", info)``, ``("prefill", done, total)``,
``("text", str)`` and finally ``("done", Result)`` or ``("error", status, message)``.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat import ThinkMode
from ..dsml import DSMLTracker, ToolCallDetector
from ..tokenizer import EOS, THINK, THINK_END, StreamingDetokenizer
from ..sampling import XorShift64Star, sample

DEFAULT_CHUNK = 512


@dataclass
class GenParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class Result:
    finish: str  # stop | length | tool_calls | error
    text: str  # the raw generated text (after stop-string truncation)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    source: str = "cold"


@dataclass
class Job:
    """One request for the worker. ``tokens`` is the fresh tokenization of ``prompt_text``."""

    kind: str  # chat | completions | responses | anthropic
    prompt_text: str
    tokens: list[int]
    mode: ThinkMode
    params: GenParams
    tools_active: bool = False
    tool_context: bool = False
    test_output: str | None = None  # test hook: emit these tokens instead of sampling
    prefill_delay: float = 0.0  # test hook: seconds slept per prefill chunk
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    on_result: Callable[[Result], None] | None = None

    def post(self, *event: Any) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the request's loop is gone
            self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()


class Worker:
    """Owns the engine in its own thread. ``load()`` runs in that thread and returns ``(session, tokenizer)``."""

    def __init__(self, load: Callable[[], tuple[Any, Any]], *, ctx: int, default_max_tokens: int = 393216,
                 trace: Callable[[str], None] | None = None) -> None:
        self._load = load
        self.ctx = ctx
        self.default_max_tokens = default_max_tokens
        self.trace = trace or (lambda s: None)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.session = None
        self.tokenizer = None
        self.busy = False
        self.served = 0
        self.tok_lock = threading.Lock()  # the tokenizer's BPE cache is shared with the request threads
        self.stopping = False
        # thinking-visible binding (§5.3): the text a client replays for the last tool-less thinking turn
        self._visible: str | None = None
        self._visible_pos = -1
        self._thread = threading.Thread(target=self._run, name="ds4-mlx-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        self.jobs.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self.jobs.qsize()

    # -- thread body ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.session, self.tokenizer = self._load()
        except Exception as e:  # noqa: BLE001 - reported through /health and every request
            self.load_error = f"{type(e).__name__}: {e}"
        self.ready.set()
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if self.stopping or self.load_error:
                job.post("error", 503, "server shutting down" if self.stopping else self.load_error)
                continue
            if job.cancelled.is_set():  # the client left while queued
                job.post("error", 499, "client disconnected")
                continue
            self.busy = True
            try:
                result = self._serve(job)
                self.served += 1
                if job.on_result:
                    job.on_result(result)
                job.post("done", result)
            except Exception as e:  # noqa: BLE001 - one bad request must never kill the worker
                self.session.reset()
                self._visible = None
                self.trace(f"error: {type(e).__name__}: {e}")
                job.post("error", 500, f"{type(e).__name__}: {e}")
            finally:
                self.busy = False
        # drain what is left after shutdown
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if job is not None:
                job.post("error", 503, "server shutting down")

    # -- prefix reuse (§5.2) -------------------------------------------------------------------------------
    def _live_text(self) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in self.session.tokens).decode("utf-8", "surrogateescape")

    def _plan(self, job: Job) -> tuple[list[int], int, str]:
        """-> (effective prompt tokens, reused prefix length, source label)."""
        live = list(self.session.tokens)
        fresh = job.tokens
        n = len(live)
        visible, self._visible = self._visible, None  # any request that does not continue it clears it
        if n and self.session.logits is not None:
            if len(fresh) >= n and fresh[:n] == live:
                return fresh, n, "memory-token"
            if (visible is not None and self._visible_pos == n and job.kind in ("chat", "anthropic")
                    and job.prompt_text.startswith(visible + EOS) and len(job.prompt_text) > len(visible)):
                with self.tok_lock:
                    rest = self.tokenizer.encode_chat(job.prompt_text[len(visible):])
                return live + rest, n, "thinking-visible"
            live_text = self._live_text()
            if len(job.prompt_text) >= len(live_text) and job.prompt_text.startswith(live_text):
                rest = job.prompt_text[len(live_text):]
                with self.tok_lock:
                    rest_ids = self.tokenizer.encode_chat(rest) if rest else []
                return live + rest_ids, n, "memory-text"
        return fresh, 0, "cold"

    def _sync(self, job: Job, tokens: list[int], reused: int) -> bool:
        """Bring the live session to ``tokens`` (prefill the part after ``reused``); False if cancelled."""
        s = self.session
        if reused == 0:
            s.reset()
        chunk = getattr(s, "chunk_size", DEFAULT_CHUNK) or DEFAULT_CHUNK
        total = len(tokens)
        pos = reused
        while pos < total:
            if job.cancelled.is_set():
                return False
            end = min(total, (pos // chunk + 1) * chunk)  # chunks end on absolute multiples of `chunk`
            s.prefill(tokens[pos:end])
            pos = end
            if job.prefill_delay:
                deadline = time.monotonic() + job.prefill_delay
                while time.monotonic() < deadline and not job.cancelled.is_set():
                    time.sleep(0.02)
            job.post("prefill", pos, total)
        return True

    # -- one job -------------------------------------------------------------------------------------------
    def _serve(self, job: Job) -> Result:
        tok = self.tokenizer
        t0 = time.monotonic()
        tokens, reused, source = self._plan(job)
        if len(tokens) >= self.ctx:  # a byte-prefix hit can tokenize differently: fall back to cold
            tokens, reused, source = job.tokens, 0, "cold"
        P = len(tokens)
        self.trace(f"--- {job.kind} request: {P} prompt tokens, reuse {source} ({reused} cached)\n"
                   f"prompt: {job.prompt_text!r}")
        job.post("start", {"prompt_tokens": P, "cached_tokens": reused, "source": source})
        if not self._sync(job, tokens, reused):
            self.trace("cancelled during prefill")
            return Result("error", "", P, reused, 0, source)
        t1 = time.monotonic()

        p = job.params
        thinking = job.mode.thinking
        if thinking:  # §3 rule 1: client knobs ignored in thinking mode
            temp, top_k, top_p, min_p = 1.0, 0, 1.0, 0.05
        else:
            temp, top_k, top_p, min_p = p.temperature, p.top_k, p.top_p, p.min_p
        max_tokens = p.max_tokens if p.max_tokens is not None else self.default_max_tokens
        max_tokens = max(0, min(max_tokens, self.ctx - P))
        rng = XorShift64Star(p.seed if p.seed and p.seed > 0 else None)
        detok = StreamingDetokenizer(tok)
        tracker = DSMLTracker() if job.tools_active else None
        detector = ToolCallDetector(in_think=job.prompt_text.endswith(THINK)) if job.tools_active else None
        with self.tok_lock:
            forced = tok.encode_chat(job.test_output) if job.test_output is not None else None
        stop_hold = max((len(s) for s in p.stop), default=1) - 1
        raw, sent, n_gen, finish = "", 0, 0, None

        while finish is None:
            if n_gen >= max_tokens:
                finish = "length"
                break
            if job.cancelled.is_set():
                finish = "error"
                break
            if forced is not None:
                token = forced[n_gen] if n_gen < len(forced) else tok.eos_id
            else:
                greedy = tracker is not None and tracker.greedy  # §6.2: DSML structure is sampled greedily
                token = sample(self.session.logits, 0.0 if greedy else temp, top_k, top_p, min_p, rng)
            if token == tok.eos_id:
                finish = "stop"
                break
            n_gen += 1
            piece = detok.add_token(token)
            raw += piece
            if p.stop and piece:
                hits = [i for s in p.stop if s and (i := raw.find(s, max(0, sent - len(s)))) >= 0]
                if hits:
                    raw = raw[: min(hits)]
                    finish = "stop"
            if finish is None and tracker is not None:
                tracker.feed(piece)
                detector.feed(piece)
                if detector.done:
                    finish = "tool_calls"
            if finish != "stop":
                self.session.step(token)  # the KV holds every emitted token (and the closed tool block)
                if finish is None and self.session.pos >= self.ctx:
                    finish = "length"
            commit = len(raw) if finish is not None else len(raw) - stop_hold
            if commit > sent:
                job.post("text", raw[sent:commit])
                sent = commit
        if not (finish == "stop" and p.stop and len(raw) < len(detok.text)):  # not cut by a stop string
            raw += detok.finalize()
        if len(raw) > sent:
            job.post("text", raw[sent:])
        t2 = time.monotonic()
        self.trace(f"generated ({finish}, {n_gen} tokens, prefill {t1 - t0:.2f}s, decode {t2 - t1:.2f}s): {raw!r}")

        # thinking-visible binding: the client will replay this turn as `</think>content<EOS>`
        if (job.kind in ("chat", "anthropic") and thinking and not job.tools_active and not job.tool_context
                and finish == "stop" and not p.stop and THINK_END in raw
                and job.prompt_text.endswith(THINK)):
            content = raw[raw.find(THINK_END) + len(THINK_END):]
            self._visible = job.prompt_text[: -len(THINK)] + THINK_END + content
            self._visible_pos = self.session.pos
        return Result(finish, raw, P, reused, n_gen, source)
