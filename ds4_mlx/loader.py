"""``load(path)``: open and validate a DS4 GGUF (or a directory written by ``ds4-mlx convert``), bind its
weights, build the model and tokenizer."""

from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Callable
from typing import Any

from .gguf_file import load_weights, open_gguf
from .model.model import Model
from .numerics import Numerics


def load(
    path: str | os.PathLike,
    numerics: str | Numerics | None = "ds4",
    *,
    progress: Callable[[str, int, int], None] | None = None,
) -> tuple[Model, Any]:
    """Load a DS4 GGUF or converted model directory -> ``(model, tokenizer)``; tokenizer is ``None`` when it
    can't be built.

    Weights stay in their GGUF quantization (never requantized); a converted directory holds the same bytes
    and gives bit-identical results. ``numerics`` picks the numeric profile: ``"ds4"`` (default, ds4's cache
    rounding simulated) or ``"hf"`` (plain f32). ``progress(stage, done, total)`` reports the GGUF's read
    (``"reading"``, bytes) and, on CUDA, the weights' move to the GPU (``"to device"``, bytes).
    """
    if Path(path).is_dir():
        from .mlx_dir import open_mlx_dir

        config, weights, tokenizer_data = open_mlx_dir(path)
    else:
        gguf = open_gguf(path)
        read = None if progress is None else lambda done, total: progress("reading", done, total)
        config, weights, tokenizer_data = gguf.config, load_weights(gguf, read), gguf.tokenizer
        _to_device(weights, progress)
    model = Model(config, weights, numerics)
    try:
        from .tokenizer import Tokenizer
    except ImportError:
        return model, None
    return model, Tokenizer.from_gguf(tokenizer_data)


def _to_device(weights: dict[str, Any], progress: Callable[[str, int, int], None] | None) -> None:
    """On CUDA: every weight read by the GPU once now. Arrays made from the file's bytes sit in managed memory,
    which the GPU otherwise pages in at first touch, inside the first requests' prefill and decode steps."""
    import mlx.core as mx

    from .kernels.fused import fault_in
    from .weights import QuantWeight

    if not (mx.default_device() == mx.gpu and mx.cuda.is_available()):
        return
    arrays = [w.data if isinstance(w, QuantWeight) else w for w in weights.values()]
    total, done = sum(a.nbytes for a in arrays), 0
    for a in arrays:
        fault_in(a)
        done += a.nbytes
        if progress is not None:
            progress("to device", done, total)
