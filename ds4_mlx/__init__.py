"""ds4-mlx: DeepSeek V4 Flash on MLX, a Python reimplementation of antirez's ds4.c engine.

Public API (mlx-lm style)::

    from ds4_mlx import load, generate
    model, tokenizer = load("ds4flash.gguf")        # or a DS4FormatError naming what is wrong
    print(generate(model, tokenizer, "Hello", max_tokens=64))
"""

from .config import ModelConfig
from .generate import generate, stream_generate
from .gguf_file import DS4FormatError, GGUFModel, load_weights, open_gguf
from .loader import load
from .session import Session

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
