"""Model parallel on ``mx.distributed``, the ranks started by ``mlx.launch``: a layer pipeline, the routed
experts split by expert id, or the attention heads split as well (:func:`tensor_share`).

In every mode rank 0 owns tokenization, sessions and sampling, and drives the other ranks: its model (a
:class:`PipelineModel` or :class:`LockstepModel`) takes the place of a :class:`~ds4_mlx.model.model.Model`
(``Session``, ``generate``, ``decode_tokens`` and the server run on it unchanged) and sends each call to the others,
whose :class:`Follower` serves rank 0's commands until it closes them (:meth:`Follower.run`).

Pipeline parallel: each rank holds a contiguous range of layers and reads only their tensors from the model file;
rank 0 holds the first layers and the embedding, the last rank the output head.

Expert and tensor parallel: every rank holds every layer but only its share of some of each layer's tensors.
``expert`` splits the routed experts by id and the shared expert by its hidden width; a MoE adds its ranks' outputs
with one ``all_sum`` (:meth:`~ds4_mlx.model.moe.MoE.shard`). ``tensor`` also splits the attention heads by output
group (their query rows, sinks and output products); attention adds its ranks' outputs with a second ``all_sum``
(:meth:`~ds4_mlx.model.attention.Attention.shard_heads`). Everything else (the KV row, compressors, indexer,
router, HC, embedding, head) is replicated: it is small, and computing it everywhere costs no collective. A call
sends the token ids to the other ranks, which run the same call on their share (:func:`lockstep`).

Wire protocol, along the chain rank r -> r + 1 (every message is an MLX send, queued in protocol order):

- a header ``int32 [HEADER_LEN]``: ``(op, a, b, c, d)``, forwarded by every rank before it acts on it;
- after a ``FORWARD(state, pos, T, logits)`` header one ``float32`` message: the T ids (bit-cast) and the
  hyper-connection state ``S [T, n_hc, E]`` after the sender's layers; the last rank sends the logits
  (``[T, V]`` or ``[1, V]``, float32) back to rank 0, unless ``logits`` is :attr:`Logits.NONE`. In lockstep the
  message is the T ids alone (``int32``), and nothing comes back;
- after ``GET(state, pos)`` the layers' state (:meth:`~ds4_mlx.model.attention.LayerCache.message`, float32) goes
  back along the chain, each rank putting its own before the later ranks'; after ``PUT(state, pos)`` rank 0 sends
  the other ranks' along the chain, each rank keeping its own part. Every size follows from ``pos`` (a KV file's
  state: saved from every layer by rank 0, restored into the ranks that hold them).

A session's state on the other ranks (their layers' KV caches, compressor frontiers, indexer rows) lives there
under an id; in rank 0's session it is one :class:`RemoteLayers` entry at the end of ``Session.caches``, whose
``snapshot`` / ``rewind_point`` / ``rewound`` are commands to the other ranks. A rank that exits closes its
sockets: the others' next send or receive raises (MLX's ring backend: "connection to a peer was lost").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import mlx.core as mx

from .backend import on_cuda_gpu
from .model.attention import LayerCache, layer_cache_from_message, message_sizes
from .model.fused import hc_post
from .model.model import Model, stage_tensor, token_array

HEADER_LEN = 5


class Op(IntEnum):
    """A header's command."""

    FORWARD = 1  # (state, pos, T, logits): run T tokens through the layers (Logits: which come back)
    NEW = 2  # (state, reserve): fresh caches
    COPY = 3  # (src, dst): a snapshot
    MARK = 4  # (src, dst): a rewind point
    REWIND = 5  # (src, point, dst): src rewound to the point
    FREE = 6  # (state,)
    STOP = 7  # rank 0 closes the pipeline
    GET = 8  # (state, pos): the ranks' layers' state (LayerCache.message) to rank 0, back along the chain
    PUT = 9  # (state, pos): each rank's layers' state from rank 0, along the chain, as a new state


class Logits(IntEnum):
    """A ``FORWARD``'s last field: the logits rank 0 wants back."""

    LAST = 0  # the last token's
    ALL = 1  # every token's
    NONE = 2  # none (a prefill chunk before the last)


def expert_range(n_expert: int, size: int, rank: int) -> range:
    """The experts rank ``rank`` of ``size`` holds: an even split of ``n_expert`` (the later ranks take one more
    when it does not divide). Raises ``ValueError`` for more ranks than experts."""
    if size > n_expert:
        raise ValueError(f"{size} ranks for {n_expert} experts: an expert-parallel rank needs at least one expert")
    return even_split(n_expert, size, rank)


PARALLEL_MODES = ("pipeline", "expert", "tensor")

# (axis, part): a tensor cut to the elements ``part`` along ``axis`` (weights.cut_storage)
Cut = tuple[int, range]


def even_split(n: int, size: int, rank: int, unit: int = 1) -> range:
    """Rank ``rank``'s part of ``n`` items split over ``size`` ranks in whole units of ``unit`` items (the later
    ranks take one unit more when it does not divide)."""
    units = n // unit
    return range(unit * (units * rank // size), unit * (units * (rank + 1) // size))


def tensor_share(cfg: Any, mode: str, size: int, rank: int) -> Callable[[str], Cut | None]:
    """How rank ``rank`` of ``size`` cuts each tensor in ``mode`` (``"expert"`` or ``"tensor"``): a function of a
    GGUF tensor name -> its :data:`Cut`, or None for a tensor held whole. Raises ``ValueError`` for more ranks
    than the split allows (an expert, or with ``"tensor"`` an attention output group, per rank at least)."""
    if mode not in ("expert", "tensor"):
        raise ValueError(f"tensor_share: mode {mode!r} (expert or tensor)")
    F, L, D = cfg.n_ff_exp, cfg.o_lora_rank, cfg.head_dim  # F: the shared expert's width too
    unit = next(u for u in (256, 32, 1) if F // u >= size)  # whole blocks of every block type where it can
    cuts = {"ffn_gate_exps": (0, expert_range(cfg.n_expert, size, rank))}
    cuts["ffn_up_exps"] = cuts["ffn_down_exps"] = cuts["ffn_gate_exps"]
    hidden = even_split(F, size, rank, unit)  # the shared expert's hidden units: its gate/up rows, down columns
    cuts.update(ffn_gate_shexp=(0, hidden), ffn_up_shexp=(0, hidden), ffn_down_shexp=(1, hidden))
    if mode == "tensor":
        G, per = cfg.n_out_group, cfg.n_head // cfg.n_out_group
        if size > G:
            raise ValueError(f"{size} ranks for {G} attention output groups: a tensor-parallel rank needs at least "
                             "one (--parallel expert splits the experts alone)")  # fmt: skip
        groups = even_split(G, size, rank)
        heads = range(groups.start * per, groups.stop * per)
        cuts.update(attn_q_b=(0, range(heads.start * D, heads.stop * D)), attn_sinks=(0, heads),
                    attn_output_a=(0, range(groups.start * L, groups.stop * L)),
                    attn_output_b=(1, range(groups.start * L, groups.stop * L)))  # fmt: skip

    def cut(name: str) -> Cut | None:
        if not name.startswith("blk."):
            return None
        return cuts.get(name.split(".")[2])

    return cut


def held_share(cut: Callable[[str], Cut | None] | None, name: str, shape: Sequence[int],
               keep: Callable[[str], bool] | None = None) -> float:  # fmt: skip
    """The share of the tensor ``name`` of ``shape`` that a rank holds: none unless ``keep`` keeps it (a pipeline
    stage's), the part ``cut`` cuts, else all of it."""
    if keep is not None and not keep(name):
        return 0.0
    part = None if cut is None else cut(name)
    return 1.0 if part is None else len(part[1]) / shape[part[0]]


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


Keep = Callable[[str], bool]  # which tensors a rank holds, by GGUF name


def rank_share(cfg: Any, mode: str, size: int, rank: int, spec: str | None = None
               ) -> tuple[list[range] | None, Keep | None, Callable[[str], Cut | None] | None]:  # fmt: skip
    """What rank ``rank`` of ``size`` holds in ``mode`` -> ``(split, keep, cut)``. A pipeline: every rank's layers
    (:func:`split_layers`, ``spec`` as there) and which tensors this rank keeps (its layers', the embedding on the
    first rank, the output head on the last: :func:`~ds4_mlx.model.model.stage_tensor`), no cut. Experts or heads
    split: no split or keep, the cut of :func:`tensor_share`."""
    if mode != "pipeline":
        return None, None, tensor_share(cfg, mode, size, rank)
    split = split_layers(cfg.n_layer, size, spec)
    mine = split[rank]
    return split, lambda name: stage_tensor(name, mine, cfg.n_layer), None


def rank_model(cfg: Any, weights: dict, numerics: Any, group: Any, split: list[range] | None,
               cut: Callable[[str], Cut | None] | None, tokenizer: Callable[[], Any],
               head_rows: Any = None) -> tuple[Any, Any]:  # fmt: skip
    """This rank's part of a model over the ranks of ``group``, from the weights it holds (:func:`rank_share`'s
    ``split`` and ``cut``) -> rank 0's model that drives the others and ``tokenizer()``, or another rank's
    :class:`Follower` and None. ``head_rows``: a pipeline's, see :class:`PipelineModel`."""
    lead = group.rank() == 0
    if split is not None:
        stage = Model(cfg, weights, numerics, layers=split[group.rank()])
        if not lead:
            return PipelineFollower(stage, group, split), None
        return PipelineModel(stage, group, split, head_rows), tokenizer()
    model = Model(cfg, weights, numerics)
    model.shard(group, cut)
    return lockstep(model, group), (tokenizer() if lead else None)


def messages_awaited() -> bool:
    """Whether every message waits for its data and its delivery before the next is queued:
    ``$DS4_MLX_AWAIT_MESSAGES`` (``1`` or ``0``), else yes on MLX-CUDA. There a two-rank pipeline on one H100
    hung with queued messages (rank 0 blocked in the CUDA allocator's lock while its device waited on a message
    still on the communication stream); awaited, no device work ever waits on a message."""
    value = os.environ.get("DS4_MLX_AWAIT_MESSAGES", "").strip()
    if value in ("0", "1"):
        return value == "1"
    if value:
        raise ValueError(f"DS4_MLX_AWAIT_MESSAGES must be 0 or 1, got {value!r}")
    return on_cuda_gpu()


class _Chain:
    """One rank's links in the pipeline: headers and states to the next rank, logits to rank 0."""

    def __init__(self, group: Any):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.prev, self.next = self.rank - 1, self.rank + 1
        self.is_last = self.next == self.size
        self.awaited = messages_awaited()

    def queue_send(self, x: mx.array, dst: int) -> None:
        """Send ``x``: queued (the stream runs the sends and receives in the order they are queued), or
        awaited (:func:`messages_awaited`)."""
        sent = mx.distributed.send(x, dst, group=self.group)
        if self.awaited:
            mx.eval(x)
            mx.eval(sent)
        else:
            mx.async_eval(sent)

    def recv(self, shape: tuple[int, ...], dtype: mx.Dtype, src: int) -> mx.array:
        received = mx.distributed.recv(shape, dtype, src, group=self.group)
        if self.awaited:
            mx.eval(received)
        return received


def _pack(tokens: mx.array, S: mx.array) -> mx.array:
    """The ids (bit-cast to float32) and the state in one flat float32 message."""
    return mx.concatenate([tokens.view(mx.float32), S.astype(mx.float32).reshape(-1)])


def _unpack_layers(cfg: Any, layers: range, pos: int, msg: mx.array, kv_dtype: mx.Dtype) -> dict[int, LayerCache]:
    """The caches of ``layers`` at ``pos`` tokens from their messages, one after another in ``msg``."""
    out, start = {}, 0
    for il in layers:
        n = sum(message_sizes(cfg, il, pos))
        out[il] = layer_cache_from_message(cfg, il, pos, msg[start : start + n], kv_dtype)
        start += n
    return out


def _held_size(side: Any, first: int, pos: int, stop: int | None = None) -> int:
    """Values in the state messages (:meth:`LayerCache.message`) at ``pos`` tokens of ranks ``first`` to ``stop``
    (default the last), as ``side`` (a leader or a follower) knows what each rank holds."""
    ranks = range(first, side._chain.size if stop is None else stop)
    return sum(sum(message_sizes(side.cfg, il, pos)) for r in ranks for il in side.held[r])


def _kv_dtype(model: Model) -> mx.Dtype:
    return model.layers[0].attn.kv_dtype


def _state(carry: tuple, n_hc: int) -> mx.array:
    """A decode ``carry`` (:meth:`~ds4_mlx.model.model.Block.decode`) as the state ``[1, n_hc, E]``: its last HC
    post applied."""
    return hc_post(*carry, n_hc=n_hc) if len(carry) == 4 else carry[0]


class RemoteLayers:
    """The part of a session's state held by the other ranks, as the last entry of rank 0's ``Session.caches``.

    It holds no arrays: ``decode_state`` is empty and ``nbytes`` is 0 (``Session.kv_bytes`` counts rank 0's
    layers). Dropping it frees the state on the other ranks (with the next command)."""

    raw = comp_rows = comp_state = index_rows = index_state = None  # Session.state_arrays: none here

    def __init__(self, leader: _Leader, state: int):
        self.leader, self.state = leader, state

    def decode_state(self) -> dict[str, mx.array]:
        return {}

    def snapshot(self) -> RemoteLayers:
        return self.leader._derive(Op.COPY, self.state)

    def rewind_point(self) -> RemoteLayers:
        return self.leader._derive(Op.MARK, self.state)

    def rewound(self, point: RemoteLayers) -> RemoteLayers:
        return self.leader._derive(Op.REWIND, self.state, point.state)

    @property
    def nbytes(self) -> int:
        return 0

    def __del__(self) -> None:
        try:
            self.leader._freed.append(self.state)
        except Exception:  # interpreter shutdown
            pass


class _Leader:
    """Rank 0's side: a model for ``Session`` whose calls also command the other ranks (:class:`Follower`).

    ``local`` is the :class:`Model` of this rank, ``held`` every rank's layers (default: all of them on every rank);
    ``make_cache`` gives this rank's caches and a :class:`RemoteLayers` for the others' state, and the snapshot,
    rewind and free of that state are commands too."""

    expert_cache = None  # streamed experts are not available over several ranks
    queues_while_building = True  # a call queues its sends at once: decode_tokens keeps to this thread

    def __init__(self, local: Model, group: Any, held: Sequence[range] | None = None):
        self.local, self.held = local, list(held or [range(local.cfg.n_layer)] * group.size())
        self.cfg, self.numerics = local.cfg, local.numerics
        self.layers = local.layers
        self.token_embd, self.output = local.token_embd, getattr(local, "output", None)  # KV files' fingerprint
        self.weights_bytes = local.weights_bytes  # this rank's
        self._chain = _Chain(group)
        self._ids = 0
        self._freed: list[int] = []
        self.closed = False

    def set_compile_decode(self, on: bool) -> None:
        """As :meth:`Model.set_compile_decode`, for this rank's layers."""
        self.local.set_compile_decode(on)

    def make_cache(self, reserve: int = 0) -> list:
        """This rank's layer caches and a :class:`RemoteLayers` for the others' (created there now)."""
        state = self._new_id()
        self._command(Op.NEW, state, reserve)
        return [*self.local.make_cache(reserve), RemoteLayers(self, state)]

    def embed(self, tokens: mx.array) -> mx.array:
        return self.local.embed(tokens)

    def layer_caches(self, caches: list) -> list[LayerCache]:
        """Every layer's cache of a session's ``caches`` (a KV file's state), the other ranks' layers fetched."""
        *local, remote = caches
        out = {layer.il: c for layer, c in zip(self.layers, local, strict=True)}
        if len(out) < self.cfg.n_layer:  # a pipeline: the other ranks hold the other layers
            pos = local[0].pos
            self._command(Op.GET, remote.state, pos)
            msg = self._chain.recv((_held_size(self, 1, pos),), mx.float32, 1)  # ranks 1.., in order
            for rank in range(1, self._chain.size):
                n = _held_size(self, rank, pos, rank + 1)
                out.update(_unpack_layers(self.cfg, self.held[rank], pos, msg[:n], _kv_dtype(self.local)))
                msg = msg[n:]
        return [out[il] for il in range(self.cfg.n_layer)]

    def adopt_caches(self, caches: Sequence[LayerCache]) -> list:
        """A session's caches from every layer's (a restored KV file): this rank's layers kept, the other ranks'
        sent along the chain (each takes its own), as a new state there."""
        pos, state = caches[0].pos, self._new_id()
        self._command(Op.PUT, state, pos)
        msg = [caches[il].message() for rank in range(1, self._chain.size) for il in self.held[rank]]
        self._chain.queue_send(mx.concatenate(msg), self._chain.next)
        return [*(caches[layer.il] for layer in self.layers), RemoteLayers(self, state)]

    def close(self) -> None:
        """End the other ranks' :meth:`Follower.run` (they return) and wait for the command to leave."""
        if self.closed:
            return
        self.closed = True
        header = mx.array([Op.STOP, 0, 0, 0, 0], dtype=mx.int32)
        mx.eval(mx.distributed.send(header, self._chain.next, group=self._chain.group))

    def __enter__(self) -> _Leader:
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
            raise RuntimeError("the other ranks were released (close)")
        while self._freed:
            self._send_header(Op.FREE, self._freed.pop())
        self._send_header(op, *args)

    def _send_header(self, op: Op, *args: int) -> None:
        values = [int(op), *map(int, args)] + [0] * (HEADER_LEN - 1 - len(args))
        self._chain.queue_send(mx.array(values, dtype=mx.int32), self._chain.next)


class PipelineModel(_Leader):
    """Rank 0's side of a pipeline: ``__call__(tokens, pos, caches)`` as :meth:`Model.__call__`, running rank 0's
    layers here and the others on their ranks; the logits come back from the last rank.

    Args:
        stage: rank 0's :class:`Model` (its first layers and the embedding).
        group: the ``mx.distributed`` group (size >= 2).
        split: every rank's layers (:func:`split_layers`).
        head_rows: the output head's first rows (a :class:`~ds4_mlx.weights.QuantWeight`, held by the last rank):
            with the embedding's, they identify the model in KV files (``kvstore.model_fingerprint``).
    """

    @property
    def overlaps_chunks(self) -> bool:
        """Consecutive prefill chunks run on different ranks at once when the caller queues them
        (``Session.queue_chunk``); not with awaited messages."""
        return not self._chain.awaited

    def __init__(self, stage: Model, group: Any, split: Sequence[range], head_rows: Any = None):
        super().__init__(stage, group, split)
        self.output = head_rows

    def __call__(
        self,
        tokens: mx.array | Sequence[int],
        pos: int,
        caches: list,
        *,
        all_logits: bool = False,
        head: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> mx.array | None:
        """As :meth:`Model.__call__`; ``should_stop`` is checked between rank 0's layers. The sends and the
        logits' receive are queued before it returns (the logits are then evaluated by the caller). With
        ``head=False`` nothing comes back: rank 0 goes on to its next call while the others run this one."""
        *local, remote = caches
        tokens = token_array(tokens)
        T = tokens.shape[0]
        S = self.local.embed(tokens)
        if T == 1:
            S = _state(self.local.decode_layers((S,), tokens, pos, local), self.cfg.n_hc)
        else:
            S = self.local.prefill_layers(S, tokens, pos, local, should_stop=should_stop)
        wanted = Logits.ALL if all_logits else Logits.LAST if head or T == 1 else Logits.NONE
        self._command(Op.FORWARD, remote.state, pos, T, wanted)
        self._chain.queue_send(_pack(tokens, S), self._chain.next)
        if wanted == Logits.NONE:
            return None
        logits = self._chain.recv((T if all_logits else 1, self.cfg.n_vocab), mx.float32, self._chain.size - 1)
        mx.async_eval(logits)  # queued now, after the sends, whatever the caller evaluates first
        return logits if all_logits else logits[0]


class LockstepModel(_Leader):
    """Rank 0's side of an expert- or tensor-parallel model. A call sends the token ids to the other ranks, then
    runs this rank's share of every layer; the ranks' ``all_sum`` calls meet in the same order, and the logits are
    rank 0's own."""

    def __call__(
        self,
        tokens: mx.array | Sequence[int],
        pos: int,
        caches: list,
        *,
        all_logits: bool = False,
        head: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> mx.array | None:
        """As :meth:`Model.__call__`, except that ``should_stop`` is not checked: a call stopped here between
        two layers would leave the other ranks waiting in a sum, so a prefill stops at the end of a call. With
        ``head=False`` the logits are queued here and None returned: the last layer's sums must run on every
        rank, whatever the caller evaluates."""
        *local, remote = caches
        tokens = token_array(tokens)
        self._command(Op.FORWARD, remote.state, pos, tokens.shape[0], Logits.ALL if all_logits else Logits.LAST)
        self._chain.queue_send(tokens, self._chain.next)
        logits = self.local(tokens, pos, local, all_logits=all_logits)
        if head:
            return logits
        mx.async_eval(logits)
        return None


class Follower:
    """A rank after rank 0: holds its model and each session's state for it, and serves rank 0's commands
    (:meth:`run`); ``_forward`` is the mode's part. ``held``: every rank's layers, as rank 0's model has them."""

    expert_cache = None

    def __init__(self, local: Model, group: Any, held: Sequence[range] | None = None):
        self.local, self.cfg, self.layers = local, local.cfg, local.layers
        self.held = list(held or [range(local.cfg.n_layer)] * group.size())
        self.rank = group.rank()
        self.weights_bytes = local.weights_bytes  # this rank's
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
            self._forward(states[a], pos=b, T=c, logits=Logits(d))
        elif op == Op.NEW:
            states[a] = self.local.make_cache(b)
        elif op == Op.COPY:
            states[b] = [x.snapshot() for x in states[a]]
        elif op == Op.MARK:
            states[b] = [x.rewind_point() for x in states[a]]
        elif op == Op.REWIND:
            states[c] = [x.rewound(p) for x, p in zip(states[a], states[b], strict=True)]
        elif op == Op.FREE:
            states.pop(a, None)
        elif op == Op.GET:  # this rank's state, then the later ranks' (from the next), to the one before
            parts = [c.message() for c in states[a]]
            if not self._chain.is_last:
                parts.append(self._chain.recv((_held_size(self, self.rank + 1, b),), mx.float32, self._chain.next))
            mx.eval(mx.distributed.send(mx.concatenate(parts), self._chain.prev, group=self._chain.group))
        elif op == Op.PUT:  # this rank's state and the later ranks', from the one before: keep its own, pass on
            msg = self._chain.recv((_held_size(self, self.rank, b),), mx.float32, self._chain.prev)
            n = _held_size(self, self.rank, b, self.rank + 1)
            if not self._chain.is_last:
                self._chain.queue_send(msg[n:], self._chain.next)
            mine = self.held[self.rank]
            states[a] = list(_unpack_layers(self.cfg, mine, b, msg[:n], _kv_dtype(self.local)).values())
            mx.eval([x for c in states[a] for x in c.decode_state().values()])

    def _forward(self, caches: list[LayerCache], pos: int, T: int, logits: Logits) -> None:
        raise NotImplementedError


class PipelineFollower(Follower):
    """A rank after rank 0 in a pipeline: holds its layers (the output head on the last rank); a forward takes
    the state from the rank before and sends its own to the next (the logits to rank 0 from the last)."""

    def _forward(self, caches: list[LayerCache], pos: int, T: int, logits: Logits) -> None:
        cfg = self.cfg
        msg = self._chain.recv((T * (1 + cfg.n_hc * cfg.n_embd),), mx.float32, self._chain.prev)
        tokens = msg[:T].view(mx.int32)
        S = msg[T:].reshape(T, cfg.n_hc, cfg.n_embd)
        if T == 1:
            carry = self.local.decode_layers((S,), tokens, pos, caches)
            out = self.local._decode_head(*carry) if self._chain.is_last else _state(carry, cfg.n_hc)
        else:
            S = self.local.prefill_layers(S, tokens, pos, caches)
            out = (self.local.head(S if logits == Logits.ALL else S[-1:])) if self._chain.is_last else S
        state = [x for cache in caches for x in cache.decode_state().values()]
        if not self._chain.is_last:
            self._chain.queue_send(_pack(tokens, out), self._chain.next)
        elif logits != Logits.NONE:
            self._chain.queue_send(out.astype(mx.float32), 0)
        # the new state is evaluated once the send is on its way, as Session does with the logits
        mx.eval(state)


class LockstepFollower(Follower):
    """A rank after rank 0 of a :class:`LockstepModel`: a forward takes the token ids (passing them on) and runs
    this rank's share of every layer, up to the last layer's state: its sums are the last ones rank 0 waits
    for; the output head, whose logits only rank 0 uses, is skipped."""

    def _forward(self, caches: list[LayerCache], pos: int, T: int, logits: Logits) -> None:
        tokens = self._chain.recv((T,), mx.int32, self._chain.prev)
        if not self._chain.is_last:
            self._chain.queue_send(tokens, self._chain.next)
        S = self.local.embed(tokens)
        if T == 1:
            S = _state(self.local.decode_layers((S,), tokens, pos, caches), self.cfg.n_hc)
        else:
            S = self.local.prefill_layers(S, tokens, pos, caches)
        mx.eval([S, *(x for cache in caches for x in cache.decode_state().values())])


def lockstep(model: Model, group: Any) -> LockstepModel | LockstepFollower:
    """An expert- or tensor-parallel ``model`` (:meth:`Model.shard`) driven by rank 0: a :class:`LockstepModel` on
    rank 0, a :class:`LockstepFollower` to ``run()`` elsewhere."""
    return LockstepModel(model, group) if group.rank() == 0 else LockstepFollower(model, group)
