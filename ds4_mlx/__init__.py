"""ds4-mlx: DeepSeek V4 Flash on MLX, a Python reimplementation of antirez's ds4.c engine.

Public API (mlx-lm style)::

    from ds4_mlx import load, generate
    model, tokenizer = load("ds4flash.gguf")        # or a DS4FormatError naming what is wrong
    print(generate(model, tokenizer, "Hello", max_tokens=64))
"""

import importlib.util as _ilu
import sys as _sys
from pathlib import Path as _Path


def _map_in_source_checkout(name: str, folder: str) -> None:
    """``custom_kernels/`` and ``convert/`` are installed as ``ds4_mlx.kernels`` / ``ds4_mlx.convert`` (pyproject's
    package-dir). In a source checkout used without installing (``PYTHONPATH=repo``, e.g. on the lent GPU) load
    them from the repo under those names."""
    full = f"ds4_mlx.{name}"
    if full in _sys.modules or _ilu.find_spec(full) is not None:
        return
    src = _Path(__file__).resolve().parent.parent / folder / "__init__.py"
    if not src.is_file():
        return
    spec = _ilu.spec_from_file_location(full, src, submodule_search_locations=[str(src.parent)])
    module = _ilu.module_from_spec(spec)
    _sys.modules[full] = module
    spec.loader.exec_module(module)
    globals()[name] = module


_map_in_source_checkout("kernels", "custom_kernels")
_map_in_source_checkout("convert", "convert")

# MLX-CUDA records ops into CUDA graphs and launches one every 20 ops, and after any op whose inputs pass a size
# cap: every routed-expert launch reads a whole stacked expert tensor, so each layer cut one more. With decode
# pipelined two steps deep (generation and the server), 100-op graphs and no cap took 0.73-0.94x the time a
# token on the H200 (benchmarks/RESULTS.md, sixteenth session). MLX reads these once, at its first GPU work;
# a user's own setting of either wins, and Metal keeps MLX's defaults.
CUDA_GRAPH_BATCHING = {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_MAX_MB_PER_BUFFER": "1000000"}


def _batch_cuda_graphs() -> None:
    import os

    import mlx.core as mx

    if not any(k in os.environ for k in CUDA_GRAPH_BATCHING) and mx.cuda.is_available():
        os.environ.update(CUDA_GRAPH_BATCHING)


_batch_cuda_graphs()

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
