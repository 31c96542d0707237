"""Device memory limits: how much MLX keeps in its buffer cache, and (Metal) how much it keeps wired.

MLX keeps freed buffers for reuse. Unbounded, that cache grows with every chunk's transients: on an H200 a 32K
prefill of the full model left the process holding 138.7 of 140 GiB, of which ~87 GB were weights. On a
128 GB Mac the same would swap. :func:`set_memory_limits` bounds the cache (by default a share of the
weights' size, at most 4 GiB) and, on Metal, wires the weights and the KV state so macOS does not page them out.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

GiB = 1 << 30
#: Default cache limit: this share of the weights' bytes, between CACHE_MIN and CACHE_MAX.
CACHE_SHARE = 0.05
CACHE_MIN, CACHE_MAX = GiB // 4, 4 * GiB
#: Wired on top of the weights and the KV state (Metal): room for a chunk's transients.
WIRED_MARGIN = 2 * GiB


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
