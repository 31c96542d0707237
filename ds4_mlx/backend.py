"""Which backend runs the custom kernels: ``fallback`` (pure MLX), ``metal``, ``cuda`` or ``sim``.

The choice is made at call time: :func:`set_kernel_backend`, else ``$DS4_MLX_KERNELS``, else automatic (the GPU
kernels when the default device is a GPU, the fallback otherwise). :class:`ds4_mlx.weights.QuantWeight`, the
graph's fused operations (:mod:`ds4_mlx.model.fused`) and the device sampler read it; the kernels themselves
take the backend as an argument.
"""

from __future__ import annotations

import os

import mlx.core as mx

#: ``sim`` runs the kernels' CUDA text on the CPU (custom_kernels/sim.py): for tests and kernel work, slow.
BACKENDS = ("fallback", "metal", "cuda", "sim")
_backend_override: str | None = None


def set_kernel_backend(name: str | None) -> None:
    """Force a backend for every later call (``None`` restores env-var / automatic selection)."""
    global _backend_override
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend_override = name


def on_cuda_gpu() -> bool:
    """Whether MLX computes on a CUDA GPU here (the default device is the GPU and MLX's backend is CUDA)."""
    return mx.default_device() == mx.gpu and mx.cuda.is_available()


def kernel_backend() -> str:
    """The backend used now: the setter's value, else ``$DS4_MLX_KERNELS``, else automatic."""
    name = _backend_override or os.environ.get("DS4_MLX_KERNELS", "").strip().lower() or "auto"
    if name == "auto":
        if mx.default_device() != mx.gpu:
            return "fallback"
        if mx.metal.is_available():
            return "metal"
        if mx.cuda.is_available():
            return "cuda"
        return "fallback"
    if name not in BACKENDS:
        raise ValueError(f"DS4_MLX_KERNELS must be one of auto|{'|'.join(BACKENDS)}, got {name!r}")
    if name == "metal" and not mx.metal.is_available():
        raise RuntimeError("DS4_MLX_KERNELS=metal but MLX has no Metal backend here")
    if name == "cuda" and not mx.cuda.is_available():
        raise RuntimeError("DS4_MLX_KERNELS=cuda but MLX has no CUDA backend here")
    return name
