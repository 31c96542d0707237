"""Open and validate a DS4 GGUF, then bind its tensors by name (docs/model.md §2–3).

Like ds4.c we fail early with one clear message: every problem raises :class:`DS4FormatError` naming the
file, the key or tensor, and what was expected versus found. The file is memory-mapped by
``gguf.GGUFReader``; :attr:`TensorInfo.data` is a view into it, not a copy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader, GGUFValueType as VT, GGMLQuantizationType as T

from .config import DS4FormatError, ModelConfig, check_config
from .layout import expected_tensors, optional_tensors, tensor_nbytes
from .tokenizer import SPECIAL_TOKENS, check_merges

ARCH = "deepseek4"

_INT_TYPES = (VT.UINT8, VT.INT8, VT.UINT16, VT.INT16, VT.UINT32, VT.INT32, VT.UINT64, VT.INT64)
_NUM_TYPES = _INT_TYPES + (VT.FLOAT32, VT.FLOAT64)

# (ModelConfig field, metadata key without the "deepseek4." prefix): integers.
_INT_KEYS = {
    "n_layer": "block_count",
    "n_embd": "embedding_length",
    "n_vocab": "vocab_size",
    "n_head": "attention.head_count",
    "n_head_kv": "attention.head_count_kv",
    "head_dim": "attention.key_length",
    "n_rot": "rope.dimension_count",
    "q_lora_rank": "attention.q_lora_rank",
    "o_lora_rank": "attention.output_lora_rank",
    "n_out_group": "attention.output_group_count",
    "n_expert": "expert_count",
    "n_expert_used": "expert_used_count",
    "n_ff_exp": "expert_feed_forward_length",
    "n_expert_shared": "expert_shared_count",
    "n_hash_layer": "hash_layer_count",
    "n_swa": "attention.sliding_window",
    "n_indexer_head": "attention.indexer.head_count",
    "indexer_head_dim": "attention.indexer.key_length",
    "indexer_top_k": "attention.indexer.top_k",
    "n_hc": "hyper_connection.count",
    "n_sinkhorn_iter": "hyper_connection.sinkhorn_iterations",
    "rope_orig_ctx": "rope.scaling.original_context_length",
}
_FLOAT_KEYS = {
    "rope_freq_base": "rope.freq_base",
    "compress_rope_freq_base": "attention.compress_rope_freq_base",
    "rope_scaling_factor": "rope.scaling.factor",
    "yarn_beta_fast": "rope.scaling.yarn_beta_fast",
    "yarn_beta_slow": "rope.scaling.yarn_beta_slow",
    "expert_weights_scale": "expert_weights_scale",
    "rms_eps": "attention.layer_norm_rms_epsilon",
    "hc_eps": "hyper_connection.epsilon",
}
# ModelConfig field -> the GGUF key it is read from (for messages)
_KEY_NAMES = {
    **{field: f"{ARCH}.{key}" for field, key in {**_INT_KEYS, **_FLOAT_KEYS}.items()},
    "compress_ratios": f"{ARCH}.attention.compress_ratios",
    "swiglu_clamp": f"{ARCH}.swiglu_clamp_exp",
    "expert_weights_norm": f"{ARCH}.expert_weights_norm",
    "context_length": f"{ARCH}.context_length",
    "name": "general.name",
}

__all__ = ["DS4FormatError", "GGUFModel", "TensorInfo", "TokenizerData", "check_tensor_values", "check_tokenizer",
           "load_weights", "open_gguf"]


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: GGML type, row-major shape, and the raw memory-mapped data."""

    name: str
    qtype: T
    shape: tuple[int, ...]
    data: np.ndarray  # uint8 (..., row_bytes) for block types; float16/float32/int32 of `shape` otherwise
    nbytes: int
    offset: int = 0  # of the first byte in the file


@dataclass(frozen=True)
class TokenizerData:
    """The ``tokenizer.*`` keys: id-indexed token strings (GPT-2 byte-char form) and ranked merges."""

    tokens: list[str]
    merges: list[str]
    token_types: list[int] | None = None


@dataclass
class GGUFModel:
    """A validated DS4 GGUF: parsed config, tensors bound by name, tokenizer data."""

    path: Path
    config: ModelConfig
    tensors: dict[str, TensorInfo]
    tokenizer: TokenizerData
    metadata: dict[str, Any]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def open_gguf(path: str | os.PathLike) -> GGUFModel:
    """Open ``path``, validate metadata and tensor layout, and return the bound model.

    Raises :class:`DS4FormatError` (one message naming file, key/tensor, expected vs found) on: a file
    that is not GGUF, a truncated file, another architecture, inconsistent metadata, and a missing,
    unexpected, wrongly typed or wrongly shaped tensor.
    """
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise DS4FormatError(f"{where}: no such file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise DS4FormatError(f"{where}: not a GGUF file (magic {magic!r}, expected b'GGUF')")
    try:
        reader = GGUFReader(path, "r")
    except Exception as e:  # the reader raises assorted errors on a cut header
        size = path.stat().st_size
        raise DS4FormatError(
            f"{where}: truncated or corrupt GGUF file ({size} bytes; reader said {type(e).__name__}: {e})"
        ) from None

    meta = _Metadata(reader, where)
    version = meta.raw("GGUF.version")
    if version != 3:
        raise DS4FormatError(f"{where}: GGUF version {version}, expected 3")
    arch = meta.get("general.architecture", str, required=False)
    if arch != ARCH:
        raise DS4FormatError(
            f"{where}: general.architecture is {arch!r}, expected {ARCH!r} (this is not a DeepSeek V4 Flash GGUF)"
        )
    config = _parse_config(meta)
    tokenizer = _parse_tokenizer(meta, config)
    tensors = _bind_tensors(reader, config, where)
    config = replace(
        config,
        expert_types=tuple(tensors[f"blk.0.ffn_{k}_exps.weight"].qtype.name for k in ("gate", "up", "down")),
    )
    return GGUFModel(path, config, tensors, tokenizer, meta.values())


def load_weights(model: GGUFModel, progress: Callable[[int, int], None] | None = None, *,
                 stream_experts: bool = False, keep: Callable[[str], bool] | None = None,
                 cut: Callable[[str], tuple[int, range] | None] | None = None) -> dict[str, Any]:  # fmt: skip
    """Turn the bound tensors into MLX values keyed by GGUF name.

    Matrices (ndim >= 2) become :class:`ds4_mlx.weights.QuantWeight`; 1-D F32 tensors and the hash
    routing tables become plain ``mx.array`` (float32 / int32). With ``stream_experts`` the routed experts stay in
    the file (:class:`ds4_mlx.streaming.StreamedTensor`). ``progress(bytes read, total)`` after each tensor (each
    is copied out of the file's memory map, so this is the file's read). ``keep(name)``: only the tensors it
    accepts are read (a pipeline stage's), the others stay in the file untouched. ``cut(name)``: the part of a
    tensor read, ``(axis, range)``, or None for all of it (an expert- or tensor-parallel rank's share,
    :func:`ds4_mlx.distributed.tensor_share`).
    """
    import mlx.core as mx

    from .streaming import StreamedTensor, is_routed_expert
    from .weights import QuantWeight, cut_storage

    out: dict[str, Any] = {}
    tensors = {n: t for n, t in model.tensors.items() if keep is None or keep(n)}
    streamed = {n for n in tensors if stream_experts and is_routed_expert(n)}

    def data_shape(name: str, t: Any) -> tuple[np.ndarray, tuple[int, ...]]:  # what is read of t, and its shape
        part = None if cut is None else cut(name)
        return (t.data, tuple(t.shape)) if part is None else cut_storage(t.data, t.qtype, t.shape, *part)

    total, done = sum(data_shape(n, t)[0].nbytes for n, t in tensors.items() if n not in streamed), 0
    for name, t in tensors.items():
        if name in streamed:
            out[name] = StreamedTensor(name, t.qtype, t.shape, model.path, t.offset)
            continue
        data, shape = data_shape(name, t)
        if name.endswith("ffn_gate_tid2eid.weight"):
            out[name] = mx.array(np.asarray(data, dtype=np.int32))
        elif len(shape) == 1:
            out[name] = mx.array(np.asarray(data, dtype=np.float32))
        else:
            out[name] = QuantWeight.from_numpy(data, t.qtype, shape)
        done += data.nbytes
        if progress is not None:
            progress(min(done, total), total)
    return out


# ---- metadata ------------------------------------------------------------------------------------


class _Metadata:
    """Typed access to GGUF key/values with error messages that name the file and key."""

    def __init__(self, reader: GGUFReader, where: str):
        self.fields = reader.fields
        self.where = where

    def raw(self, key: str) -> Any:
        f = self.fields.get(key)
        return None if f is None else f.contents()

    def _field(self, key: str):
        f = self.fields.get(key)
        if f is None:
            raise DS4FormatError(f"{self.where}: missing metadata key {key}")
        return f

    def get(self, key: str, kind: type, required: bool = True) -> Any:
        f = self.fields.get(key)
        if f is None:
            if required:
                raise DS4FormatError(f"{self.where}: missing metadata key {key}")
            return None
        vt = f.types[0]
        ok = {
            int: vt in _INT_TYPES,
            float: vt in _NUM_TYPES,
            bool: vt == VT.BOOL,
            str: vt == VT.STRING,
        }[kind]
        if not ok:
            raise DS4FormatError(f"{self.where}: metadata key {key} has type {vt.name}, expected {kind.__name__}")
        return kind(f.contents())

    def array(self, key: str, kind: type, min_len: int) -> list:
        f = self._field(key)
        if f.types[0] != VT.ARRAY:
            raise DS4FormatError(f"{self.where}: metadata key {key} is {f.types[0].name}, expected an array")
        elem = f.types[1] if len(f.types) > 1 else None
        allowed = _INT_TYPES if kind is int else (VT.FLOAT32, VT.FLOAT64) if kind is float else (VT.STRING,)
        values = f.contents()
        if values and elem not in allowed:
            raise DS4FormatError(
                f"{self.where}: metadata array {key} holds {elem.name if elem else '?'}, expected {kind.__name__}"
            )
        if len(values) < min_len:
            raise DS4FormatError(
                f"{self.where}: metadata array {key} has {len(values)} entries, expected at least {min_len}"
            )
        return [kind(v) for v in values]

    def values(self) -> dict[str, Any]:
        out = {}
        for k, f in self.fields.items():
            if k.startswith("tokenizer.ggml.") and f.types and f.types[0] == VT.ARRAY:
                out[k] = f"[{len(f.data)} entries]"
            else:
                out[k] = f.contents()
        return out


def _parse_config(meta: _Metadata) -> ModelConfig:
    p = ARCH + "."
    ints = {field: meta.get(p + key, int) for field, key in _INT_KEYS.items()}
    floats = {field: meta.get(p + key, float) for field, key in _FLOAT_KEYS.items()}
    n_layer = ints["n_layer"]
    ratios = meta.array(p + "attention.compress_ratios", int, n_layer)[:n_layer]
    clamp = meta.array(p + "swiglu_clamp_exp", float, n_layer)[:n_layer]
    cfg = ModelConfig(
        **ints,
        **floats,
        compress_ratios=tuple(ratios),
        swiglu_clamp=tuple(clamp),
        expert_weights_norm=meta.get(p + "expert_weights_norm", bool),
        context_length=meta.get(p + "context_length", int, required=False) or 0,
        name=meta.get("general.name", str, required=False) or "",
    )
    value_length = meta.get(p + "attention.value_length", int)
    group_count = meta.get(p + "expert_group_count", int, required=False) or 0
    group_used = meta.get(p + "expert_group_used_count", int, required=False) or 0
    _check_consistency(cfg, meta.where, value_length, group_count, group_used)
    return cfg


def _check_consistency(cfg: ModelConfig, where: str, value_length: int, group_count: int, group_used: int) -> None:
    """:func:`~ds4_mlx.config.check_config` under the GGUF's key names, plus the keys only a GGUF has."""
    p = ARCH + "."

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DS4FormatError(f"{where}: inconsistent metadata: {what}")

    check_config(cfg, where, _KEY_NAMES)
    need(value_length == cfg.head_dim, f"{p}attention.value_length {value_length} != key_length {cfg.head_dim}")
    need(group_count == 0 and group_used == 0, f"{p}expert_group_count/expert_group_used_count = {group_count}/{group_used}, expected 0 (no group-limited routing)")


def _parse_tokenizer(meta: _Metadata, cfg: ModelConfig) -> TokenizerData:
    tokens = meta.array("tokenizer.ggml.tokens", str, 1)
    merges = meta.array("tokenizer.ggml.merges", str, 1)
    types = meta.fields.get("tokenizer.ggml.token_type")
    data = TokenizerData(tokens, merges, [int(t) for t in types.contents()] if types is not None else None)
    check_tokenizer(data, cfg.n_vocab, meta.where)
    return data


def check_tokenizer(data: TokenizerData, n_vocab: int, where: str, source: str = "tokenizer.ggml") -> None:
    """Raise :class:`DS4FormatError` unless ``data`` builds the tokenizer: one token per vocab id, the 7
    specials present, every merge ``"A B"`` over the vocabulary. ``source`` names the lists in messages."""
    if len(data.tokens) != n_vocab:
        raise DS4FormatError(f"{where}: {source}.tokens has {len(data.tokens)} entries, expected vocab_size {n_vocab}")
    bad = next((i for i, t in enumerate(data.tokens) if not isinstance(t, str)), None)
    if bad is not None:
        raise DS4FormatError(f"{where}: {source}.tokens[{bad}] is {data.tokens[bad]!r}, expected a string")
    known = set(data.tokens)
    for s in SPECIAL_TOKENS:
        if s not in known:
            raise DS4FormatError(f"{where}: {source}.tokens lacks the special token {s!r}")
    try:
        check_merges(known, data.merges)
    except ValueError as e:
        raise DS4FormatError(f"{where}: {source}.merges: {e}") from None


# ---- tensors -------------------------------------------------------------------------------------


def _bind_tensors(reader: GGUFReader, cfg: ModelConfig, where: str) -> dict[str, TensorInfo]:
    expected = expected_tensors(cfg)
    optional = optional_tensors(cfg)
    found: dict[str, TensorInfo] = {}
    for t in reader.tensors:  # GGUFReader already refused a file too short for its tensor data
        spec = expected.get(t.name) or optional.get(t.name)
        if spec is None:
            raise DS4FormatError(f"{where}: unexpected tensor {t.name} (not part of the DS4 layout for this config)")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        qtype = T(t.tensor_type)
        if qtype not in spec.types:
            allowed = "/".join(x.name for x in spec.types)
            raise DS4FormatError(f"{where}: tensor {t.name} has type {qtype.name}, expected {allowed}")
        if shape != spec.shape:
            raise DS4FormatError(f"{where}: tensor {t.name} has shape {list(shape)}, expected {list(spec.shape)}")
        found[t.name] = TensorInfo(t.name, qtype, shape, t.data, tensor_nbytes(shape, qtype), int(t.data_offset))
    missing = [n for n in expected if n not in found and n not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise DS4FormatError(f"{where}: missing tensor {missing[0]}{more}")
    _check_expert_types(found, cfg, where)
    check_tensor_values({n: t.data for n, t in found.items() if t.qtype in (T.F32, T.I32)}, cfg, where)
    return found


def check_tensor_values(small: dict[str, np.ndarray], cfg: ModelConfig, where: str) -> None:
    """The values of the small tensors (the F32 norms, HC scales, sinks and router biases; the I32 hash-routing
    tables): one NaN or infinity in a norm makes every logit NaN, an expert id out of range reads past the
    experts. Cheap: these are a few MB even in the full model."""
    for name, a in small.items():
        if a.dtype.kind == "f":
            if not np.isfinite(a).all():
                i = int(np.flatnonzero(~np.isfinite(a.reshape(-1)))[0])
                raise DS4FormatError(f"{where}: tensor {name} holds {a.reshape(-1)[i]} at index {i}, expected finite values")
        elif a.size and (a.min() < 0 or a.max() >= cfg.n_expert):
            bad = int(a.min()) if a.min() < 0 else int(a.max())
            raise DS4FormatError(f"{where}: tensor {name} holds expert id {bad}, expected 0..{cfg.n_expert - 1}")


def _check_expert_types(found: dict[str, TensorInfo], cfg: ModelConfig, where: str) -> None:
    """Routed gate and up must share one type; down may differ (docs/model.md §3.1)."""
    for il in range(cfg.n_layer):
        g, u = (found[f"blk.{il}.ffn_{k}_exps.weight"].qtype for k in ("gate", "up"))
        if g != u:
            raise DS4FormatError(
                f"{where}: blk.{il}.ffn_gate_exps.weight is {g.name} but ffn_up_exps is {u.name}; "
                "gate and up must share a type"
            )
