"""Manifold-constrained hyper-connections (mHC): HC pre, HC post and the output HC head.

The residual state of every token is ``n_hc`` streams of width ``n_embd`` (docs/model.md §4.2). Each
sublayer collapses them into one input with HC *pre* (§4.3) and expands its output back with HC
*post* (§4.9); the final state is collapsed once more by the output HC head (§4.10).

These are the pure-MLX versions, vectorized over T tokens: the fallback and the oracle of the fused
hyper-connection kernels (:mod:`.fused`), so they keep small, explicit signatures.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from ..config import ModelConfig


def _sinkhorn(logits: mx.array, n_iter: int, eps: float) -> mx.array:
    """Project ``logits [..., n, n]`` onto (nearly) doubly-stochastic matrices, ds4's way.

    Row softmax + eps, column normalize, then ``n_iter - 1`` row/column passes, each dividing by
    ``sum + eps`` (``hc_split_sinkhorn_one()``; transformers ``DeepseekV4HyperConnection``).
    ds4 multiplies by the reciprocal of the sum; we do the same.
    """
    c = mx.softmax(logits, axis=-1) + eps  # row softmax, max-subtracted inside
    c = c * (1.0 / (c.sum(axis=-2, keepdims=True) + eps))  # columns
    for _ in range(n_iter - 1):
        c = c * (1.0 / (c.sum(axis=-1, keepdims=True) + eps))  # rows
        c = c * (1.0 / (c.sum(axis=-2, keepdims=True) + eps))  # columns
    return c


def _mix(S: mx.array, fn: Any, rms_eps: float) -> mx.array:
    """``fn @ RMSNorm_noweight(flatten(S))``: S [T, n_hc, E] -> [T, n_mix] (f32, no act. quant)."""
    T = S.shape[0]
    flat = mx.fast.rms_norm(S.reshape(T, -1), None, rms_eps)  # [T, n_hc*E]
    return fn.matmul(flat)  # [T, n_mix]


def _split_gates(
    m: mx.array, scale: mx.array, base: mx.array, n_hc: int, n_iter: int, hc_eps: float
) -> tuple[mx.array, mx.array, mx.array]:
    """Mixing vector ``m [T, 2n+n²]`` -> (pre [T,n], post [T,n], comb [T,n,n]) per §4.3 steps 3–7."""
    T = m.shape[0]
    pre = mx.sigmoid(m[:, :n_hc] * scale[0] + base[:n_hc]) + hc_eps  # [T, n]
    post = 2.0 * mx.sigmoid(m[:, n_hc : 2 * n_hc] * scale[1] + base[n_hc : 2 * n_hc])  # [T, n]
    logits = m[:, 2 * n_hc :] * scale[2] + base[2 * n_hc :]  # [T, n*n], row-major C[r][c]
    comb = _sinkhorn(logits.reshape(T, n_hc, n_hc), n_iter, hc_eps)  # [T, n, n]
    return pre, post, comb


_split_gates_compiled = mx.compile(_split_gates)


def hc_pre(
    S: mx.array, fn: Any, scale: mx.array, base: mx.array, cfg: ModelConfig
) -> tuple[mx.array, mx.array, mx.array]:
    """HC pre (docs/model.md §4.3): collapse the streams into one sublayer input.

    Args:
        S: stream state ``[T, n_hc, E]`` f32.
        fn: mixing weight ``[2n+n², n*E]`` (a ``QuantWeight``, F16 in the GGUF; anything with ``.matmul``).
        scale: ``[3]`` f32 (pre, post, comb scales). base: ``[2n+n²]`` f32.
    Returns:
        ``x [T, E]`` (sublayer input), ``post [T, n_hc]`` and ``comb [T, n_hc, n_hc]`` for :func:`hc_post`.
    """
    m = _mix(S, fn, cfg.rms_eps)  # [T, 24]
    pre, post, comb = _split_gates_compiled(m, scale, base, cfg.n_hc, cfg.n_sinkhorn_iter, cfg.hc_eps)
    x = (pre[:, None, :] @ S).squeeze(1)  # [T,1,n] @ [T,n,E] -> [T, E] = sum_h pre[h] S[h]
    return x, post, comb


def hc_post(S: mx.array, y: mx.array, post: mx.array, comb: mx.array) -> mx.array:
    """HC post (docs/model.md §4.9): ``S_new[c] = post[c] * y + sum_r comb[r][c] * S[r]``.

    S ``[T, n_hc, E]`` is the state that went into the matching :func:`hc_pre`; y ``[T, E]`` the
    sublayer output. Returns the new state ``[T, n_hc, E]``.
    """
    return post[:, :, None] * y[:, None, :] + mx.swapaxes(comb, -1, -2) @ S  # [T, n, E]


def hc_head(S: mx.array, fn: Any, scale: mx.array, base: mx.array, cfg: ModelConfig) -> mx.array:
    """Output HC head (docs/model.md §4.10 steps 1–3): collapse the final streams ``[T, n_hc, E]`` -> ``[T, E]``.

    ``fn [n_hc, n_hc*E]`` (F16), ``scale [1]``, ``base [n_hc]``. The output norm and LM head follow.
    """
    m = _mix(S, fn, cfg.rms_eps)  # [T, n_hc]
    w = mx.sigmoid(m * scale[0] + base) + cfg.hc_eps  # [T, n_hc]
    return (w[:, None, :] @ S).squeeze(1)  # [T, E]
