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

With ``sessions > 1`` (``serve --batched-session N``) the worker holds N live sessions (:class:`Slot`), each with
its own KV state, protocol bindings, thinking-visible text and disk-cache frontier, and serves up to N jobs at
once. A job goes to the idle slot whose live state it reuses longest (the same rules as above); when none
matches, to an empty slot or else the least recently used one, whose session is saved to disk first (``evict``).
A job that finds every slot busy waits, first come first served. The jobs then advance together
(:meth:`Worker._run_batched`): each loop runs one decode step for every job that is decoding, the B tokens as B
rows of one model call, then one prefill quantum of one prefilling job, in turn (chunks end on absolute multiples
of ``prefill_quantum``, so a job's prefill is the same alone or beside others). Each job's id is drawn with its
own knobs, on the device where they allow it, inside the step that takes it
(:func:`~ds4_mlx.generate.sample_and_step`); the step is queued and the ids are read back while the device runs
it, so each job's stop rules, DSML state and cancellation, and the building of the next step, overlap the device's
work. A job whose id ends its answer (EOS, a stop string, a cancel) rewinds its session to before that step.

Events go back to the request's event loop as tuples: ``("start", info)``, ``("prefill", done, total)``,
``("text", str)`` and finally ``("done", Result)`` or ``("error", status, message)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from ..chat import ThinkMode
from ..generate import DEFAULT_LAG, Draw, decode_tokens, sample_and_step
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


#: Prefill tokens between two decode steps of the other jobs (``serve --mixed-prefill-quantum``, ds4's default).
DEFAULT_PREFILL_QUANTUM = 128


@dataclass
class Slot:
    """One live session of the worker and what it remembers about its frontier (§5.2, §5.3)."""

    index: int
    session: Any
    bindings: dict[str, LiveBinding] = field(default_factory=dict)  # Responses / Anthropic (§5.3)
    epoch: int = 0  # the serial of the job that last started here (a binding must come from it)
    visible: str | None = None  # thinking-visible binding: the text a client replays for the last turn
    visible_pos: int = -1
    last_saved: int = 0  # frontier of the last cold/continued save (0 after a miss)
    last_used: float = 0.0  # time.monotonic() when its last job ended (least recently used is evicted first)
    job: Job | None = None  # the job it serves now

    def forget(self) -> None:
        """Drop every binding (after a failed job: the session was reset)."""
        self.bindings, self.visible, self.visible_pos = {}, None, -1


class Refused(Exception):
    """A job the worker refuses before touching the session (409 live state lost, 400 context)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass
class GenParams:
    """A request's sampling knobs and stop rules."""

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
    """A finished job: what the request thread turns into the API's answer."""

    finish: str  # stop | length | tool_calls | error
    text: str  # the raw generated text (after stop-string truncation)
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    source: str = "cold"
    cache_reason: str = ""
    epoch: int = 0  # the worker's job serial (a binding is accepted only while no later job started)
    live_pos: int = 0  # live token count when the job ended
    slot: int = 0  # the live session that served it (Worker.slots)


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
    submitted: float = 0.0  # time.monotonic() at Worker.submit (queue wait statistics)

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


class _Answer:
    """One job's answer as its ids come (§3): the text, stop strings, DSML structure and finish reason; it posts
    the text as it is settled."""

    def __init__(self, job: Job, tokenizer, tok_lock: threading.Lock, prompt_tokens: int, max_tokens: int,
                 continued_due: Callable[[int], bool]) -> None:  # fmt: skip
        p = job.params
        self.job, self.tok, self.P, self.max_tokens = job, tokenizer, prompt_tokens, max_tokens
        self.client = SamplingParams(p.temperature, p.top_p, p.top_k, p.min_p)
        self.sampler = Sampler(self.client, p.seed if p.seed and p.seed > 0 else None)
        self.detok = StreamingDetokenizer(tokenizer)
        self.tracker = DSMLTracker() if job.tools_active else None
        self.detector = ToolCallDetector(in_think=job.prompt_text.endswith(THINK)) if job.tools_active else None
        with tok_lock:
            self.forced = tokenizer.encode_chat(job.test_output) if job.test_output is not None else None
        self.stop_hold = max((len(s) for s in p.stop), default=1) - 1
        self.continued_due = continued_due
        self.raw, self.sent, self.n_gen, self.finish = "", 0, 0, None

    @property
    def running(self) -> bool:
        return self.finish is None and self.n_gen < self.max_tokens

    def knobs(self) -> SamplingParams:
        """§3: thinking fills the knobs the client left out; §6.2: DSML structure is greedy."""
        greedy = self.tracker is not None and self.tracker.greedy
        return server_params(self.client, thinking=self.job.mode.thinking, dsml_structure=greedy,
                             explicit=self.job.params.explicit)

    def forced_id(self) -> int:
        """The test hook's next id (its text, then EOS)."""
        return self.forced[self.n_gen] if self.n_gen < len(self.forced) else self.tok.eos_id

    def take(self, token: int) -> tuple[bool, bool]:
        """Account for the next id -> ``(keep, save)``: whether it goes into the KV, and whether a continued save
        is due after it. Sets :attr:`finish` when the answer ends here."""
        p = self.job.params
        if self.job.cancelled.is_set():
            self.finish = "error"
            return False, False
        if token == self.tok.eos_id:
            self.finish = "stop"
            return False, False
        self.n_gen += 1
        piece = self.detok.add_token(token)
        self.raw += piece
        if p.stop and piece:
            hits = [i for s in p.stop if s and (i := self.raw.find(s, max(0, self.sent - len(s)))) >= 0]
            if hits:
                self.raw = self.raw[: min(hits)]
                self.finish = "stop"
        if self.finish is None and self.tracker is not None:
            self.tracker.feed(piece)
            self.detector.feed(piece)
            if self.detector.done:
                self.finish = "tool_calls"
        if self.finish is None and self.n_gen >= self.max_tokens:  # max_tokens also ends at a full context
            self.finish = "length"
        keep = self.finish != "stop"  # the KV holds every emitted token (and the closed tool block)
        outside = self.tracker is None or self.tracker.state == DecodeState.OUTSIDE  # never save inside DSML
        save = keep and outside and self.continued_due(self.P + self.n_gen)
        commit = len(self.raw) if self.finish is not None else len(self.raw) - self.stop_hold
        if commit > self.sent:
            self.job.post("text", self.raw[self.sent : commit])
            self.sent = commit
        return keep, save

    def close(self) -> str:
        """Post the text still held back; -> the finish reason."""
        self.finish = self.finish or "length"  # max_tokens == 0
        if not (self.finish == "stop" and self.job.params.stop and len(self.raw) < len(self.detok.text)):
            self.raw += self.detok.finalize()  # not cut by a stop string
        if len(self.raw) > self.sent:
            self.job.post("text", self.raw[self.sent :])
        return self.finish


@dataclass
class _Task:
    """A job in the batched worker: its slot, its generator (:meth:`Worker._task`) and what it waits for."""

    job: Job
    slot: Slot
    gen: Any
    draw: Draw | None = None  # how to draw its next id (None: planned or prefilling)
    turn: int = 0  # when it last had a prefill quantum (the oldest goes next)


class Worker:
    """Owns the engine in its own thread. ``load()`` runs in that thread and returns ``(session, tokenizer)``.

    ``sessions``: live sessions (more are made with ``session.sibling()``); with more than one, up to that many
    jobs run at once, their decode steps batched and their prefills cut into ``prefill_quantum`` tokens."""

    def __init__(self, load: Callable[[], tuple[Any, Any]], *, ctx: int, default_max_tokens: int = 393216,
                 trace: Callable[[str], None] | None = None, kv_dir: str | None = None,
                 kv_policy: CachePolicy | None = None, lag: int = DEFAULT_LAG, sessions: int = 1,
                 prefill_quantum: int = DEFAULT_PREFILL_QUANTUM) -> None:  # fmt: skip
        if sessions < 1:
            raise ValueError(f"the worker needs at least one session, got {sessions}")
        if prefill_quantum < 1:
            raise ValueError(f"the prefill quantum must be a positive token count, got {prefill_quantum}")
        self._load = load
        self.lag = lag  # steps queued ahead of the id read back (decode_tokens; batched: one; 0 = synchronous)
        self.ctx = ctx
        self.n_sessions, self.prefill_quantum = sessions, prefill_quantum
        self.default_max_tokens = default_max_tokens
        self.trace = trace or (lambda s: None)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.ready = threading.Event()
        self.load_error: str | None = None
        self.slots: list[Slot] = []
        self.tokenizer = None
        self.served = 0
        self.tok_lock = threading.Lock()  # the tokenizer's BPE cache is shared with the request threads
        self.stopping = False
        self._bind_lock = threading.Lock()  # the slots' bindings, set by the request threads through bind()
        self._epoch = 0
        # disk KV cache (§5.4-5.7), built in the worker thread once the model is loaded
        self.kv_dir, self.kv_policy = kv_dir, kv_policy or CachePolicy()
        self.kv: DiskCache | None = None
        self.counters = Counter()  # requests, hits/misses by source, tokens reused/computed
        self.decisions: deque = deque(maxlen=32)  # the last cache decisions, newest last
        self.batch_sizes = Counter()  # batched decode steps by their number of sessions
        self.waits: deque = deque(maxlen=256)  # the last jobs' queue waits in seconds (submit to start)
        self._waiting: deque[Job] = deque()  # batched: jobs taken from the queue that wait for a free slot
        self.tool_memory = None  # the app's ToolMemory: its blocks found in a saved text go in the file's map
        self._thread = threading.Thread(target=self._run, name="ds4-mlx-worker", daemon=True)

    @property
    def session(self):
        """The first live session (the only one unless ``sessions > 1``)."""
        return self.slots[0].session if self.slots else None

    @property
    def busy(self) -> bool:
        return any(s.job is not None for s in self.slots)

    def start(self) -> None:
        self._thread.start()

    def submit(self, job: Job) -> None:
        job.submitted = time.monotonic()
        self.jobs.put(job)

    def stop(self, timeout: float = 10.0) -> None:
        self.stopping = True
        for slot in self.slots:  # the current generations end with an error (§4.9)
            if slot.job is not None:
                slot.job.cancel()
        self.jobs.put(None)
        self._thread.join(timeout)

    @property
    def queued(self) -> int:
        return self.jobs.qsize() + len(self._waiting)

    # -- thread body ---------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            session, self.tokenizer = self._load()
            self.slots = [Slot(0, session)] + [Slot(i, session.sibling()) for i in range(1, self.n_sessions)]
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
        if self.n_sessions > 1 and not self.load_error:
            self._run_batched()
        else:
            self._run_single()
        # drain what is left after shutdown
        while self._waiting:
            self._waiting.popleft().post("error", 503, "server shutting down")
        while not self.jobs.empty():
            job = self.jobs.get_nowait()
            if job is not None:
                job.post("error", 503, "server shutting down")
        for slot in self.slots:
            self._save_live(slot, "shutdown", slot.bindings.get("responses"))
        if (cache := self._expert_cache()) is not None:
            cache.save_profile()  # the process leaves by os._exit, past the cache's own exit hook
        release = getattr(getattr(self.session, "model", None), "close", None)
        if release is not None:  # a model over several ranks: the others stop following
            release()

    def _refuse_early(self, job: Job) -> bool:
        """Answer a job that cannot start (shutting down, no model, client gone); True if it was answered."""
        if self.stopping or self.load_error:
            job.post("error", 503, "server shutting down" if self.stopping else self.load_error)
            return True
        if job.cancelled.is_set():  # the client left while queued
            job.post("error", 499, "client disconnected")
            return True
        return False

    def _run_single(self) -> None:
        """One job at a time on the one live session, decode pipelined (:func:`decode_tokens`)."""
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if self._refuse_early(job):
                continue
            slot = self.slots[0]
            slot.job = job
            self.waits.append(time.monotonic() - job.submitted)
            try:
                result = self._serve(slot, job)
                self._finished(slot, job, result)
            except Refused as e:  # nothing ran; the session and its bindings are untouched
                job.post("error", e.status, e.message, "invalid_request_error")
            except Exception as e:  # noqa: BLE001 - one bad request must never kill the worker
                self._failed(slot, job, e)
            finally:
                slot.job = None
                slot.last_used = time.monotonic()

    def _finished(self, slot: Slot, job: Job, result: Result) -> None:
        result.live_pos, result.slot = slot.session.pos, slot.index
        self.served += 1
        if job.on_result:
            job.on_result(result)
        job.post("done", result)

    def _failed(self, slot: Slot, job: Job, e: Exception) -> None:
        slot.session.reset()
        with self._bind_lock:
            slot.forget()
        self.trace(f"error: {type(e).__name__}: {e}")
        job.post("error", 500, f"{type(e).__name__}: {e}")

    # -- batched: N live sessions, one decode step for all ---------------------------------------------------
    def _run_batched(self) -> None:
        """The scheduler of ``sessions > 1``: place waiting jobs in slots, then per loop one batched decode step
        of every decoding job and one prefill quantum of the prefilling job that waited longest for one."""
        tasks: list[_Task] = []
        turns = itertools.count()
        while True:
            try:  # wait for work only when nothing runs
                job = self.jobs.get() if not tasks and not self._waiting else self.jobs.get_nowait()
                while True:
                    if job is None:
                        for t in tasks:  # stop() cancelled them: they end here, their sessions at a step boundary
                            t.gen.close()
                            t.job.post("error", 503, "server shutting down")
                            t.slot.job = None
                        return
                    self._waiting.append(job)
                    job = self.jobs.get_nowait()
            except queue.Empty:
                pass
            self._place(tasks)
            decoding = [t for t in tasks if t.draw is not None]
            if decoding:
                try:
                    ids, points = sample_and_step([t.slot.session for t in decoding], [t.draw for t in decoding],
                                                  wait=not self.lag)
                    self.batch_sizes[len(decoding)] += 1
                except Exception as e:  # noqa: BLE001 - the step's sessions are lost, the worker goes on
                    for t in decoding:
                        tasks.remove(t)
                        self._release(t)
                        self._failed(t.slot, t.job, e)
                else:
                    for t, token, point in zip(decoding, ids, points):
                        self._advance(t, tasks, (token, point))
            prefilling = [t for t in tasks if t.draw is None]
            if prefilling:
                t = min(prefilling, key=lambda t: t.turn)
                t.turn = next(turns)
                self._advance(t, tasks)

    def _place(self, tasks: list[_Task]) -> None:
        """Start the waiting jobs, first come first served, while a slot is free for the first of them."""
        while self._waiting:
            job = self._waiting[0]
            if self._refuse_early(job):
                self._waiting.popleft()
                continue
            slot, plan = self._route(job)
            if slot is None:
                return
            self._waiting.popleft()
            self.waits.append(time.monotonic() - job.submitted)
            slot.job = job
            t = _Task(job, slot, self._task(slot, job, plan))
            tasks.append(t)
            self._advance(t, tasks)  # plans it (a disk restore, a 409) and stops before the prefill

    def _route(self, job: Job) -> tuple[Slot | None, tuple | None]:
        """The idle slot for ``job`` and its live reuse plan: the longest live reuse, else an empty slot, else
        the least recently used one (None plan: a miss there). ``(None, None)`` when every slot is busy."""
        idle = [s for s in self.slots if s.job is None]
        if not idle:
            return None, None
        best, best_plan = None, None
        for s in idle:
            with self._bind_lock:
                bindings = dict(s.bindings)
            plan = self._live_plan(s, job, bindings, s.visible)
            if plan is not None and (best_plan is None or plan[1] > best_plan[1]):
                best, best_plan = s, plan
        if best is not None:
            return best, best_plan
        empty = [s for s in idle if s.session.pos == 0]
        return (empty[0] if empty else min(idle, key=lambda s: s.last_used)), None

    def _advance(self, t: _Task, tasks: list[_Task], sent: tuple | None = None) -> None:
        """Run ``t`` to its next yield (sending it ``sent``): how to draw its next id, or None (its next prefill
        quantum); finish it when it returns."""
        try:
            t.draw = t.gen.send(sent)
            return
        except StopIteration as stop:
            self._finished(t.slot, t.job, stop.value)
        except Refused as e:
            t.job.post("error", e.status, e.message, "invalid_request_error")
        except Exception as e:  # noqa: BLE001 - one bad request must never kill the worker
            self._failed(t.slot, t.job, e)
        tasks.remove(t)
        self._release(t)

    @staticmethod
    def _release(t: _Task) -> None:
        t.slot.job = None
        t.slot.last_used = time.monotonic()

    def _task(self, slot: Slot, job: Job, plan: tuple | None):
        """One job of the batched worker, as a generator: yields None when planned and after every prefill
        quantum, then how to draw each next id (the test hook's id, or the sampler and knobs). The scheduler
        draws the decoding jobs' ids, steps them into the sessions together (:func:`~ds4_mlx.generate.sample_and_step`)
        and sends each job its id and its session's rewind point from before the step; returns the
        :class:`Result`."""
        tokens, reused, source, reason, cold_at, t0 = self._begin(slot, job, plan)
        P = len(tokens)
        yield None
        grain = min(self._chunk(slot), self.prefill_quantum)
        if not (yield from self._prefill(slot, job, tokens, reused, cold_at, grain)):
            self.trace("cancelled during prefill")
            return Result("error", "", P, reused, 0, source, reason, job.epoch)
        t1 = time.monotonic()
        ans = self._answer(slot, job, P)
        s = slot.session
        while ans.running:
            token, before = yield ans.forced_id() if ans.forced is not None else (ans.sampler, ans.knobs())
            keep, save = ans.take(token)
            if not keep:
                s.rewind(before)  # the step took it already: an EOS, a stop or a cancel never enters the KV
            if save:
                self._save_at(slot, "continued")
        return self._end(slot, job, ans, tokens, reused, source, reason, t0, t1)

    # -- disk cache helpers ----------------------------------------------------------------------------------
    def _chunk(self, slot: Slot) -> int:
        return getattr(slot.session, "chunk_size", None) or DEFAULT_CHUNK

    def _save_live(self, slot: Slot, reason: str, responses: LiveBinding | None = None) -> None:
        """evict/shutdown save of a whole live session, keyed by the visible text of a Responses binding
        (ext bit1) or of the thinking-visible binding (ext bit2) when it matches the live frontier, else by the
        live tokens' bytes."""
        kv, s = self.kv, slot.session
        if kv is None or s is None or s.logits is None or s.pos < kv.policy.min_tokens:
            return
        try:
            if responses is not None and responses.visible is not None and responses.pos == s.pos:
                text = responses.visible.encode("utf-8", "surrogateescape")
                kv.store(s, text, reason, flags=FLAG_RESPONSES_VISIBLE, tool_map=self._tool_map(text))
            elif slot.visible is not None and slot.visible_pos == s.pos:
                text = slot.visible.encode("utf-8", "surrogateescape")
                kv.store(s, text, reason, flags=FLAG_THINKING_VISIBLE, tool_map=self._tool_map(text))
            else:
                text = self.tokenizer.decode_bytes(s.tokens)
                kv.store(s, text, reason, tool_map=self._tool_map(text))
        except Exception as e:  # noqa: BLE001 - a failed save never fails a request
            self.trace(f"kv: {reason} save failed: {type(e).__name__}: {e}")

    def _save_at(self, slot: Slot, reason: str) -> None:
        """cold/continued save of a live session at its current length (keyed by its tokens' bytes)."""
        try:
            text = self.tokenizer.decode_bytes(slot.session.tokens)
            if self.kv.store(slot.session, text, reason, tool_map=self._tool_map(text)) is not None:
                slot.last_saved = slot.session.pos
        except Exception as e:  # noqa: BLE001
            self.trace(f"kv: {reason} save failed: {type(e).__name__}: {e}")

    def _tool_map(self, text: bytes) -> dict[str, str] | None:
        if self.tool_memory is None or self.tool_memory.max_ids <= 0:
            return None
        return self.tool_memory.for_text(text.decode("utf-8", "replace")) or None

    def _continued_due(self, slot: Slot, pos: int) -> bool:
        """Whether a session of ``pos`` tokens is due a continued save (an aligned frontier not saved yet)."""
        kv = self.kv
        if kv is None:
            return False
        step = kv.policy.continued_step
        return bool(step) and pos % step == 0 and pos >= kv.policy.min_tokens and pos > slot.last_saved

    def stats(self) -> dict:
        """Counters for ``GET /v1/stats``: cache decisions, tokens reused and computed, the disk cache, the live
        sessions, batch sizes and queue waits, the streamed experts' cache."""
        waits = list(self.waits)
        now = time.monotonic()
        return {"requests": self.counters["requests"],
                "hits": {k[4:]: v for k, v in self.counters.items() if k.startswith("hit:")},
                "misses": {k[5:]: v for k, v in self.counters.items() if k.startswith("miss:")},
                "conflicts": self.counters["conflicts"],
                "tokens_reused": self.counters["tokens_reused"],
                "prefill_tokens_computed": self.counters["prefill_tokens"],
                "live_tokens": self.session.pos if self.session is not None else 0,
                "sessions": [{"slot": s.index, "active": s.job is not None, "live_tokens": s.session.pos,
                              "idle_s": None if s.job is not None or not s.last_used else round(now - s.last_used, 3)}
                             for s in self.slots],
                "batch_sizes": {str(b): n for b, n in sorted(self.batch_sizes.items())},
                "queue_wait_s": {"jobs": len(waits), "mean": round(sum(waits) / len(waits), 4) if waits else 0.0,
                                 "max": round(max(waits), 4) if waits else 0.0},
                "last_decisions": list(self.decisions),
                "disk": self.kv.summary() if self.kv is not None else None,
                "experts": self.expert_stats()}

    def expert_stats(self) -> dict | None:
        """The streamed experts' cache counters (``--ssd-streaming``), or None when the experts are resident."""
        cache = self._expert_cache()
        return cache.stats() if cache is not None else None

    def _expert_cache(self):
        return getattr(getattr(self.session, "model", None), "expert_cache", None)  # no model: a test's fake session

    # -- live protocol bindings (§5.3) ----------------------------------------------------------------------
    def live_call_ids(self, kind: str) -> frozenset[str]:
        """The call ids of the live bindings of ``kind`` in every slot (parse-time check of tool outputs, §4.8)."""
        with self._bind_lock:
            found = [s.bindings[kind].ids for s in self.slots if kind in s.bindings]
        return frozenset().union(*found)

    def bind(self, kind: str, result: Result, ids: list[str], visible: str | None = None) -> bool:
        """Remember the live frontier of a finished ``responses``/``anthropic`` turn (called by the request thread
        with the call ids it showed the client). Ignored once another job has started in its slot: its frontier
        is gone."""
        with self._bind_lock:
            slot = self.slots[result.slot]
            if result.epoch != slot.epoch:
                return False
            slot.bindings[kind] = LiveBinding(result.live_pos, frozenset(ids), visible)
            return True

    # -- prefix reuse (§5.2) -------------------------------------------------------------------------------
    def _live_text(self, slot: Slot) -> str:
        return b"".join(self.tokenizer.token_bytes(t) for t in slot.session.tokens).decode("utf-8", "surrogateescape")

    def _live_plan(self, slot: Slot, job: Job, bindings: dict[str, LiveBinding], visible: str | None
                   ) -> tuple[list[int], int, str, str] | None:  # fmt: skip
        """How ``job`` reuses ``slot``'s live state -> (effective prompt tokens, reused prefix length, source label,
        reason), or None when it does not (or it continues tool calls that are not the live ones). Changes
        nothing: the worker also uses it to choose a slot."""
        live = list(slot.session.tokens)
        n = len(live)
        has_live = n > 0 and slot.session.logits is not None
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
        if (cont is not None and cont.requires_live) or not has_live:
            return None
        fresh = job.tokens
        if len(fresh) >= n and fresh[:n] == live:
            return fresh, n, "memory-token", f"live-prefix hit: live tokens are a prefix ({n} tokens)"
        if (visible is not None and slot.visible_pos == n and job.kind in ("chat", "anthropic")
                and job.prompt_text.startswith(visible + EOS) and len(job.prompt_text) > len(visible)):
            with self.tok_lock:
                rest = self.tokenizer.encode_chat(job.prompt_text[len(visible):])
            return live + rest, n, "thinking-visible", f"live-prefix hit: thinking-visible text ({n} tokens)"
        live_text = self._live_text(slot)
        if len(job.prompt_text) >= len(live_text) and job.prompt_text.startswith(live_text):
            rest = job.prompt_text[len(live_text):]
            with self.tok_lock:
                rest_ids = self.tokenizer.encode_chat(rest) if rest else []
            return live + rest_ids, n, "memory-text", f"live-prefix hit: live text is a byte prefix ({n} tokens)"
        return None

    _UNPLANNED = object()

    def _plan(self, slot: Slot, job: Job, live: Any = _UNPLANNED) -> tuple[list[int], int, str, str]:
        """-> (effective prompt tokens, reused prefix length, source label, reason). ``live``: the slot's
        :meth:`_live_plan` for this job when the caller already has it."""
        fresh = job.tokens
        with self._bind_lock:  # any request that does not continue a binding clears the slot's
            self._epoch += 1
            job.epoch = slot.epoch = self._epoch
            bindings, slot.bindings = slot.bindings, {}
        visible, slot.visible = slot.visible, None
        if live is self._UNPLANNED:
            live = self._live_plan(slot, job, bindings, visible)
        if live is not None:
            return live
        cont = job.continuation
        if cont is not None and cont.requires_live:  # tool outputs without their calls and no live state
            with self._bind_lock:
                if slot.epoch == job.epoch:  # nothing ran: keep the bindings for a request that matches
                    slot.bindings = bindings
            slot.visible = visible
            n = slot.session.pos
            b = bindings.get(job.kind)
            why = ("no live binding" if b is None else f"live frontier {b.pos} != {n}" if b.pos != n
                   else f"call ids {sorted(cont.ids)} != live {sorted(b.ids)}")
            self.counters["requests"] += 1
            self.counters["conflicts"] += 1
            self.decisions.append({"kind": job.kind, "prompt_tokens": len(fresh), "cached_tokens": 0,
                                   "source": "conflict", "reason": f"409: live tool state lost ({why})",
                                   "cold_save_at": None, "time": int(time.time())})
            self.trace(f"--- {job.kind} request: 409, live tool state lost ({why})")
            raise Refused(409, LOST[job.kind])
        if self.kv is None:
            return fresh, 0, "cold", "miss: no live prefix" + (" (disk cache off)" if self.kv_dir is None else "")
        # §5.2 #7: save the live session before it is replaced, then look on disk
        slot.visible = visible
        self._save_live(slot, "evict", bindings.get("responses"))
        slot.visible = None
        slot.last_saved = 0
        if len(fresh) < self.kv.policy.min_tokens:
            return fresh, 0, "cold", f"miss: below min tokens ({len(fresh)} < {self.kv.policy.min_tokens})"
        prompt = job.prompt_text.encode("utf-8", "surrogateescape")
        lk = self.kv.lookup(prompt)
        if not lk.hit:
            return fresh, 0, "cold", f"miss: {lk.reason}"
        slot.session.restore(lk.snapshot)
        base = list(lk.snapshot.tokens)
        rest = prompt[lk.text_bytes:]
        with self.tok_lock:
            rest_ids = self.tokenizer.encode_chat(rest) if rest else []
        return (base + rest_ids, len(base), "disk-text",
                f"disk hit at {len(base)} tokens ({lk.entry.name[:12]}, {lk.text_bytes} text bytes)")

    def _prefill(self, slot: Slot, job: Job, tokens: list[int], reused: int, cold_at: int, grain: int):
        """Bring the slot's session to ``tokens`` (prefill the part after ``reused``), as a generator that yields
        after every chunk and returns False if cancelled.

        Chunks end on absolute multiples of ``grain`` and of the session's chunk size; with a disk cache also at
        ``cold_at`` (cold save there) and at multiples of the continued step (continued saves)."""
        s = slot.session
        if reused == 0:
            s.reset()
        chunk = self._chunk(slot)
        step = self.kv.policy.continued_step if self.kv is not None else 0
        # a pipeline: queue the chunks before the last (no model: a test's fake session)
        overlap = getattr(getattr(s, "model", None), "overlaps_chunks", False)
        total = len(tokens)
        pos = reused
        while pos < total:
            if job.cancelled.is_set():
                return False
            end = min(total, (pos // chunk + 1) * chunk, (pos // grain + 1) * grain)
            if step:
                end = min(end, (pos // step + 1) * step)
            if pos < cold_at < end:
                end = cold_at
            if overlap and end < total and end != cold_at and not self._continued_due(slot, end):
                s.queue_chunk(tokens[pos:end])  # its rows are on the later ranks while rank 0 runs the next chunk
            else:
                try:
                    s.prefill(tokens[pos:end], should_stop=job.cancelled.is_set)  # checked between layers
                except PrefillCancelled:  # the session is back at `pos`, a chunk boundary
                    return False
            self.counters["prefill_tokens"] += end - pos
            pos = end
            if self.kv is not None:
                if pos == cold_at:
                    self._save_at(slot, "cold")
                elif self._continued_due(slot, s.pos):
                    self._save_at(slot, "continued")
            if job.prefill_delay:
                deadline = time.monotonic() + job.prefill_delay
                while time.monotonic() < deadline and not job.cancelled.is_set():
                    time.sleep(0.02)
            job.post("prefill", pos, total)
            if pos < total:
                yield
        return True

    # -- one job -------------------------------------------------------------------------------------------
    def _begin(self, slot: Slot, job: Job, live: Any = _UNPLANNED) -> tuple:
        """Plan ``job`` in ``slot`` and announce it -> (tokens, reused, source, reason, cold save point, start)."""
        tok = self.tokenizer
        t0 = time.monotonic()
        tokens, reused, source, reason = self._plan(slot, job, live)
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
                               "reason": reason, "cold_save_at": cold_at or None, "time": int(time.time()),
                               "slot": slot.index})
        self.trace(f"--- {job.kind} request: {P} prompt tokens, reuse {source} ({reused} cached)"
                   + (f", session {slot.index}" if self.n_sessions > 1 else "") + "\n"
                   f"cache: {reason}" + (f"; cold save at {cold_at} tokens" if cold_at else "") + "\n"
                   f"prompt: {job.prompt_text!r}")
        job.post("start", {"prompt_tokens": P, "cached_tokens": reused, "source": source})
        return tokens, reused, source, reason, cold_at, t0

    def _answer(self, slot: Slot, job: Job, P: int) -> _Answer:
        p = job.params
        max_tokens = p.max_tokens if p.max_tokens is not None else self.default_max_tokens
        max_tokens = max(0, min(max_tokens, self.ctx - P))
        return _Answer(job, self.tokenizer, self.tok_lock, P, max_tokens, lambda pos: self._continued_due(slot, pos))

    def _serve(self, slot: Slot, job: Job) -> Result:
        """One job on its own: prefill in chunks, then the pipelined decode loop."""
        tokens, reused, source, reason, cold_at, t0 = self._begin(slot, job)
        P = len(tokens)
        prefill = self._prefill(slot, job, tokens, reused, cold_at, self._chunk(slot))
        while True:
            try:
                next(prefill)
            except StopIteration as done:
                synced = done.value
                break
        if not synced:
            self.trace("cancelled during prefill")
            return Result("error", "", P, reused, 0, source, reason, job.epoch)
        t1 = time.monotonic()
        ans = self._answer(slot, job, P)
        session = slot.session
        while ans.running:
            # Pipelined (generate.decode_tokens) until the answer ends or a continued save needs the session
            # settled at the position of the last id; that id is not in the session when the ids stop coming.
            if ans.forced is not None:
                ids = _forced_ids(session, ans.forced[ans.n_gen:] + [self.tokenizer.eos_id])
            else:
                ids = decode_tokens(session, ans.sampler, ans.max_tokens - ans.n_gen, lag=self.lag, knobs=ans.knobs)
            token, keep, save = None, False, False
            with contextlib.closing(ids):
                for token, _ in ids:
                    keep, save = ans.take(token)  # step this id into the KV / save the session after it
                    if ans.finish is not None or save:
                        break
            if keep:
                session.step(token)
            if save:
                self._save_at(slot, "continued")
        return self._end(slot, job, ans, tokens, reused, source, reason, t0, t1)

    def _end(self, slot: Slot, job: Job, ans: _Answer, tokens: list[int], reused: int, source: str, reason: str,
             t0: float, t1: float) -> Result:  # fmt: skip
        finish = ans.close()
        raw = ans.raw
        t2 = time.monotonic()
        self.trace(f"generated ({finish}, {ans.n_gen} tokens, prefill {t1 - t0:.2f}s, decode {t2 - t1:.2f}s): {raw!r}")
        # thinking-visible binding: the client will replay this turn as `</think>content<EOS>`
        p = job.params
        if (job.kind in ("chat", "anthropic") and job.mode.thinking and not job.tools_active and not job.tool_context
                and finish == "stop" and not p.stop and THINK_END in raw
                and job.prompt_text.endswith(THINK)):
            content = raw[raw.find(THINK_END) + len(THINK_END):]
            slot.visible = job.prompt_text[: -len(THINK)] + THINK_END + content
            slot.visible_pos = slot.session.pos
        return Result(finish, raw, len(tokens), reused, ans.n_gen, source, reason, job.epoch)
