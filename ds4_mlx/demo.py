"""The built-in demo model: a tiny random-weight GGUF built once and cached in the user cache dir.

It lets every command (``generate --demo``, ``chat --demo``, ``serve --demo``) run on a fresh machine with
no download. Its weights are random, so its text is gibberish — it exercises the engine, not the model.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from .paths import cache_dir

DEMO_SEED = 0


def demo_model_path() -> Path:
    """Path of the demo GGUF, writing it on first use (atomically, so a crash never leaves half a file)."""
    from .testing import make_tiny_gguf

    path = cache_dir() / f"demo-tiny-q2-seed{DEMO_SEED}.gguf"
    if not path.exists():
        print(f"building the demo model (once; cached as {path})…", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        make_tiny_gguf(tmp, seed=DEMO_SEED, experts="q2", hca_ratio=16)
        os.replace(tmp, path)
        print(f"built the demo model in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    return path
