"""``load(path)``: open and validate a DS4 GGUF (or a directory written by ``ds4-mlx convert``), bind its
weights, build the model and tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from .gguf_file import load_weights, open_gguf
from .model.model import Model
from .numerics import Numerics


def load(path: str | os.PathLike, numerics: str | Numerics | None = "ds4") -> tuple[Model, Any]:
    """Load a DS4 GGUF or converted model directory -> ``(model, tokenizer)``; tokenizer is ``None`` when it
    can't be built.

    Weights stay in their GGUF quantization (never requantized); a converted directory holds the same bytes
    and gives bit-identical results. ``numerics`` picks the numeric profile: ``"ds4"`` (default, ds4's cache
    rounding simulated) or ``"hf"`` (plain f32).
    """
    if Path(path).is_dir():
        from .mlx_dir import open_mlx_dir

        config, weights, tokenizer_data = open_mlx_dir(path)
    else:
        gguf = open_gguf(path)
        config, weights, tokenizer_data = gguf.config, load_weights(gguf), gguf.tokenizer
    model = Model(config, weights, numerics)
    try:
        from .tokenizer import Tokenizer
    except ImportError:
        return model, None
    return model, Tokenizer.from_gguf(tokenizer_data)
