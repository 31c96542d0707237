"""Pure-MLX operations that the sublayers run and the graph's fused operations fall back to (:mod:`.fused`).

- :func:`attend`: softmax attention with a sink logit per head (docs/model.md §4.4);
- :func:`index_scores_reference`, :func:`select_top_k`, :func:`selected_indices`: the indexer's scores and its
  top-k rows, ties to the lower row (§4.7);
- :func:`route_top_k`: the top-k router (§4.8) and its parts, :func:`sqrt_softplus`, :func:`topk_lowest_index`
  and :func:`route_weights`;
- :func:`swiglu`: the experts' clamped SwiGLU (§4.8), and :func:`swiglu_host` in numpy.

Prefill runs them as they are; on the kernel backends a decode step runs their fused kernels instead, and the
tests hold those kernels against these functions.
"""

from __future__ import annotations

from functools import lru_cache, partial

import mlx.core as mx
import numpy as np

from .. import host


# --- attention --------------------------------------------------------------------------------------------


def attend(
    q: mx.array, raw: mx.array, raw_mask: np.ndarray | None, comp: mx.array | None, gathered: mx.array | None,
    comp_mask: mx.array | None, sinks: mx.array, scale: float,
) -> mx.array:  # fmt: skip
    """Softmax attention with a per-head sink logit ``sinks [H]`` in the denominator; every key is its own value.

    Keys: ``raw [Mr, D]`` shared by the queries ``q [T, H, D]``, plus either ``comp [Nc, D]`` (shared) or
    ``gathered [T, k, D]`` (per query); the masks are ``[T, Mr]`` and ``[T, Nc or k]`` (``None`` = all visible).
    Returns ``o [T, H, D]`` (before the inverse RoPE). Chunks on the CPU run in numpy (:mod:`ds4_mlx.host`).
    """
    T, H, _ = q.shape
    if host.wanted(T):
        return _attend_host(q, raw, raw_mask, comp, gathered, comp_mask, sinks, scale)
    s = [(q @ raw.T) * scale]  # [T, H, Mr]
    masks = [mx.array(raw_mask) if raw_mask is not None else None]
    if comp is not None:
        s.append((q @ comp.T) * scale)  # [T, H, Nc]
    if gathered is not None:
        s.append((q @ gathered.swapaxes(1, 2)) * scale)  # [T, H, k]
    masks.append(comp_mask)
    logits = [mx.broadcast_to(sinks[None, :, None], (T, H, 1))]
    for part, m in zip(s, masks):
        logits.append(part if m is None else mx.where(m[:, None, :], part, -mx.inf))
    p = mx.softmax(mx.concatenate(logits, axis=-1), axis=-1)  # [T, H, 1+Mr+Nc]; the sink carries no value
    Mr = raw.shape[0]
    o = p[..., 1 : 1 + Mr] @ raw  # [T, H, D]
    if comp is not None:
        o = o + p[..., 1 + Mr :] @ comp
    if gathered is not None:
        o = o + p[..., 1 + Mr :] @ gathered  # [T, H, k] @ [T, k, D]
    return o


def _attend_host(
    q: mx.array, raw: mx.array, raw_mask: np.ndarray | None, comp: mx.array | None, gathered: mx.array | None,
    comp_mask: mx.array | None, sinks: mx.array, scale: float,
) -> mx.array:  # fmt: skip
    """:func:`attend` in numpy, the heads of all queries in one product per key set."""
    T, H, D = q.shape
    extra = [a for a in (comp, gathered, comp_mask) if a is not None]
    q, raw, sinks, *extra = host.to_numpy(q, raw, sinks, *extra)
    comp, gathered, comp_mask = (extra.pop(0) if a is not None else None for a in (comp, gathered, comp_mask))
    q = q * np.float32(scale)
    parts = [(q.reshape(T * H, D) @ raw.T).reshape(T, H, -1)]  # [T, H, Mr]
    masks = [raw_mask]
    if comp is not None:
        parts.append((q.reshape(T * H, D) @ comp.T).reshape(T, H, -1))  # [T, H, Nc]
    if gathered is not None:
        parts.append(q @ gathered.swapaxes(1, 2))  # [T, H, k]
    masks.append(comp_mask)
    parts = [p if m is None else np.where(m[:, None, :], p, -np.inf) for p, m in zip(parts, masks)]
    top = np.maximum(sinks[None, :], np.max([p.max(axis=-1, initial=-np.inf) for p in parts], axis=0))[..., None]
    probs = [np.exp(p - top) for p in parts]
    denom = np.exp(sinks[None, :, None] - top) + sum(p.sum(axis=-1, keepdims=True) for p in probs)
    o = (probs[0].reshape(T * H, -1) @ raw).reshape(T, H, D)
    if comp is not None:
        o += (probs[1].reshape(T * H, -1) @ comp).reshape(T, H, D)
    if gathered is not None:
        o += probs[1] @ gathered  # [T, H, k] @ [T, k, D]
    return mx.array(o / denom)


# --- indexer ----------------------------------------------------------------------------------------------


def index_scores_reference(iq: mx.array, w: mx.array, keys: mx.array, scale: float) -> mx.array:
    """``score [T, N] = sum_h w[t, h] * scale * relu(keys . iq[t, h])`` for ``iq [T, H, D]``, ``w [T, H]``, ``keys [N, D]``."""
    T, H, D = iq.shape
    if host.wanted(T):  # numpy on the CPU (ds4_mlx.host): all heads of all queries in one product
        iq, w, keys = host.to_numpy(iq, w, keys)
        dots = np.maximum((iq.reshape(T * H, D) @ keys.T).reshape(T, H, -1), 0)
        return mx.array(np.einsum("thn,th->tn", dots, w * np.float32(scale)))
    # The head sum as multiply + reduce, not a [1, H] @ [H, N] product: one fused elementwise op and a reduction
    # instead of two ops and a cuBLAS call (~40 µs of host time each on MLX-CUDA).
    return (mx.maximum(iq @ keys.T, 0.0) * (w * scale)[:, :, None]).sum(axis=1)


def select_top_k(scores: mx.array, n_visible: np.ndarray, k: int) -> mx.array:
    """Boolean ``[T, N]``: per query, the top ``k`` of its first ``n_visible[t]`` rows, ties to the lower index.

    Rows beyond ``n_visible`` are never selected; a query with ``n_visible <= k`` gets all its rows.
    """
    T, N = scores.shape
    n_visible = np.asarray(n_visible).reshape(T, 1)
    visible = None
    if n_visible.min() < N:
        scores, visible = _hide_invisible(scores, mx.array(n_visible, dtype=mx.int32))
    if N <= k:
        return visible if visible is not None else mx.ones((T, N), mx.bool_)
    kth = mx.topk(scores, k, axis=-1).min(axis=-1, keepdims=True)  # k-th largest value: order-free   [T, 1]
    sel = _top_with_ties(scores, kth, mx.array(k, dtype=mx.int32))
    return sel if visible is None else sel & visible


@partial(mx.compile, shapeless=True)
def _hide_invisible(scores: mx.array, n_visible: mx.array) -> tuple[mx.array, mx.array]:
    """Scores of rows ``c >= n_visible`` set to -inf; also returns the visibility mask."""
    c = mx.cumsum(mx.ones_like(scores, dtype=mx.int32), axis=-1) - 1  # row index (shapeless-friendly arange)
    visible = c < n_visible
    return mx.where(visible, scores, -mx.inf), visible


@partial(mx.compile, shapeless=True)
def _top_with_ties(scores: mx.array, kth: mx.array, k: mx.array) -> mx.array:
    """Everything above the k-th largest value, plus the lowest-index ties that still fit."""
    above = scores > kth
    tie = scores == kth
    need = k - above.sum(axis=-1, keepdims=True)  # how many ties still fit
    return above | (tie & (mx.cumsum(tie.astype(mx.int32), axis=-1) <= need))


def selected_indices(mask: mx.array, k: int) -> mx.array:
    """The ``k`` selected row indices of a ``[T, N]`` mask with exactly ``k`` True per row, ascending."""
    N = mask.shape[-1]
    c = mx.arange(N)[None, :]
    key = mx.where(mask, c, N + c)  # distinct keys: the selected rows are the k smallest
    return mx.sort(mx.argpartition(key, k - 1, axis=-1)[:, :k], axis=-1)


# --- MoE --------------------------------------------------------------------------------------------------

ROUTE_SUM_FLOOR = 6.103515625e-5  # ds4's floor on the sum of the selected probabilities (2^-14)
RANK_MAX_ELEMS = 1 << 25  # largest [T, N, N] comparison block of the top-k selection


@mx.compile
def sqrt_softplus(x: mx.array) -> mx.array:
    """``sqrt(softplus(x))`` with ds4's thresholds: softplus(x) = x if x > 20, exp(x) if x < -20."""
    sp = mx.where(x > 20.0, x, mx.where(x < -20.0, mx.exp(x), mx.log1p(mx.exp(mx.minimum(x, 20.0)))))
    return mx.sqrt(sp)


@lru_cache(maxsize=None)
def _iota(n: int) -> mx.array:
    """``0..n-1`` made on the host: a constant of a compiled step, not an op in every replay."""
    return mx.array(np.arange(n, dtype=np.int32))


@mx.compile
def _ranks(scores: mx.array, idx: mx.array) -> mx.array:
    """Rank of every entry of ``scores [T, N]`` in (score descending, index ascending) order: ``[T, N]``;
    ``idx`` is ``0..N-1``."""
    this, other = scores[:, :, None], scores[:, None, :]  # [T, N, 1], [T, 1, N]
    beats = (other > this) | ((other == this) & (idx[None, :] < idx[:, None]))  # [T, N, N]: e' ahead of e
    return beats.astype(mx.int32).sum(axis=-1)  # a permutation of 0..N-1 per row


def topk_lowest_index(scores: mx.array, k: int) -> mx.array:
    """Indices of the k largest ``scores [T, N]`` -> int32 ``[T, k]``, by descending score.

    Ties go to the lower index, as ds4's ``topk_desc()`` does (repeated strict-``>`` arg-max). MLX
    documents no tie order for ``topk``/``argsort``, so the order is made explicit: each entry's rank
    counts the entries ahead of it (higher score, or equal score and lower index). The ranks are
    distinct, so sorting them is unambiguous. (O(N²) per token, a few kernels: N = 256 experts.)
    """
    T, N = scores.shape
    step = max(1, RANK_MAX_ELEMS // (N * N))  # bound the [T, N, N] comparison tensor in long prefills
    ranks = [_ranks(scores[i : i + step], _iota(N)) for i in range(0, T, step)]
    ranks = ranks[0] if len(ranks) == 1 else mx.concatenate(ranks)
    return mx.argsort(ranks, axis=-1)[:, :k].astype(mx.int32)


def route_weights(prob_sel: mx.array, scale: float, norm: bool) -> mx.array:
    """Route weights from the selected unbiased probabilities ``[T, k]`` (§4.8 step 5)."""
    if norm:
        prob_sel = prob_sel / mx.maximum(prob_sel.sum(axis=-1, keepdims=True), ROUTE_SUM_FLOOR)
    return prob_sel * scale


def route_top_k(
    logits: mx.array, bias: mx.array | None, k: int, scale: float, norm: bool
) -> tuple[mx.array, mx.array]:
    """Top-k routing of ``logits [T, n_expert]`` -> (expert ids int32 ``[T, k]``, weights ``[T, k]``): the
    bias shifts the selection only (§4.8). The pure-MLX oracle of the fused ``moe_route`` kernel."""
    prob = sqrt_softplus(logits)  # [T, n_expert]
    sel = topk_lowest_index(prob if bias is None else prob + bias, k)  # [T, k]
    return sel, route_weights(mx.take_along_axis(prob, sel, axis=-1), scale, norm)


@mx.compile
def _swiglu_clamped(g: mx.array, u: mx.array, lo: mx.array, hi: mx.array) -> mx.array:
    g = mx.minimum(g, hi)
    u = mx.clip(u, lo, hi)
    return g * mx.sigmoid(g) * u


def swiglu_host(g: np.ndarray, u: np.ndarray, clamp: float) -> np.ndarray:
    """:func:`swiglu` in numpy (:mod:`ds4_mlx.host`)."""
    if clamp > 0:
        g, u = np.minimum(g, np.float32(clamp)), np.clip(u, np.float32(-clamp), np.float32(clamp))
    return g * host.sigmoid(g) * u


@lru_cache(maxsize=None)
def _scalar(v: float) -> mx.array:
    return mx.array(v, dtype=mx.float32)


def swiglu(g: mx.array, u: mx.array, clamp: float) -> mx.array:
    """``silu(min(g, c)) * clamp(u, -c, c)`` (ds4 ``swiglu()``, applied to routed and shared experts)."""
    if clamp > 0:
        # -c is a host constant too: negated inside, it would be one more launch in every compiled step
        return _swiglu_clamped(g, u, _scalar(-float(clamp)), _scalar(float(clamp)))
    return g * mx.sigmoid(g) * u
