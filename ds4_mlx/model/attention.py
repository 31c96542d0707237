"""The attention sublayer of one layer (docs/model.md §4.4, §4.11) and its per-layer cache (§5.1).

    n  = rms(x) * attn_norm
    qr = rms(attn_q_a @ n) * attn_q_a_norm ;  q = headrms(attn_q_b @ qr)          [T, H, D]
    kv = rms(attn_kv @ n) * attn_kv_a_norm                                        [T, D]  (K = V)
    rope(q, kv) ; kv = f16r(fp8(kv)) -> raw window
    ratio r > 0: compressor(n) -> compressed rows;  ratio 4: indexer picks top-k of them per query
    o  = softmax_with_sink(q . keys / sqrt(D)) @ keys ;  inverse rope(o)
    y  = attn_output_b @ blockdiag(attn_output_a) o                               [T, E]

A call takes T consecutive tokens (T = 1 decode, T > 1 a prefill chunk) and is equivalent to T decode
steps: keys are the carried raw rows plus the chunk's rows under a banded causal mask, compressed row c
is visible to the query at p iff ``c < (p+1)//r``, and each query runs the indexer over its own visible
prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache
from typing import Any, NamedTuple

import mlx.core as mx
import numpy as np

from ..backend import kernel_backend
from ..config import ModelConfig
from ..kernels import ATTN_CHUNK_DIMS, MV_MAX_TOKENS, Cols, Scaled16, attention_chunk
from ..kernels.fused import kernel_counts
from ..numerics import Numerics, get_numerics, kv_rounding
from ..weights import QuantWeight
from .compressor import Compressor, CompressorState, index_array
from .fused import attend_one, chunk_top_k, qkv_rows, top_k_rows  # kernels on the GPU, MLX on the CPU
from .indexer import Indexer
from .ops import attend, select_top_k, selected_indices
from .rope import Rope, apply_rope

# Prefill attention runs in blocks of queries whose score matrices (and gathered rows) fit in this many bytes,
# and of at most ATTN_BLOCK_QUERIES queries: a block's raw keys are the band of its queries' windows, of which
# each query sees n_swa, so longer blocks compute more masked scores.
ATTN_BLOCK_BYTES = 1 << 28
ATTN_BLOCK_QUERIES = 256
# With more than this many compressed rows per top-k slot, a prefill block gathers each query's selected
# rows ([T, k, D]) instead of masking a [T, H, N] score matrix (decode always gathers).
GATHER_MIN_ROWS_PER_K = 4


@dataclass
class LayerCache:
    """One layer's attention state (docs/model.md §5.1). Arrays are never mutated in place, only replaced."""

    ratio: int
    pos: int  # tokens consumed so far (= position of the next token)
    raw: mx.array  # [min(pos, n_swa), D]  last raw KV rows, logical (position) order (f16 with f16r, else f32)
    comp: mx.array | None = None  # [capacity, D]  compressed rows; the first n_comp are valid (dtype as raw)
    n_comp: int = 0
    comp_state: CompressorState | None = None  # attention compressor frontier (f32)
    index: mx.array | None = None  # [capacity, 128]  indexer compressed rows (ratio 4)
    n_index: int = 0
    index_state: CompressorState | None = None  # indexer compressor frontier (f32)
    # Capacity the compressed-row buffers take at their first growth: the rows of the session's reserved
    # context. A buffer that never grows keeps the compiled decode steps' shapes (no retrace, no kernel JIT).
    reserve_rows: int = 0

    @property
    def n_raw(self) -> int:
        return self.raw.shape[0]

    @property
    def comp_rows(self) -> mx.array | None:
        return None if self.comp is None else self.comp[: self.n_comp]

    @property
    def index_rows(self) -> mx.array | None:
        return None if self.index is None else self.index[: self.n_index]

    def decode_state(self) -> dict[str, mx.array]:
        """The arrays a one-token step reads and replaces (see :meth:`Attention.decode`)."""
        st = {"raw": self.raw}
        if self.comp is not None:
            st.update(comp=self.comp, cfr=self.comp_state.fr)
        if self.index is not None:
            st.update(index=self.index, ifr=self.index_state.fr)
        return st

    def take_decode_state(self, st: dict[str, mx.array], key: "DecodeKey") -> None:
        """Adopt the arrays of a finished one-token step; one more token, one more row if a window completed."""
        self.raw, self.pos = st["raw"], self.pos + 1
        if self.comp is not None:
            self.comp, self.comp_state = st["comp"], CompressorState(st["cfr"])
            self.n_comp += key.complete
        if self.index is not None:
            self.index, self.index_state = st["index"], CompressorState(st["ifr"])
            self.n_index += key.complete

    def snapshot(self) -> "LayerCache":
        """An independent copy (cheap: MLX arrays are immutable and the cache only ever rebinds them)."""
        return replace(self)

    def rewind_point(self) -> "LayerCache":
        """A snapshot without the compressed-row buffers, for :meth:`rewound` (see ``Session.rewind_point``)."""
        return replace(self, comp=None, index=None)

    def rewound(self, point: "LayerCache") -> "LayerCache":
        """The state at ``point`` (an earlier :meth:`rewind_point` of this cache), with this cache's row buffers:
        rows are only ever appended to them, so their first ``n_comp`` / ``n_index`` rows are the point's."""
        if point.pos > self.pos:
            raise ValueError(f"rewind point at {point.pos} tokens is ahead of the cache ({self.pos})")
        return replace(point, comp=self.comp, index=self.index)

    def message(self) -> mx.array:
        """The state as one flat float32 array (raw rows, valid compressed rows, their frontier, valid indexer
        rows, theirs), to move it between ranks: :func:`layer_cache_from_message` reads it back."""
        parts = [self.raw, self.comp_rows, self.comp_state and self.comp_state.fr, self.index_rows,
                 self.index_state and self.index_state.fr]  # fmt: skip
        return mx.concatenate([p.astype(mx.float32).reshape(-1) for p in parts if p is not None])

    @property
    def nbytes(self) -> int:
        """Bytes of the state's contents: the valid rows of the capacity buffers (not their spare room)."""
        rows = [(self.raw, self.n_raw), (self.comp, self.n_comp), (self.index, self.n_index)]
        states = [self.comp_state, self.index_state]
        used = sum(a.itemsize * n * a.shape[1] for a, n in rows if a is not None)
        return used + sum(s.nbytes for s in states if s is not None)


def make_layer_cache(cfg: ModelConfig, il: int, reserve: int = 0) -> LayerCache:
    """An empty cache for layer ``il``; its compressed-row buffers grow to ``reserve`` tokens' rows at once."""
    r = cfg.compress_ratio(il)
    rows = -(-reserve // r) if r else 0
    cache = LayerCache(ratio=r, pos=0, raw=mx.zeros((0, cfg.head_dim), mx.float32), reserve_rows=rows)
    if r:
        cache.comp = mx.zeros((0, cfg.head_dim), mx.float32)
        cache.comp_state = CompressorState.init(r, cfg.head_dim)
    if cfg.has_indexer(il):
        cache.index = mx.zeros((0, cfg.indexer_head_dim), mx.float32)
        cache.index_state = CompressorState.init(4, cfg.indexer_head_dim)
    return cache


def message_sizes(cfg: ModelConfig, il: int, pos: int) -> list[int]:
    """The lengths of the parts of layer ``il``'s :meth:`LayerCache.message` at ``pos`` tokens: each follows from
    the layer and the position (the raw window's rows, one compressed row per ``ratio`` tokens)."""
    r, D, ID = cfg.compress_ratio(il), cfg.head_dim, cfg.indexer_head_dim
    sizes = [min(pos, cfg.n_swa) * D]
    if r:
        coff = 2 if r == 4 else 1
        sizes += [pos // r * D, 2 * coff * r * coff * D]
    if cfg.has_indexer(il):
        sizes += [pos // 4 * ID, 2 * 8 * 2 * ID]
    return sizes


def layer_cache_from_message(cfg: ModelConfig, il: int, pos: int, msg: mx.array, kv_dtype: mx.Dtype) -> LayerCache:
    """Layer ``il``'s cache at ``pos`` tokens from its :meth:`LayerCache.message` (rows stored as ``kv_dtype``,
    indexer rows as f32, as the engine keeps them)."""
    cache = make_layer_cache(cfg, il)
    edges = np.cumsum([0, *message_sizes(cfg, il, pos)]).tolist()
    if msg.shape[0] != edges[-1]:
        raise ValueError(f"layer {il} at {pos} tokens: a state of {msg.shape[0]} values, expected {edges[-1]}")
    parts = iter(msg[a:b] for a, b in zip(edges, edges[1:]))
    cache.pos, cache.raw = pos, next(parts).reshape(-1, cfg.head_dim).astype(kv_dtype)
    if cache.ratio:
        cache.comp = next(parts).reshape(-1, cfg.head_dim).astype(kv_dtype)
        cache.n_comp = cache.comp.shape[0]
        cache.comp_state = CompressorState(next(parts).reshape(cache.comp_state.fr.shape))
    if cache.index is not None:
        cache.index = next(parts).reshape(-1, cfg.indexer_head_dim)
        cache.n_index = cache.index.shape[0]
        cache.index_state = CompressorState(next(parts).reshape(cache.index_state.fr.shape))
    return cache


@lru_cache(maxsize=64)
def _group_ids(T: int, G: int) -> mx.array:
    """int32 ``[T, G]``, row ``t = 0..G-1``: made on the host, so a compiled step holds it as a constant."""
    return mx.array(np.broadcast_to(np.arange(G, dtype=np.int32), (T, G)))


class DecodeKey(NamedTuple):
    """The static choices of a one-token step; a compiled step is traced once per key (and buffer shapes)."""

    complete: bool  # the token completes a compressor window: pool it and append a compressed row
    has_comp: bool  # at least one compressed row is visible
    select: bool  # the indexer picks top-k of the visible rows (more than top_k of them)
    static: bool  # the raw window is full, so the step's shapes repeat from token to token


def _reserve(buf: mx.array, n: int, need: int, dtype, floor: int = 0) -> mx.array:
    """A capacity buffer whose first ``n`` rows are kept, stored as ``dtype``, with room for ``need`` rows.

    Capacity grows to at least ``floor`` rows, then doubles, so a decode step's buffer shapes (and its compiled
    trace) change only log-many times, and never while the session stays within its reserved context.
    """
    if buf.dtype != dtype:
        buf = buf.astype(dtype)
    if buf.shape[0] < need:
        cap = max(2 * buf.shape[0], need, 16, floor)
        buf = mx.concatenate([buf[:n], mx.zeros((cap - n, buf.shape[1]), buf.dtype)])
    return buf


def _append_rows(
    buf: mx.array, n: int, rows: mx.array | None, dtype=mx.float32, floor: int = 0
) -> tuple[mx.array, int]:
    """Write ``rows`` after the first ``n`` rows of a capacity buffer (see :func:`_reserve`), stored as ``dtype``."""
    if rows is None:
        return buf, n
    buf = _reserve(buf, n, n + rows.shape[0], dtype, floor)
    return mx.slice_update(buf, rows.astype(buf.dtype), mx.array([n]), axes=(0,)), n + rows.shape[0]


def _split_cols(y: mx.array, sizes: tuple[int, ...]) -> list[Cols]:
    """One token's ``y [1, sum(sizes)]`` -> its consecutive column blocks, read in place by the kernels."""
    return [Cols(y, int(a)) for a in np.cumsum([0, *sizes[:-1]])]


class Attention:
    """Attention sublayer of layer ``il``; ``weights`` is the flat dict keyed by GGUF tensor names."""

    def __init__(self, cfg: ModelConfig, il: int, weights: dict, numerics: Numerics | str | None = None):
        self.cfg, self.il = cfg, il
        self.numerics = get_numerics(numerics)
        self.ratio = cfg.compress_ratio(il)
        self.n_head, self.head_dim, self.nope = cfg.n_head, cfg.head_dim, cfg.nope_dim
        self.n_group, self.o_lora = cfg.n_out_group, cfg.o_lora_rank
        self.n_swa, self.eps, self.scale = cfg.n_swa, cfg.rms_eps, cfg.attn_scale
        self.rope = Rope.for_layer(cfg, il, recurrence=self.numerics.rope_recurrence)
        # With f16r every cached KV row is f16-exact (docs/model.md §4.12), so f16 storage is lossless. Indexer rows
        # stay f32: the indexer scan reads them all as f32 operands, and they are a quarter of the width.
        self.kv_dtype = mx.float16 if self.numerics.f16_cache else mx.float32

        p = f"blk.{il}."
        self.attn_norm = weights[p + "attn_norm.weight"]  # [E]
        q_a, kv = weights[p + "attn_q_a.weight"], weights[p + "attn_kv.weight"]  # [q_lora, E], [D, E]
        self.q_lora = q_a.out_features
        # q_a and kv rows stacked: both project the normed input, so one matvec gives both [q_lora + D, E]
        self.attn_q_a_kv = QuantWeight.stack_rows([q_a, kv])
        self.attn_q_a_norm = weights[p + "attn_q_a_norm.weight"]  # [q_lora]
        self.attn_q_b = weights[p + "attn_q_b.weight"]  # [H*D, q_lora]
        self.attn_kv_a_norm = weights[p + "attn_kv_a_norm.weight"]  # [D]
        self.attn_sinks = weights[p + "attn_sinks.weight"]  # [H]
        self.attn_output_a = weights[p + "attn_output_a.weight"]  # [G*o_lora, (H/G)*D]
        self.attn_output_b = weights[p + "attn_output_b.weight"]  # [E, G*o_lora]
        self._output_a_groups = None  # attn_output_a as (G, o_lora, in) "experts", for prefill
        self.group = None  # tensor parallel: the ranks, which add their heads' outputs (shard_heads)

        self.compressor = self.indexer = None
        if self.ratio:
            self.compressor = Compressor(
                cfg, il, weights, "attn_compressor", self.head_dim, self.ratio, self.rope,
                kv_rounding(self.numerics, self.nope), self.kv_dtype,
            )  # fmt: skip
        if cfg.has_indexer(il):
            self.indexer = Indexer(cfg, il, weights, self.numerics, self.rope)
        self.n_f16 = None
        if self.indexer is not None:
            # The F16 projections of the normed input (compressor kv+gate, indexer head weights, indexer
            # compressor kv+gate) as one decode matvec; the parts become views of its rows (no second copy).
            parts = [self.compressor.wkv_gate, self.indexer.wproj, self.indexer.compressor.wkv_gate]
            self.n_f16 = QuantWeight.stack_rows(parts)
            self.compressor.wkv_gate, self.indexer.wproj, self.indexer.compressor.wkv_gate = self.n_f16.split_rows(
                [w.out_features for w in parts]
            )
            cw, iw = self.compressor.width, self.indexer.compressor.width
            self.n_f16_cols = (cw, cw, self.indexer.n_head, iw, iw)  # kv, gate, head weights, kv, gate

    # --- the sublayer -----------------------------------------------------------------------------------

    def __call__(self, x: mx.array, pos: int, cache: LayerCache) -> mx.array:
        """``x [T, E]`` (HC-pre output at positions ``pos..pos+T-1``) -> ``y [T, E]``; updates ``cache``."""
        return self.forward(self.norm(x), pos, cache)

    def norm(self, x: mx.array) -> mx.array:
        """The sublayer's input RMSNorm (HC pre applies it itself in the model: ``hc_pre(..., norm=attn_norm)``)."""
        return mx.fast.rms_norm(x, self.attn_norm, self.eps)

    def forward(self, n: mx.array, pos: int, cache: LayerCache) -> mx.array:
        """The sublayer from its normed input ``n [T, E]`` (:meth:`norm`) -> ``y [T, E]``; updates ``cache``."""
        if pos != cache.pos:
            raise ValueError(f"layer {self.il}: cache holds {cache.pos} tokens, got a chunk at position {pos}")
        T = n.shape[0]
        if T == 1:
            key, io = self.decode_inputs(pos, cache)
            y, st = self.decode(n, cache.decode_state(), io, key)
            cache.take_decode_state(st, key)
            return y
        D, W, r = self.head_dim, self.n_swa, self.ratio
        C, S = self.rope.tables(pos + np.arange(T), D)  # [T, D] each
        qa, q, kv = self._project(n, C, S)

        # Raw window: the last W-1 carried rows + the chunk's rows; key j sits at position pos - keep + j.
        keep = min(cache.n_raw, W - 1)
        raw_keys = mx.concatenate([cache.raw[cache.n_raw - keep :], kv]) if keep else kv  # [keep+T, D]

        if r:
            rows, cache.comp_state = self.compressor(n, pos, cache.comp_state)
            cache.comp, cache.n_comp = _append_rows(cache.comp, cache.n_comp, rows, self.kv_dtype, cache.reserve_rows)
            if self.indexer is not None:
                irows, cache.index_state = self.indexer.compressor(n, pos, cache.index_state)
                cache.index, cache.n_index = _append_rows(cache.index, cache.n_index, irows, mx.float32, cache.reserve_rows)

        backend = kernel_backend()
        if backend != "fallback" and D in ATTN_CHUNK_DIMS:  # one launch, keys read where they are
            o = attention_chunk(q, raw_keys, cache.comp if r else None, self._selected_rows(qa, n, pos, cache),
                                self.attn_sinks, keep=keep, window=W, pos=pos, ratio=r,
                                top_k=self.indexer.top_k if self.indexer is not None else 0, scale=self.scale,
                                C=C, S=S, groups=self.n_group, backend=backend)  # inverse-RoPE'd  fmt: skip
        else:  # in blocks of queries, so that score matrices stay bounded at long contexts
            B = self._query_block(T, keep, cache)
            outs = []
            for i0 in range(0, T, B):
                i1 = min(T, i0 + B)
                outs.append(self._attend_block(q[i0:i1], qa[i0:i1], n[i0:i1], pos, i0, raw_keys, keep, cache))
            o = outs[0] if len(outs) == 1 else mx.concatenate(outs)  # [T, H, D]
            o = apply_rope(o, C[:, None, :], S[:, None, :], inverse=True)
        y = self._output(o)  # [T, E]

        cache.raw = (raw_keys[-W:] if raw_keys.shape[0] > W else raw_keys).astype(self.kv_dtype)
        cache.pos = pos + T
        return y

    def _project(
        self, n: mx.array, C: mx.array, S: mx.array, window: tuple[mx.array, int, mx.dtype] | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """Normed input ``n [T, E]`` -> ``qa [T, q_lora]`` (``attn_q_a n``, before its norm: ``qr = rms(qa) *
        attn_q_a_norm`` is the prologue of each matvec that reads it), RoPE'd ``q [T, H, D]`` and the stored KV
        row (with ``window``, one token: the new raw window, see :func:`qkv_rows`, and ``qa`` as :class:`Cols`)."""
        q_a_kv = self.attn_q_a_kv.matmul(n)  # [T, q_lora + D]: attn_q_a n, then attn_kv n
        if window is None:
            qa, kvb = q_a_kv[:, : self.q_lora], q_a_kv[:, self.q_lora :]
        else:  # one token: its kernels read the columns in place (no slice nodes)
            qa, kvb = Cols(q_a_kv, 0), Cols(q_a_kv, self.q_lora)
        q, kv = qkv_rows(  # q = rope(headrms(q_b qr)) [T, H, D]; kv = kv_row(rope(rms(attn_kv n))) [T, D]
            self.attn_q_b.matmul_rms(qa, self.attn_q_a_norm, self.eps, scaled_out=True), kvb,
            self.attn_kv_a_norm, C, S, self.eps, self.n_head, nope_fp8=self.nope if self.numerics.fp8_kv else 0,
            f16r=self.numerics.f16_cache, window=window,
        )  # fmt: skip
        return qa, q, kv

    # --- one-token decode: a pure function of arrays, so a step can be compiled --------------------------

    def decode_inputs(self, pos: int, cache: LayerCache) -> tuple[DecodeKey, dict]:
        """Host side of the one-token step at ``pos``: its static key and per-step arrays (RoPE tables, row
        indices, the visible-row count). Grows the compressed-row buffers when a row is due and they are full."""
        if pos != cache.pos:
            raise ValueError(f"layer {self.il}: cache holds {cache.pos} tokens, got a token at position {pos}")
        r = self.ratio
        C, S = self.rope.row(pos, self.head_dim)
        io: dict = {"C": C, "S": S}
        complete = bool(r) and (pos + 1) % r == 0
        n_vis = (pos + 1) // r if r else 0  # compressed rows visible to this token (after its own append)
        select = self.indexer is not None and n_vis > self.indexer.top_k
        if r:
            io["comp"] = self.compressor.decode_inputs(pos)
            io["slot"] = index_array(cache.n_comp)  # where a completed window's row goes
            if complete:
                cache.comp = _reserve(cache.comp, cache.n_comp, cache.n_comp + 1, self.kv_dtype, cache.reserve_rows)
        if self.indexer is not None:
            io["index"] = self.indexer.compressor.decode_inputs(pos)
            if complete:
                cache.index = _reserve(cache.index, cache.n_index, cache.n_index + 1, mx.float32, cache.reserve_rows)
            if select:
                io["Ci"], io["Si"] = self.rope.row(pos, self.indexer.head_dim)
                io["index_counts"] = kernel_counts(n_vis, self.indexer.top_k)
        # Keys of attend_one: the kept raw rows plus this token's, and the compressed rows attended.
        io["counts"] = kernel_counts(min(cache.n_raw, self.n_swa - 1) + 1, self.indexer.top_k if select else n_vis)
        return DecodeKey(complete, n_vis > 0, select, cache.n_raw >= self.n_swa - 1), io

    def decode(self, n: mx.array, st: dict[str, mx.array], io: dict, key: DecodeKey) -> tuple[mx.array, dict]:
        """One token's normed input ``n [1, E]`` over the cache arrays ``st`` (:meth:`LayerCache.decode_state`) ->
        ``(y [1, E], new arrays)``. Same math as a chunk of one; compressed rows live in fixed-capacity buffers
        whose first ``n_vis`` rows are visible, so shapes repeat from token to token."""
        raw = st["raw"]  # the new raw window [keep+1 <= W, D] comes out of the Q/KV launch
        qa, q, window = self._project(n, io["C"], io["S"], (raw, min(raw.shape[0], self.n_swa - 1), self.kv_dtype))
        st = dict(st, raw=window)
        comp_proj = index_proj = hw = None
        if self.n_f16 is not None:  # one matvec for the compressors' and the indexer's projections of n
            ckv, cg, hw, ikv, ig = _split_cols(self.n_f16.matmul(n), self.n_f16_cols)
            comp_proj, index_proj = (ckv, cg), (ikv, ig)
        elif self.ratio:
            comp_proj = self.compressor.project_one(n)
        o, st = self._attend_state(q, qa, comp_proj, index_proj, hw, st, io, key)
        return self._output(o), st

    def decode_batch(
        self, n: mx.array, sts: list[dict], ios: list[dict], keys: tuple[DecodeKey, ...]
    ) -> tuple[mx.array, list[dict]]:
        """One token of each of B sessions: normed inputs ``n [B, E]`` (row b at its own session's position),
        each session's cache arrays ``sts[b]``, step inputs ``ios[b]`` and key ``keys[b]`` (see :meth:`decode`)
        -> ``(y [B, E], new arrays per session)``. The projections and the output products take the B rows at
        once (each weight read once for all of them); the KV row, compressors, indexer and attention run per
        session over its own state, as :meth:`decode` does."""
        B, Lq = n.shape[0], self.q_lora
        q_a_kv = self.attn_q_a_kv.matmul(n)  # [B, q_lora + D]
        qa, kvb = q_a_kv[:, :Lq], q_a_kv[:, Lq:]
        qb = self.attn_q_b.matmul_rms(qa, self.attn_q_a_norm, self.eps)  # [B, H*D]
        f16 = self.n_f16.matmul(n) if self.n_f16 is not None else None  # [B, sum(n_f16_cols)]
        comp_all = self.compressor.project(n) if self.ratio and f16 is None else None
        edges = np.cumsum([0, *self.n_f16_cols]) if f16 is not None else None
        outs, new = [], []
        for b in range(B):
            st, io, key, row = sts[b], ios[b], keys[b], slice(b, b + 1)
            raw = st["raw"]
            q, window = qkv_rows(
                qb[row], kvb[row], self.attn_kv_a_norm, io["C"], io["S"], self.eps, self.n_head,
                nope_fp8=self.nope if self.numerics.fp8_kv else 0, f16r=self.numerics.f16_cache,
                window=(raw, min(raw.shape[0], self.n_swa - 1), self.kv_dtype),
            )  # fmt: skip
            comp_proj = index_proj = hw = None
            if f16 is not None:
                ckv, cg, hw, ikv, ig = (f16[row, int(a) : int(z)] for a, z in zip(edges[:-1], edges[1:]))
                comp_proj, index_proj = (ckv, cg), (ikv, ig)
            elif comp_all is not None:
                comp_proj = (comp_all[0][row], comp_all[1][row])
            o, st = self._attend_state(q, qa[row], comp_proj, index_proj, hw, dict(st, raw=window), io, key)
            outs.append(o)
            new.append(st)
        o = mx.concatenate(outs) if B > 1 else outs[0]  # [B, H, D]
        return self._output(o), new

    def _attend_state(self, q, qa, comp_proj, index_proj, hw, st: dict, io: dict, key: DecodeKey
                      ) -> tuple[mx.array, dict]:  # fmt: skip
        """The per-session part of a decode step after the projections: compressor and indexer rows, the
        indexer's selection and the attention of ``q [1, H, D]`` -> ``(o [1, H, D], new cache arrays)``."""
        r = self.ratio
        if r:
            row, st["cfr"] = self.compressor.decode(comp_proj, st["cfr"], io["comp"], key.complete)
            if row is not None:
                st["comp"] = mx.slice_update(st["comp"], row.astype(st["comp"].dtype), io["slot"], axes=(0,))
        if self.indexer is not None:
            ic = self.indexer.compressor
            row, st["ifr"] = ic.decode(index_proj, st["ifr"], io["index"], key.complete)
            if row is not None:
                st["index"] = mx.slice_update(st["index"], row, io["slot"], axes=(0,))

        comp = st["comp"] if key.has_comp else None  # [capacity, D]: attend_one reads its first counts[1] rows
        idx = None
        if key.select:  # attend to the indexer's top-k rows only
            scores = self.indexer.scores(qa, hw, io["Ci"], io["Si"], st["index"], io["index_counts"])  # [1, capacity]
            idx = top_k_rows(scores, io["index_counts"], self.indexer.top_k)  # [1, k] of the first n_vis rows
        return attend_one(q, st["raw"], comp, idx, io["counts"], self.attn_sinks, io["C"], io["S"], self.scale), st

    # --- chunks -------------------------------------------------------------------------------------------

    def _selected_rows(self, qa: mx.array, n: mx.array, pos: int, cache: LayerCache) -> mx.array | None:
        """The indexer's top-k compressed rows of every query of a chunk, ``[T, top_k]`` (valid ones first, as
        :func:`selected_indices` orders them), or None where no query selects (no indexer, or every query sees at
        most top_k rows). Scored in blocks of queries whose ``[block, rows]`` scores fit ATTN_BLOCK_BYTES."""
        T, k = qa.shape[0], self.indexer.top_k if self.indexer is not None else 0
        nmax = (pos + T) // self.ratio if self.ratio else 0
        if self.indexer is None or nmax <= k:
            return None
        pq = pos + np.arange(T)
        Ci, Si = self.rope.tables(pq, self.indexer.head_dim)
        hw, keys = self.indexer.head_weights(n), cache.index[:nmax]
        B = max(1, min(T, ATTN_BLOCK_BYTES // (4 * nmax * (1 if self.indexer.chunk_kernel else self.indexer.n_head))))
        parts = []
        for i0 in range(0, T, B):
            i1 = min(T, i0 + B)
            scores = self.indexer.scores(qa[i0:i1], hw[i0:i1], Ci[i0:i1], Si[i0:i1], keys)  # [block, nmax]
            parts.append(chunk_top_k(scores, pos + 1 + i0, self.ratio, k))  # query t sees (pos + t + 1) // ratio
        return parts[0] if len(parts) == 1 else mx.concatenate(parts)

    def _query_block(self, T: int, keep: int, cache: LayerCache) -> int:
        """Queries per block: the [block, heads, keys] scores, the indexer's head scores (unless fused) and the
        gathered rows stay under ATTN_BLOCK_BYTES; at most ATTN_BLOCK_QUERIES."""
        comp = cache.n_comp if self.ratio else 0
        if self.indexer is not None and comp >= GATHER_MIN_ROWS_PER_K * self.indexer.top_k:
            comp = self.indexer.top_k  # each query's selected rows, gathered
        width = self.n_head * (min(keep + T, self.n_swa + T) + comp)
        if self.indexer is not None:
            if not self.indexer.chunk_kernel:  # its [block, heads, rows] head scores
                width = max(width, self.indexer.n_head * cache.n_index)
            width = max(width, self.indexer.top_k * self.head_dim)  # gathered rows [block, top_k, D]
        return max(1, min(T, ATTN_BLOCK_QUERIES, ATTN_BLOCK_BYTES // (4 * max(1, width))))

    def _attend_block(
        self, q: mx.array, qa: mx.array, n: mx.array, pos: int, i0: int, raw_keys: mx.array, keep: int,
        cache: LayerCache,
    ) -> mx.array:  # fmt: skip
        """Attention output ``[Tb, H, D]`` of the queries ``i0 .. i0+Tb-1`` of the chunk starting at ``pos``."""
        Tb, W, r = q.shape[0], self.n_swa, self.ratio
        pq = pos + i0 + np.arange(Tb)  # query positions

        # Raw keys: the band of positions p-W+1 .. p over this block's queries.
        j0, j1 = max(0, i0 + keep - (W - 1)), i0 + keep + Tb
        raw = raw_keys[j0:j1]  # [Mr, D]
        raw_mask = None
        if Tb > 1:
            pk = pos - keep + np.arange(j0, j1)
            raw_mask = (pk[None, :] <= pq[:, None]) & (pk[None, :] > pq[:, None] - W)  # [Tb, Mr]

        # Compressed keys: row c is visible to the query at p iff c < (p+1)//r.
        comp, comp_mask, gathered = None, None, None
        n_visible = (pq + 1) // r if r else None
        if r and n_visible[-1] > 0:
            nmax = int(n_visible[-1])
            comp = cache.comp[:nmax]  # [Nc, D]
            k = self.indexer.top_k if self.indexer is not None else 0
            if self.indexer is not None and nmax > k:
                Ci, Si = self.rope.tables(pq, self.indexer.head_dim)
                scores = self.indexer.scores(qa, self.indexer.head_weights(n), Ci, Si, cache.index[:nmax])  # [Tb, Nc]
                sel = select_top_k(scores, n_visible, k)  # [Tb, Nc]
                if Tb == 1 or nmax >= GATHER_MIN_ROWS_PER_K * k:
                    # Attend to each query's k selected rows only (queries seeing < k rows get a mask).
                    idx = selected_indices(sel, k)  # [Tb, k]
                    gathered = comp[idx].astype(mx.float32)  # [Tb, k, D]
                    if n_visible[0] < k:
                        comp_mask = mx.take_along_axis(sel, idx, axis=1)  # [Tb, k]
                    comp = None
                else:
                    comp_mask = sel
            elif n_visible[0] < nmax:
                comp_mask = mx.array(np.arange(nmax)[None, :] < n_visible[:, None])

        comp = None if comp is None else comp.astype(mx.float32)
        return attend(q, raw, raw_mask, comp, gathered, comp_mask, self.attn_sinks, self.scale)

    def shard_heads(self, group: Any, heads: range) -> None:
        """Tensor parallel: this layer holds the attention heads ``heads`` (whole output groups: their query rows,
        sinks and output products) of the ranks of ``group``, which add their outputs (:meth:`_output`)."""
        per = self.cfg.heads_per_group
        if len(heads) % per or heads.start % per:
            raise ValueError(f"layer {self.il}: heads {heads} are not whole output groups of {per}")
        held = (self.attn_sinks.shape[0], self.attn_q_b.out_features // self.head_dim,
                self.attn_output_a.out_features // self.o_lora * per,
                self.attn_output_b.in_features // self.o_lora * per)  # fmt: skip
        if set(held) != {len(heads)}:
            raise ValueError(f"layer {self.il}: sinks, q_b, output_a and output_b hold {held} heads, not the "
                             f"{len(heads)} of {heads}")  # fmt: skip
        self.n_head, self.n_group, self.group = len(heads), len(heads) // per, group

    def _output(self, o: mx.array | Scaled16) -> mx.array:
        """``y = attn_output_b @ blockdiag(attn_output_a) o`` -> ``[T, E]``; with heads split, the ranks' sum.
        ``o``: ``[T, H, D]``, or :func:`attention_chunk`'s ``[G, T, H/G * D]``."""
        y = self.attn_output_b.matmul(self._grouped_output_a(o))
        return y if self.group is None else mx.distributed.all_sum(y, group=self.group)

    def _grouped_output_a(self, o: mx.array | Scaled16) -> mx.array | Scaled16:
        """``low [T, G*o_lora]``: group g (heads g*H/G ..) times its own o_lora rows of attn_output_a."""
        G, L = self.n_group, self.o_lora
        if isinstance(o, Scaled16):  # attention_chunk's output, [G, T, H/G * D]
            T = o.a.shape[1]
            if T > MV_MAX_TOKENS:  # f16 in, f16 out where it can: attn_output_b's product reads it as it is
                low = self._output_a_grouped().batched_matmul(o, scaled_out=True)  # [G, T, L]
                if isinstance(low, Scaled16):
                    return Scaled16(low.a.swapaxes(0, 1).reshape(T, G * L))
                return low.swapaxes(0, 1).reshape(T, G * L)
            o = o.values().swapaxes(0, 1).reshape(T, self.n_head, -1)
        T = o.shape[0]
        if T > MV_MAX_TOKENS:  # a chunk: G dense products of T tokens each
            y = self._output_a_grouped().batched_matmul(o.reshape(T, G, -1).swapaxes(0, 1))  # [G, T, L]
            return y.swapaxes(0, 1).reshape(T, G * L)
        # attn_output_a viewed as G "experts" of shape [L, (H/G)*D]; token t's slot g uses expert g (its heads
        # g*H/G.. of o, read as [T, G, (H/G)*D]), so each row block is read once and multiplied only by its own
        # group (no G x wasted work or weight reads).
        return self._output_a_grouped().gather_matmul(o, _group_ids(T, G), out_shape=(T, G * L))

    def _output_a_grouped(self):
        """attn_output_a as a 3-D ``(G, o_lora, (H/G)*D)`` weight over the same bytes (built on first use)."""
        if self._output_a_groups is None:
            w, G, L = self.attn_output_a, self.n_group, self.o_lora
            self._output_a_groups = type(w)(w.data.reshape(G, L, *w.data.shape[1:]), w.qtype, (G, L, w.shape[1]))
        return self._output_a_groups
