"""Device memory limits: how much MLX keeps in its buffer cache, and (Metal) how much it keeps wired.

MLX keeps freed buffers for reuse. Unbounded, that cache grows with every chunk's transients: on an H200 a 32K
prefill of the full model left the process holding 138.7 of 140 GiB, of which ~87 GB were weights. On a
128 GB Mac the same would swap. :func:`set_memory_limits` bounds the cache (by default a share of the
weights' size, at most 4 GiB) and, on Metal, wires the weights and the KV state so macOS does not page them out.
:func:`plan_sessions` sizes the server's live sessions (``serve --batched-session``) from the same estimates
ds4-bench checks its context against (:func:`kv_bytes_estimate`, :func:`available_memory`).
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass

import mlx.core as mx

from .config import ModelConfig

GiB = 1 << 30
#: Default cache limit: this share of the weights' bytes, between CACHE_MIN and CACHE_MAX.
CACHE_SHARE = 0.05
CACHE_MIN, CACHE_MAX = GiB // 4, 4 * GiB
#: Wired on top of the weights and the KV state (Metal): room for a chunk's transients.
WIRED_MARGIN = 2 * GiB
# Prefill scratch beyond the KV state and the weights, per token of a chunk: the HC streams and their
# mixes, the routed experts' activations and one row of logits, all f32 with a few live copies each. On the
# H200 (43 layers, q2) a 32K prompt's chunks of 2048 / 4096 / 8192 took MLX's peak 5.6 / 8.2 / 15.5 GB past
# the weights and the KV state; this estimate gives 6.0 / 9.8 / 17.5 GB.
_SCRATCH_COPIES = 11
# Attention score blocks (attention.ATTN_BLOCK_BYTES) with their softmax copies, plus allocator slack.
_SCRATCH_FIXED = 2 << 30
#: Most live sessions ``serve`` picks by itself (a ``--batched-session`` count of 0): the decode kernels take up
#: to 8 tokens a launch.
AUTO_SESSIONS_MAX = 8


@dataclass(frozen=True)
class MemoryLimits:
    """What :func:`set_memory_limits` applied, in bytes (``wired`` None where the backend has no wired limit)."""

    cache: int
    wired: int | None

    def describe(self) -> str:
        wired = "" if self.wired is None else f", wired limit {self.wired / GiB:.1f} GiB"
        return f"buffer cache limit {self.cache / GiB:.2f} GiB{wired}"


def default_cache_limit(weights_bytes: int) -> int:
    """The buffer cache limit for a model of ``weights_bytes``: :data:`CACHE_SHARE` of it, clamped."""
    return int(min(max(CACHE_SHARE * weights_bytes, CACHE_MIN), CACHE_MAX))


def default_wired_limit(weights_bytes: int, kv_bytes: int = 0) -> int | None:
    """Metal: the weights, the KV state and :data:`WIRED_MARGIN`, at most the device's recommended working set.
    None elsewhere."""
    if not mx.metal.is_available():
        return None
    want = weights_bytes + kv_bytes + WIRED_MARGIN
    cap = mx.device_info().get("max_recommended_working_set_size") if hasattr(mx, "device_info") else None
    return int(min(want, cap)) if isinstance(cap, int) and cap > 0 else int(want)


def set_memory_limits(weights_bytes: int, kv_bytes: int = 0, *, cache_gb: float | None = None,
                      wired_gb: float | None = None) -> MemoryLimits:  # fmt: skip
    """Bound MLX's buffer cache (``cache_gb``, default :func:`default_cache_limit`; 0 keeps no cache) and, on Metal,
    set the wired limit (``wired_gb``, default :func:`default_wired_limit`). Returns what was applied."""
    if cache_gb is not None and not cache_gb >= 0:
        raise ValueError(f"the cache limit must be >= 0 GB, got {cache_gb}")
    if wired_gb is not None and not wired_gb >= 0:
        raise ValueError(f"the wired limit must be >= 0 GB, got {wired_gb}")
    cache = default_cache_limit(weights_bytes) if cache_gb is None else int(cache_gb * GiB)
    mx.set_cache_limit(cache)
    wired = default_wired_limit(weights_bytes, kv_bytes) if wired_gb is None else int(wired_gb * GiB)
    if wired is not None and mx.metal.is_available():
        try:
            mx.set_wired_limit(wired)
        except (RuntimeError, ValueError):  # older macOS, or more than the device allows: keep MLX's default
            wired = None
    else:
        wired = None
    return MemoryLimits(cache, wired)


# ---- sizing: weights, KV state, prefill scratch, and what the device has -----------------------------------


def kv_bytes_estimate(cfg: ModelConfig, ctx: int) -> int:
    """Upper bound of the KV state after ``ctx`` tokens (f32 rows, capacity buffers grown by doubling)."""
    total = 0
    for il in range(cfg.n_layer):
        total += min(ctx, cfg.n_swa) * cfg.head_dim * 4
        r = cfg.compress_ratio(il)
        if r:
            total += max(2 * math.ceil(ctx / r), 16) * cfg.head_dim * 4 + 2 * r * 2 * cfg.head_dim * 4
        if cfg.has_indexer(il):
            total += max(2 * math.ceil(ctx / 4), 16) * cfg.indexer_head_dim * 4 + 2 * 4 * 2 * cfg.indexer_head_dim * 4
    return total


def scratch_bytes_estimate(cfg: ModelConfig, chunk: int) -> int:
    """Transient prefill memory for one chunk of ``chunk`` tokens (see ``_SCRATCH_COPIES``)."""
    per_token = (cfg.n_hc * cfg.n_embd + cfg.n_expert_used * cfg.n_ff_exp * 2 + cfg.n_vocab) * 4
    return chunk * per_token * _SCRATCH_COPIES // 4 + _SCRATCH_FIXED


def available_memory() -> tuple[int, str]:
    """Bytes the default device can use, and where the number came from."""
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    for key in ("max_recommended_working_set_size", "memory_size", "total_memory"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return int(info[key]), f"device {key}"
    if mx.default_device().type == mx.DeviceType.gpu:
        try:  # MLX-CUDA: ask the driver through nvidia-smi (no extra Python dependency)
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout.split()
            return int(out[0]) * 2**20, "nvidia-smi memory.total"
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            pass
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "host physical memory"


def plan_sessions(requested: int, cfg: ModelConfig, ctx: int, weights_bytes: int, chunk: int,
                  available: tuple[int, str] | None = None) -> int:
    """How many live sessions of ``ctx`` tokens the server holds: ``requested``, checked to fit beside the weights
    and one prefill chunk's scratch, or with ``requested == 0`` as many as fit (at most :data:`AUTO_SESSIONS_MAX`).
    ``available``: (bytes, where the number came from), default :func:`available_memory`. Raises ``ValueError``
    with the figures when not even that many (or one) fit."""
    if requested < 0:
        raise ValueError(f"--batched-session must be >= 0 (0 = as many as fit), got {requested}")
    avail, source = available if available is not None else available_memory()
    kv, scratch = kv_bytes_estimate(cfg, ctx), scratch_bytes_estimate(cfg, chunk)
    room = avail - weights_bytes - scratch
    fit = max(0, room // kv) if kv else AUTO_SESSIONS_MAX
    n = requested or min(fit, AUTO_SESSIONS_MAX)
    if n < 1 or n > fit:
        want = max(n, 1)
        raise ValueError(
            f"{want} session(s) of --ctx {ctx} do not fit: weights {weights_bytes / GiB:.2f} GiB + "
            f"{want} x KV {kv / GiB:.3f} GiB + prefill scratch {scratch / GiB:.2f} GiB = "
            f"{(weights_bytes + want * kv + scratch) / GiB:.2f} GiB > {avail / GiB:.2f} GiB available ({source}); "
            f"at most {fit} fit at this context")
    return n
