"""ds4-mlx: DeepSeek V4 Flash on MLX, a Python reimplementation of antirez's ds4.c engine.

Public API (mlx-lm style)::

    from ds4_mlx import open_gguf
    gguf = open_gguf("ds4flash.gguf")   # validated config + tensors, or a DS4FormatError
"""

from .config import ModelConfig
from .gguf_file import DS4FormatError, GGUFModel, load_weights, open_gguf

__version__ = "0.1.0"

__all__ = ["DS4FormatError", "GGUFModel", "ModelConfig", "load_weights", "open_gguf", "__version__"]
