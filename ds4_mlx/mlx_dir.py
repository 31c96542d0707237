"""Open a converted ds4-mlx model directory (``ds4-mlx convert``): the same config, weights and tokenizer data
as :func:`ds4_mlx.gguf_file.open_gguf` + :func:`load_weights` give for the source GGUF, read with ``mx.load``.

Directory layout (format version :data:`FORMAT_VERSION`)::

    config.json                     every ModelConfig field + {"ds4_mlx": {format, format_version, source}}
    tokenizer.json                  Hugging Face ``tokenizers`` file (byte-level BPE + ds4 split + 7 specials)
    tokenizer_config.json           HF-style specials + ``ds4_chat`` rendering settings (+ GGUF token types)
    model.safetensors.index.json    weight_map, per-shard {size, sha256}, per-tensor {qtype, shape}
    model-0000i-of-0000n.safetensors  tensors under GGUF names, bytes exactly as in the GGUF:
                                    block types as uint8 ``(*shape[:-1], row_bytes)``, F16/F32/BF16/I32 as is

Load-time checks: format version, every shard present with its recorded size, tensor names/types/shapes
against the DS4 layout. Shard checksums (sha256, ~1.7 GB/s on one core, i.e. ~50 s for the 81 GB model) are
checked at convert time and by :func:`verify_dir` (``verify=True``), not on every load.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from gguf import GGMLQuantizationType as T

from .config import ModelConfig
from .gguf_file import DS4FormatError, TokenizerData
from .layout import expected_tensors, optional_tensors

FORMAT = "ds4-mlx"
FORMAT_VERSION = 1
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
HASH_CHUNK = 16 << 20

_TUPLE_FIELDS = ("compress_ratios", "swiglu_clamp", "expert_types")


def is_mlx_dir(path: str | os.PathLike) -> bool:
    """True for a directory holding a ``config.json`` (what ``load`` treats as a converted model)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v) for f in fields(cfg)}


def config_from_json(d: dict[str, Any], where: str) -> ModelConfig:
    names = [f.name for f in fields(ModelConfig)]
    missing = [n for n in names if n not in d]
    if missing:
        raise DS4FormatError(f"{where}: config.json lacks ModelConfig field(s) {', '.join(missing)}")
    return ModelConfig(**{n: tuple(d[n]) if n in _TUPLE_FIELDS else d[n] for n in names})


def sha256_file(path: Path, progress=None) -> str:
    """sha256 of a file, read in 16 MiB chunks into one reused buffer (``progress(n)`` after each)."""
    h, buf = hashlib.sha256(), bytearray(HASH_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress(n)
    return h.hexdigest()


def _read_json(path: Path, what: str) -> dict[str, Any]:
    if not path.is_file():
        raise DS4FormatError(f"{path}: missing {what} (not a complete ds4-mlx model directory; re-run ds4-mlx convert)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise DS4FormatError(f"{path}: corrupt {what}: {e}") from None


def read_dir_config(path: str | os.PathLike) -> tuple[ModelConfig, dict[str, Any]]:
    """``config.json`` → (ModelConfig, the ``ds4_mlx`` format block); fails on another format/version."""
    root = Path(path)
    d = _read_json(root / CONFIG, "config.json")
    fmt = d.get("ds4_mlx")
    where = str(root / CONFIG)
    if not isinstance(fmt, dict) or fmt.get("format") != FORMAT:
        raise DS4FormatError(f"{where}: not a ds4-mlx model directory (no \"ds4_mlx\": {{\"format\": \"{FORMAT}\"}})")
    if fmt.get("format_version") != FORMAT_VERSION:
        raise DS4FormatError(
            f"{where}: ds4-mlx format version {fmt.get('format_version')!r}, this ds4_mlx reads version "
            f"{FORMAT_VERSION}; re-convert the GGUF with this version (ds4-mlx convert MODEL.gguf {root})"
        )
    return config_from_json(d, where), fmt


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The shard index, after checking every shard exists with its recorded size."""
    root = Path(path)
    index = _read_json(root / INDEX, INDEX)
    for name in ("shards", "tensors", "weight_map"):
        if name not in index:
            raise DS4FormatError(f"{root / INDEX}: missing {name!r}")
    for shard, info in index["shards"].items():
        f = root / shard
        if not f.is_file():
            raise DS4FormatError(f"{f}: missing shard (listed in {INDEX}); re-run ds4-mlx convert to resume")
        size = f.stat().st_size
        if size != info["size"]:
            raise DS4FormatError(
                f"{f}: shard is {size} bytes, the index records {info['size']} (truncated or corrupt); "
                "delete it and re-run ds4-mlx convert"
            )
    return index


def verify_dir(path: str | os.PathLike, progress=None) -> None:
    """Full check: :func:`read_index` plus every shard's sha256 against the index."""
    root = Path(path)
    index = read_index(root)
    for shard, info in index["shards"].items():
        got = sha256_file(root / shard, progress)
        if got != info["sha256"]:
            raise DS4FormatError(
                f"{root / shard}: sha256 {got[:16]}… does not match the index ({info['sha256'][:16]}…): corrupt shard; "
                "delete it and re-run ds4-mlx convert"
            )


def tokenizer_data_from_files(root: Path) -> TokenizerData:
    """GGUF ``tokenizer.ggml.*`` data back from ``tokenizer.json`` (+ exact lists the converter stored when the
    HF vocab could not hold them, e.g. duplicate token strings)."""
    tcfg = _read_json(root / TOKENIZER_CONFIG, TOKENIZER_CONFIG)
    exact = tcfg.get("ds4_gguf_tokenizer", {})
    if "tokens" in exact and "merges" in exact:
        tokens, merges = exact["tokens"], exact["merges"]
    else:
        hf = _read_json(root / TOKENIZER, TOKENIZER)
        tokens, merges = tokenizer_lists_from_hf(hf)
    return TokenizerData(list(tokens), list(merges), tcfg.get("ds4_token_types"))


def tokenizer_lists_from_hf(hf: dict[str, Any]) -> tuple[list[str], list[str]]:
    vocab: dict[str, int] = hf["model"]["vocab"]
    tokens: list[str | None] = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in hf["model"]["merges"]]
    return tokens, merges  # type: ignore[return-value]


def _check_layout(cfg: ModelConfig, tensors: dict[str, Any], where: str) -> None:
    expected, optional = expected_tensors(cfg), optional_tensors(cfg)
    for name, info in tensors.items():
        spec = expected.get(name) or optional.get(name)
        if spec is None:
            raise DS4FormatError(f"{where}: unexpected tensor {name} (not part of the DS4 layout for this config)")
        if T[info["qtype"]] not in spec.types or tuple(info["shape"]) != spec.shape:
            raise DS4FormatError(
                f"{where}: tensor {name} is {info['qtype']}{info['shape']}, expected "
                f"{'/'.join(t.name for t in spec.types)}{list(spec.shape)}"
            )
    missing = [n for n in expected if n not in tensors]
    if missing:
        raise DS4FormatError(f"{where}: missing tensor {missing[0]}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def open_mlx_dir(
    path: str | os.PathLike, *, verify: bool = False
) -> tuple[ModelConfig, dict[str, Any], TokenizerData]:
    """Open a converted directory → ``(config, weights, tokenizer_data)``, the same values as
    ``open_gguf`` / ``load_weights`` on the source GGUF (weights keyed by GGUF name; matrices as
    :class:`~ds4_mlx.weights.QuantWeight` over the raw GGUF bytes, vectors float32, tid2eid int32).

    Shards are opened with ``mx.load`` (lazy: bytes are read when first evaluated). Sizes are always
    checked; ``verify=True`` also checks every shard's sha256 (reads the whole model once).
    Raises :class:`DS4FormatError` with a message naming the file and the fix.
    """
    import mlx.core as mx

    from .weights import QuantWeight

    root = Path(path)
    cfg, _ = read_dir_config(root)
    if verify:
        verify_dir(root)
    index = read_index(root)
    _check_layout(cfg, index["tensors"], str(root / INDEX))

    arrays: dict[str, mx.array] = {}
    for shard in index["shards"]:
        try:
            arrays.update(mx.load(str(root / shard)))
        except Exception as e:  # MLX raises RuntimeError/ValueError on a bad header
            raise DS4FormatError(f"{root / shard}: cannot read safetensors shard ({e})") from None
    weights: dict[str, Any] = {}
    for name, info in index["tensors"].items():
        a = arrays.get(name)
        if a is None:
            raise DS4FormatError(f"{root / index['weight_map'][name]}: tensor {name} missing from the shard")
        qtype, shape = T[info["qtype"]], tuple(info["shape"])
        if name.endswith("ffn_gate_tid2eid.weight"):
            weights[name] = a if a.dtype == mx.int32 else a.astype(mx.int32)
        elif len(shape) == 1:
            weights[name] = a if a.dtype == mx.float32 else a.astype(mx.float32)
        else:
            try:
                weights[name] = QuantWeight(a, qtype, shape)
            except ValueError as e:
                raise DS4FormatError(f"{root / index['weight_map'][name]}: {e}") from None
    return cfg, weights, tokenizer_data_from_files(root)


def check_model(path: str | os.PathLike) -> ModelConfig:
    """Cheap validation of a GGUF file or a converted directory (no weights read) → its config.
    Raises :class:`DS4FormatError`. For the CLI / server's early model check."""
    if Path(path).is_dir():
        cfg, _ = read_dir_config(path)
        _check_layout(cfg, read_index(path)["tensors"], str(Path(path) / INDEX))
        return cfg
    from .gguf_file import open_gguf

    return open_gguf(path).config


def open_tokenizer_data(path: str | os.PathLike) -> TokenizerData:
    """The GGUF tokenizer data of a GGUF file or a converted directory (for ``Tokenizer.from_gguf``)."""
    if Path(path).is_dir():
        read_dir_config(path)
        return tokenizer_data_from_files(Path(path))
    from .gguf_file import open_gguf

    return open_gguf(path).tokenizer
