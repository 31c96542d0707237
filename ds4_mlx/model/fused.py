"""The graph's fused operations: each runs its fused kernel (:mod:`ds4_mlx.kernels.fused`) on the kernel
backends and its pure-MLX form on the ``fallback`` backend (CPU, or ``DS4_MLX_KERNELS=fallback``) and for
inputs the kernel does not cover.

Hyper-connections (:func:`hc_pre`, :func:`hc_post`, :func:`hc_post_pre`), the compressor's window
(:func:`compressor_pool`, :func:`compressor_emit`, :func:`compressor_write`), the query heads and KV row
(:func:`qkv_rows`), one decode token's attention (:func:`attend_one`), the indexer (:func:`index_query`,
:func:`index_scores`, :func:`top_k_rows`) and the MoE (:func:`moe_route`, :func:`expert_swiglu`,
:func:`expert_down_sum`, :func:`experts_with_shared`). The kernels check their inputs on every backend and
return None where they do not run; the pure-MLX forms come from :mod:`.hyper`, :mod:`.rope`, :mod:`.ops` and
:mod:`ds4_mlx.numerics`, and are the tests' oracle. ``backend`` overrides :func:`ds4_mlx.backend.kernel_backend`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..backend import kernel_backend
from ..kernels import Cols, Scaled16, cols
from ..kernels import fused as K
from ..numerics import HADAMARD_DIM, f16r as round_f16, fp8_e4m3_round_trip, indexer_qat
from . import hyper
from .ops import attend, index_scores_reference, route_top_k, select_top_k, selected_indices, swiglu
from .rope import apply_rope


def _pick(backend: str | None) -> str:
    return kernel_backend() if backend is None else backend


# --- hyper-connections ------------------------------------------------------------------------------------


def hc_pre(
    S: mx.array | Cols, fn: Any, scale: mx.array, base: mx.array, cfg, *, norm: mx.array | None = None,
    backend: str | None = None, tpb: int | None = None, split: bool | None = None, cols: bool = False,
):  # fmt: skip
    """HC pre (docs/model.md §4.3); same signature and results as :func:`.hyper.hc_pre`.

    S ``[T, n_hc, E]`` f32; fn the F16 ``QuantWeight [2n+n², n*E]``; scale ``[3]``; base ``[2n+n²]``.
    Returns ``x [T, E]``, ``post [T, n_hc]``, ``comb [T, n_hc, n_hc]``; with ``norm [E]`` the sublayer's
    normed input ``rms_norm(x, norm, cfg.rms_eps)`` instead of ``x`` (one launch less). ``tpb`` and ``split``
    override the launch choice (tests and benchmarks): ``split`` runs hc_mix first (default for
    T <= HC_PRE_SPLIT_MAX_T). ``cols`` (the decode step): one token's results as :class:`Cols` of the launch's
    one output row, where the kernels that read them find them (on the kernel backends; else arrays).
    """
    return _hc_pre(S, fn, scale, base, cfg, norm, None, _pick(backend), tpb, split, cols=cols)[1:4]


def hc_post_pre(
    S: mx.array | Cols, y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, fn: Any, scale: mx.array,
    base: mx.array, cfg, *, norm: mx.array | None = None, quantize: bool = False, cols: bool = False,
    backend: str | None = None,
) -> tuple:  # fmt: skip
    """HC post of one sublayer then HC pre of the next: ``S' = hc_post(S, y, post, comb)``, then
    ``hc_pre(S', fn, scale, base, cfg, norm=norm, cols=cols)`` -> ``(S', x or n, post', comb', xq)``. For
    decode-sized T the post runs inside the mix launch (one launch less). ``quantize``: on CUDA (and the sim
    backend, which runs its text), that launch also writes its output quantized as
    :func:`ds4_mlx.kernels.quantize_x` does (``xq``, for :func:`experts_with_shared`); else ``xq`` is None. Metal
    has no 4-byte integer dot, and ds4's Metal build keeps f32 activations, so it keeps f32 x too."""
    b = _pick(backend)
    T = K.check_hc_post(S, y, post, comb, cfg.n_hc)[1]
    if T > K.HC_PRE_SPLIT_MAX_T:  # prefill: no split mix to carry the post
        S = hc_post(S, y, post, comb, backend=b)
        return (S, *hc_pre(S, fn, scale, base, cfg, norm=norm, backend=b), None)
    return _hc_pre(S, fn, scale, base, cfg, norm, (y, post, comb), b, None, None, quantize, cols)


def _hc_pre(S, fn, scale, base, cfg, norm, post_of, backend, tpb, split, quantize=False, cols=False) -> tuple:
    """-> ``(S', x or n, post, comb, xq or None)``; ``post_of = (y, post, comb)`` applies HC post to S first
    (inside the split mix; only :func:`hc_post_pre` passes it, for decode-sized T). With ``cols`` and one
    token, S' is :class:`Cols` of the mix launch's output row (what hc_mix, hc_pre and hc_post read in place)."""
    n_hc = cfg.n_hc
    out = K.hc_pre(S, fn, scale, base, n_hc, cfg.n_sinkhorn_iter, cfg.rms_eps, cfg.hc_eps, norm=norm,
                   post_of=post_of, backend=backend, tpb=tpb, split=split, quantize=quantize, cols=cols)  # fmt: skip
    if out is not None:
        return out
    S = _state_array(S, n_hc, fn.shape[1] // n_hc)
    if post_of is not None:
        S = hyper.hc_post(S, *_gate_arrays(*post_of, n_hc))
    x, post, comb = hyper.hc_pre(S, fn, scale, base, cfg)
    return S, (x if norm is None else mx.fast.rms_norm(x, norm, cfg.rms_eps)), post, comb, None


def hc_post(
    S: mx.array | Cols, y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, *, n_hc: int | None = None,
    backend: str | None = None,
) -> mx.array:  # fmt: skip
    """HC post (docs/model.md §4.9); same signature and results as :func:`.hyper.hc_post`. ``post`` and ``comb`` may
    be :class:`Cols` of HC pre's output row (:func:`hc_pre` ``cols``), and ``S`` one token's state as
    :class:`Cols` of the mix launch's row (:func:`hc_post_pre` ``cols``; give ``n_hc`` then)."""
    out = K.hc_post(S, y, post, comb, n_hc=n_hc, backend=_pick(backend))
    if out is not None:
        return out
    n = S.shape[1] if n_hc is None else n_hc
    return hyper.hc_post(_state_array(S, n, y.shape[-1]), *_gate_arrays(y, post, comb, n))


def _state_array(S: mx.array | Cols, n_hc: int, E: int) -> mx.array:
    """A stream state as ``[T, n_hc, E]``: ``S`` itself, or one token's :class:`Cols` of the mix launch's row."""
    return S.a[:, : n_hc * E].reshape(1, n_hc, E) if isinstance(S, Cols) else S


def _gate_arrays(y: mx.array, post: mx.array | Cols, comb: mx.array | Cols, n: int) -> tuple:
    """``(y, post [T, n], comb [T, n, n])`` as arrays, for the pure-MLX :func:`.hyper.hc_post`."""
    if not isinstance(post, Cols):
        return y, post, comb
    return y, cols(post, n), cols(comb, n * n).reshape(1, n, n)


# --- compressor window ------------------------------------------------------------------------------------


def compressor_pool(
    kv: mx.array,
    score: mx.array,
    norm: mx.array,
    C: mx.array,
    S: mx.array,
    eps: float,
    *,
    lanes: int = 1,
    rounding: Any = None,
    out_dtype: mx.Dtype = mx.float32,
    backend: str | None = None,
) -> mx.array:
    """Pool, norm and RoPE finished compressor windows (docs/model.md §4.6 steps 4–6), then ds4's storage rounding
    ``rounding`` (a :class:`ds4_mlx.numerics.RowRounding`, or ``None``) -> ``[nw, hd]`` as ``out_dtype``
    (float32, or float16 when the rounding ends in f16).

    ``lanes=1``: ``kv``/``score`` are the entries ``[nw, n_ent, hd]`` (what ``Compressor._finish`` builds).
    ``lanes=2``: the ratio-4 frontier layout ``[nw, 2r, 2hd]`` (lane A of rows 0..r-1, lane B of rows r..2r-1),
    so decode can pass the state directly. Scores already include APE. ``norm [hd]``; ``C, S [nw, hd]`` are
    ``Rope.tables(window_starts, hd)``.
    """
    row = K.compressor_pool(kv, score, norm, C, S, eps, lanes=lanes, rounding=rounding, out_dtype=out_dtype,
                            backend=_pick(backend))  # fmt: skip
    if row is not None:
        return row
    row = _pool(kv, score, norm, C, S, eps, lanes)
    return (row if rounding is None else rounding(row)).astype(out_dtype)


def _pool(kv: mx.array, score: mx.array, norm: mx.array, C: mx.array, S: mx.array, eps: float, lanes: int):
    """The pure-MLX pooling of ``Compressor._finish`` (before ``finish_row``), for either layout."""
    if lanes == 2:  # frontier layout -> entries: lane A of rows 0..n-1, lane B of rows n..2n-1
        n, hd = kv.shape[1] // 2, kv.shape[2] // 2
        kv = mx.concatenate([kv[:, :n, :hd], kv[:, n:, hd:]], axis=1)
        score = mx.concatenate([score[:, :n, :hd], score[:, n:, hd:]], axis=1)
    pooled = (mx.softmax(score, axis=1) * kv).sum(axis=1)  # [nw, hd]
    c = mx.fast.rms_norm(pooled, norm, eps)
    return apply_rope(c, C, S)


def compressor_emit(
    fr: mx.array, kv_row: mx.array | Cols, score_row: mx.array | Cols, ape: mx.array, at: mx.array, norm: mx.array,
    C: mx.array, S: mx.array, eps: float, *, lanes: int, neg: float, rounding: Any = None,
    out_dtype: mx.Dtype = mx.float32, backend: str | None = None,
) -> tuple[mx.array, mx.array]:  # fmt: skip
    """The decode token that completes a window: :func:`compressor_write` of its row, :func:`compressor_pool`
    of the frontier (``rounding``, ``out_dtype`` as there), then the next frontier (docs/model.md §4.6)
    -> ``(row [1, hd], fr)``.

    ``fr [2, rows, lanes*hd]`` is the frontier, kv then score (:class:`ds4_mlx.model.compressor.CompressorState`).
    The next frontier: with ``lanes=2`` (ratio 4) the finished window's rows ``r..2r-1`` become rows ``0..r-1``
    and rows ``r..`` are empty (kv 0, score ``neg``); with ``lanes=1`` it is all empty. On the GPU one launch.
    """
    out = K.compressor_emit(fr, kv_row, score_row, ape, at, norm, C, S, eps, lanes=lanes, neg=neg, rounding=rounding,
                            out_dtype=out_dtype, backend=_pick(backend))  # fmt: skip
    if out is not None:
        return out
    _, rows, width = fr.shape
    new = compressor_write(fr, kv_row, score_row, ape, at, backend="fallback")
    kv, score = new[0], new[1]
    row = compressor_pool(kv[None], score[None], norm, C, S, eps, lanes=lanes, rounding=rounding,
                          out_dtype=out_dtype, backend="fallback")  # fmt: skip
    empty = (rows // lanes, width)
    nxt_kv, nxt_sc = mx.zeros(empty, mx.float32), mx.full(empty, neg, mx.float32)
    if lanes == 2:  # the finished window becomes the previous one
        nxt_kv, nxt_sc = mx.concatenate([kv[rows // 2 :], nxt_kv]), mx.concatenate([score[rows // 2 :], nxt_sc])
    return row, mx.stack([nxt_kv, nxt_sc])


def compressor_write(
    fr: mx.array, kv_row: mx.array | Cols, score_row: mx.array | Cols, ape: mx.array, at: mx.array, *,
    backend: str | None = None,
) -> mx.array:  # fmt: skip
    """One decode token into its compressor frontier ``fr [2, R, W]`` (kv, then score; docs/model.md §4.6):
    ``kv[at] = kv_row``, ``score[at] = score_row + ape`` -> the new frontier. ``kv_row``, ``score_row`` (each
    ``[1, W]`` or :class:`Cols`) and ``ape`` ``[1, W]`` are f32, ``at`` the frontier row
    (:func:`ds4_mlx.kernels.fused.kernel_index`)."""
    out = K.compressor_write(fr, kv_row, score_row, ape, at, backend=_pick(backend))
    if out is not None:
        return out
    W = fr.shape[2]
    return mx.stack([mx.slice_update(fr[0], cols(kv_row, W), at[:1], axes=(0,)),
                     mx.slice_update(fr[1], cols(score_row, W) + ape, at[:1], axes=(0,))])  # fmt: skip


# --- attention --------------------------------------------------------------------------------------------


def qkv_rows(
    qb: mx.array | Scaled16,
    kvb: mx.array | Cols,
    norm: mx.array,
    C: mx.array,
    S: mx.array,
    eps: float,
    n_head: int,
    *,
    nope_fp8: int = 0,
    f16r: bool = False,
    window: tuple[mx.array, int, mx.dtype] | None = None,
    backend: str | None = None,
) -> tuple[mx.array, mx.array]:
    """Query heads and KV row after their projections (docs/model.md §4.4, §4.12) -> ``q [T, n_head, D]``,
    ``kv [T, D]``.

    ``qb [T, n_head*D]`` (attn_q_b output, float32 or :class:`Scaled16`): per-head RMS norm (no weight), RoPE.
    ``kvb [T, D]`` (attn_kv output; one token's may be :class:`Cols`): RMS norm × ``norm [D]``, RoPE, then the
    FP8 round trip of the first ``nope_fp8`` dims (0: none) and f16 rounding (``f16r``), as ds4 stores the row.
    ``C, S [T, D]``: the tokens' RoPE tables. ``window = (raw, keep, dtype)`` (one token): instead of the row,
    the raw window after it, ``concat(raw[-keep:], row)`` stored as ``dtype``, in the same launch.
    """
    out = K.qkv_rows(qb, kvb, norm, C, S, eps, n_head, nope_fp8=nope_fp8, f16r=f16r, window=window,
                     backend=_pick(backend))  # fmt: skip
    if out is not None:
        return out
    qb = qb.values() if isinstance(qb, Scaled16) else qb
    T, D = qb.shape[0], qb.shape[1] // n_head
    q = apply_rope(mx.fast.rms_norm(qb.reshape(T, n_head, D), None, eps), C[:, None, :], S[:, None, :])
    kv = apply_rope(mx.fast.rms_norm(cols(kvb, D), norm, eps), C, S)
    if nope_fp8:
        kv = fp8_e4m3_round_trip(kv, nope_fp8)
    kv = round_f16(kv) if f16r else kv
    if window is None:
        return q, kv
    raw, keep, dtype = window
    kv = kv.astype(dtype)  # the row is f16-exact with f16r: cast the one row, not the f32 window
    return q, mx.concatenate([raw[raw.shape[0] - keep :].astype(dtype), kv]) if keep else kv


def attend_one(
    q: mx.array,
    raw: mx.array,
    comp: mx.array | None,
    idx: mx.array | None,
    counts: mx.array,
    sinks: mx.array,
    C: mx.array,
    S: mx.array,
    scale: float,
    *,
    nsg: int | None = None,
    backend: str | None = None,
) -> mx.array:
    """One decode token's attention and the inverse RoPE of its output (docs/model.md §4.4) -> ``o [1, H, D]`` f32.

    ``q [1, H, D]`` f32 (RoPE'd); ``raw [Mr, D]``: the raw window, every row visible; ``comp [cap, D]``: the
    compressed-row buffer (raw's dtype, f16 or f32) or None; ``idx [1, k]`` (u)int32: the rows of ``comp`` the
    indexer selected, or None to attend to the first ``counts[1]`` rows; ``counts`` int32 ``[8] = (Mr, rows of
    comp attended, ...)`` (:func:`ds4_mlx.kernels.fused.kernel_counts`), so one compiled step serves every
    token; ``sinks [H]``; ``C, S [1, D]``: the token's RoPE tables; ``scale``: the score scale. ``nsg``: the
    kernel's simdgroups a head (:func:`ds4_mlx.kernels.fused.attend_one`).
    """
    o = K.attend_one(q, raw, comp, idx, counts, sinks, C, S, scale, nsg=nsg, backend=_pick(backend))
    if o is not None:
        return o
    gathered = rows = mask = None
    if idx is not None:
        gathered = comp[idx].astype(mx.float32)  # [1, k, D]
    elif comp is not None:
        rows, mask = comp.astype(mx.float32), mx.arange(comp.shape[0])[None, :] < counts[1]
    o = attend(q, raw.astype(mx.float32), None, rows, gathered, mask, sinks, scale)
    return apply_rope(o, C[:, None, :], S[:, None, :], inverse=True)


# --- indexer ----------------------------------------------------------------------------------------------


def index_query(
    qb: mx.array, C: mx.array, S: mx.array, n_head: int, qat: bool, *, backend: str | None = None
) -> mx.array:
    """The indexer's query heads (docs/model.md §4.7) -> ``[T, n_head, 128]``: RoPE of ``qb [T, n_head*128]``
    (indexer.attn_q_b output) with the tokens' tables ``C, S [T, 128]``, then, with ``qat``, Hadamard-128 and
    the FP4 round trip (``numerics.indexer_qat``)."""
    q = K.index_query(qb, C, S, n_head, qat, backend=_pick(backend))
    if q is not None:
        return q
    q = apply_rope(qb.reshape(qb.shape[0], n_head, HADAMARD_DIM), C[:, None, :], S[:, None, :])
    return indexer_qat(q) if qat else q


def index_scores(
    iq: mx.array, w: mx.array | Cols, keys: mx.array, counts: mx.array, scale: float, *, backend: str | None = None
) -> mx.array:
    """The indexer's scores of one decode token (docs/model.md §4.7) -> ``[1, N]``: ``iq [1, H, D]`` query heads,
    ``w [1, H]`` head weights (or :class:`Cols`; times ``scale``), ``keys [N, D]`` the indexer rows, of which
    the first ``counts[0]`` are scored (``counts`` from :func:`ds4_mlx.kernels.fused.kernel_counts`; the kernel
    writes 0 past them, the fallback scores all)."""
    s = K.index_scores(iq, w, keys, counts, scale, backend=_pick(backend))
    if s is not None:
        return s
    return index_scores_reference(iq, cols(w, iq.shape[1]), keys, scale)


def top_k_rows(scores: mx.array, counts: mx.array, k: int, *, backend: str | None = None) -> mx.array:
    """The ``k`` highest of the first ``counts[0]`` (> k) scores of ``scores [1, N]``, ties to the lower row,
    as row indices ``[1, k]`` in ascending order (what ``select_top_k`` + ``selected_indices`` give).
    ``counts`` int32 ``[8] = (visible rows, k, ...)`` is made on the host
    (:func:`ds4_mlx.kernels.fused.kernel_counts`)."""
    if scores.ndim != 2 or scores.shape[0] != 1:
        raise ValueError(f"top_k_rows: scores must be one token's [1, N], got {tuple(scores.shape)}")
    idx = K.top_k_rows(scores, counts, k, backend=_pick(backend))
    if idx is not None:
        return idx
    visible = mx.arange(scores.shape[1])[None, :] < counts[0]
    scores = mx.where(visible, scores, -mx.inf)  # more than k visible: no -inf is selected
    return selected_indices(select_top_k(scores, np.array([scores.shape[1]]), k), k).astype(mx.int32)


def chunk_top_k(scores: mx.array, first: int, ratio: int, k: int, *, backend: str | None = None) -> mx.array:
    """Per query r of a chunk: the ``k`` highest of its first ``(first + r) // ratio`` scores of ``scores [R, N]``
    (causal visibility; N > k), ties to the lower row, as row indices ``[R, k]``, valid ones first in ascending
    order (what ``select_top_k`` + ``selected_indices`` give; a query seeing at most k rows lists ``0 .. k-1``)."""
    R, N = scores.shape
    idx = K.top_k_rows(scores, K.chunk_top_k_counts(N, k, first, ratio), k, backend=_pick(backend))
    if idx is not None:
        return idx
    n_visible = np.minimum((first + np.arange(R)) // ratio, N)
    return selected_indices(select_top_k(scores, n_visible, k), k).astype(mx.int32)


# --- MoE --------------------------------------------------------------------------------------------------


def moe_route(
    logits: mx.array, bias: mx.array | None, k: int, scale: float, norm: bool, *, packed: bool = False,
    backend: str | None = None,
) -> tuple[mx.array, mx.array | None]:  # fmt: skip
    """Top-k router (docs/model.md §4.8) of ``logits [T, n_expert]`` (ffn_gate_inp output) -> expert ids int32
    ``[T, k]`` by descending ``prob + bias`` (ties to the lower id) and their weights ``[T, k]``: the unbiased
    probs, normalized if ``norm``, times ``scale``; same results as :func:`.ops.route_top_k`. ``packed``: where
    the kernel runs, ``(route, None)`` instead: its one int32 output ``[T, 2k]``, each row the ids then the
    weights' f32 bits, which :func:`experts_with_shared` reads as it is
    (:func:`ds4_mlx.kernels.fused.unpack_route` splits it); the pure-MLX path still returns the two arrays."""
    out = K.moe_route(logits, bias, k, scale, norm, packed=packed, backend=_pick(backend))
    return route_top_k(logits, bias, k, scale, norm) if out is None else out


def expert_swiglu(
    gate: Any, up: Any, x: mx.array, clamp: float, ids: mx.array | None = None, route_w: mx.array | None = None,
    *, backend: str | None = None,
) -> mx.array:  # fmt: skip
    """The experts' clamped SwiGLU (docs/model.md §4.8): ``swiglu(gate·x, up·x, clamp)``, times ``route_w`` if given.

    Dense (the shared expert): ``x [T, E]`` -> ``[T, F]``. Gathered (the routed experts, ``ids [T, k]``, route
    weights ``[T, k]``): -> ``[T, k, F]``. For decode-sized T on the GPU one matvec launch reads both weights and
    applies the activation; same results as :func:`.ops.swiglu` over the two products.
    """
    mid = K.expert_swiglu(gate, up, x, clamp, ids, route_w, backend=_pick(backend))
    if mid is not None:
        return mid
    g, u = (gate.matmul(x), up.matmul(x)) if ids is None else (gate.gather_matmul(x, ids), up.gather_matmul(x, ids))
    mid = swiglu(g, u, clamp)
    return mid if route_w is None else mid * route_w[..., None]


def expert_down_sum(
    down: Any, mid: mx.array, ids: mx.array, add: mx.array | None = None, *, backend: str | None = None
) -> mx.array:
    """The routed experts' down projections summed per token (docs/model.md §4.8): ``mid [T, k, F]``, ``ids [T, k]``
    -> ``sum_j down[ids[t, j]] @ mid[t, j]`` ``[T, E]``, plus ``add [T, E]`` (the shared expert) if given.
    For decode-sized T on the GPU: one matvec launch instead of the gathered product, a reduction and an add."""
    y = K.expert_down_sum(down, mid, ids, add, backend=_pick(backend))
    if y is not None:
        return y
    y = down.gather_matmul(mid, ids).sum(axis=1)
    return y if add is None else y + add


def experts_with_shared(
    gate: Any, up: Any, down: Any, shared_gate_up: Any, shared_down: Any, x: mx.array | Cols, ids: mx.array,
    route_w: mx.array | None, clamp: float, *, xq: mx.array | Cols | None = None, backend: str | None = None,
) -> mx.array | None:  # fmt: skip
    """The whole expert part of the MoE (docs/model.md §4.8) in two matvec launches for decode-sized T on the GPU
    (:func:`ds4_mlx.kernels.fused.experts_with_shared`): the routed experts with ``ids`` and ``route_w`` (or
    :func:`moe_route`'s packed route and None) plus the shared expert, ``shared_gate_up`` its gate rows then its
    up rows; ``xq``: x quantized (:func:`hc_post_pre` ``quantize``). None where the kernels do not apply (the
    caller runs :func:`expert_swiglu` and :func:`expert_down_sum` then)."""
    return K.experts_with_shared(gate, up, down, shared_gate_up, shared_down, x, ids, route_w, clamp, xq=xq,
                                 backend=_pick(backend))  # fmt: skip
