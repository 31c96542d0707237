"""Random-weight models built directly in device memory, in the published q2/q4 layout (no GGUF file).

``random_model("full")`` gives a model of the real DeepSeek V4 Flash shape (~87 GB of q2 weights) so anyone
with a large GPU or Mac can measure speed without the 81 GB download; ``random_model("tiny")`` gives the
docs/model.md §9 test shape (CPU ok). The values are random but every quantized block is valid (finite f16
scales, values with std ≈ fan-in^-1/2), so activations stay O(1) and the kernels do their real work.
Every tensor is its own buffer (nothing shared between layers), so caches do not flatter timings.

The recipes avoid launches MLX-CUDA 0.32.4 refuses at the full shape (each noted where it applies).
"""

from __future__ import annotations

import zlib
from dataclasses import replace
from typing import Any, Callable

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .config import ModelConfig
from .layout import EXPERT_VARIANTS, expected_tensors, layout_sizes
from .model.model import Model
from .testing import SCALE_FIELDS, expert_type, flash_config, tiny_config, unit_rms, weight_init
from .weights import QuantWeight

SHAPES = ("tiny", "full")


def random_block_bytes(qtype: T, shape: tuple[int, ...], std: float, key: mx.array | None = None) -> mx.array:
    """Random valid blocks (uniform bytes, finite f16 scales) whose values have std ≈ ``std``; built on device.

    int32 randint, cast, f16 scale columns spliced in with one concatenate: MLX-CUDA runs that at 0.7 GB per
    tensor, while an in-place slice update of the scale bytes failed to launch there
    (``cudaGraphAddKernelNode ... invalid argument``).
    """
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    raw = mx.random.randint(0, 256, (n_blocks, block_bytes), key=key).astype(mx.uint8)
    d_off, m_off, m_ratio = SCALE_FIELDS[qtype]  # the test factory's calibration (zero-mean values)
    d = std / unit_rms(qtype)
    fields = {d_off: d} if m_off is None else {d_off: d, m_off: d * m_ratio}
    cols, pos = [], 0
    for off in sorted(fields):
        f16 = mx.array(np.array([fields[off]], np.float16).view(np.uint8))
        cols += [raw[:, pos:off], mx.broadcast_to(f16, (n_blocks, 2))]
        pos = off + 2
    cols.append(raw[:, pos:])
    return mx.concatenate(cols, axis=1).reshape(*shape[:-1], shape[-1] // block * block_bytes)


def random_dense(shape: tuple[int, ...], std: float, dtype) -> mx.array:
    """Gaussian weights; the 0.5 G-element embedding is drawn on the host (MLX-CUDA failed to launch it)."""
    if int(np.prod(shape)) > 1 << 26:
        host = np.random.default_rng(0).standard_normal(shape, dtype=np.float32) * std
        return mx.array(host.astype(np.float16 if dtype == mx.float16 else np.float32))
    return (std * mx.random.normal(shape)).astype(dtype)


def random_quant_weight(qtype: T, shape: tuple[int, ...], std: float, key: mx.array | None = None) -> QuantWeight:
    """A random weight of ``qtype`` (Gaussian F16/F32, or random valid blocks) with values of std ≈ ``std``;
    block types drawn from ``key`` when given (else MLX's global random state)."""
    if qtype in (T.F16, T.F32):
        return QuantWeight(random_dense(shape, std, mx.float16 if qtype == T.F16 else mx.float32), qtype, shape)
    return QuantWeight(random_block_bytes(qtype, shape, std, key), qtype, shape)


def random_weights(cfg: ModelConfig, experts: str = "q2", seed: int = 0,
                   cut: Callable[[str], tuple[int, range] | None] | None = None,
                   keep: Callable[[str], bool] | None = None) -> dict:  # fmt: skip
    """``{gguf name: QuantWeight | mx.array}`` for every tensor of the layout, random, in device memory.

    Each tensor is evaluated as soon as it is built, so peak memory stays at the weights' size. ``cut``: an expert-
    or tensor-parallel rank's share (:func:`ds4_mlx.distributed.tensor_share`): a tensor it cuts is drawn at its
    cut shape from its own key, so every rank draws the same other weights. ``keep``: only the tensors it keeps
    (a pipeline stage's, :func:`ds4_mlx.distributed.rank_share`).
    """
    if experts not in EXPERT_VARIANTS:
        raise ValueError(f"experts must be one of {sorted(EXPERT_VARIANTS)}, got {experts!r}")
    mx.random.seed(seed)
    out = {}
    for name, spec in expected_tensors(cfg).items():
        if keep is not None and not keep(name):
            continue
        shape, qtype, key = spec.shape, spec.types[0], None
        if spec.component == "experts":
            qtype = expert_type(name, experts)
        part = None if cut is None else cut(name)
        if part is not None:
            shape = tuple(len(part[1]) if i == part[0] else s for i, s in enumerate(shape))
            key = mx.random.key(seed * 7919 + zlib.crc32(name.encode()))
        if qtype == T.I32:  # tid2eid: distinct experts per token
            # on the host: MLX-CUDA's sort fails to launch for more than 65535 rows (grid y limit)
            rows = np.argsort(np.random.default_rng(seed).random((shape[0], cfg.n_expert)), axis=1)[:, : shape[1]]
            out[name] = mx.array(rows.astype(np.int32))
            continue
        dist, a, b = weight_init(name, shape)
        if len(shape) == 1:
            out[name] = (mx.random.uniform(a, b, shape, key=key) if dist == "uniform"
                         else a + b * mx.random.normal(shape, key=key))  # fmt: skip
        else:
            out[name] = random_quant_weight(qtype, shape, b, key)
        try:
            mx.eval(out[name].data if isinstance(out[name], QuantWeight) else out[name])
        except RuntimeError as e:
            raise RuntimeError(f"building {name} {shape} {qtype.name}: {e}") from None
    return out


def shape_config(shape: str = "tiny", layers: int | None = None) -> ModelConfig:
    """The config of a named shape: ``tiny`` (docs/model.md §9) or ``full`` (V4 Flash); ``layers`` truncates it."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {SHAPES}, got {shape!r}")
    cfg = flash_config() if shape == "full" else tiny_config()
    if layers:
        cfg = replace(cfg, n_layer=layers, n_hash_layer=min(cfg.n_hash_layer, layers),
                      compress_ratios=cfg.compress_ratios[:layers], swiglu_clamp=cfg.swiglu_clamp[:layers])
    return cfg


def random_weights_bytes(cfg: ModelConfig, experts: str = "q2",
                         cut: Callable[[str], tuple[int, range] | None] | None = None,
                         keep: Callable[[str], bool] | None = None) -> int:  # fmt: skip
    """Bytes :func:`random_weights` will allocate (from the layout, before building anything), with the tensors cut
    by ``cut`` and kept by ``keep`` (a rank's, :func:`random_weights`)."""
    from .distributed import held_share

    specs = expected_tensors(cfg)
    return round(sum(b * held_share(cut, n, specs[n].shape, keep) for n, b in layout_sizes(cfg, experts).items()))


def random_model(shape: str = "tiny", experts: str = "q2", *, seed: int = 0, numerics: str = "ds4",
                 layers: int | None = None, group: Any = None, parallel: str = "expert") -> tuple[Any, Any]:
    """A random-weight :class:`Model` of ``shape`` -> ``(model, tokenizer)``; with ``group`` (several ranks) this
    rank's part, as :func:`ds4_mlx.loader.load` gives it: ``parallel="expert"`` or ``"tensor"`` a share of every
    layer (:meth:`Model.shard`), ``"pipeline"`` an even split of the layers; rank 0 gets the model that drives the
    others (with the tokenizer), another rank a :class:`~ds4_mlx.distributed.Follower` (and None).

    The tokenizer is the test factory's byte-level BPE (vocab 512, ``testing.tiny_tokenizer``) for both shapes:
    its ids are valid at the full shape's vocabulary too (text is meaningless with random weights anyway).
    """
    from .distributed import rank_model, rank_share
    from .testing import tiny_tokenizer
    from .tokenizer import Tokenizer

    cfg = shape_config(shape, layers)
    tokenizer = Tokenizer.from_gguf(tiny_tokenizer(512))
    if group is None or group.size() == 1:
        return Model(cfg, random_weights(cfg, experts, seed), numerics), tokenizer
    split, keep, cut = rank_share(cfg, parallel, group.size(), group.rank())
    weights = random_weights(cfg, experts, seed, cut, keep)
    return rank_model(cfg, weights, numerics, group, split, cut, lambda: tokenizer)

