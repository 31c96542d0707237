"""GGUF → ds4-mlx model directory (see :mod:`ds4_mlx.mlx_dir` for the layout).

Lossless: every tensor is copied byte for byte under its GGUF name (block types as uint8 rows, F16/F32/BF16/I32
as is); nothing is requantized or re-laid out. Streaming: tensor bytes go from the GGUF to the shard through one
reused 64 MiB buffer (``os.preadv``, no memmap touched), so resident memory stays ~100 MB whatever the model size.
Resumable: each finished shard's size and sha256 are recorded in a state file; a re-run skips a shard whose file
still has that size and hash. The source GGUF's sha256 (for ``config.json``) is computed by a second thread
reading the file sequentially while the shards are written.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as T
from numpy.lib.array_utils import byte_bounds

from ds4_mlx.gguf_file import DS4FormatError, GGUFModel, open_gguf
from ds4_mlx.mlx_dir import (
    CONFIG, FORMAT, FORMAT_VERSION, INDEX, TOKENIZER, TOKENIZER_CONFIG, config_to_json, sha256_file, storage_layout,
    tokenizer_lists_from_hf,
)

STATE = ".ds4-convert-state.json"  # resume record: source identity, plan, finished shards' size + sha256
COPY_CHUNK = 64 << 20


@dataclass
class Entry:
    """One tensor: where its bytes are in the GGUF and how they are stored in the shard."""

    name: str
    qtype: T
    shape: tuple[int, ...]  # row-major math shape
    storage_shape: tuple[int, ...]  # shape of the stored array (block types: (*shape[:-1], row_bytes))
    dtype: str  # safetensors dtype
    offset: int  # byte offset in the GGUF file
    nbytes: int


@dataclass
class Shard:
    filename: str
    entries: list[Entry] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def header(self) -> bytes:
        """safetensors header: u64 length + JSON (space-padded to 8 bytes), tensors packed in order."""
        meta: dict[str, Any] = {"__metadata__": {"format": "mlx", "ds4_mlx_format_version": str(FORMAT_VERSION)}}
        pos = 0
        for e in self.entries:
            meta[e.name] = {"dtype": e.dtype, "shape": list(e.storage_shape), "data_offsets": [pos, pos + e.nbytes]}
            pos += e.nbytes
        js = json.dumps(meta, separators=(",", ":")).encode()
        js += b" " * (-len(js) % 8)
        return len(js).to_bytes(8, "little") + js

    @property
    def size(self) -> int:
        return len(self.header()) + self.data_bytes


def _entry(name: str, t, file_base: int) -> Entry:
    dtype, storage = storage_layout(t.qtype, t.shape)
    if not t.data.flags.c_contiguous or t.data.nbytes != t.nbytes:
        raise DS4FormatError(f"{name}: tensor data is not one contiguous run of {t.nbytes} bytes in the GGUF")
    return Entry(name, t.qtype, tuple(t.shape), tuple(storage), dtype, byte_bounds(t.data)[0] - file_base, t.nbytes)


def _file_base(gguf: GGUFModel) -> int:
    """Address of byte 0 of the GGUF memmap that the tensor views point into."""
    a = next(iter(gguf.tensors.values())).data
    while isinstance(a.base, np.ndarray):
        a = a.base
    if not isinstance(a, np.memmap) or a.nbytes != gguf.path.stat().st_size:
        raise DS4FormatError(f"{gguf.path}: tensor data is not a view of the whole-file memmap")
    return byte_bounds(a)[0]


def plan_shards(gguf: GGUFModel, shard_bytes: float = 5e9) -> list[Shard]:
    """Tensors in file order, packed greedily into shards of at most ``shard_bytes`` (a larger single
    tensor gets a shard of its own). Named ``model-0000i-of-0000n.safetensors``."""
    base = _file_base(gguf)
    entries = sorted((_entry(n, t, base) for n, t in gguf.tensors.items()), key=lambda e: e.offset)
    groups: list[list[Entry]] = [[]]
    size = 0
    for e in entries:
        if groups[-1] and size + e.nbytes > shard_bytes - 1_000_000:  # leave room for the header
            groups.append([])
            size = 0
        groups[-1].append(e)
        size += e.nbytes
    n = len(groups)
    return [Shard(f"model-{i + 1:05d}-of-{n:05d}.safetensors", g) for i, g in enumerate(groups)]


# ---- writing ---------------------------------------------------------------------------------------------------


def _write_json(path: Path, obj: Any, indent: int | None = 2) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(obj, indent=indent, ensure_ascii=False), encoding="utf-8")
    os.replace(tmp, path)


def _write_shard(src_fd: int, shard: Shard, out: Path, buf: bytearray, advance) -> str:
    """Copy the shard's tensors from the GGUF into ``out`` (via ``out.partial``, renamed at the end); sha256."""
    h = hashlib.sha256()
    view = memoryview(buf)
    tmp = out.with_name(out.name + ".partial")
    with open(tmp, "wb", buffering=0) as f:
        head = shard.header()
        h.update(head)
        f.write(head)
        for e in shard.entries:
            pos, end = e.offset, e.offset + e.nbytes
            while pos < end:
                n = os.preadv(src_fd, [view[: min(len(buf), end - pos)]], pos)
                if n <= 0:
                    raise DS4FormatError(f"{e.name}: GGUF ended while reading the tensor at byte {pos}")
                h.update(view[:n])
                f.write(view[:n])
                pos += n
                advance(n)
        os.fsync(f.fileno())
    os.replace(tmp, out)
    return h.hexdigest()


def _load_state(out_dir: Path, source: dict, plan: list[Shard]) -> dict:
    want = {"source": {k: source[k] for k in ("size", "mtime_ns")}, "plan": {s.filename: s.size for s in plan}}
    try:
        state = json.loads((out_dir / STATE).read_text())
        if state.get("source", {}).get("size") == source["size"] and state["source"].get("mtime_ns") == source["mtime_ns"] \
                and state.get("plan") == want["plan"]:
            return state
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    return {**want, "shards": {}}


def _progress(enabled: bool):
    if not enabled:
        return None
    from rich.progress import (
        BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn,
    )

    return Progress(
        TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn(), TimeRemainingColumn(),
    )


def _human(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{int(n)} B"


def describe_plan(gguf: GGUFModel, plan: list[Shard]) -> str:
    lines = [f"{gguf.path}: {len(gguf.tensors)} tensors, {_human(gguf.nbytes)} of tensor data, "
             f"experts {gguf.config.experts_label}; {len(plan)} shard(s):"]
    for s in plan:
        types: dict[str, int] = {}
        for e in s.entries:
            types[e.qtype.name] = types.get(e.qtype.name, 0) + e.nbytes
        mix = ", ".join(f"{k} {_human(v)}" for k, v in sorted(types.items(), key=lambda kv: -kv[1]))
        lines.append(f"  {s.filename}  {len(s.entries):5d} tensors  {_human(s.size):>10}  ({mix})")
    lines.append(f"  + {CONFIG}, {TOKENIZER}, {TOKENIZER_CONFIG}, {INDEX}")
    return "\n".join(lines)


def convert(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dry_run: bool = False,
    shard_bytes: float = 5e9,
    progress: bool = True,
    measure_load: bool = False,
    log=print,
) -> dict[str, Any]:
    """Convert ``gguf_path`` into the model directory ``out_dir``; returns a report dict.

    ``dry_run`` only prints the plan. A re-run over a partly written ``out_dir`` keeps every shard whose size
    and sha256 match the state file (``report["skipped"]``). ``measure_load`` loads the model both ways at the
    end (GGUF vs directory, all weights evaluated) and reports the times and their ratio.
    """
    from ds4_mlx.tokenizer import Tokenizer

    t_start = time.perf_counter()
    src = Path(gguf_path)
    gguf = open_gguf(src)
    plan = plan_shards(gguf, shard_bytes)
    total = sum(s.size for s in plan)
    report: dict[str, Any] = {"source": str(src), "out_dir": str(out_dir), "shards": [s.filename for s in plan],
                              "bytes": total, "written": [], "skipped": []}
    if dry_run:
        log(describe_plan(gguf, plan))
        return report

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    st = src.stat()
    source = {"path": str(src.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    state = _load_state(out, source, plan)
    bar = _progress(progress)

    # source sha256 in a second thread (hashlib and file reads release the GIL), unless a resume already has it
    src_hash: dict[str, str] = {}
    cached = state["source"].get("sha256")
    hasher = None
    if cached:
        src_hash["sha256"] = cached
    else:
        hash_task = bar.add_task("sha256 source", total=st.st_size) if bar else None

        def hash_source() -> None:
            adv = (lambda n: bar.advance(hash_task, n)) if bar else None
            src_hash["sha256"] = sha256_file(src, adv)

        hasher = threading.Thread(target=hash_source, daemon=True)

    index_shards: dict[str, dict] = {}
    try:
        if bar:
            bar.start()
        if hasher:
            hasher.start()
        task = bar.add_task("convert", total=total) if bar else None
        advance = (lambda n: bar.advance(task, n)) if bar else (lambda n: None)
        buf = bytearray(min(COPY_CHUNK, max(1 << 20, max(e.nbytes for s in plan for e in s.entries))))
        fd = os.open(src, os.O_RDONLY)
        try:
            for s in plan:
                path = out / s.filename
                done = state["shards"].get(s.filename)
                if done and path.is_file() and path.stat().st_size == s.size == done["size"] \
                        and sha256_file(path) == done["sha256"]:
                    report["skipped"].append(s.filename)
                    index_shards[s.filename] = done
                    advance(s.size)
                    continue
                digest = _write_shard(fd, s, path, buf, advance)
                index_shards[s.filename] = state["shards"][s.filename] = {"size": s.size, "sha256": digest}
                _write_json(out / STATE, state)
                report["written"].append(s.filename)
        finally:
            os.close(fd)
        if hasher:
            hasher.join()
            state["source"]["sha256"] = src_hash["sha256"]
            _write_json(out / STATE, state)
    finally:
        if bar:
            bar.stop()

    tok = Tokenizer.from_gguf(gguf.tokenizer)
    _write_tokenizer(out, tok, gguf)
    cfg_json = config_to_json(gguf.config)
    cfg_json["ds4_mlx"] = {
        "format": FORMAT, "format_version": FORMAT_VERSION,
        "source": {"file": src.name, "sha256": src_hash["sha256"], "size": st.st_size},
    }
    _write_json(out / CONFIG, cfg_json)
    # the index goes last: a directory without it is visibly incomplete
    _write_json(out / INDEX, {
        "metadata": {"format": FORMAT, "format_version": FORMAT_VERSION, "total_size": total},
        "shards": index_shards,
        "tensors": {e.name: {"qtype": e.qtype.name, "shape": list(e.shape)} for s in plan for e in s.entries},
        "weight_map": {e.name: s.filename for s in plan for e in s.entries},
    })
    elapsed = time.perf_counter() - t_start
    report.update(seconds=elapsed, source_sha256=src_hash["sha256"])
    written_bytes = sum(s.size for s in plan if s.filename in report["written"])
    report["bytes_per_s"] = written_bytes / elapsed if elapsed > 0 else 0.0
    log(f"wrote {out}: {len(report['written'])} shard(s) written, {len(report['skipped'])} kept, "
        f"{_human(total)} in {elapsed:.1f} s ({_human(report['bytes_per_s'])}/s)")
    if measure_load:
        report.update(measure_load_times(src, out))
        log(f"load (all weights evaluated): GGUF {report['load_gguf_s']:.2f} s, directory {report['load_dir_s']:.2f} s "
            f"(GGUF/dir = {report['load_ratio']:.2f}x)")
    return report


def _write_tokenizer(out: Path, tok, gguf: GGUFModel) -> None:
    """``tokenizer.json`` (HF) and ``tokenizer_config.json`` (specials, chat-rendering settings, token types).
    The GGUF token/merge lists are stored verbatim as well only if the HF vocab cannot give them back."""
    from ds4_mlx import chat
    from ds4_mlx.tokenizer import SPECIAL_TOKENS

    text = tok.to_hf_json()
    (out / TOKENIZER).write_text(text, encoding="utf-8")
    tokens, merges = tokenizer_lists_from_hf(json.loads(text))
    tcfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok.tokens[tok.bos_id],
        "eos_token": tok.tokens[tok.eos_id],
        "add_bos_token": False,  # the ds4 renderers write BOS themselves
        "clean_up_tokenization_spaces": False,
        "model_max_length": gguf.config.context_length or None,
        "ds4_chat": {
            "renderer": "ds4_mlx.chat (docs/serving.md §2)",
            "pretokenizer": tok.pretokenizer,
            "special_tokens": {s: tok.special_ids[s] for s in SPECIAL_TOKENS},
            "default_system": chat.DEFAULT_SYSTEM,
            "think_modes": [m.value for m in chat.ThinkMode],
            "default_think_mode": chat.ThinkMode.HIGH.value,
            "think_max_min_ctx": chat.THINK_MAX_MIN_CTX,
            "think_max_prefix": chat.THINK_MAX_PREFIX,
        },
        "ds4_token_types": gguf.tokenizer.token_types,
    }
    if tokens != list(gguf.tokenizer.tokens) or merges != list(gguf.tokenizer.merges):
        tcfg["ds4_gguf_tokenizer"] = {"tokens": list(gguf.tokenizer.tokens), "merges": list(gguf.tokenizer.merges)}
    _write_json(out / TOKENIZER_CONFIG, tcfg)


def measure_load_times(gguf_path: Path, out_dir: Path) -> dict[str, float]:
    """Wall time to open, build the weights dict with every weight evaluated, and build the tokenizer:
    GGUF (``open_gguf`` + ``load_weights``) vs directory (``open_mlx_dir``), same process, same work."""
    import gc

    import mlx.core as mx

    from ds4_mlx.gguf_file import load_weights
    from ds4_mlx.mlx_dir import open_mlx_dir
    from ds4_mlx.tokenizer import Tokenizer

    def open_either(p: Path):
        if p.is_dir():
            _, weights, tok = open_mlx_dir(p)
        else:
            g = open_gguf(p)
            weights, tok = load_weights(g), g.tokenizer
        return weights, Tokenizer.from_gguf(tok)

    def timed(p: Path) -> float:
        t = time.perf_counter()
        weights, _ = open_either(p)
        mx.eval([getattr(w, "data", w) for w in weights.values()])
        dt = time.perf_counter() - t
        del weights
        gc.collect()
        return dt

    t_gguf, t_dir = timed(gguf_path), timed(out_dir)
    return {"load_gguf_s": t_gguf, "load_dir_s": t_dir, "load_ratio": t_gguf / t_dir if t_dir else float("inf")}
