"""``load(path)``: open and validate a DS4 GGUF (or a directory written by ``ds4-mlx convert``), bind its
weights, build the model and tokenizer."""

from __future__ import annotations

import os
from functools import partial
from pathlib import Path
from collections.abc import Callable
from typing import Any

import numpy as np

from .gguf_file import load_weights, open_gguf
from .model.model import Model
from .numerics import Numerics


def load(
    path: str | os.PathLike,
    numerics: str | Numerics | None = "ds4",
    *,
    progress: Callable[[str, int, int], None] | None = None,
    expert_cache: str | None = None,
    expert_preload: int | None = None,
    expert_profile: str | os.PathLike | None = None,
    group: Any = None,
    layers: str | None = None,
    parallel: str = "pipeline",
) -> tuple[Any, Any]:
    """Load a DS4 GGUF or converted model directory -> ``(model, tokenizer)``; tokenizer is ``None`` when it
    can't be built.

    Weights stay in their GGUF quantization (never requantized); a converted directory holds the same bytes
    and gives bit-identical results. ``numerics`` picks the numeric profile: ``"ds4"`` (default, ds4's cache
    rounding simulated) or ``"hf"`` (plain f32). ``progress(stage, done, total)`` reports the GGUF's read
    (``"reading"``, bytes) and, on CUDA, the weights' move to the GPU (``"to device"``, bytes).

    ``expert_cache`` (a GGUF only): leave the routed experts in the file and stream them through a device cache
    of that size (``"N"`` experts, ``"N%"`` of them or ``"NGB"``, see :mod:`ds4_mlx.streaming`). ``expert_profile``:
    the cache's use profile (:class:`~ds4_mlx.streaming.ExpertCache`); ``expert_preload``: experts read into the
    cache before the first token, the profile's most used first (default: fill the cache when the profile holds
    uses, else none; ``progress`` reports ``"preloading experts"``, bytes).

    ``group`` (an ``mx.distributed`` group of several ranks, e.g. ``mx.distributed.init()`` under ``mlx.launch``):
    a layer pipeline (:mod:`ds4_mlx.distributed`). Each rank reads only its layers' tensors: ``layers`` gives
    every rank's range (``"0:2,2:6"``; default an even split). Rank 0 gets a
    :class:`~ds4_mlx.distributed.PipelineModel` and the tokenizer, the others a
    :class:`~ds4_mlx.distributed.PipelineFollower` to ``run()`` and ``None``. With ``parallel="expert"`` every rank
    reads every layer but only its share of the routed and shared experts, with ``parallel="tensor"`` of the
    attention heads too (:func:`~ds4_mlx.distributed.tensor_share`); rank 0 gets a
    :class:`~ds4_mlx.distributed.LockstepModel` and the tokenizer, the others a ``LockstepFollower`` and ``None``.
    A group of one rank loads as without.
    """
    from .distributed import PARALLEL_MODES, rank_model, rank_share

    if parallel not in PARALLEL_MODES:
        raise ValueError(f"parallel={parallel!r}: the modes are {', '.join(map(repr, PARALLEL_MODES))}")
    sharded = group is not None and group.size() > 1
    if expert_cache is None and (expert_preload is not None or expert_profile is not None):
        raise ValueError("an expert preload or use profile is for streamed experts: give expert_cache too")
    if sharded and expert_cache is not None:
        raise ValueError(f"expert streaming is not available with {parallel} parallel")
    if layers is not None and not (sharded and parallel == "pipeline"):
        raise ValueError("--layers splits the model over the ranks of a pipeline; "
                         + (f"this is {parallel} parallel" if sharded else "this is one rank"))
    gguf = None
    if Path(path).is_dir():
        if expert_cache is not None:
            raise ValueError(f"{path}: expert streaming reads a GGUF file, not a converted directory")
        from .mlx_dir import open_mlx_dir

        config, weights, tokenizer_data = open_mlx_dir(path)
    else:
        gguf = open_gguf(path)
        config, tokenizer_data = gguf.config, gguf.tokenizer
    split, keep, cut = rank_share(config, parallel, group.size(), group.rank(), layers) if sharded else (None,) * 3
    if gguf is None:  # a converted directory: its weights kept and cut in memory (_cut_weight)
        head_rows = _head_rows(weights["output.weight"]) if split else None
        weights = {n: _cut_weight(w, cut(n) if cut else None) for n, w in weights.items() if keep is None or keep(n)}
    else:
        head_rows = _head_rows(gguf.tensors["output.weight"]) if split else None
        read = None if progress is None else lambda done, total: progress("reading", done, total)
        weights = load_weights(gguf, read, stream_experts=expert_cache is not None, keep=keep, cut=cut)
        _to_device(weights, progress)
    if sharded:
        return rank_model(config, weights, numerics, group, split, cut, lambda: _tokenizer(tokenizer_data), head_rows)
    cache = None
    if expert_cache is not None:
        from .streaming import ExpertCache

        cache = ExpertCache.from_weights(weights, expert_cache, min_slots=config.n_expert_used, profile=expert_profile)
        if expert_preload is None and cache.uses.any():
            expert_preload = cache.slots
        if expert_preload:
            cache.preload(expert_preload, None if progress is None else partial(progress, "preloading experts"))
    model = Model(config, weights, numerics)
    if cache is not None:
        model.stream_experts(cache)
    return model, _tokenizer(tokenizer_data)


def _tokenizer(tokenizer_data: Any) -> Any:
    try:
        from .tokenizer import Tokenizer
    except ImportError:
        return None
    return Tokenizer.from_gguf(tokenizer_data)


def _head_rows(w: Any) -> Any:
    """The first rows of the output head (a GGUF tensor or a directory's weight): in a pipeline rank 0 keeps them
    to identify the model in KV files, the last rank holds the head."""
    from .weights import QuantWeight, cut_storage

    data, shape = cut_storage(w.data, w.qtype, w.shape, 0, range(4))
    return QuantWeight.from_numpy(np.asarray(data), w.qtype, shape)


def _cut_weight(w: Any, part: Any) -> Any:
    """A converted directory's weight cut to ``part`` (:func:`~ds4_mlx.weights.cut_storage`; a view of its rows,
    a copy of the blocks of its columns), or ``w`` for None."""
    import mlx.core as mx
    from gguf import GGMLQuantizationType as QT

    from .weights import QuantWeight, cut_storage

    if part is None:
        return w
    if isinstance(w, QuantWeight):
        data, shape = cut_storage(w.data, w.qtype, w.shape, *part)
        return QuantWeight(mx.contiguous(data), w.qtype, shape)
    return mx.contiguous(cut_storage(w, QT.F32, w.shape, *part)[0])


def _to_device(weights: dict[str, Any], progress: Callable[[str, int, int], None] | None) -> None:
    """On CUDA: every weight read by the GPU once now. Arrays made from the file's bytes sit in managed memory,
    which the GPU otherwise pages in at first touch, inside the first requests' prefill and decode steps."""
    import mlx.core as mx

    from .backend import on_cuda_gpu
    from .kernels.fused import fault_in
    from .weights import QuantWeight

    if not on_cuda_gpu():
        return
    resident = [w for w in weights.values() if isinstance(w, (QuantWeight, mx.array))]  # not streamed experts
    arrays = [w.data if isinstance(w, QuantWeight) else w for w in resident]
    total, done = sum(a.nbytes for a in arrays), 0
    for a in arrays:
        fault_in(a)
        done += a.nbytes
        if progress is not None:
            progress("to device", done, total)


def check_expert_cache(path: str | os.PathLike, size: str, profile: str | os.PathLike | None = None
                       ) -> tuple[int, int]:  # fmt: skip
    """Refuse, before any weight is read, an expert cache ``size`` that does not parse or cannot hold a token's
    experts, a use ``profile`` of another model, or streaming from a converted directory (ValueError; a bad file
    raises DS4FormatError). Returns (the cache's bytes, the routed experts' bytes in the file)."""
    if Path(path).is_dir():
        raise ValueError(f"{path}: expert streaming reads a GGUF file, not a converted directory")
    from .streaming import check_cache_size, expert_unit_bytes, parse_cache_size, read_profile

    g = open_gguf(path)
    cfg = g.config
    unit, n_units = expert_unit_bytes(g.tensors), cfg.n_layer * cfg.n_expert
    slots = min(parse_cache_size(size, unit, n_units) // unit, n_units)
    check_cache_size(slots, cfg.n_expert_used, unit)
    if profile is not None:
        read_profile(Path(profile), list(range(cfg.n_layer)), cfg.n_expert)
    return slots * unit, n_units * unit
