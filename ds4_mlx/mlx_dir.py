"""Open a converted ds4-mlx model directory (``ds4-mlx convert``): the same config, weights and tokenizer data
as :func:`ds4_mlx.gguf_file.open_gguf` + :func:`load_weights` give for the source GGUF, read with ``mx.load``.

Directory layout (format version :data:`FORMAT_VERSION`)::

    config.json                     every ModelConfig field + {"ds4_mlx": {format, format_version, source}}
    tokenizer.json                  Hugging Face ``tokenizers`` file (byte-level BPE + ds4 split + 7 specials)
    tokenizer_config.json           HF-style specials + ``ds4_chat`` rendering settings (+ GGUF token types)
    model.safetensors.index.json    weight_map, per-shard {size, sha256}, per-tensor {qtype, shape}
    model-0000i-of-0000n.safetensors  tensors under GGUF names, bytes exactly as in the GGUF:
                                    block types as uint8 ``(*shape[:-1], row_bytes)``, F16/F32/BF16/I32 as is

Load-time checks (:func:`check_model`, also what ``inspect`` runs): format version, the config's types and
ranges (:func:`~ds4_mlx.config.check_config`, the rules a GGUF's metadata meets), every shard present with its
recorded size and a header that places each tensor where the index says, tensor names/types/shapes against the
DS4 layout, finite values in the small tensors, and a tokenizer that builds. Shard checksums (sha256, ~1.7 GB/s
on one core, i.e. ~50 s for the 81 GB model) are checked at convert time and by :func:`verify_dir`
(``verify=True``), not on every load.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .config import DS4FormatError, ModelConfig, check_config
from .gguf_file import TokenizerData, check_tensor_values, check_tokenizer
from .layout import expected_tensors, optional_tensors, tensor_nbytes

FORMAT = "ds4-mlx"
FORMAT_VERSION = 1
CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
HASH_CHUNK = 16 << 20

_TUPLE_FIELDS = ("compress_ratios", "swiglu_clamp", "expert_types")
# safetensors dtype of the tensors stored as they are; every block-quantized type is stored as raw uint8 rows
ST_DTYPE = {T.F32: "F32", T.F16: "F16", T.BF16: "BF16", T.I32: "I32"}
_NP_DTYPE = {"F32": np.float32, "I32": np.int32}  # the small tensors whose values are checked at load


def is_mlx_dir(path: str | os.PathLike) -> bool:
    """True for a directory holding a ``config.json`` (what ``load`` treats as a converted model)."""
    p = Path(path)
    return p.is_dir() and (p / CONFIG).is_file()


def config_to_json(cfg: ModelConfig) -> dict[str, Any]:
    return {f.name: (list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v) for f in fields(cfg)}


def config_from_json(d: dict[str, Any], where: str) -> ModelConfig:
    """``config.json``'s fields → a :class:`ModelConfig` checked like a GGUF's metadata (names as in the file)."""
    names = [f.name for f in fields(ModelConfig)]
    missing = [n for n in names if n not in d]
    if missing:
        raise DS4FormatError(f"{where}: config.json lacks ModelConfig field(s) {', '.join(missing)}")
    cfg = ModelConfig(**{n: tuple(d[n]) if n in _TUPLE_FIELDS and isinstance(d[n], list) else d[n] for n in names})
    check_config(cfg, where)
    types = cfg.expert_types
    if not (isinstance(types, tuple) and len(types) == 3 and all(t in T.__members__ for t in types)):
        raise DS4FormatError(f"{where}: expert_types = {_short(types)}, expected three GGML type names")
    return cfg


def storage_layout(qtype: T, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(safetensors dtype, stored shape) of a GGUF tensor: block types as uint8 ``(*shape[:-1], row_bytes)``."""
    if qtype in ST_DTYPE:
        return ST_DTYPE[qtype], tuple(shape)
    block, type_size = GGML_QUANT_SIZES[qtype]
    return "U8", (*shape[:-1], shape[-1] // block * type_size)


def _short(value: Any, n: int = 80) -> str:
    r = repr(value)
    return r if len(r) <= n else r[: n - 1] + "…"


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
    where = str(root / CONFIG)
    if not isinstance(d, dict):
        raise DS4FormatError(f"{where}: expected a JSON object, found {type(d).__name__}")
    fmt = d.get("ds4_mlx")
    if not isinstance(fmt, dict) or fmt.get("format") != FORMAT:
        raise DS4FormatError(f"{where}: not a ds4-mlx model directory (no \"ds4_mlx\": {{\"format\": \"{FORMAT}\"}})")
    if fmt.get("format_version") != FORMAT_VERSION:
        raise DS4FormatError(
            f"{where}: ds4-mlx format version {fmt.get('format_version')!r}, this ds4_mlx reads version "
            f"{FORMAT_VERSION}; re-convert the GGUF with this version (ds4-mlx convert MODEL.gguf {root})"
        )
    return config_from_json(d, where), fmt


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The shard index, after checking its structure and that every shard exists with its recorded size."""
    root = Path(path)
    index = _read_json(root / INDEX, INDEX)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DS4FormatError(f"{root / INDEX}: {what}")

    need(isinstance(index, dict), f"expected a JSON object, found {type(index).__name__}")
    for name in ("shards", "tensors", "weight_map"):
        need(name in index, f"missing {name!r}")
        need(isinstance(index[name], dict), f"{name!r} is {type(index[name]).__name__}, expected an object")
    for shard, info in index["shards"].items():
        need(Path(shard).name == shard and shard.endswith(".safetensors"), f"shard {shard!r} is not a .safetensors file name")
        need(isinstance(info, dict) and type(info.get("size")) is int and info["size"] >= 8
             and isinstance(info.get("sha256"), str),
             f"shard {shard}: {_short(info)}, expected {{\"size\": bytes, \"sha256\": hex digest}}")
    for name, t in index["tensors"].items():
        need(isinstance(t, dict) and t.get("qtype") in T.__members__ and isinstance(t.get("shape"), list)
             and all(type(d) is int and d > 0 for d in t["shape"]),
             f"tensor {name}: {_short(t)}, expected {{\"qtype\": GGML type name, \"shape\": [positive integers]}}")
        need(index["weight_map"].get(name) in index["shards"], f"weight_map puts tensor {name} in no listed shard")
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


def verify_dir(path: str | os.PathLike, progress=None, index: dict[str, Any] | None = None) -> None:
    """Full check: :func:`read_index` (or the ``index`` it gave) plus every shard's sha256 against the index."""
    root = Path(path)
    index = index or read_index(root)
    for shard, info in index["shards"].items():
        got = sha256_file(root / shard, progress)
        if got != info["sha256"]:
            raise DS4FormatError(
                f"{root / shard}: sha256 {got[:16]}… does not match the index ({info['sha256'][:16]}…): corrupt shard; "
                "delete it and re-run ds4-mlx convert"
            )


def tokenizer_data_from_files(root: Path, n_vocab: int) -> TokenizerData:
    """GGUF ``tokenizer.ggml.*`` data back from ``tokenizer.json`` (+ exact lists the converter stored when the
    HF vocab could not hold them, e.g. duplicate token strings), checked like a GGUF's (one token per vocab id,
    the specials, merges over the vocabulary)."""
    tcfg = _read_json(root / TOKENIZER_CONFIG, TOKENIZER_CONFIG)
    if not isinstance(tcfg, dict):
        raise DS4FormatError(f"{root / TOKENIZER_CONFIG}: expected a JSON object, found {type(tcfg).__name__}")
    exact = tcfg.get("ds4_gguf_tokenizer") or {}
    types = tcfg.get("ds4_token_types")
    if isinstance(exact, dict) and "tokens" in exact and "merges" in exact:
        where, tokens, merges = root / TOKENIZER_CONFIG, exact["tokens"], exact["merges"]
        if not (isinstance(tokens, list) and isinstance(merges, list)):
            raise DS4FormatError(f"{where}: ds4_gguf_tokenizer.tokens/merges must be lists")
    else:
        where = root / TOKENIZER
        try:
            tokens, merges = tokenizer_lists_from_hf(_read_json(where, TOKENIZER))
        except ValueError as e:
            raise DS4FormatError(f"{where}: {e}") from None
    if types is not None and not (isinstance(types, list) and all(type(t) is int for t in types)):
        raise DS4FormatError(f"{root / TOKENIZER_CONFIG}: ds4_token_types must be a list of integers")
    data = TokenizerData(tokens, merges, types)
    check_tokenizer(data, n_vocab, str(where), source="tokenizer")
    return data


def tokenizer_lists_from_hf(hf: Any) -> tuple[list[str], list[str]]:
    """(tokens by id, ``"A B"`` merges) of a ``tokenizer.json``; ``ValueError`` when it has no BPE model."""
    model = hf.get("model") if isinstance(hf, dict) else None
    vocab, merges = (model.get("vocab"), model.get("merges")) if isinstance(model, dict) else (None, None)
    if not (isinstance(vocab, dict) and vocab and all(type(i) is int and 0 <= i < 1 << 24 for i in vocab.values())
            and isinstance(merges, list)):
        raise ValueError("expected a BPE model: model.vocab (token -> id) and model.merges (a list)")
    tokens: list[str | None] = [None] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    return tokens, [" ".join(m) if isinstance(m, list) else m for m in merges]  # type: ignore[return-value]


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
    found = tuple(tensors[f"blk.0.ffn_{k}_exps.weight"]["qtype"] for k in ("gate", "up", "down"))
    if found != cfg.expert_types:
        raise DS4FormatError(f"{where}: the experts are {'/'.join(found)}, config.json says {'/'.join(cfg.expert_types)}")


def _check_shards(root: Path, cfg: ModelConfig, index: dict[str, Any]) -> None:
    """Each shard's safetensors header must hold every tensor the index puts there, with the stored dtype and
    shape and its bytes inside the file; then the small tensors' values (:func:`check_tensor_values`)."""
    by_shard: dict[str, list[str]] = {}
    for name, shard in index["weight_map"].items():
        if name in index["tensors"]:
            by_shard.setdefault(shard, []).append(name)
    small: dict[str, np.ndarray] = {}
    for shard, names in by_shard.items():
        path = root / shard
        size = index["shards"][shard]["size"]
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            try:
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} in a file of {size} bytes")
                header = json.loads(f.read(n))
                if not isinstance(header, dict):
                    raise ValueError("the header is not a JSON object")
            except (ValueError, UnicodeDecodeError) as e:
                raise DS4FormatError(
                    f"{path}: corrupt safetensors header ({e}); delete it and re-run ds4-mlx convert") from None
            for name in names:
                info = index["tensors"][name]
                qtype, shape = T[info["qtype"]], tuple(info["shape"])
                dtype, stored = storage_layout(qtype, shape)
                nbytes = tensor_nbytes(shape, qtype)
                entry = header.get(name)
                ok = isinstance(entry, dict) and entry.get("dtype") == dtype and entry.get("shape") == list(stored)
                offsets = entry.get("data_offsets") if ok else None
                if not (ok and isinstance(offsets, list) and len(offsets) == 2
                        and all(type(o) is int for o in offsets) and 0 <= offsets[0]
                        and offsets[1] - offsets[0] == nbytes and 8 + n + offsets[1] <= size):
                    raise DS4FormatError(
                        f"{path}: corrupt safetensors header: tensor {name} is {_short(entry, 120)}, expected "
                        f"{dtype}{list(stored)} ({nbytes} bytes inside the file); delete it and re-run ds4-mlx convert")
                if dtype in _NP_DTYPE:
                    f.seek(8 + n + offsets[0])
                    small[name] = np.frombuffer(f.read(nbytes), _NP_DTYPE[dtype]).reshape(shape)
    check_tensor_values(small, cfg, str(root))


def _check_dir(root: Path, verify: bool = False) -> tuple[ModelConfig, dict[str, Any], TokenizerData]:
    """Every load-time check of a converted directory (the module docstring lists them), no weights read;
    ``verify``: the shards' checksums too, before their contents are looked at (a corrupt shard is named so)."""
    cfg, _ = read_dir_config(root)
    index = read_index(root)
    if verify:
        verify_dir(root, index=index)
    _check_layout(cfg, index["tensors"], str(root / INDEX))
    _check_shards(root, cfg, index)
    return cfg, index, tokenizer_data_from_files(root, cfg.n_vocab)


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
    cfg, index, tokenizer = _check_dir(root, verify)

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
    return cfg, weights, tokenizer


def check_model(path: str | os.PathLike, *, verify: bool = False) -> ModelConfig:
    """Cheap validation of a GGUF file or a converted directory (no weights read) → its config.
    Raises :class:`DS4FormatError`. For the CLI / server's early model check. ``verify``: a directory's shard
    checksums too (reads the whole model once)."""
    if Path(path).is_dir():
        return _check_dir(Path(path), verify)[0]
    from .gguf_file import open_gguf

    return open_gguf(path).config


def open_tokenizer_data(path: str | os.PathLike) -> TokenizerData:
    """The GGUF tokenizer data of a GGUF file or a converted directory (for ``Tokenizer.from_gguf``)."""
    if Path(path).is_dir():
        cfg, _ = read_dir_config(path)
        return tokenizer_data_from_files(Path(path), cfg.n_vocab)
    from .gguf_file import open_gguf

    return open_gguf(path).tokenizer
