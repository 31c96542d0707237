"""The single model worker (docs/serving.md §4.9, §5.1-5.3, §3 stop rules).

One thread owns the model and its one live :class:`~ds4_mlx.session.Session`. Requests arrive as :class:`Job`
objects in a FIFO queue and run one at a time, never interleaved. For each job the worker

1. picks the longest reusable live state (§5.2): first the live protocol bindings (§5.3: the Responses visible
   transcript, a Responses/Anthropic tool-output continuation whose ids equal the live call ids — a request
   that needs one and finds none gets 409), then the live tokens as a token prefix of the fresh tokenization,
   else the thinking-visible binding (hidden reasoning kept in the KV), else the live text as a byte prefix of
   the rendered prompt (only the remaining bytes are tokenized), else a cold prefill;
2. prefills the rest in chunks that end on absolute multiples of the chunk size; a cancelled job (the client went
   away) stops between two layers and the chunk in progress is undone, so the KV stays valid at a chunk boundary;
   With a disk cache (``--kv-disk-dir``) a miss first saves the live session (``evict``), then looks for the
   longest cached rendered-byte prefix on disk (§5.6); a cold prompt is saved at its stable prefix (``cold``),
   long prefills and generations at aligned frontiers (``continued``), the live session at exit (``shutdown``);
3. samples token by token with ds4's rules (thinking overrides the client's knobs; greedy inside DSML
   structure) until EOS, a stop string, ``max_tokens``, a full context, a closed tool block, or a disconnect.
   Decoding is pipelined (:func:`~ds4_mlx.generate.decode_tokens`): ids are drawn on the device where the
   knobs allow it, two steps ahead of the text; an id whose knobs changed meanwhile (a DSML boundary) is
   redrawn, and the queued steps are dropped at the end and before a continued save.

Events go back to the request's event loop as tuples: ``("start", info)``, ``("prefill", done, total)``,
``("text", str)`` and finally ``("done", Result)`` or ``("error", status, message)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat import ThinkMode
from ..generate import DEFAULT_LAG, decode_tokens
from ..dsml import DSMLTracker, ToolCallDetector
from ..tokenizer import EOS, THINK, THINK_END, StreamingDetokenizer
from ..sampling import Sampler, SamplingParams, server_params
from ..session import DEFAULT_CHUNK, PrefillCancelled
from ..dsml import DecodeState
from ..kvstore import FLAG_RESPONSES_VISIBLE, FLAG_THINKING_VISIBLE, CachePolicy, DiskCache



MISS_KINDS = ("below min tokens", "no file", "text diverged", "token mismatch", "incompatible file",
              "tokenizes past the context", "no live prefix")


def miss_kind(reason: str) -> str:
    """The counter bucket of a miss reason (the reason itself carries the details: byte offsets, file names)."""
    return next((k for k in MISS_KINDS if k in reason), "other")


# §4.8: the 409 of a request that needs live tool state the worker no longer holds
LOST = {"responses": "Responses continuation state is not available; retry by replaying the full input history",
        "anthropic": "Anthropic continuation state is not available; retry by replaying the full messages history"}


@dataclass(frozen=True)
class LiveBinding:
    """What the worker remembers about its live frontier for one API (§5.3)."""

    pos: int  # live token count when the turn ended
    ids: frozenset[str]  # call ids of that turn
    visible: str | None = None  # Responses: the replayable transcript, without its final EOS


class Refused(Exception):
    """A job the worker refuses before touching the session (409 live state lost, 400 context)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class GenParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05
    seed: int | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    explicit: frozenset[str] = frozenset()  # the knobs the request set (they win in thinking mode too, §3)


@dataclass
class Result:
    finish: str  # stop | length | tool_calls | error
    text: str  # the raw generated text (after stop-string truncation)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    source: str = "cold"
    cache_reason: str = ""
    epoch: int = 0  # the worker's job serial (a binding is accepted only while no later job started)
    live_pos: int = 0  # live token count when the job ended


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
    continuation: Any = None  # bindings.Continuation: trailing tool outputs that may continue the live KV
    test_output: str | None = None  # test hook: emit these tokens instead of sampling
    prefill_delay: float = 0.0  # test hook: seconds slept per prefill chunk
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    epoch: int = 0  # set by the worker when the job starts
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


def _forced_ids(session, ids: list[int]):
    """The test hook's ids (``Job.test_output``) with :func:`~ds4_mlx.generate.decode_tokens`' contract: an id
    enters the session when the next one is asked for."""
    for token in ids:
        yield token, None
        session.step(token)


class Worker:
    """Owns the engine in its own thread. ``load()`` runs in that thread and returns ``(session, tokenizer)``."""

    def __init__(self, load: Callable[[], tuple[Any, Any]], *, ctx: int, default_max_tokens: int = 393216,
                 trace: Callable[[str], None] | None = None, kv_dir: str | None = None,
                 kv_policy: CachePolicy | None = None, lag: int = DEFAULT_LAG) -> None:
        self._load = load
        self.lag = lag  # decode steps queued ahead of the id read back (decode_tokens; 0 = synchronous)
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
        # Responses / Anthropic live bindings (§5.3), set by the request thread through bind()
        self._bindings: dict[str, LiveBinding] = {}
        self._bind_lock = threading.Lock()
        self._epoch = 0
        # disk KV cache (§5.4-5.7), built in the worker thread once the model is loaded
        self.kv_dir, self.kv_policy = kv_dir, kv_policy or CachePolicy()
        self.kv: DiskCache | None = None
        self._last_saved = 0  # frontier of the last cold/continued save (0 after a miss)
        self.counters = Counter()  # requests, hits/misses by source, tokens reused/computed
        self.decisions: deque = deque(maxlen=32)  # the last cache decisions, newest last
        self._current: Job | None = None
        self.tool_memory = None  # the app's ToolMemory: its blocks found in a saved text go in the file's map
        self._thread = threading.Thread(target=self._run, name="ds4-mlx-worker", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        self.jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        if self._current is not None:  # the current generation ends with an error (§4.9)
            self._current.cancel()
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
        if self.kv_dir and not self.load_error:
            try:
                self.kv = DiskCache(self.kv_dir, self.session.model, ctx=self.ctx, policy=self.kv_policy,
                                    log=self.trace)
                self.trace(f"kv: disk cache {self.kv_dir}: {len(self.kv.entries())} files")
            except Exception as e:  # noqa: BLE001 - the server still serves without a disk cache
                self.trace(f"kv: disk cache disabled: {type(e).__name__}: {e}")
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
            self._current = job
            try:
                result = self._serve(job)
                result.live_pos = self.session.pos
                self.served += 1
                if job.on_result:
                    job.on_result(result)
                job.post("done", result)
            except Refused as e:  # nothing ran; the session and its bindings are untouched
                job.post("error", e.status, e.message, "invalid_request_error")
            except Exception as e:  # noqa: BLE001 - one bad request must never kill the worker
                self.session.reset()
                self._visible = None
                with self._bind_lock:
                    self._bindings = {}
                self.trace(f"error: {type(e).__name__}: {e}")
                job.post("error", 500, f"{type(e).__name__}: {e}")
            finally:
                self.busy = False
                self._current = None
        # drain what is left after shutdown
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if job is not None:
                job.post("error", 503, "server shutting down")
        self._save_live("shutdown", self._bindings.get("responses"))

    # -- disk cache helpers ----------------------------------------------------------------------------------
    def _chunk(self) -> int:
        return getattr(self.session, "chunk_size", None) or DEFAULT_CHUNK

    def _save_live(self, reason: str, responses: LiveBinding | None = None) -> None:
        """evict/shutdown save of the whole live session, keyed by the visible text of a Responses binding
        (ext bit1) or of the thinking-visible binding (ext bit2) when it matches the live frontier, else by the
        live tokens' bytes."""
        kv, s = self.kv, self.session
        if kv is None or s is None or s.logits is None or s.pos < kv.policy.min_tokens:
            return
        try:
            if responses is not None and responses.visible is not None and responses.pos == s.pos:
                text = responses.visible.encode("utf-8", "surrogateescape")
                kv.store(s, text, reason, flags=FLAG_RESPONSES_VISIBLE, tool_map=self._tool_map(text))
            elif self._visible is not None and self._visible_pos == s.pos:
                text = self._visible.encode("utf-8", "surrogateescape")
                kv.store(s, text, reason, flags=FLAG_THINKING_VISIBLE, tool_map=self._tool_map(text))
            else:
                text = self.tokenizer.decode_bytes(s.tokens)
                kv.store(s, text, reason, tool_map=self._tool_map(text))
        except Exception as e:  # noqa: BLE001 - a failed save never fails a request
            self.trace(f"kv: {reason} save failed: {type(e).__name__}: {e}")

    def _save_at(self, reason: str) -> None:
        """cold/continued save of the live session at its current length (keyed by its tokens' bytes)."""
        try:
            text = self.tokenizer.decode_bytes(self.session.tokens)
            if self.kv.store(self.session, text, reason, tool_map=self._tool_map(text)) is not None:
                self._last_saved = self.session.pos
        except Exception as e:  # noqa: BLE001
            self.trace(f"kv: {reason} save failed: {type(e).__name__}: {e}")

    def _tool_map(self, text: bytes) -> dict[str, str] | None:
        if self.tool_memory is None or self.tool_memory.max_ids <= 0:
            return None
        return self.tool_memory.for_text(text.decode("utf-8", "replace")) or None

    def _continued_due(self, pos: int) -> bool:
        """Whether a session of ``pos`` tokens is due a continued save (an aligned frontier not saved yet)."""
        kv = self.kv
        if kv is None:
            return False
        step = kv.policy.continued_step
        return bool(step) and pos % step == 0 and pos >= kv.policy.min_tokens and pos > self._last_saved

    def _maybe_continued(self) -> None:
        if self._continued_due(self.session.pos):
            self._save_at("continued")

    def stats(self) -> dict:
        """Counters for ``GET /v1/stats``: cache decisions, tokens reused and computed, the disk cache, the streamed
        experts' cache."""
        return {"requests": self.counters["requests"],
                "hits": {k[4:]: v for k, v in self.counters.items() if k.startswith("hit:")},
                "misses": {k[5:]: v for k, v in self.counters.items() if k.startswith("miss:")},
                "conflicts": self.counters["conflicts"],
                "tokens_reused": self.counters["tokens_reused"],
                "prefill_tokens_computed": self.counters["prefill_tokens"],
                "live_tokens": self.session.pos if self.session is not None else 0,
                "last_decisions": list(self.decisions),
                "disk": self.kv.summary() if self.kv is not None else None,
                "experts": self.expert_stats()}

    def expert_stats(self) -> dict | None:
        """The streamed experts' cache counters (``--ssd-streaming``), or None when the experts are resident."""
        cache = getattr(self.session.model, "expert_cache", None) if self.session is not None else None
        return cache.stats() if cache is not None else None

    # -- live protocol bindings (§5.3) ----------------------------------------------------------------------
    def live_call_ids(self, kind: str) -> frozenset[str]:
        """The call ids of the live binding of ``kind`` (parse-time check of tool outputs, §4.8)."""
        with self._bind_lock:
            b = self._bindings.get(kind)
        return b.ids if b is not None else frozenset()

    def bind(self, kind: str, result: Result, ids: list[str], visible: str | None = None) -> bool:
        """Remember the live frontier of a finished ``responses``/``anthropic`` turn (called by the request thread
        with the call ids it showed the client). Ignored once another job has started: its frontier is gone."""
        with self._bind_lock:
            if result.epoch != self._epoch:
                return False
            self._bindings[kind] = LiveBinding(result.live_pos, frozenset(ids), visible)
            return True

    # -- prefix reuse (§5.2) -------------------------------------------------------------------------------
    def _live_text(self) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in self.session.tokens).decode("utf-8", "surrogateescape")

    def _plan(self, job: Job) -> tuple[list[int], int, str, str]:
        """-> (effective prompt tokens, reused prefix length, source label, reason)."""
        live = list(self.session.tokens)
        fresh = job.tokens
        n = len(live)
        with self._bind_lock:  # any request that does not continue a binding clears them all
            self._epoch += 1
            job_epoch, bindings, self._bindings = self._epoch, self._bindings, {}
        job.epoch = job_epoch
        visible, self._visible = self._visible, None
        has_live = n > 0 and self.session.logits is not None
        resp, cont = bindings.get("responses"), job.continuation
        # §5.2 #1: the Responses visible transcript at the live frontier
        if (has_live and job.kind == "responses" and resp is not None and resp.visible is not None
                and resp.pos == n and job.prompt_text.startswith(resp.visible + EOS)
                and len(job.prompt_text) > len(resp.visible + EOS)):
            with self.tok_lock:
                rest = self.tokenizer.encode_chat(job.prompt_text[len(resp.visible):])
            return live + rest, n, "responses-visible", f"live-prefix hit: Responses visible text ({n} tokens)"
        # §5.2 #2/#3: tool outputs answering exactly the live call ids -> live tokens + §5.3 tail
        b = bindings.get(job.kind) if cont is not None else None
        if has_live and b is not None and b.pos == n and b.ids == cont.ids:
            with self.tok_lock:
                rest = self.tokenizer.encode_chat(cont.tail)
            source = f"{job.kind}-tool-output"
            return live + rest, n, source, f"live-prefix hit: {source} ({len(cont.ids)} call ids, {n} tokens)"
        if cont is not None and cont.requires_live:  # tool outputs without their calls and no live state
            with self._bind_lock:
                if self._epoch == job_epoch:  # nothing ran: keep the bindings for a request that matches
                    self._bindings = bindings
            self._visible = visible
            why = ("no live binding" if b is None else f"live frontier {b.pos} != {n}" if b.pos != n
                   else f"call ids {sorted(cont.ids)} != live {sorted(b.ids)}")
            self.counters["requests"] += 1
            self.counters["conflicts"] += 1
            self.decisions.append({"kind": job.kind, "prompt_tokens": len(fresh), "cached_tokens": 0,
                                   "source": "conflict", "reason": f"409: live tool state lost ({why})",
                                   "cold_save_at": None, "time": int(time.time())})
            self.trace(f"--- {job.kind} request: 409, live tool state lost ({why})")
            raise Refused(409, LOST[job.kind])
        if has_live:
            if len(fresh) >= n and fresh[:n] == live:
                return fresh, n, "memory-token", f"live-prefix hit: live tokens are a prefix ({n} tokens)"
            if (visible is not None and self._visible_pos == n and job.kind in ("chat", "anthropic")
                    and job.prompt_text.startswith(visible + EOS) and len(job.prompt_text) > len(visible)):
                with self.tok_lock:
                    rest = self.tokenizer.encode_chat(job.prompt_text[len(visible):])
                return live + rest, n, "thinking-visible", f"live-prefix hit: thinking-visible text ({n} tokens)"
            live_text = self._live_text()
            if len(job.prompt_text) >= len(live_text) and job.prompt_text.startswith(live_text):
                rest = job.prompt_text[len(live_text):]
                with self.tok_lock:
                    rest_ids = self.tokenizer.encode_chat(rest) if rest else []
                return live + rest_ids, n, "memory-text", f"live-prefix hit: live text is a byte prefix ({n} tokens)"
        if self.kv is None:
            return fresh, 0, "cold", "miss: no live prefix" + (" (disk cache off)" if self.kv_dir is None else "")
        # §5.2 #7: save the live session before it is replaced, then look on disk
        self._visible = visible
        self._save_live("evict", resp)
        self._visible = None
        self._last_saved = 0
        if len(fresh) < self.kv.policy.min_tokens:
            return fresh, 0, "cold", f"miss: below min tokens ({len(fresh)} < {self.kv.policy.min_tokens})"
        prompt = job.prompt_text.encode("utf-8", "surrogateescape")
        lk = self.kv.lookup(prompt)
        if not lk.hit:
            return fresh, 0, "cold", f"miss: {lk.reason}"
        self.session.restore(lk.snapshot)
        base = list(lk.snapshot.tokens)
        rest = prompt[lk.text_bytes:]
        with self.tok_lock:
            rest_ids = self.tokenizer.encode_chat(rest) if rest else []
        return (base + rest_ids, len(base), "disk-text",
                f"disk hit at {len(base)} tokens ({lk.entry.name[:12]}, {lk.text_bytes} text bytes)")

    def _sync(self, job: Job, tokens: list[int], reused: int, cold_at: int = 0) -> bool:
        """Bring the live session to ``tokens`` (prefill the part after ``reused``); False if cancelled.

        With a disk cache, a chunk also ends at ``cold_at`` (cold save there) and at multiples of the continued
        step (continued saves)."""
        s = self.session
        if reused == 0:
            s.reset()
        chunk = self._chunk()
        step = self.kv.policy.continued_step if self.kv is not None else 0
        total = len(tokens)
        pos = reused
        while pos < total:
            if job.cancelled.is_set():
                return False
            end = min(total, (pos // chunk + 1) * chunk)  # chunks end on absolute multiples of `chunk`
            if step:
                end = min(end, (pos // step + 1) * step)
            if pos < cold_at < end:
                end = cold_at
            try:
                s.prefill(tokens[pos:end], should_stop=job.cancelled.is_set)  # checked between layers
            except PrefillCancelled:  # the session is back at `pos`, a chunk boundary
                return False
            self.counters["prefill_tokens"] += end - pos
            pos = end
            if self.kv is not None:
                if pos == cold_at:
                    self._save_at("cold")
                else:
                    self._maybe_continued()
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
        tokens, reused, source, reason = self._plan(job)
        if len(tokens) >= self.ctx and source.endswith("-tool-output"):  # the live KV is the only prompt there is
            raise Refused(400, f"Prompt has {len(tokens)} tokens, but the configured context size is {self.ctx} "
                               "tokens")
        if len(tokens) >= self.ctx:  # a byte-prefix hit can tokenize differently: fall back to cold
            tokens, reused, source, reason = job.tokens, 0, "cold", "miss: reused prefix tokenizes past the context"
        P = len(tokens)
        cold_at = 0
        pol = self.kv.policy if self.kv is not None else None
        if pol is not None and reused == 0 and pol.cold_max_tokens and pol.min_tokens <= P <= pol.cold_max_tokens:
            cold_at = pol.cold_length(tokens, tok.user_id, tok.assistant_id)
        self.counters["requests"] += 1
        if reused:
            self.counters["hit:" + source] += 1
        else:
            self.counters["miss:" + miss_kind(reason)] += 1
        self.counters["tokens_reused"] += reused
        self.decisions.append({"kind": job.kind, "prompt_tokens": P, "cached_tokens": reused, "source": source,
                               "reason": reason, "cold_save_at": cold_at or None, "time": int(time.time())})
        self.trace(f"--- {job.kind} request: {P} prompt tokens, reuse {source} ({reused} cached)\n"
                   f"cache: {reason}" + (f"; cold save at {cold_at} tokens" if cold_at else "") + "\n"
                   f"prompt: {job.prompt_text!r}")
        job.post("start", {"prompt_tokens": P, "cached_tokens": reused, "source": source})
        if not self._sync(job, tokens, reused, cold_at):
            self.trace("cancelled during prefill")
            return Result("error", "", P, reused, 0, source, reason, job.epoch)
        t1 = time.monotonic()

        p = job.params
        client = SamplingParams(p.temperature, p.top_p, p.top_k, p.min_p)
        max_tokens = p.max_tokens if p.max_tokens is not None else self.default_max_tokens
        max_tokens = max(0, min(max_tokens, self.ctx - P))
        sampler = Sampler(client, p.seed if p.seed and p.seed > 0 else None)
        detok = StreamingDetokenizer(tok)
        tracker = DSMLTracker() if job.tools_active else None
        detector = ToolCallDetector(in_think=job.prompt_text.endswith(THINK)) if job.tools_active else None
        with self.tok_lock:
            forced = tok.encode_chat(job.test_output) if job.test_output is not None else None
        stop_hold = max((len(s) for s in p.stop), default=1) - 1
        raw, sent, n_gen, finish = "", 0, 0, None

        def knobs() -> SamplingParams:  # §3: thinking fills the knobs the client left out; §6.2: DSML structure is greedy
            greedy = tracker is not None and tracker.greedy
            return server_params(client, thinking=job.mode.thinking, dsml_structure=greedy, explicit=p.explicit)

        while finish is None and n_gen < max_tokens:
            # Pipelined (generate.decode_tokens) until the answer ends or a continued save needs the session
            # settled at the position of the last id; that id is not in the session when the ids stop coming.
            if forced is not None:
                ids = _forced_ids(self.session, forced[n_gen:] + [tok.eos_id])
            else:
                ids = decode_tokens(self.session, sampler, max_tokens - n_gen, lag=self.lag, knobs=knobs)
            token, keep, save = None, False, False
            with contextlib.closing(ids):
                for token, _ in ids:
                    keep = save = False  # step this id into the KV / save the session after it
                    if job.cancelled.is_set():
                        finish = "error"
                        break
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
                    if finish is None and n_gen >= max_tokens:  # max_tokens also ends at a full context
                        finish = "length"
                    keep = finish != "stop"  # the KV holds every emitted token (and the closed tool block)
                    outside = tracker is None or tracker.state == DecodeState.OUTSIDE  # never save inside DSML
                    save = keep and outside and self._continued_due(P + n_gen)
                    commit = len(raw) if finish is not None else len(raw) - stop_hold
                    if commit > sent:
                        job.post("text", raw[sent:commit])
                        sent = commit
                    if finish is not None or save:
                        break
            if keep:
                self.session.step(token)
            if save:
                self._save_at("continued")
        finish = finish or "length"  # max_tokens == 0
        if not (finish == "stop" and p.stop and len(raw) < len(detok.text)):  # not cut by a stop string
            raw += detok.finalize()
        if len(raw) > sent:
            job.post("text", raw[sent:])
        t2 = time.monotonic()
        self.trace(f"generated ({finish}, {n_gen} tokens, prefill {t1 - t0:.2f}s, decode {t2 - t1:.2f}s): {raw!r}")

        # thinking-visible binding: the client will replay this turn as `</think>content<EOS>`
        if (job.kind in ("chat", "anthropic") and job.mode.thinking and not job.tools_active and not job.tool_context
                and finish == "stop" and not p.stop and THINK_END in raw
                and job.prompt_text.endswith(THINK)):
            content = raw[raw.find(THINK_END) + len(THINK_END):]
            self._visible = job.prompt_text[: -len(THINK)] + THINK_END + content
            self._visible_pos = self.session.pos
        return Result(finish, raw, P, reused, n_gen, source, reason, job.epoch)
