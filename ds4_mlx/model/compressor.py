"""KV compressor (docs/model.md §4.6): gated softmax pooling of every ``r`` tokens into one cached row.

The same algorithm serves the attention compressor (``attn_compressor_*``, ``hd = head_dim``) and the
indexer compressor (``indexer_compressor_*``, ``hd = indexer_head_dim``). Ratio-4 layers use two
overlapping lanes (``coff = 2``): a window's row pools lane A of the previous window's 4 tokens together
with lane B of its own 4 tokens; ratio-R layers pool their R tokens (``coff = 1``).

The frontier keeps ds4's layout (``compressor_decode_one()``): ``kv``/``score`` ``[coff*r, coff*hd]`` in f32;
for ratio 4 rows 0..3 hold the previous complete window and rows 4..7 the current one, for ratio R rows
0..R-1 hold the current window. Unwritten rows are kv = 0, score = NEG (ds4's canonical state).

A chunk of T tokens is processed in one go: the partial window in the frontier is prepended to the
chunk's rows, every window completed inside the chunk is pooled at once, and the remainder becomes the
new frontier. T = 1 (decode) writes its row in place of the frontier (``slice_update``) and pools only
when it completes a window; both paths leave the same canonical frontier.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..kernels import Cols
from ..kernels.fused import kernel_index, resident
from ..numerics import RowRounding
from ..weights import QuantWeight
from .fused import compressor_emit, compressor_pool, compressor_write
from .rope import Rope


@lru_cache(maxsize=1 << 16)
def index_array(i: int) -> mx.array:
    """``int32 [1]`` holding ``i``: a position-dependent index passed into a (compiled) decode step (cached)."""
    return resident(mx.array([i], dtype=mx.int32))


NEG = -1.0e30  # ds4's "minus infinity" for scores


@dataclass(frozen=True)
class CompressorState:
    """The f32 frontier of one compressor (never rounded): its kv and score rows, ``[coff*r, coff*hd]`` each,
    as one array ``fr [2, coff*r, coff*hd]``, which the decode kernels read and write whole (one output array
    a launch instead of two)."""

    fr: mx.array

    @classmethod
    def of(cls, kv: mx.array, score: mx.array) -> "CompressorState":
        return cls(mx.stack([kv, score]))

    @classmethod
    def init(cls, ratio: int, hd: int) -> "CompressorState":
        coff = 2 if ratio == 4 else 1
        shape = (coff * ratio, coff * hd)
        return cls.of(mx.zeros(shape, mx.float32), mx.full(shape, NEG, mx.float32))

    @property
    def kv(self) -> mx.array:
        return self.fr[0]

    @property
    def score(self) -> mx.array:
        return self.fr[1]

    @property
    def nbytes(self) -> int:
        return self.fr.nbytes


class Compressor:
    """One compressor's weights and its step; ``prefix`` is ``"attn_compressor"`` or ``"indexer_compressor"``."""

    def __init__(
        self,
        cfg: ModelConfig,
        il: int,
        weights: dict,
        prefix: str,
        hd: int,
        ratio: int,
        rope: Rope,
        rounding: RowRounding | None = None,
        out_dtype: mx.Dtype = mx.float32,
    ):
        self.ratio, self.hd = ratio, hd
        self.coff = 2 if ratio == 4 else 1
        self.width = self.coff * hd
        self.eps = cfg.rms_eps
        self.rope = rope
        self.rounding = rounding  # how ds4 stores a finished row (FP8 or QAT, then f16r), as the profile says
        self.out_dtype = out_dtype  # the finished rows' type: their cache's
        p = f"blk.{il}.{prefix}"
        # kv and gate rows stacked: both project the same input, so one matvec gives both [2*coff*hd, E]
        self.wkv_gate = QuantWeight.stack_rows([weights[f"{p}_kv.weight"], weights[f"{p}_gate.weight"]])
        self.ape = weights[f"{p}_ape.weight"].dequantize()  # [r, coff*hd] f32, dequantized once
        self.norm = weights[f"{p}_norm.weight"]  # [hd]
        if tuple(self.ape.shape) != (ratio, self.width):
            raise ValueError(f"{p}_ape: shape {self.ape.shape}, expected {(ratio, self.width)}")
        self._ape_row = [self.ape[i : i + 1] for i in range(ratio)]  # decode's per-position rows, ready-made
        mx.eval(self._ape_row)

    def init_state(self) -> CompressorState:
        return CompressorState.init(self.ratio, self.hd)

    def project(self, n: mx.array) -> tuple[mx.array, mx.array]:
        """``n [T, E]`` -> its kv rows and gate scores (before APE), ``[T, coff*hd]`` each."""
        y = self.wkv_gate.matmul(n)  # [T, 2w]
        return y[:, : self.width], y[:, self.width :]

    def project_one(self, n: mx.array) -> tuple[Cols, Cols]:
        """:meth:`project` of one token, as columns of the one projection row (the kernels read them in place)."""
        y = self.wkv_gate.matmul(n)  # [1, 2w]
        return Cols(y, 0), Cols(y, self.width)

    def __call__(self, n: mx.array, pos: int, state: CompressorState) -> tuple[mx.array | None, CompressorState]:
        """Feed ``n [T, E]`` (attn-normed inputs at positions ``pos..pos+T-1``).

        Returns ``(rows, new_state)``: ``rows [nw, hd]`` are the finished rows of the windows completed in
        this chunk (in order; ``None`` if none), already normed, RoPE'd at their window start and rounded.
        """
        r, w = self.ratio, self.width
        T = n.shape[0]
        if T == 1:
            io = self.decode_inputs(pos)
            row, fr = self.decode(self.project_one(n), state.fr, io, complete=(pos + 1) % r == 0)
            return row, CompressorState(fr)
        kv_cur, sc_cur = self.project(n)  # [T, w] each
        sc_cur = sc_cur + self._ape_rows(pos, T)

        cur0 = r if self.coff == 2 else 0  # first frontier row of the current window
        k = pos % r  # tokens of the current window already in the frontier
        seq_kv = mx.concatenate([state.kv[cur0 : cur0 + k], kv_cur]) if k else kv_cur  # [k+T, w]
        seq_sc = mx.concatenate([state.score[cur0 : cur0 + k], sc_cur]) if k else sc_cur
        nw = (pos + T) // r - pos // r  # windows completed inside this chunk

        rows = None
        if nw:
            win_kv = seq_kv[: nw * r].reshape(nw, r, w)
            win_sc = seq_sc[: nw * r].reshape(nw, r, w)
            if self.coff == 2:
                # frontier layout per window: the previous window's rows (lane A is read) + its own (lane B)
                prev_kv = mx.concatenate([state.kv[None, :r], win_kv[:-1]]) if nw > 1 else state.kv[None, :r]
                prev_sc = mx.concatenate([state.score[None, :r], win_sc[:-1]]) if nw > 1 else state.score[None, :r]
                ent_kv = mx.concatenate([prev_kv, win_kv], axis=1)  # [nw, 2r, 2hd]
                ent_sc = mx.concatenate([prev_sc, win_sc], axis=1)
            else:
                ent_kv, ent_sc = win_kv, win_sc  # [nw, r, hd]
            rows = self._finish(ent_kv, ent_sc, (pos // r + np.arange(nw)) * r)  # RoPE at each window start

        rem = (pos + T) % r  # tokens of the new partial window
        cur_kv, cur_sc = seq_kv[nw * r :], seq_sc[nw * r :]  # [rem, w]
        cur_kv = mx.concatenate([cur_kv, mx.zeros((r - rem, w), mx.float32)])  # unwritten rows: 0 / NEG
        cur_sc = mx.concatenate([cur_sc, mx.full((r - rem, w), NEG, mx.float32)])
        if self.coff == 2:
            prev_kv = win_kv[-1] if nw else state.kv[:r]
            prev_sc = win_sc[-1] if nw else state.score[:r]
            cur_kv = mx.concatenate([prev_kv, cur_kv])
            cur_sc = mx.concatenate([prev_sc, cur_sc])
        return rows, CompressorState.of(cur_kv, cur_sc)

    def decode_inputs(self, pos: int) -> dict[str, mx.array]:
        """Host-side arrays of the decode step at ``pos`` (so :meth:`decode` never sees ``pos`` itself).

        ``at``: the token's frontier row; ``ape``: its APE row ``[1, w]`` (``pos mod r``); ``C``/``S``: RoPE tables at
        the window start, used when the token completes the window.
        """
        r, k = self.ratio, pos % self.ratio
        C, S = self.rope.row(max(pos + 1 - r, 0), self.hd)
        return {"at": kernel_index(k + (r if self.coff == 2 else 0)), "ape": self._ape_row[k], "C": C, "S": S}

    def decode(
        self, proj: tuple[mx.array | Cols, mx.array | Cols], fr: mx.array, io: dict[str, mx.array], complete: bool
    ) -> tuple[mx.array | None, mx.array]:
        """One token, given as its projections ``proj = (kv, gate)``, ``[1, w]`` each or :class:`Cols`
        (:meth:`project_one`): write it into its frontier row; pool when it ``complete``s a window.

        A pure function of arrays (the frontier ``fr``, :attr:`CompressorState.fr`, and ``io`` from
        :meth:`decode_inputs`), so a decode step can be compiled; same math as the chunked path. Returns
        ``(row [1, hd] or None, new frontier)``.
        """
        kv_row, score_row = proj
        if not complete:
            return None, compressor_write(fr, kv_row, score_row, io["ape"], io["at"])  # [2, coff*r, w]
        # Write, pool the frontier (one window's entries), and the next frontier: the finished window becomes
        # "previous" (ratio 4) and the new current one is empty.
        return compressor_emit(fr, kv_row, score_row, io["ape"], io["at"], self.norm, io["C"], io["S"],
                               self.eps, lanes=self.coff, neg=NEG, rounding=self.rounding,
                               out_dtype=self.out_dtype)  # fmt: skip

    def _finish(self, ent_kv: mx.array, ent_sc: mx.array, starts) -> mx.array:
        """Pool finished windows, norm, RoPE at the window starts, round -> ``[nw, hd]``.

        ``ent_kv``/``ent_sc``: ``[nw, r, hd]`` (ratio R) or, for ratio 4, ``[nw, 2r, 2hd]`` in frontier layout:
        the softmax runs over lane A (first hd columns) of rows 0..r-1 and lane B (last hd) of rows r..2r-1.
        ``compressor_pool`` is the fused GPU kernel; on the fallback backend it is the pure-MLX
        ``softmax -> weighted sum -> rms_norm -> apply_rope``.
        """
        C, S = self.rope.tables(starts, self.hd)
        return compressor_pool(ent_kv, ent_sc, self.norm, C, S, self.eps, lanes=self.coff, rounding=self.rounding,
                               out_dtype=self.out_dtype)  # fmt: skip

    def _ape_rows(self, pos: int, T: int) -> mx.array:
        """``ape[p mod r]`` for p in pos..pos+T-1 -> ``[T, w]``."""
        r = self.ratio
        if T == 1:
            return self.ape[pos % r : pos % r + 1]
        if pos % r == 0 and T % r == 0:
            return mx.tile(self.ape, (T // r, 1))
        return self.ape[mx.array((pos + np.arange(T)) % r, dtype=mx.int32)]
