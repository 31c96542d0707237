"""Where ds4-mlx keeps files it makes for itself: the built-in demo model and the kernels' build products."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$DS4_MLX_CACHE``, else ``$XDG_CACHE_HOME/ds4-mlx``, else ``~/.cache/ds4-mlx``."""
    if os.environ.get("DS4_MLX_CACHE"):
        return Path(os.environ["DS4_MLX_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ds4-mlx"
