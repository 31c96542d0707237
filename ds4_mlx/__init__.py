"""ds4-mlx: DeepSeek V4 Flash on MLX, a Python reimplementation of antirez's ds4.c engine.

Public API (mlx-lm style)::

    from ds4_mlx import load, generate
    model, tokenizer = load("ds4flash.gguf")        # or a DS4FormatError naming what is wrong
    print(generate(model, tokenizer, "Hello", max_tokens=64))
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _map_kernels_in_source_checkout() -> None:
    """``custom_kernels/`` is installed as ``ds4_mlx.kernels`` (pyproject's package-dir). In a source checkout used
    without installing (``PYTHONPATH=repo``, e.g. on the lent GPU) load it from the repo under that name."""
    if "ds4_mlx.kernels" in _sys.modules or _ilu.find_spec("ds4_mlx.kernels") is not None:
        return
    src = _Path(__file__).resolve().parent.parent / "custom_kernels" / "__init__.py"
    spec = _ilu.spec_from_file_location("ds4_mlx.kernels", src, submodule_search_locations=[str(src.parent)])
    module = _ilu.module_from_spec(spec)
    _sys.modules["ds4_mlx.kernels"] = module
    spec.loader.exec_module(module)
    globals()["kernels"] = module


_map_kernels_in_source_checkout()

from .config import ModelConfig  # noqa: E402
from .generate import generate, stream_generate  # noqa: E402
from .gguf_file import DS4FormatError, GGUFModel, load_weights, open_gguf  # noqa: E402
from .loader import load  # noqa: E402
from .session import Session  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "DS4FormatError",
    "GGUFModel",
    "ModelConfig",
    "Session",
    "generate",
    "load",
    "load_weights",
    "open_gguf",
    "stream_generate",
    "__version__",
]
