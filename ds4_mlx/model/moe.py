"""The FFN sublayer: sqrt-softplus router, hash or top-k expert selection, clamped SwiGLU experts
and the shared expert (docs/model.md §4.8, ds4 ``layer_ffn_one()``).

Routed experts run through ``QuantWeight.gather_matmul`` so only the selected experts' blocks are
read; the expert tensors stay in their GGUF quantization. The router's and the activation's math is in
:mod:`.ops`; :mod:`.fused` runs router and experts as kernels on the GPU.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from .. import host
from ..backend import kernel_backend
from ..config import ModelConfig
from ..kernels import MV_MAX_TOKENS, cols, mm_gather, mm_gather_swiglu, routes_for, supports
from ..kernels.fused import takes_quantized_x, unpack_route
from ..weights import QuantWeight, expert_groups
from .fused import expert_down_sum, expert_swiglu, experts_with_shared, moe_route  # kernels on the GPU, MLX on the CPU
from .ops import route_weights, sqrt_softplus, swiglu, swiglu_host


class MoE:
    """FFN sublayer of layer ``il``: ``y = sum_i W_down[e_i](w_i * swiglu(...)) + shared(n)``.

    ``weights`` is the model's dict keyed by GGUF tensor names (``blk.{il}.ffn_*``).
    """

    def __init__(self, cfg: ModelConfig, il: int, weights: dict[str, Any], numerics: Any = None):
        p = f"blk.{il}."
        self.cfg, self.il = cfg, il
        self.clamp = float(cfg.swiglu_clamp[il])
        self.ffn_norm = weights[p + "ffn_norm.weight"]
        self.ffn_gate_inp = weights[p + "ffn_gate_inp.weight"]  # [n_expert, E] F16
        self.exp_probs_b = weights.get(p + "exp_probs_b.bias")  # [n_expert] f32, optional
        self.ffn_gate_tid2eid = weights.get(p + "ffn_gate_tid2eid.weight") if cfg.is_hash_layer(il) else None
        if cfg.is_hash_layer(il) and self.ffn_gate_tid2eid is None:
            raise ValueError(f"hash layer {il} has no {p}ffn_gate_tid2eid.weight")
        self.ffn_gate_exps = weights[p + "ffn_gate_exps.weight"]  # [n_expert, F, E]
        self.ffn_up_exps = weights[p + "ffn_up_exps.weight"]  # [n_expert, F, E]
        self.ffn_down_exps = weights[p + "ffn_down_exps.weight"]  # [n_expert, E, F]
        # The shared expert's gate and up rows stacked [2F, E]: decode reads them in the routed experts' launch;
        # the two parts are views of its rows (no second copy).
        self.ffn_gate_up_shexp = QuantWeight.stack_rows([weights[p + f"ffn_{k}_shexp.weight"] for k in ("gate", "up")])
        F = self.ffn_gate_up_shexp.out_features // 2
        self.ffn_gate_shexp, self.ffn_up_shexp = self.ffn_gate_up_shexp.split_rows([F, F])  # [F, E] each
        self.ffn_down_shexp = weights[p + "ffn_down_shexp.weight"]  # [E, F]
        # decode on the GPU: HC pre also writes the normed input quantized, for the gate+up launch's integer dots
        self.quantized_x = bool(getattr(numerics, "quantized_x", False)) and takes_quantized_x(
            self.ffn_gate_exps, self.ffn_up_exps, self.ffn_gate_up_shexp)
        self.streamed = None  # an ExpertCache where the routed experts stay in the file (Model.stream_experts)
        self.group, self.expert_ids = None, None  # expert parallel: the ranks, and the routed experts this one holds

    def route(self, n: mx.array, tokens: mx.array, packed: bool = False) -> tuple[mx.array, mx.array | None]:
        """Router: normed input ``n [T, E]``, token ids ``[T]`` -> (expert ids int32 [T,k], weights [T,k]).
        ``packed``: where the fused router runs, its one packed output and None instead (:func:`moe_route`)."""
        cfg, logits = self.cfg, self.ffn_gate_inp.matmul(n)  # [T, n_expert]
        scale, norm = cfg.expert_weights_scale, cfg.expert_weights_norm
        if self.ffn_gate_tid2eid is None:  # fused kernel on the GPU, route_top_k otherwise
            return moe_route(logits, self.exp_probs_b, cfg.n_expert_used, scale, norm, packed=packed)
        # Hash layers: fixed experts per token id (Metal clamps the id; bias unused).
        tok = mx.clip(tokens.astype(mx.int32), 0, self.ffn_gate_tid2eid.shape[0] - 1)
        sel = self.ffn_gate_tid2eid[tok].astype(mx.int32)  # [T, k]
        return sel, route_weights(mx.take_along_axis(sqrt_softplus(logits), sel, axis=-1), scale, norm)

    def routed(self, n: mx.array, sel: mx.array, w: mx.array, add: mx.array | None = None, *,
               experts: tuple | None = None, chunk: int | None = None) -> mx.array:  # fmt: skip
        """Routed experts: ``sum_i W_down[e_i] (swiglu(W_gate[e_i] n, W_up[e_i] n) * w_i)`` (+ ``add``) -> [T, E].
        ``experts``: the (gate, up, down) weights ``sel`` indexes (default the layer's own); ``chunk``: the token
        count that picks the path (default T; a span of a chunk passes the chunk's, to run as the chunk would)."""
        experts = experts or (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        chunk = chunk or sel.shape[0]
        if host.wanted(chunk) and kernel_backend() == "fallback":
            y = self._routed_host(experts, n, sel, w)
        else:
            y = self._routed_chunk(experts, n, sel, w, chunk)
        if y is None:
            # route weight before down (ds4); on the GPU each line is one matvec launch for decode
            mid = expert_swiglu(experts[0], experts[1], n, self.clamp, sel, w)  # [T, k, F]
            return expert_down_sum(experts[2], mid, sel, add)  # [T, E]
        return y if add is None else y + add

    def _routed_chunk(self, experts: tuple, n: mx.array, sel: mx.array, w: mx.array, chunk: int) -> mx.array | None:
        """The routed experts of a prefill chunk on the kernel backends, in two launches over the pairs sorted by
        expert once: gate+up with the SwiGLU and the route weight as epilogue (``mid`` in f16, the down tiles'
        precision), then down; each token's k products summed. None where the kernels do not apply."""
        backend = kernel_backend()
        T, k = sel.shape
        gate, up, down = experts
        if backend == "fallback" or chunk <= MV_MAX_TOKENS or not all(map(supports, experts)):
            return None
        flat = sel.reshape(-1)
        routes = routes_for(flat, gate.shape[0], backend)
        mid = mm_gather_swiglu(gate, up, n, flat, k, self.clamp, backend, route_w=w.reshape(-1),
                               routes=routes)  # [T*k, F]  fmt: skip
        y = mm_gather(down, mid, flat, k, backend, routes=routes)  # [T*k, E]
        return y.reshape(T, k, -1).sum(axis=1)

    def _routed_host(self, experts: tuple, n: mx.array, sel: mx.array, w: mx.array) -> mx.array:
        """The routed experts of a chunk on the CPU, in numpy (:mod:`ds4_mlx.host`): the pairs grouped by expert
        once, then each expert's gate, up, SwiGLU, route weight and down over its own rows."""
        T, k = sel.shape
        gate_w, up_w, down_w = experts
        x, ids, rw = host.to_numpy(n, sel, w)
        ids, rw = ids.reshape(-1), rw.reshape(-1, 1)
        y = np.empty((T * k, down_w.out_features), np.float32)
        for e, pairs in expert_groups(ids, gate_w.shape[0]):
            xe = x[pairs // k]  # the pairs' tokens
            gate, up = (xe @ m.host_f32(e, e + 1)[0].T for m in (gate_w, up_w))
            y[pairs] = (swiglu_host(gate, up, self.clamp) * rw[pairs]) @ down_w.host_f32(e, e + 1)[0].T
        return mx.array(y.reshape(T, k, -1).sum(axis=1))

    def shared(self, n: mx.array) -> mx.array:
        """Shared expert with the same clamped SwiGLU -> [T, E]."""
        if n.shape[0] > MV_MAX_TOKENS:  # a chunk: gate and up rows in one product
            F = self.ffn_gate_shexp.out_features
            gu = self.ffn_gate_up_shexp.matmul(n)  # [T, 2F]
            mid = swiglu(gu[:, :F], gu[:, F:], self.clamp)
        else:
            mid = expert_swiglu(self.ffn_gate_shexp, self.ffn_up_shexp, n, self.clamp)  # [T, F]
        return self.ffn_down_shexp.matmul(mid)

    def __call__(self, x: mx.array, tokens: mx.array) -> mx.array:
        """``x [T, E]`` = HC-pre output, ``tokens [T]`` the input ids -> ``y [T, E]`` (before HC post)."""
        return self.forward(self.norm(x), tokens)

    def norm(self, x: mx.array) -> mx.array:
        """The sublayer's input RMSNorm (HC pre applies it itself in the model: ``hc_pre(..., norm=ffn_norm)``)."""
        return mx.fast.rms_norm(x, self.ffn_norm, self.cfg.rms_eps)

    def forward(self, n, tokens: mx.array, nq=None) -> mx.array:
        """The sublayer from its normed input ``n [T, E]`` (:meth:`norm`) -> ``y [T, E]``; ``nq``: ``n``
        quantized by HC pre (:attr:`quantized_x`), or None. In the decode step both may be one token's
        :class:`~ds4_mlx.kernels.Cols` of HC pre's output row."""
        if self.streamed is not None:
            return self.streamed_experts(n, *self.route(n, tokens), nq)
        if self.group is not None:
            return self._forward_sharded(n, tokens)
        sel, w = self.route(n, tokens, packed=True)  # w None: sel is the router's one packed output
        return self.experts(n, sel, w, nq)

    def experts(self, n, sel: mx.array, w: mx.array | None, nq=None, *, weights: tuple | None = None) -> mx.array:
        """Routed (``weights``, default the layer's own, indexed by ``sel``) and shared experts of ``n``."""
        gate, up, down = weights or (self.ffn_gate_exps, self.ffn_up_exps, self.ffn_down_exps)
        y = experts_with_shared(gate, up, down, self.ffn_gate_up_shexp, self.ffn_down_shexp, n, sel, w, self.clamp,
                                xq=nq)  # decode on the GPU: two launches  fmt: skip
        if y is None:
            if w is None:
                sel, w = unpack_route(sel)
            n = cols(n, self.ffn_gate_inp.in_features)
            y = self.routed(n, sel, w, add=self.shared(n), experts=(gate, up, down))
        return y

    def shard(self, group: Any, experts: range) -> None:
        """Expert parallel: this layer holds the routed experts ``experts`` (its expert tensors are those rows) and
        a part of the shared expert's hidden units, of the ranks of ``group``, which add their outputs
        (:meth:`_forward_sharded`)."""
        if self.ffn_gate_exps.shape[0] != len(experts):
            raise ValueError(f"layer {self.il}: {self.ffn_gate_exps.shape[0]} routed experts held for the "
                             f"{len(experts)} of {experts}")  # fmt: skip
        self.group, self.expert_ids = group, experts

    def _forward_sharded(self, n, tokens: mx.array) -> mx.array:
        """:meth:`forward` with this rank's share of the experts: the pairs routed elsewhere go to a local expert
        with route weight 0 (so every product keeps its shape and path), and one ``all_sum`` over the ranks adds
        the shares of the routed and the shared experts."""
        n = cols(n, self.ffn_gate_inp.in_features)
        sel, w = self.route(n, tokens)
        e0 = self.expert_ids.start
        here = (sel >= e0) & (sel < self.expert_ids.stop)
        routed = self.routed(n, mx.where(here, sel - e0, 0), mx.where(here, w, 0.0), add=self.shared(n))
        return mx.distributed.all_sum(routed, group=self.group)

    def streamed_experts(self, n, sel: mx.array, w: mx.array, nq=None) -> mx.array:
        """The routed experts ``sel`` (weights ``w``, the router's output) and the shared expert of ``n``, the
        routed ones read from the file: the host waits for ``sel`` and makes the chosen experts resident, then
        they run where they sit. A chunk that chooses more experts than the cache holds runs in parts that fit,
        cut so that every product keeps the resident model's shape and path (so its rounding)."""
        ids = np.array(sel)  # which experts to read: the router's output, on the host
        if len(np.unique(ids)) <= self.streamed.slots:
            weights, slots = self.streamed.fetch(self.il, ids)
            return self.streamed.reading(self.experts(n, slots, w, nq, weights=weights))
        n = cols(n, self.ffn_gate_inp.in_features)
        if len(ids) <= MV_MAX_TOKENS:
            return self._streamed_in_full(n, ids, w, nq)
        if host.wanted(len(ids)) and kernel_backend() == "fallback":
            y = self._streamed_by_expert(n, ids, w)
        else:
            y = self._streamed_by_token(n, ids, w)
        return y + self.shared(n)

    def _streamed_in_full(self, n: mx.array, ids: np.ndarray, w: mx.array, nq) -> mx.array:
        """A decode-sized call whose experts do not fit: on the GPU its routed and shared experts are one launch
        whose shape depends on the call's token count, so each span of tokens runs the whole call (the other
        tokens pointed at slot 0 with route weight 0) and keeps its own rows."""
        T = len(ids)
        y = None
        for t0, t1 in self.streamed.spans(ids):
            weights, slots = self.streamed.fetch(self.il, ids[t0:t1])
            mine = mx.array((np.arange(T) >= t0) & (np.arange(T) < t1))[:, None]
            sel = mx.pad(slots, [(t0, T - t1), (0, 0)])
            ys = self.experts(n, sel, mx.where(mine, w, 0.0), nq, weights=weights)
            y = ys if y is None else mx.where(mine, ys, y)
            mx.eval(y)  # before the next span's experts take the slots
        return y

    def _streamed_by_token(self, n: mx.array, ids: np.ndarray, w: mx.array) -> mx.array:
        """Routed experts of a chunk in spans of tokens whose experts fit (the kernels and MLX's products: a
        token's products do not depend on the other tokens of the call), each span on the chunk's path."""
        parts = []
        for t0, t1 in self.streamed.spans(ids):
            weights, slots = self.streamed.fetch(self.il, ids[t0:t1])
            parts.append(self.routed(n[t0:t1], slots, w[t0:t1], experts=weights, chunk=len(ids)))
            mx.eval(parts[-1])  # before the next span's experts take the slots
        return mx.concatenate(parts)

    def _streamed_by_expert(self, n: mx.array, ids: np.ndarray, w: mx.array) -> mx.array:
        """Routed experts of a chunk on the CPU in groups of experts that fit (numpy's products: each expert with
        all its pairs at once, as :meth:`_routed_host` runs it), each pair a row."""
        T, k = ids.shape
        flat, rw = ids.reshape(-1), w.reshape(-1, 1)
        y = np.empty((T * k, self.ffn_down_shexp.out_features), np.float32)
        for group in self.streamed.groups(ids):
            pairs = np.flatnonzero(np.isin(flat, group))
            weights, slots = self.streamed.fetch(self.il, flat[pairs])
            x, pw = n[mx.array(pairs // k)], rw[mx.array(pairs)]  # the pairs' tokens and route weights
            y[pairs] = np.array(self._routed_host(weights, x, slots[:, None], pw))
        return mx.array(y.reshape(T, k, -1).sum(axis=1))
