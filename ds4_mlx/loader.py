"""``load(path)``: open and validate a DS4 GGUF, bind its weights, build the model and tokenizer."""

from __future__ import annotations

import os
from typing import Any

from .gguf_file import load_weights, open_gguf
from .model.model import Model
from .numerics import Numerics


def load(path: str | os.PathLike, numerics: str | Numerics | None = "ds4") -> tuple[Model, Any]:
    """Load a DS4 GGUF -> ``(model, tokenizer)``; tokenizer is ``None`` when it can't be built.

    Weights stay in their GGUF quantization (never requantized). ``numerics`` picks the numeric
    profile: ``"ds4"`` (default, ds4's cache rounding simulated) or ``"hf"`` (plain f32).
    """
    gguf = open_gguf(path)
    model = Model(gguf.config, load_weights(gguf), numerics)
    try:
        from .tokenizer import Tokenizer
    except ImportError:
        return model, None
    return model, Tokenizer.from_gguf(gguf.tokenizer)
