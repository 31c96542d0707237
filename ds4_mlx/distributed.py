"""Model parallel on ``mx.distributed``, the ranks started by ``mlx.launch``: a layer pipeline, or the routed
experts split by expert id (:func:`expert_range`).

Expert parallel: every rank holds every layer but only its share of each layer's routed experts, and runs the
whole program (tokenizer, sessions, sampling) in step with the others. A MoE adds its ranks' routed outputs with
one ``all_sum`` (:meth:`~ds4_mlx.model.moe.MoE.shard_experts`); the sums are the same on every rank, so the ranks
sample the same tokens. Rank 0 prints.

Pipeline parallel: each rank holds a contiguous range of layers and reads only their tensors from the model file.

Rank 0 holds the first layers and the embedding, and owns tokenization and sampling: its
:class:`PipelineModel` takes the place of a :class:`~ds4_mlx.model.model.Model` (``Session``, ``generate`` and
``decode_tokens`` run on it unchanged). The other ranks run :meth:`PipelineFollower.run`, which serves rank 0's
commands until it closes the pipeline; the last rank holds the output head.

Wire protocol, along the chain rank r -> r + 1 (every message is an MLX send, queued in protocol order):

- a header ``int32 [HEADER_LEN]``: ``(op, a, b, c, d)``, forwarded by every rank before it acts on it;
- after a ``FORWARD(state, pos, T, all_logits)`` header one ``float32`` message: the T ids (bit-cast) and the
  hyper-connection state ``S [T, n_hc, E]`` after the sender's layers; the last rank sends the logits
  (``[T, V]`` or ``[1, V]``, float32) back to rank 0.

A session's state on the other ranks (their layers' KV caches, compressor frontiers, indexer rows) lives there
under an id; in rank 0's session it is one :class:`RemoteLayers` entry at the end of ``Session.caches``, whose
``snapshot`` / ``rewind_point`` / ``rewound`` are commands to the other ranks. A rank that exits closes its
sockets: the others' next send or receive raises (MLX's ring backend: "connection to a peer was lost").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import mlx.core as mx

from .model.attention import LayerCache
from .model.fused import hc_post
from .model.model import Model, token_array

HEADER_LEN = 5


class Op(IntEnum):
    """A header's command."""

    FORWARD = 1  # (state, pos, T, all_logits): run T tokens through the layers
    NEW = 2  # (state, reserve): fresh caches
    COPY = 3  # (src, dst): a snapshot
    MARK = 4  # (src, dst): a rewind point
    REWIND = 5  # (src, point, dst): src rewound to the point
    FREE = 6  # (state,)
    STOP = 7  # rank 0 closes the pipeline


def expert_range(n_expert: int, size: int, rank: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: an even split of ``n_expert`` (the later ranks take one more
    when it does not divide). Raises ``ValueError`` for more ranks than experts."""
    if size > n_expert:
        raise ValueError(f"{size} ranks for {n_expert} experts: an expert-parallel rank needs at least one expert")
    return range(n_expert * rank // size, n_expert * (rank + 1) // size)


def split_layers(n_layer: int, size: int, spec: str | None = None) -> list[range]:
    """The layers of each of ``size`` ranks: an even split (the later ranks take one more when it does not divide),
    or ``spec``, one ``A:B`` range per rank separated by commas (``"0:2,2:6"``), contiguous from 0 to ``n_layer``.
    Raises ``ValueError`` for a spec that does not cover the model, or more ranks than layers."""
    if size > n_layer:
        raise ValueError(f"{size} ranks for {n_layer} layers: a pipeline rank needs at least one layer")
    if spec is None:
        return [range(n_layer * r // size, n_layer * (r + 1) // size) for r in range(size)]
    parts = [p.strip() for p in spec.split(",")]
    if len(parts) != size:
        raise ValueError(f"--layers {spec!r} gives {len(parts)} ranges for {size} ranks (one A:B per rank)")
    ranges, start = [], 0
    for part in parts:
        a, sep, b = part.partition(":")
        if not (sep and a.strip().isdigit() and b.strip().isdigit()):
            raise ValueError(f"--layers {spec!r}: {part!r} is not a range A:B of layer numbers")
        r = range(int(a), int(b))
        if r.start != start or len(r) == 0:
            raise ValueError(f"--layers {spec!r}: {part!r} must start at layer {start} and hold at least one layer")
        ranges.append(r)
        start = r.stop
    if start != n_layer:
        raise ValueError(f"--layers {spec!r} ends at layer {start}; the model has {n_layer} layers")
    return ranges


class _Chain:
    """One rank's links in the pipeline: headers and states to the next rank, logits to rank 0."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.prev, self.next = self.rank - 1, self.rank + 1
        self.is_last = self.next == self.size

    def queue_send(self, x: mx.array, dst: int) -> None:
        # queued, not awaited: the stream runs the sends and receives in the order they are queued
        mx.async_eval(mx.distributed.send(x, dst, group=self.group))

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        return mx.distributed.recv(shape, dtype, src, group=self.group)


def _pack(tokens: mx.array, S: mx.array) -> mx.array:
    """The ids (bit-cast to float32) and the state in one flat float32 message."""
    return mx.concatenate([tokens.view(mx.float32), S.astype(mx.float32).reshape(-1)])


def _state(carry: tuple, n_hc: int) -> mx.array:
    """A decode ``carry`` (:meth:`~ds4_mlx.model.model.Block.decode`) as the state ``[1, n_hc, E]``: its last HC
    post applied."""
    return hc_post(*carry, n_hc=n_hc) if len(carry) == 4 else carry[0]


class RemoteLayers:
    """The part of a session's state held by the other ranks, as the last entry of rank 0's ``Session.caches``.

    It holds no arrays: ``decode_state`` is empty and ``nbytes`` is 0 (``Session.kv_bytes`` counts rank 0's
    layers). Dropping it frees the state on the other ranks (with the next command)."""

    raw = comp_rows = comp_state = index_rows = index_state = None  # Session.state_arrays: none here

    def __init__(self, pipeline: PipelineModel, state: int):
        self.pipeline, self.state = pipeline, state

    def decode_state(self) -> dict[str, mx.array]:
        return {}

    def snapshot(self) -> RemoteLayers:
        return self.pipeline._derive(Op.COPY, self.state)

    def rewind_point(self) -> RemoteLayers:
        return self.pipeline._derive(Op.MARK, self.state)

    def rewound(self, point: RemoteLayers) -> RemoteLayers:
        return self.pipeline._derive(Op.REWIND, self.state, point.state)

    @property
    def nbytes(self) -> int:
        return 0

    def __del__(self) -> None:
        try:
            self.pipeline._freed.append(self.state)
        except Exception:  # interpreter shutdown
            pass


class PipelineModel:
    """Rank 0's side of a pipeline: ``__call__(tokens, pos, caches)`` as :meth:`Model.__call__`, running rank 0's
    layers here and the others on their ranks; the logits come back from the last rank.

    Args:
        stage: rank 0's :class:`Model` (its first layers and the embedding).
        group: the ``mx.distributed`` group (size >= 2).
        split: every rank's layers (:func:`split_layers`).
    """

    expert_cache = None  # streamed experts are not available in a pipeline
    queues_while_building = True  # a call queues its sends at once: decode_tokens keeps to this thread

    def __init__(self, stage: Model, group: Any, split: Sequence[range]):
        self.stage, self.split = stage, list(split)
        self.cfg, self.numerics = stage.cfg, stage.numerics
        self.layers = stage.layers
        self.weights_bytes = stage.weights_bytes  # this rank's
        self._chain = _Chain(group)
        self._ids = 0
        self._freed: list[int] = []
        self.closed = False

    def set_compile_decode(self, on: bool) -> None:
        """As :meth:`Model.set_compile_decode`, for rank 0's layers."""
        self.stage.set_compile_decode(on)

    def make_cache(self, reserve: int = 0) -> list:
        """Rank 0's layer caches and a :class:`RemoteLayers` for the others' (created there now)."""
        state = self._new_id()
        self._command(Op.NEW, state, reserve)
        return [*self.stage.make_cache(reserve), RemoteLayers(self, state)]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.stage.embed(tokens)

    def __call__(
        self,
        tokens: mx.array | Sequence[int],
        pos: int,
        caches: list,
        *,
        all_logits: bool = False,
        should_stop: Callable[[], bool] | None = None,
    ) -> mx.array:
        """As :meth:`Model.__call__`; ``should_stop`` is checked between rank 0's layers. The sends and the
        logits' receive are queued before it returns (the logits are then evaluated by the caller)."""
        *local, remote = caches
        tokens = token_array(tokens)
        T = tokens.shape[0]
        S = self.stage.embed(tokens)
        if T == 1:
            S = _state(self.stage.decode_layers((S,), tokens, pos, local), self.cfg.n_hc)
        else:
            S = self.stage.prefill_layers(S, tokens, pos, local, should_stop=should_stop)
        self._command(Op.FORWARD, remote.state, pos, T, int(all_logits))
        self._chain.queue_send(_pack(tokens, S), self._chain.next)
        logits = self._chain.recv((T if all_logits else 1, self.cfg.n_vocab), mx.float32, self._chain.size - 1)
        mx.async_eval(logits)  # queued now, after the sends, whatever the caller evaluates first
        return logits if all_logits else logits[0]

    def close(self) -> None:
        """End the other ranks' :meth:`PipelineFollower.run` (they return) and wait for the command to leave."""
        if self.closed:
            return
        self.closed = True
        header = mx.array([Op.STOP, 0, 0, 0, 0], dtype=mx.int32)
        mx.eval(mx.distributed.send(header, self._chain.next, group=self._chain.group))

    def __enter__(self) -> PipelineModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _new_id(self) -> int:
        self._ids += 1
        return self._ids

    def _derive(self, op: Op, *states: int) -> RemoteLayers:
        new = self._new_id()
        self._command(op, *states, new)
        return RemoteLayers(self, new)

    def _command(self, op: Op, *args: int) -> None:
        if self.closed:
            raise RuntimeError("the pipeline is closed")
        while self._freed:
            self._send_header(Op.FREE, self._freed.pop())
        self._send_header(op, *args)

    def _send_header(self, op: Op, *args: int) -> None:
        values = [int(op), *args] + [0] * (HEADER_LEN - 1 - len(args))
        self._chain.queue_send(mx.array(values, dtype=mx.int32), self._chain.next)


class PipelineFollower:
    """A rank after rank 0: holds its layers (the output head on the last rank) and each session's state for
    them, and serves rank 0's commands (:meth:`run`)."""

    expert_cache = None

    def __init__(self, stage: Model, group: Any, split: Sequence[range]):
        self.stage, self.split = stage, list(split)
        self.cfg = stage.cfg
        self.rank = group.rank()
        self.weights_bytes = stage.weights_bytes  # this rank's
        self._chain = _Chain(group)
        self.states: dict[int, list[LayerCache]] = {}

    def run(self) -> None:
        """Serve commands until rank 0 closes the pipeline. Raises ``RuntimeError`` when a rank is lost."""
        while True:
            header = self._chain.recv((HEADER_LEN,), mx.int32, self._chain.prev)
            mx.eval(header)
            if not self._chain.is_last:
                self._chain.queue_send(header, self._chain.next)
            op, *args = header.tolist()
            if op == Op.STOP:
                mx.synchronize()  # the forwarded header has left
                return
            self._apply(Op(op), *args)

    def _apply(self, op: Op, a: int, b: int, c: int, d: int) -> None:
        states = self.states
        if op == Op.FORWARD:
            self._forward(states[a], pos=b, T=c, all_logits=bool(d))
        elif op == Op.NEW:
            states[a] = self.stage.make_cache(b)
        elif op == Op.COPY:
            states[b] = [x.snapshot() for x in states[a]]
        elif op == Op.MARK:
            states[b] = [x.rewind_point() for x in states[a]]
        elif op == Op.REWIND:
            states[c] = [x.rewound(p) for x, p in zip(states[a], states[b], strict=True)]
        elif op == Op.FREE:
            states.pop(a, None)

    def _forward(self, caches: list[LayerCache], pos: int, T: int, all_logits: bool) -> None:
        cfg = self.cfg
        msg = self._chain.recv((T * (1 + cfg.n_hc * cfg.n_embd),), mx.float32, self._chain.prev)
        tokens = msg[:T].view(mx.int32)
        S = msg[T:].reshape(T, cfg.n_hc, cfg.n_embd)
        if T == 1:
            carry = self.stage.decode_layers((S,), tokens, pos, caches)
            out = self.stage._decode_head(*carry) if self._chain.is_last else _state(carry, cfg.n_hc)
        else:
            S = self.stage.prefill_layers(S, tokens, pos, caches)
            out = (self.stage.head(S if all_logits else S[-1:])) if self._chain.is_last else S
        if self._chain.is_last:
            sent = mx.distributed.send(out.astype(mx.float32), 0, group=self._chain.group)
        else:
            sent = mx.distributed.send(_pack(tokens, out), self._chain.next, group=self._chain.group)
        # the new state is evaluated with the send, as Session does with the logits (same graph every step)
        mx.eval([sent, *(x for cache in caches for x in cache.decode_state().values())])
