"""The whole DeepSeek V4 Flash forward pass (docs/model.md §4.2, §4.11, §11).

``tokens -> embedding (n_hc identical streams) -> n_layer x [HC pre -> attention -> HC post ->
HC pre -> MoE -> HC post] -> output HC head -> output norm -> LM head``. The per-layer KV state
lives in :class:`~ds4_mlx.model.attention.LayerCache` objects owned by the caller (a
:class:`~ds4_mlx.session.Session`), so one model serves any number of sessions.
"""

from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Callable, Sequence

import mlx.core as mx

from ..backend import kernel_backend
from ..config import ModelConfig
from ..kernels import MV_MAX_TOKENS
from ..kernels.fused import fault_in
from ..numerics import Numerics, get_numerics
from ..weights import QuantWeight
from .attention import Attention, DecodeKey, LayerCache, make_layer_cache
from .fused import hc_post, hc_post_pre, hc_pre  # kernels on the GPU, .hyper on the CPU
from .hyper import hc_head
from .moe import MoE

# DS4_MLX_COMPILE=0 runs decode steps op by op (debugging, A/B timing); the default compiles them.
COMPILE_DECODE = os.environ.get("DS4_MLX_COMPILE", "1").strip() != "0"
# On the CPU the pure-MLX products decode a weight's blocks at every call, and MLX's CPU elementwise ops are slow:
# that was ~2/3 of a demo-model decode step. A model whose float32 values fit in this keeps them instead.
KEEP_DEQUANTIZED_MAX_BYTES = 512 << 20
# Compiled batched steps a layer keeps: one per mix of the B sessions' step keys (which of them complete a
# compressor window, select with the indexer); the mixes change as sessions join and leave.
BATCH_STEPS_KEPT = 256


class PrefillCancelled(Exception):
    """Raised by :meth:`Model.__call__` between two layers when its ``should_stop`` callable returns true."""


class Block:
    """One transformer layer: attention and MoE sublayers, each wrapped in HC pre/post."""

    def __init__(self, cfg: ModelConfig, il: int, weights: dict[str, Any], numerics: Numerics):
        p = f"blk.{il}."
        self.cfg, self.il = cfg, il
        self.hc_attn = tuple(weights[p + f"hc_attn_{k}.weight"] for k in ("fn", "scale", "base"))
        self.hc_ffn = tuple(weights[p + f"hc_ffn_{k}.weight"] for k in ("fn", "scale", "base"))
        self.attn = Attention(cfg, il, weights, numerics)
        self.ffn = MoE(cfg, il, weights, numerics)

        self.compile_decode = True  # Model.set_compile_decode
        self._steps: dict[DecodeKey, Callable] = {}
        self._routed_steps: dict[DecodeKey, Callable] = {}  # streamed experts: the step up to the router
        self._batch_steps: dict[tuple[DecodeKey, ...], Callable] = {}  # Block.decode_batch's, by the B keys

    def __call__(self, S: mx.array, tokens: mx.array, pos: int, cache: LayerCache) -> mx.array:
        """State ``S [T, n_hc, E]`` of tokens at ``pos..pos+T-1`` -> the layer's output state (same shape)."""
        if S.shape[0] == 1:
            return hc_post(*self.decode((S,), tokens, pos, cache), n_hc=self.cfg.n_hc)
        n, post, comb = hc_pre(S, *self.hc_attn, self.cfg, norm=self.attn.attn_norm)  # normed input [T, E]
        S, n, post, comb, _ = hc_post_pre(S, self.attn.forward(n, pos, cache), post, comb, *self.hc_ffn, self.cfg,
                                          norm=self.ffn.ffn_norm)  # fmt: skip
        return hc_post(S, self.ffn.forward(n, tokens), post, comb)

    def decode(self, carry: tuple, tokens: mx.array, pos: int, cache: LayerCache) -> tuple:
        """One token: the layer as one (compiled) function of the state and the cache arrays.

        ``carry`` is ``(S,)`` or the previous layer's ``(S, y, post, comb)`` with its last HC post still to
        apply; the result is this layer's. The post runs inside the next HC mix launch (one launch a layer
        less), and after the last layer in :meth:`Model.decode_head`.
        """
        key, io = self.attn.decode_inputs(pos, cache)
        if self.ffn.streamed is None:
            carry, st = self._step_fn(key)(carry, tokens, cache.decode_state(), io)
        else:  # the host reads the router's choice between the two parts
            (S, n, post, comb, nq, sel, w), st = self._compiled(self._routed_steps, self._routed_step, key)(
                carry, tokens, cache.decode_state(), io)
            carry = (S, self.ffn.streamed_experts(n, sel, w, nq), post, comb)
        cache.take_decode_state(st, key)
        return carry

    def _step(self, key: DecodeKey, carry: tuple, tokens: mx.array, st: dict, io: dict) -> tuple[tuple, dict]:
        (S, n, post, comb, nq), st = self._attention_step(key, carry, st, io)
        return (S, self.ffn.forward(n, tokens, nq), post, comb), st

    def _routed_step(self, key: DecodeKey, carry: tuple, tokens: mx.array, st: dict, io: dict
                     ) -> tuple[tuple, dict]:  # fmt: skip
        """:meth:`_step` up to the MoE's router: its experts are read from the file before they run."""
        (S, n, post, comb, nq), st = self._attention_step(key, carry, st, io)
        return (S, n, post, comb, nq, *self.ffn.route(n, tokens)), st

    def _attention_step(self, key: DecodeKey, carry: tuple, st: dict, io: dict) -> tuple[tuple, dict]:
        """HC pre, attention and HC post, then the MoE's HC pre -> ``((S, n, post, comb, nq), st)``."""
        if len(carry) == 1:
            S = carry[0]
            n, post, comb = hc_pre(S, *self.hc_attn, self.cfg, norm=self.attn.attn_norm, cols=True)
        else:
            S, n, post, comb, _ = hc_post_pre(*carry, *self.hc_attn, self.cfg, norm=self.attn.attn_norm, cols=True)
        # n, post, comb (and nq) are columns of one output row of the HC pre launch, S of the mix launch's (on the
        # kernel backends)
        y, st = self.attn.decode(n, st, io, key)
        S, n, post, comb, nq = hc_post_pre(S, y, post, comb, *self.hc_ffn, self.cfg, norm=self.ffn.ffn_norm,
                                           quantize=self.ffn.quantized_x, cols=True)  # fmt: skip
        return (S, n, post, comb, nq), st

    def decode_batch(self, S: mx.array, tokens: mx.array, positions: Sequence[int],
                     caches: Sequence[LayerCache]) -> mx.array:  # fmt: skip
        """One token of each of B sessions: state ``S [B, n_hc, E]``, ids ``tokens [B]``, row b at
        ``positions[b]`` over ``caches[b]`` -> the layer's output state (same shape); updates the caches.

        The HC mixes, the projections, the output products and the MoE take the B rows at once, so each weight
        is read once a step for all of them; attention runs per session (:meth:`Attention.decode_batch`)."""
        keys, ios = zip(*(self.attn.decode_inputs(p, c) for p, c in zip(positions, caches, strict=True)))
        S, sts = self._batch_fn(keys)(S, tokens, [c.decode_state() for c in caches], list(ios))
        for c, st, key in zip(caches, sts, keys):
            c.take_decode_state(st, key)
        return S

    def _step_batch(self, keys: tuple[DecodeKey, ...], S: mx.array, tokens: mx.array, sts: list, ios: list
                    ) -> tuple[mx.array, list]:  # fmt: skip
        n, post, comb = hc_pre(S, *self.hc_attn, self.cfg, norm=self.attn.attn_norm)
        y, sts = self.attn.decode_batch(n, sts, ios, keys)
        S, n, post, comb, nq = hc_post_pre(S, y, post, comb, *self.hc_ffn, self.cfg, norm=self.ffn.ffn_norm,
                                           quantize=self.ffn.quantized_x)  # as one session's step: mv_reg's x
        return hc_post(S, self.ffn.forward(n, tokens, nq), post, comb), sts

    def _batch_fn(self, keys: tuple[DecodeKey, ...]) -> Callable:
        """The batched step for ``keys`` (one per session), compiled once every raw window is full (as
        :meth:`_step_fn`) for decode-sized batches on the kernel backends. Elsewhere it runs op by op: the pure-MLX
        products of several tokens (larger batches, the CPU's expert gather) read ids on the host, which a
        compiled function cannot."""
        if not (all(k.static for k in keys) and self.compile_decode and len(keys) <= MV_MAX_TOKENS
                and kernel_backend() != "fallback" and self.ffn.streamed is None):
            return partial(self._step_batch, keys)
        fn = self._batch_steps.get(keys)
        if fn is None:
            if len(self._batch_steps) >= BATCH_STEPS_KEPT:  # sessions join and leave: keys of past mixes
                self._batch_steps.clear()
            fn = self._batch_steps[keys] = mx.compile(partial(self._step_batch, keys))
        return fn

    def _step_fn(self, key: DecodeKey) -> Callable:
        """The step for ``key``, compiled once the raw window is full (before that its shapes change every
        token). Compiling removes the Python graph building from every step and fuses the elementwise chains:
        decode is host-bound (benchmarks/RESULTS.md)."""
        return self._compiled(self._steps, self._step, key)

    def _compiled(self, kept: dict[DecodeKey, Callable], step: Callable, key: DecodeKey) -> Callable:
        """``step`` for ``key``, compiled (and kept in ``kept``) as :meth:`_step_fn` says."""
        if not (key.static and self.compile_decode):
            return partial(step, key)
        fn = kept.get(key)
        if fn is None:
            fn = kept[key] = mx.compile(partial(step, key))
        return fn


class Model:
    """DeepSeek V4 Flash built from GGUF-named weights (see :func:`ds4_mlx.gguf_file.load_weights`).

    Args:
        cfg: the model's :class:`ModelConfig` (every dimension comes from here).
        weights: ``{gguf tensor name: QuantWeight | mx.array}``.
        numerics: numeric profile (``"ds4"`` default, ``"hf"``) or a :class:`Numerics`.
        layers: the layers to build (default all). A part of the layers is a pipeline stage
            (:mod:`ds4_mlx.distributed`): it runs :meth:`decode_layers` / :meth:`prefill_layers`, and holds the
            embedding only if it starts at layer 0 and the output head only if it ends at the last layer
            (``weights`` then needs only the stage's tensors, :func:`stage_tensor`).
    """

    def __init__(self, cfg: ModelConfig, weights: dict[str, Any], numerics: str | Numerics | None = "ds4",
                 layers: range | None = None):  # fmt: skip
        self.cfg = cfg
        self.numerics = get_numerics(numerics)
        self.layer_range = range(cfg.n_layer) if layers is None else layers
        self.weights_bytes = sum(w.nbytes for w in weights.values())  # what the weights take in memory
        first, last = self.layer_range.start == 0, self.layer_range.stop == cfg.n_layer
        self.token_embd = weights["token_embd.weight"] if first else None  # [V, E] F16
        self.layers = [Block(cfg, il, weights, self.numerics) for il in self.layer_range]
        # On CUDA, arrays made from host data (a GGUF, the random model's host-drawn tables) sit in managed memory
        # and the GPU faults a page in at first touch, inside a step (an embedding row's fault took 179 µs;
        # Nsight Compute on the H200). A decode step reads one row, picked by the token, of the
        # embedding and of the hash layers' routing tables: read them once now.
        hash_tables = [b.ffn.ffn_gate_tid2eid for b in self.layers if b.ffn.ffn_gate_tid2eid is not None]
        for table in ([self.token_embd.data] if first else []) + hash_tables:
            fault_in(table)
        if last:
            self.output_hc = tuple(weights[f"output_hc_{k}.weight"] for k in ("fn", "scale", "base"))
            self.output_norm = weights["output_norm.weight"]  # [E]
            self.output = weights["output.weight"]  # [V, E] Q8_0 (not tied to the embedding)
        self.expert_cache = None  # where the routed experts stream from (stream_experts), if they do
        # Evaluate the state layer by layer (two at most in flight) when a call has at least this many tokens:
        # bounds the memory of long prefill chunks; single-token decode stays one lazy graph.
        self.eval_layers_from = 64
        self.set_compile_decode(COMPILE_DECODE)
        f32_bytes = 4 * sum(math.prod(w.shape) for w in weights.values() if isinstance(w, QuantWeight))
        if mx.default_device() == mx.cpu and f32_bytes <= KEEP_DEQUANTIZED_MAX_BYTES:
            self.keep_dequantized()

    def keep_dequantized(self) -> None:
        """Every weight keeps its float32 values (:meth:`QuantWeight.keep_dequantized`): for small models on the
        CPU, where the pure-MLX products would decode the blocks again at every call."""
        for w in _quant_weights(self):
            w.keep_dequantized()

    def stream_experts(self, cache: Any) -> None:
        """Run the routed experts from ``cache`` (a :class:`ds4_mlx.streaming.ExpertCache` of this model's file)
        instead of resident weights. A streamed MoE waits for its router on the host, so a decode step runs each
        layer in two parts: up to the router (compiled), then the experts once they are resident."""
        for layer in self.layers:
            layer.ffn.streamed = cache
        self.expert_cache = cache
        self.weights_bytes += cache.nbytes

    def shard(self, group: Any, cut: Callable[[str], tuple[int, range] | None]) -> None:
        """Expert or tensor parallel (:mod:`ds4_mlx.distributed`): this rank holds the tensors cut by ``cut``
        (:func:`~ds4_mlx.distributed.tensor_share`), and the layers add the ranks' shares: the MoE always, the
        attention where its heads are split. The ``all_sum`` calls are queued as a step is built and steps run op
        by op (rank 0 drives the ranks: :func:`~ds4_mlx.distributed.lockstep`)."""
        for layer in self.layers:
            p = f"blk.{layer.il}."
            layer.ffn.shard(group, cut(p + "ffn_gate_exps.weight")[1])
            heads = cut(p + "attn_sinks.weight")
            if heads is not None:
                layer.attn.shard_heads(group, heads[1])
        self.set_compile_decode(False)

    def set_compile_decode(self, on: bool) -> None:
        """Run one-token steps as compiled functions (the default) or op by op (``DS4_MLX_COMPILE=0``)."""
        for layer in self.layers:
            layer.compile_decode = on
            layer._steps.clear()
            layer._routed_steps.clear()
            layer._batch_steps.clear()
        self._decode_head = mx.compile(self.decode_head) if on else self.decode_head

    def make_cache(self, reserve: int = 0) -> list[LayerCache]:
        """Fresh per-layer KV state (raw window, compressed rows, compressor/indexer frontiers); the
        compressed-row buffers are sized for ``reserve`` tokens when they are first written."""
        return [make_layer_cache(self.cfg, il, reserve) for il in self.layer_range]

    def layer_caches(self, caches: list[LayerCache]) -> list[LayerCache]:
        """Every layer's cache of a session's ``caches`` (what a KV file saves): here the caches themselves; a model
        over several ranks (:mod:`ds4_mlx.distributed`) fetches the other ranks' layers."""
        return list(caches)

    def adopt_caches(self, caches: Sequence[LayerCache]) -> list[LayerCache]:
        """The inverse of :meth:`layer_caches`: a session's caches from every layer's (a restored KV file)."""
        return list(caches)

    def embed(self, tokens: mx.array) -> mx.array:
        """``tokens [T]`` -> initial state ``[T, n_hc, E]``: every stream is the f16 embedding row (§4.2)."""
        x0 = self.token_embd.rows(tokens)  # [T, E] f32
        return mx.broadcast_to(x0[:, None, :], (x0.shape[0], self.cfg.n_hc, x0.shape[1]))

    def head(self, S: mx.array) -> mx.array:
        """Final state ``[T, n_hc, E]`` -> logits ``[T, V]`` (§4.10: HC head, norm, LM head)."""
        x = hc_head(S, *self.output_hc, self.cfg)  # [T, E]
        x = mx.fast.rms_norm(x, self.output_norm, self.cfg.rms_eps)
        return self.output.matmul(x)  # [T, V]

    def decode_head(self, *carry: mx.array) -> mx.array:
        """The last layer's decode ``carry`` (see :meth:`Block.decode`) -> logits ``[1, V]``."""
        return self.head(hc_post(*carry, n_hc=self.cfg.n_hc) if len(carry) == 4 else carry[0])

    def decode_batch(self, tokens: mx.array | Sequence[int], positions: Sequence[int],
                     caches: Sequence[list[LayerCache]]) -> mx.array:  # fmt: skip
        """One decode step of B independent sessions: ``tokens[b]`` at ``positions[b]`` over ``caches[b]`` (each a
        session's per-layer caches, updated in place) -> next-token logits ``[B, V]``. Row b equals what
        ``self([tokens[b]], positions[b], caches[b])`` gives, up to the products' summation order."""
        tokens = mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens.astype(mx.int32)
        if not (tokens.shape[0] == len(positions) == len(caches)):
            raise ValueError(f"{tokens.shape[0]} tokens, {len(positions)} positions, {len(caches)} caches")
        S = self.embed(tokens)
        for il, layer in enumerate(self.layers):
            S = layer.decode_batch(S, tokens, positions, [c[il] for c in caches])
        return self.head(S)

    def __call__(
        self,
        tokens: mx.array | Sequence[int],
        pos: int,
        caches: list[LayerCache],
        *,
        all_logits: bool = False,
        head: bool = True,
        should_stop: Callable[[], bool] | None = None,
    ) -> mx.array | None:
        """Run ``tokens [T]`` at positions ``pos..pos+T-1``, updating ``caches`` in place.

        Returns the next-token logits of the last token ``[V]`` (f32), or ``[T, V]`` for every
        position with ``all_logits=True``; with ``head=False`` (several tokens: a prefill chunk whose logits
        nobody reads) only the caches, and None. ``should_stop`` (several tokens only): checked after each layer,
        whose state is then evaluated; when it returns true, :class:`PrefillCancelled` is raised and ``caches``
        are left part-way (the caller rolls them back, as ``Session.prefill`` does).
        """
        tokens = token_array(tokens)
        S = self.embed(tokens)
        if tokens.shape[0] == 1:
            logits = self._decode_head(*self.decode_layers((S,), tokens, pos, caches))
            return logits if all_logits else logits[0]
        S = self.prefill_layers(S, tokens, pos, caches, should_stop=should_stop)
        if not head:
            return None
        return self.head(S) if all_logits else self.head(S[-1:])[0]

    def decode_layers(self, carry: tuple, tokens: mx.array, pos: int, caches: list[LayerCache]) -> tuple:
        """One token through this model's layers: ``carry`` in and out as in :meth:`Block.decode`."""
        for layer, cache in zip(self.layers, caches, strict=True):
            carry = layer.decode(carry, tokens, pos, cache)
        return carry

    def prefill_layers(self, S: mx.array, tokens: mx.array, pos: int, caches: list[LayerCache], *,
                       should_stop: Callable[[], bool] | None = None) -> mx.array:  # fmt: skip
        """Several tokens' state ``S [T, n_hc, E]`` through this model's layers (``should_stop`` as in
        :meth:`__call__`)."""
        before = None  # the layer before's output, queued
        for layer, cache in zip(self.layers, caches, strict=True):
            S = layer(S, tokens, pos, cache)
            if tokens.shape[0] >= self.eval_layers_from or should_stop is not None:
                # Queue this layer and wait for the one before: the host builds a layer's graph while the
                # device runs the previous one, and no more than two layers' buffers are ever live.
                mx.async_eval(S)
                if before is not None:
                    mx.eval(before)
                before = S
            if should_stop is not None and should_stop():
                raise PrefillCancelled(f"prefill stopped after layer {layer.il} of {self.cfg.n_layer}")
        return S


def token_array(tokens: mx.array | Sequence[int]) -> mx.array:
    """Token ids as an int32 ``mx.array`` (lists converted, arrays cast)."""
    return mx.array(tokens, dtype=mx.int32) if not isinstance(tokens, mx.array) else tokens.astype(mx.int32)


def stage_tensor(name: str, layers: range, n_layer: int) -> bool:
    """Whether the GGUF tensor ``name`` belongs to the pipeline stage of ``layers``: its layers' ``blk.N.``
    tensors, the embedding on the first stage, the output head on the last."""
    if name.startswith("blk."):
        return int(name.split(".", 2)[1]) in layers
    if name.startswith("token_embd."):
        return layers.start == 0
    return layers.stop == n_layer  # output_hc_*, output_norm, output


def _quant_weights(obj: Any, seen: set[int] | None = None) -> list[QuantWeight]:
    """The :class:`QuantWeight` objects reachable from ``obj`` through the graph's own objects (layers,
    sublayers), lists and tuples, each once (stacked and split weights included)."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, QuantWeight):
        return [obj]
    if isinstance(obj, (list, tuple)):
        children = obj
    elif type(obj).__module__.startswith("ds4_mlx.model"):
        children = vars(obj).values()
    else:
        return []
    return [w for child in children for w in _quant_weights(child, seen)]
