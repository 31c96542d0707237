"""Lightning indexer of ratio-4 layers (docs/model.md §4.7): picks which compressed rows a query attends to.

    iq      = QAT(rope(indexer.attn_q_b @ qr))          [H_i, 128]
    w       = (indexer.proj @ n) / sqrt(128 * H_i)        [H_i]
    score_c = sum_h w_h * relu(K_c . iq_h)               over the visible rows c < (p+1)//4

and the top-k rows by (score descending, index ascending) are selected (:func:`.ops.select_top_k`; in decode
:func:`.fused.top_k_rows`); ds4 breaks ties by the lower index (``indexer_allowed_decode_one()``). MLX
documents no tie order for ``topk``/``argpartition``, so the selection is built from the k-th largest *value*
(a multiset, order-free) plus an explicit cumulative count of the ties. When a query sees ``<= top_k`` rows,
all of them are visible and nothing is scored.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ..backend import kernel_backend
from ..config import ModelConfig
from ..kernels import index_scores_chunk
from ..numerics import Numerics, indexer_rounding
from .compressor import Compressor
from .fused import index_query, index_scores  # kernels on the GPU, MLX on the CPU
from .ops import index_scores_reference
from .rope import Rope


class Indexer:
    """Indexer weights of layer ``il``: its own compressor (128-wide rows) plus the query/weight projections."""

    def __init__(self, cfg: ModelConfig, il: int, weights: dict, numerics: Numerics, rope: Rope):
        self.n_head, self.head_dim, self.top_k = cfg.n_indexer_head, cfg.indexer_head_dim, cfg.indexer_top_k
        self.numerics, self.rope = numerics, rope
        self.wq_b = weights[f"blk.{il}.indexer.attn_q_b.weight"]  # [H_i*128, q_lora]
        self.q_norm, self.eps = weights[f"blk.{il}.attn_q_a_norm.weight"], cfg.rms_eps  # qr = rms(qa) * q_norm
        self.wproj = weights[f"blk.{il}.indexer.proj.weight"]  # [H_i, E]
        self.scale = 1.0 / math.sqrt(self.head_dim * self.n_head)
        self.compressor = Compressor(
            cfg, il, weights, "indexer_compressor", self.head_dim, 4, rope, indexer_rounding(numerics)
        )

    def head_weights(self, n: mx.array) -> mx.array:
        """``indexer.proj @ n`` for the normed input ``n [T, E]`` -> ``[T, H_i]`` (unscaled)."""
        return self.wproj.matmul(n)

    def scores(
        self, qa: mx.array, hw: mx.array, C: mx.array, S: mx.array, keys: mx.array, counts: mx.array | None = None
    ) -> mx.array:
        """``score [T, N]`` of the indexer rows ``keys [N, 128]``; ``qa [T, q_lora]`` the attention's ``attn_q_a n``
        before its norm, ``hw`` = :meth:`head_weights`, ``C, S [T, 128]`` the queries' RoPE tables. Decode
        passes ``counts`` (:func:`ds4_mlx.kernels.fused.kernel_counts`): only the first ``counts[0]`` rows need
        scores, in one fused launch."""
        qb = self.wq_b.matmul_rms(qa, self.q_norm, self.eps)  # indexer.attn_q_b @ qr
        iq = index_query(qb, C, S, self.n_head, self.numerics.indexer_qat)  # [T, H_i, 128]
        if counts is not None:
            return index_scores(iq, hw, keys, counts, self.scale)
        if self.chunk_kernel:
            return index_scores_chunk(iq, hw * self.scale, keys, kernel_backend())  # [T, N]
        return index_scores_reference(iq, hw, keys, self.scale)  # [T, N]

    @property
    def chunk_kernel(self) -> bool:
        """Whether a chunk's scores run as one fused launch (``index_mm``: no [T, H_i, N] head scores in memory).
        Its bf16 tiles hold the FP4-simulated queries and rows exactly, so only with the QAT profile."""
        return self.numerics.indexer_qat and 128 % self.n_head == 0 and kernel_backend() != "fallback"
