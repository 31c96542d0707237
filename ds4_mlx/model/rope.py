"""ds4's partial RoPE: interleaved pairs on the LAST ``n_rot`` dims of a vector, YaRN on compressed layers.

docs/model.md §4.5 (``rope_tail_ext_inplace()``, ``rope_tail_layer_inplace()``). For pair ``k`` at position ``p``:

    theta_extrap_k = p * base^(-2k/n_rot)                      (f32)
    theta_interp_k = freq_scale * theta_extrap_k
    theta_k        = theta_interp_k * (1 - ramp_k) + theta_extrap_k * ramp_k     (YaRN layers)
    ramp_k         = 1 - clamp((k - low) / max(0.001, high - low), 0, 1)

and ``(t[2k], t[2k+1]) <- (t[2k] c - t[2k+1] s, t[2k] s + t[2k+1] c)`` with ``c, s = cos, sin(theta_k)``
(the inverse rotation negates ``s``). The YaRN magnitude is exactly 1.0 in f32, so none is applied.

Positions are Python ints known on the host, so the angle tables are computed in NumPy with ds4's f32
arithmetic (optionally its CPU angle recurrence) and cached; the rotation itself is a few MLX ops over the
whole head: ``x * C + swap_pairs(x) * S`` with ``C = 1, S = 0`` on the untouched leading dims.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property, lru_cache

import mlx.core as mx
import numpy as np

from ..config import ModelConfig
from ..kernels.fused import resident, stream_key


@dataclass(frozen=True)
class Rope:
    """One layer's RoPE parameters (ratio-0 layers: plain RoPE; compressed layers: compress base + YaRN)."""

    n_rot: int
    base: float
    freq_scale: float = 1.0
    yarn: bool = False
    corr_low: float = 0.0
    corr_high: float = 0.0
    recurrence: bool = False  # ds4 CPU: t_0 = p, t_{k+1} = t_k * powf(base, -2/n_rot), all in f32

    @classmethod
    def for_layer(cls, cfg: ModelConfig, il: int, recurrence: bool = False) -> "Rope":
        if cfg.compress_ratio(il) == 0:
            return cls(n_rot=cfg.n_rot, base=cfg.rope_freq_base, recurrence=recurrence)
        base = cfg.compress_rope_freq_base
        low, high = yarn_corr_dims(cfg.n_rot, cfg.rope_orig_ctx, base, cfg.yarn_beta_fast, cfg.yarn_beta_slow)
        return cls(
            n_rot=cfg.n_rot,
            base=base,
            freq_scale=1.0 / cfg.rope_scaling_factor,
            yarn=True,
            corr_low=low,
            corr_high=high,
            recurrence=recurrence,
        )

    # --- angles (host side) -----------------------------------------------------------------------------

    def ramp(self) -> np.ndarray:
        """YaRN blend weight per pair (1 = original frequency, 0 = fully interpolated), float32."""
        k = np.arange(self.n_rot // 2, dtype=np.float32)
        y = (k - np.float32(self.corr_low)) / np.float32(max(0.001, self.corr_high - self.corr_low))
        return (1.0 - np.clip(y, 0.0, 1.0)).astype(np.float32)

    def angles(self, positions) -> np.ndarray:
        """``theta [len(positions), n_rot/2]`` in float32, computed the way ds4 does."""
        p = np.asarray(positions, dtype=np.float32).reshape(-1, 1)
        half = self.n_rot // 2
        if self.recurrence:
            ts = np.float32(math.pow(self.base, -2.0 / self.n_rot))
            steps = np.concatenate([p, np.full((p.shape[0], half - 1), ts, np.float32)], axis=1)
            extrap = np.multiply.accumulate(steps, axis=1, dtype=np.float32)  # sequential f32 products
        else:
            inv = (self.base ** (-2.0 * np.arange(half) / self.n_rot)).astype(np.float32)
            extrap = p * inv  # f32
        if not self.yarn:
            return (extrap * np.float32(self.freq_scale)).astype(np.float32)
        ramp = self.ramp()
        interp = extrap * np.float32(self.freq_scale)
        return (interp * (np.float32(1.0) - ramp) + extrap * ramp).astype(np.float32)

    def tables(self, positions, head_dim: int) -> tuple[mx.array, mx.array]:
        """Full-head rotation tables ``C, S [len(positions), head_dim]`` (1 and 0 on the leading dims).

        ``S`` holds ``-sin`` on even and ``+sin`` on odd rope dims, so ``x*C + swap_pairs(x)*S`` rotates.
        Cached by (params, positions, head_dim): every layer of a kind reuses one table per step.
        """
        p = np.asarray(positions, dtype=np.int64).reshape(-1)
        if p.size == 1:
            return self.row(int(p[0]), head_dim)
        key = (self, _positions_key(p), head_dim)
        hit = _TABLES.get(key)
        if hit is not None:
            _TABLES.move_to_end(key)
            return hit
        out = _TABLES[key] = tuple(mx.array(t) for t in self._host_tables(p, head_dim))
        if len(_TABLES) > _TABLES_MAX:
            _TABLES.popitem(last=False)
        return out

    def row(self, pos: int, head_dim: int) -> tuple[mx.array, mx.array]:
        """The tables of one position ``[1, head_dim]`` each (decode): a row of a block of DECODE_BLOCK
        positions' tables, made once and kept on the device (``resident``), so a step brings no new host data
        to the GPU. A decode step asks every layer for its rows: the lookup is keyed by small ints (a Rope
        hashes all its fields), and equal Ropes share the rows."""
        # the rows (and, on CUDA, the blocks) are lazy ops of the stream they were made on, which only its own
        # thread may run (MLX streams are per thread): a row made in one thread must not serve another
        stream = stream_key()
        key = (self._id, pos, head_dim, stream)
        hit = _ROWS.get(key)
        if hit is None:
            if len(_ROWS) >= _ROWS_MAX:
                _ROWS.clear()
            b, i = divmod(pos, DECODE_BLOCK)
            C, S = self._block(b, head_dim, stream)
            hit = _ROWS[key] = (C[i : i + 1], S[i : i + 1])
        return hit

    @cached_property
    def _id(self) -> int:
        return _ROPE_IDS.setdefault(self, len(_ROPE_IDS))

    @lru_cache(maxsize=32)
    def _block(self, block: int, head_dim: int, stream: str) -> tuple[mx.array, mx.array]:
        p = block * DECODE_BLOCK + np.arange(DECODE_BLOCK)
        return tuple(resident(mx.array(t)) for t in self._host_tables(p, head_dim))

    def _host_tables(self, positions: np.ndarray, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        theta = self.angles(positions).astype(np.float64)  # [T, n_rot/2]
        cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
        T, lead = theta.shape[0], head_dim - self.n_rot
        C = np.ones((T, head_dim), np.float32)
        S = np.zeros((T, head_dim), np.float32)
        C[:, lead::2], C[:, lead + 1 :: 2] = cos, cos
        S[:, lead::2], S[:, lead + 1 :: 2] = -sin, sin
        return C, S


_TABLES: "OrderedDict[tuple, tuple[mx.array, mx.array]]" = OrderedDict()
_TABLES_MAX = 64
_ROWS: dict[tuple[int, int, int], tuple[mx.array, mx.array]] = {}
_ROWS_MAX = 4096
_ROPE_IDS: dict["Rope", int] = {}
DECODE_BLOCK = 256  # positions per decode table block


def _positions_key(p: np.ndarray) -> tuple:
    if p.size > 1 and np.all(np.diff(p) == p[1] - p[0]):
        return ("range", int(p[0]), int(p[1] - p[0]), int(p.size))  # arithmetic progressions: O(1) key
    return ("list", p.tobytes())


def yarn_corr_dims(n_rot: int, orig_ctx: int, base: float, beta_fast: float, beta_slow: float) -> tuple[float, float]:
    """ggml/ds4 ``rope_yarn_corr_dims()``: ``low = max(0, floor(corr(beta_fast)))``, ``high = min(n-1, ceil(corr(beta_slow)))``."""

    def corr(b: float) -> float:
        return n_rot * math.log(orig_ctx / (b * 2 * math.pi)) / (2 * math.log(base))

    return max(0.0, math.floor(corr(beta_fast))), min(n_rot - 1.0, math.ceil(corr(beta_slow)))


def swap_pairs(x: mx.array) -> mx.array:
    """``(x0, x1, x2, x3, ...) -> (x1, x0, x3, x2, ...)`` along the last axis."""
    shape = x.shape
    return x.reshape(*shape[:-1], shape[-1] // 2, 2)[..., ::-1].reshape(shape)


@mx.compile
def _rotate(x: mx.array, C: mx.array, S: mx.array) -> mx.array:
    return x * C + swap_pairs(x) * S


@mx.compile
def _rotate_inverse(x: mx.array, C: mx.array, S: mx.array) -> mx.array:
    return x * C - swap_pairs(x) * S


def apply_rope(x: mx.array, C: mx.array, S: mx.array, inverse: bool = False) -> mx.array:
    """Rotate the last ``n_rot`` dims of ``x [..., head_dim]`` with tables broadcastable to ``x``.

    ``inverse`` negates the angle (ds4's inverse RoPE of the attention output). Compiled: one fused kernel.
    """
    return _rotate_inverse(x, C, S) if inverse else _rotate(x, C, S)
