"""ds4-mlx: DeepSeek V4 Flash on MLX, a Python reimplementation of antirez's ds4.c engine.

Public API (mlx-lm style)::

    from ds4_mlx import load, generate
    model, tokenizer = load("ds4flash.gguf")        # or a DS4FormatError naming what is wrong
    print(generate(model, tokenizer, "Hello", max_tokens=64))
"""

import importlib as _importlib
import importlib.util as _ilu
import sys as _sys
import types as _types
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
# token on the H200. MLX reads these once, at its first GPU work;
# a user's own setting of either wins, and Metal keeps MLX's defaults.
CUDA_GRAPH_BATCHING = {"MLX_MAX_OPS_PER_BUFFER": "100", "MLX_MAX_MB_PER_BUFFER": "1000000"}


def _batch_cuda_graphs() -> None:
    import os

    import mlx.core as mx

    if not any(k in os.environ for k in CUDA_GRAPH_BATCHING) and mx.cuda.is_available():
        os.environ.update(CUDA_GRAPH_BATCHING)


_batch_cuda_graphs()

__version__ = "0.1.0"

#: The public API, imported on first use (PEP 562): ``import ds4_mlx.kernels`` (or any leaf module) does not
#: pull in the model, sessions and generation. Name -> the submodule that defines it.
_LAZY = {
    "DS4FormatError": "gguf_file",
    "GGUFModel": "gguf_file",
    "ModelConfig": "config",
    "Session": "session",
    "generate": "generate",
    "load": "loader",
    "load_weights": "gguf_file",
    "open_gguf": "gguf_file",
    "stream_generate": "generate",
}

__all__ = [*_LAZY, "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


class _Package(_types.ModuleType):
    """The package's module type: ``ds4_mlx.generate`` stays the function. Importing a submodule binds it on its
    package, and the submodule ``generate`` would otherwise hide the function of that name."""

    def __setattr__(self, name: str, value) -> None:
        if name == "generate" and isinstance(value, _types.ModuleType):
            value = value.generate
        super().__setattr__(name, value)


_sys.modules[__name__].__class__ = _Package
