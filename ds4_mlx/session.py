"""A generation session: the token history, the per-layer KV state and the last logits (docs/model.md §5).

``prefill`` feeds a prompt in chunks (any chunk size: boundaries need not line up with the compression
ratios), ``step`` decodes one token, and ``snapshot``/``restore`` keep and bring back the whole state in
memory. The model itself is stateless, so several sessions can share one :class:`~ds4_mlx.model.Model`.
"""

from __future__ import annotations

import functools
import queue
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import mlx.core as mx

from .model.model import Model, PrefillCancelled
from .weights import EVAL_LOCK

#: Tokens per model call in a prefill (ds4 uses 2048): a chunk decodes every routed expert's weights once per tile
#: of its tokens, so longer chunks spread that work over more tokens. On the H200 a 32K prompt prefills 1.21x
#: faster in chunks of 4096 than of 2048 for 2.7 GB more transient memory (8192: 1.40x for 10 GB more;
#: benchmarks/RESULTS.md).
DEFAULT_CHUNK = 4096


def _arrays(obj, out: list | None = None) -> list[mx.array]:
    """Every ``mx.array`` reachable from ``obj`` (attributes, lists, tuples, dicts)."""
    out = [] if out is None else out
    if isinstance(obj, mx.array):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _arrays(v, out)
    elif isinstance(obj, dict):
        for v in obj.values():
            _arrays(v, out)
    elif hasattr(obj, "__dict__"):
        _arrays(vars(obj), out)
    elif hasattr(obj, "__slots__"):
        _arrays([getattr(obj, k, None) for k in obj.__slots__], out)
    return out


@dataclass(frozen=True)
class SessionSnapshot:
    """Everything the next token needs: token ids, last logits and every layer's cache state."""

    tokens: tuple[int, ...]
    logits: mx.array | None
    caches: tuple


class Session:
    """Incremental inference over one token stream (batch size 1).

    Attributes:
        tokens: the ids processed so far. ``pos`` (= ``len(tokens)``) is the next position.
        logits: f32 next-token logits ``[V]`` after the last processed token (``None`` when empty).
    """

    def __init__(self, model: Model, *, chunk_size: int = DEFAULT_CHUNK, reserve: int = 0):
        """``reserve``: the context (tokens) to size the KV buffers for up front, e.g. the server's ``--ctx``.
        Within it the buffers never grow, so compiled decode steps are never retraced (a growth past it
        doubles them, which costs one retrace, and on GPUs a JIT of the kernels at the new shapes)."""
        self.model = model
        self.chunk_size = chunk_size
        self.reserve = reserve
        self.queue_work = mx.async_eval  # how a pipelined step is queued (StepEncoder hands it to its thread)
        self.reset()

    def reset(self) -> None:
        """Forget everything: empty caches, no tokens, no logits."""
        self.caches = self.model.make_cache(self.reserve)
        self._tokens: list[int | mx.array] = []  # an mx.array entry is a token queued by a pipelined step
        self.logits: mx.array | None = None

    @property
    def tokens(self) -> list[int]:
        """The ids processed so far (waits for pipelined steps' tokens if there are any)."""
        if any(isinstance(t, mx.array) for t in self._tokens):
            self._tokens = [int(t.item()) if isinstance(t, mx.array) else t for t in self._tokens]
        return list(self._tokens)

    @property
    def pos(self) -> int:
        return len(self._tokens)

    def _run(self, tokens: list[int] | mx.array, wait: bool = True,
             should_stop: Callable[[], bool] | None = None) -> mx.array:
        if should_stop is None:
            logits = self.model(tokens, self.pos, self.caches)
        else:
            point = self.rewind_point()
            try:
                logits = self.model(tokens, self.pos, self.caches, should_stop=should_stop)
            except PrefillCancelled:
                self.rewind(point)  # the layers already run hold this call's rows: back to where it started
                raise
        # The whole new state is evaluated with the logits, also what they do not read yet (the compressor
        # frontiers until their window completes): so every step queues the same graph, up to which windows
        # complete. MLX-CUDA reuses a CUDA graph only for the same topology; leaving that state for a later
        # step made the steps' graphs vary with history, and each new one cost 1-3 ms of cudaGraphInstantiate.
        work = [logits, *(a for c in self.caches for a in c.decode_state().values())]
        (mx.eval if wait else self.queue_work)(work)
        self._tokens.extend(tokens if isinstance(tokens, list) else [tokens[0]])
        self.logits = logits
        return logits

    def prefill(self, tokens: Sequence[int], chunk_size: int | None = None,
                should_stop: Callable[[], bool] | None = None) -> mx.array:
        """Process ``tokens`` after the current history, ``chunk_size`` tokens per model call.

        Returns the next-token logits ``[V]`` after the last one. ``should_stop`` is checked between layers
        (a server passes "the client went away"): when it returns true the model call in progress is undone,
        so the session ends at a call boundary exactly as if the prefill had stopped there, and
        :class:`~ds4_mlx.model.model.PrefillCancelled` is raised.
        """
        tokens = [int(t) for t in tokens]
        if not tokens:
            raise ValueError("prefill needs at least one token")
        step = chunk_size or self.chunk_size
        for i in range(0, len(tokens), step):
            if i + step < len(tokens) and should_stop is None:
                self.queue_chunk(tokens[i : i + step])
            else:
                self._run(tokens[i : i + step], should_stop=should_stop)
        return self.logits

    def queue_chunk(self, tokens: list[int]) -> None:
        """Prefill ``tokens``, a chunk before the last: its logits are not read (``logits`` is None until the next
        call), and its state is queued, not awaited, so the host goes on to build the next chunk; in a layer
        pipeline the ranks then work on consecutive chunks."""
        self.model(tokens, self.pos, self.caches, head=False)
        mx.async_eval([a for c in self.caches for a in c.decode_state().values()])
        self._tokens.extend(tokens)
        self.logits = None

    def step(self, token: int | mx.array) -> mx.array:
        """Decode one token; returns the next-token logits ``[V]``.

        ``token`` may be an ``mx.array`` scalar still being computed (e.g. sampled lazily from the previous
        logits). Then nothing waits: the step is queued with ``mx.async_eval`` and its logits are returned
        unevaluated, so the caller can build the next step while the device runs this one (mlx-lm style
        pipelining). Reading ``tokens`` or the logits' values waits for the queued work.
        """
        return self._run(_token_row(token), wait=not isinstance(token, mx.array))

    def sibling(self) -> Session:
        """A new empty session over the same model, with this one's chunk size and reserved context."""
        return Session(self.model, chunk_size=self.chunk_size, reserve=self.reserve)

    def snapshot(self) -> SessionSnapshot:
        """An in-memory copy of the state; later calls do not change it."""
        return SessionSnapshot(tuple(self.tokens), self.logits, tuple(c.snapshot() for c in self.caches))

    def restore(self, snap: SessionSnapshot) -> None:
        """Return to ``snap`` (which stays usable: it can be restored again)."""
        self.caches = [c.snapshot() for c in snap.caches]
        self._tokens = list(snap.tokens)
        self.logits = snap.logits

    def rewind_point(self) -> SessionSnapshot:
        """A mark to come back to with :meth:`rewind` (:func:`~ds4_mlx.generate.decode_tokens` takes one a step).

        Unlike :meth:`snapshot` it does not wait for tokens queued by pipelined steps (its ``tokens`` may hold
        their lazy ids) and does not hold the compressed-row buffers: while a buffer is held elsewhere, appending
        a row to it copies the whole buffer instead of writing the row in place. So it is only valid for this
        session, as long as the session has only moved forward since."""
        return SessionSnapshot(tuple(self._tokens), self.logits, tuple(c.rewind_point() for c in self.caches))

    def rewind(self, point: SessionSnapshot) -> None:
        """Go back to ``point`` (from :meth:`rewind_point`); the rows appended since stay in the buffers, unused."""
        if len(point.tokens) > self.pos:
            raise ValueError(f"rewind point at {len(point.tokens)} tokens is ahead of the session ({self.pos})")
        self.caches = [c.rewound(p) for c, p in zip(self.caches, point.caches, strict=True)]
        self._tokens = list(point.tokens)
        self.logits = point.logits

    def state_arrays(self) -> list[mx.array]:
        """What the next tokens depend on: the logits and every layer's raw window, valid compressed rows and
        compressor frontiers (not the buffers' spare rows). Sessions with equal arrays continue alike."""
        return _arrays([self.logits] + [(c.raw, c.comp_rows, c.comp_state, c.index_rows, c.index_state)
                                        for c in self.caches])

    @property
    def kv_bytes(self) -> int:
        """Bytes of every layer's KV state (raw windows, valid compressed rows, frontiers), as ds4-bench's
        ``kvcache_bytes`` counts it: what the state holds, not the spare capacity of its buffers."""
        return sum(c.nbytes for c in self.caches)


def step_batch(sessions: Sequence[Session], tokens: Sequence[int | mx.array], *, wait: bool = True
               ) -> list[mx.array]:  # fmt: skip
    """Decode ``tokens[b]`` in ``sessions[b]`` for every b in one model call -> each session's next-token logits.

    The sessions must share one model. The layers take the B tokens as B rows, so every weight is read once for
    all of them (:meth:`~ds4_mlx.model.model.Model.decode_batch`); each session ends as if it had run
    :meth:`Session.step` itself (up to the products' summation order). One session is a plain :meth:`Session.step`.
    Sessions without a model of their own (test stand-ins) step one by one.

    A token may be an ``mx.array`` id still being computed (drawn on the device from the session's logits). With
    ``wait=False`` the step is queued with ``mx.async_eval`` and its logits are returned unevaluated, as
    :meth:`Session.step` does for a lazy token.
    """
    if len(sessions) != len(tokens):
        raise ValueError(f"{len(sessions)} sessions, {len(tokens)} tokens")
    if not all(isinstance(s, Session) for s in sessions):
        return [s.step(int(t)) for s, t in zip(sessions, tokens)]
    if len(sessions) == 1:
        return [sessions[0]._run(_token_row(tokens[0]), wait=wait)]
    model = sessions[0].model
    if any(s.model is not model for s in sessions):
        raise ValueError("a batched step needs sessions of one model")
    if len({id(s) for s in sessions}) != len(sessions):
        raise ValueError("a session appears twice in one batched step")
    tokens = [t if isinstance(t, mx.array) else int(t) for t in tokens]
    ids = mx.concatenate([_token_row(t) if isinstance(t, mx.array) else mx.array([t], mx.int32) for t in tokens])
    logits = model.decode_batch(ids, [s.pos for s in sessions], [s.caches for s in sessions])
    rows = [logits[b] for b in range(len(sessions))]
    states = [a for s in sessions for c in s.caches for a in c.decode_state().values()]
    (mx.eval if wait else mx.async_eval)(rows, states)
    for s, t, row in zip(sessions, tokens, rows):
        s._tokens.append(t)
        s.logits = row
    return rows


def _token_row(token: int | mx.array) -> list[int] | mx.array:
    """One token as a model call's ids: an int as a one-id list, a lazy id as int32 ``[1]``."""
    return token.reshape(1).astype(mx.int32) if isinstance(token, mx.array) else [int(token)]


@functools.cache
def _shared_stream() -> mx.Stream:
    """A stream any thread may evaluate on (MLX's own streams belong to the thread that made them)."""
    return mx.new_thread_unsafe_stream(mx.default_device())


class StepEncoder:
    """Queues a session's pipelined steps from a thread of its own.

    MLX encodes a step's graph for the device inside ``mx.async_eval`` (C++, without the GIL), and the host
    builds the next step in Python: in one thread the two add up, here they overlap (on the H200 the threaded
    loop took 0.83-0.86x the time a step of the single-threaded one). Use as a context manager around the steps: while it is open the session's pipelined steps
    (``Session.step`` with a lazy token) are built on a stream every thread may use and evaluated only by
    this thread, and the caller reads a step's arrays only after :meth:`wait` on the event :meth:`submit`
    returned (or after :meth:`drain`); anything else it evaluates needs :meth:`drain` first. (The package's
    own evaluations while building a step, a weight's derived form on first use, take
    :data:`~ds4_mlx.weights.EVAL_LOCK` instead, which the worker holds while it queues.)
    """

    def __init__(self, session: Session, switch_interval: float = 2e-4) -> None:
        self.session = session
        self._switch = switch_interval
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._last = threading.Event()
        self._last.set()
        self._error: BaseException | None = None
        #: CPU seconds the worker spent queueing steps: MLX's encode without its waits for the device
        self.cpu_seconds = 0.0

    def __enter__(self) -> StepEncoder:
        # what the next step reads must not be a lazy array of this thread's stream (the worker cannot run it)
        mx.eval(self.session.state_arrays())
        self._stream = mx.stream(_shared_stream())
        self._stream.__enter__()
        # the worker takes the GIL for a moment between steps; Python's 5 ms hand-over would stall it
        self._interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._interval, self._switch))
        self._thread = threading.Thread(target=self._work, name="ds4-mlx-step-encoder", daemon=True)
        self._thread.start()
        self.session.queue_work = self.submit
        return self

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            work, done = job
            t = time.thread_time()
            try:
                if self._error is None:
                    with EVAL_LOCK:  # not while the caller's thread makes a weight's derived form
                        mx.async_eval(work)
            except BaseException as e:  # raised in the caller's thread at its next wait
                self._error = e
            finally:
                self.cpu_seconds += time.thread_time() - t
                done.set()

    def submit(self, work) -> threading.Event:
        """Queue ``work`` (arrays) for the worker; the event is set once it is on the device."""
        self._raise()
        done = threading.Event()
        self._jobs.put((work, done))
        self._last = done
        return done

    @property
    def last(self) -> threading.Event:
        """The event of the newest :meth:`submit` (the session's last pipelined step)."""
        return self._last

    def wait(self, done: threading.Event) -> None:
        done.wait()
        self._raise()

    def drain(self) -> None:
        """Wait until everything submitted is on the device (the worker is then idle)."""
        self.wait(self._last)

    def _raise(self) -> None:
        if self._error is not None:
            raise RuntimeError("a decode step failed to queue on the device") from self._error

    def __exit__(self, *exc) -> None:
        self._jobs.put(None)
        self._thread.join()
        self.session.queue_work = mx.async_eval
        sys.setswitchinterval(self._interval)
        self._stream.__exit__(*exc)
        if exc[0] is None:
            self._raise()
