"""Disk KV cache: session payloads ("DSV4", docs/model.md §5.2) and KVC cache files (docs/serving.md §5.4-5.7).

A *payload* is everything the next token needs — token ids, the last logits and every layer's state (raw
window rows in position order, compressed rows, compressor frontiers, indexer rows and frontiers) — laid out
like ds4's ``ds4_session_save_payload()``: rows are written as f32 (our f16 rows are f16-exact, so the round
trip is exact) and read back in the dtype the engine keeps them in.

A *KVC file* wraps a payload with a 52-byte header, the cache text (the rendered bytes of the cached prefix;
the file is named after its SHA1) and an optional tool-id map. :class:`DiskCache` is the directory: save
policy helpers, lookup of the longest cached byte prefix of a prompt, load, budget and eviction, and counters
that explain every hit and miss.

Files are interchangeable with ds4's. ds4-mlx writes the header bytes and payload fields as ds4 does (its
prefill chunk, zeros where ds4 reserves) and the indexer rows in ds4's Hadamard-rotated form under either numeric
profile, and appends a :class:`KVFooter` that ds4 never reads: the writer's model fingerprint and CRCs of the
payload and the tool-id map, so a corrupt file is refused with a reason instead of loaded. ds4's own files have
no footer and are loaded on the payload's checks alone.

Research scripts use two functions::

    from ds4_mlx.kvstore import session_to_file, session_from_file
    session_to_file(session, "state.kv", text=b"...")  # any cache key; the tokenizer's bytes by default
    session = session_from_file(model, "state.kv")     # a new Session that continues like the saved one

(bit-identical under the ``ds4`` profile; under ``hf`` the indexer rows, rotated to ds4's form and back, are
exact to f32 rounding: they only rank compressed rows, and the tests' continuations equal uninterrupted runs).

Every malformed, truncated, foreign or incompatible input raises :class:`KVCacheError` with a reason; the
directory-level API turns that into a logged skip (never a crash, never a half-restored session).
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import re
import struct
import threading
import time
import zlib
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .numerics import f16r

PAYLOAD_MAGIC = 0x34565344  # "DSV4" little-endian
PAYLOAD_VERSION = 1
KVC_MAGIC = b"KVC"
KVC_VERSION = 1
DEFAULT_CTX = 32768
HEADER = struct.Struct("<3sBBBBBIIIIQQQI")  # docs/serving.md §5.4: 52 bytes, then the cache text
assert HEADER.size == 52
PAYLOAD_HEAD = struct.Struct("<13I")
DS4_PREFILL_CHUNK = 2048  # ds4's prefill chunk for contexts longer than that
REASONS = {0: "unknown", 1: "cold", 2: "continued", 3: "evict", 4: "shutdown", 5: "agent", 6: "agent"}
REASON_CODES = {"unknown": 0, "cold": 1, "continued": 2, "evict": 3, "shutdown": 4, "agent": 5}
FLAG_TOOL_MAP, FLAG_RESPONSES_VISIBLE, FLAG_THINKING_VISIBLE = 1, 2, 4
NAME_RE = re.compile(r"^[0-9a-f]{40}\.kv$")
TMP_RE = re.compile(r"^[0-9a-f]{40}\.kv\.tmp\.(\d+)(?:\.\d+)?$")  # ds4: .tmp.<pid>; ds4-mlx: .tmp.<pid>.<tid>
STALE_TMP_S = 3600.0  # no save takes this long
FOOTER = struct.Struct("<3sBIIIQ")  # KVFooter: magic, version, fingerprint, payload CRC, trailer CRC, payload bytes
FOOTER_MAGIC, FOOTER_VERSION = b"KVI", 1
HALF_LIFE_S = 6 * 3600.0


class KVCacheError(Exception):
    """A payload or cache file that cannot be used; ``str(e)`` is the reason."""


# --- model identity ------------------------------------------------------------------------------------------
def quant_bits(model) -> int:
    """Routed-expert quant bits of ``model`` (header byte 4): 2 (IQ2_XXS/Q2_K), 4 (Q4_K), else the type's width."""
    name = model.layers[0].ffn.ffn_gate_exps.qtype.name
    return {"IQ2_XXS": 2, "Q2_K": 2, "Q4_K": 4, "Q8_0": 8, "F16": 16, "BF16": 16, "F32": 32}.get(name, 0)


def model_fingerprint(model) -> int:
    """A u32 that tells models of the same shape apart (header bytes 20-23, 0 in ds4's files = unknown):
    CRC32 of the first rows of the embedding and the LM head."""
    crc = 0
    for w in (model.token_embd, model.output):
        crc = zlib.crc32(np.asarray(w.data[:4]).tobytes(), crc)
    return crc or 1


# --- the session payload (docs/model.md §5.2) --------------------------------------------------------------------
def _f32(a: mx.array | None, n: int | None = None) -> bytes:
    if a is None:
        return b""
    if n is not None:
        a = a[:n]
    return np.asarray(a.astype(mx.float32)).astype("<f4", copy=False).tobytes()


def ds4_prefill_chunk(ctx: int) -> int:
    """The prefill chunk ds4 records for a context of ``ctx`` tokens (2048, or the whole context when shorter).
    ds4 loads only a payload whose value equals its own, so files are written with it whatever chunk the
    session prefilled with; ds4-mlx's prefill gives the same state for any chunking, so loading ignores it."""
    return min(DS4_PREFILL_CHUNK, ctx)


def _payload_dims(cfg, ctx: int) -> list[int]:
    """The 13 header words as ds4 writes them (token and raw-row counts left 0 for the caller)."""
    raw_cap = min(cfg.n_swa, ctx)
    comp_cap = ctx // min(r for r in cfg.compress_ratios if r) + 2
    return [PAYLOAD_MAGIC, PAYLOAD_VERSION, ctx, ds4_prefill_chunk(ctx), raw_cap, raw_cap, comp_cap, 0, cfg.n_layer,
            cfg.head_dim, cfg.indexer_head_dim, cfg.n_vocab, 0]


@functools.cache
def _hadamard(n: int) -> np.ndarray:
    """The normalized Sylvester Hadamard matrix in float64 (symmetric and orthogonal: its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def _indexer_rows(rows: np.ndarray, numerics) -> np.ndarray:
    """Indexer compressed rows (f32) between the engine's form and ds4's, in either direction. ds4 stores them
    Hadamard-rotated (its FP4 simulation of the indexer, which the ``ds4`` profile keeps); the ``hf`` profile keeps
    them unrotated (it rotates its queries neither), so it converts on save and on load, in float64: a round
    trip is exact to f32 rounding."""
    if numerics.indexer_qat or not len(rows):
        return rows
    return (rows.astype(np.float64) @ _hadamard(rows.shape[-1])).astype(np.float32)


def session_payload(session, *, ctx: int = DEFAULT_CTX) -> bytes:
    """The "DSV4" v1 payload of ``session``'s current state (ds4's layout and row forms; every row as f32)."""
    cfg = session.model.cfg
    tokens = session.tokens
    N = len(tokens)
    if N == 0 or session.logits is None:
        raise KVCacheError("empty session")
    R = min(N, cfg.n_swa)
    head = _payload_dims(cfg, ctx)
    head[7], head[12] = N, R
    caches = session.model.layer_caches(session.caches)  # over several ranks: the others' layers too
    parts = [PAYLOAD_HEAD.pack(*head), np.asarray(tokens, "<u4").tobytes(), _f32(session.logits.reshape(-1)),
             np.asarray([c.n_comp for c in caches], "<u4").tobytes(),
             np.asarray([c.n_index for c in caches], "<u4").tobytes()]
    for c in caches:
        if c.pos != N or c.n_raw != R:
            raise KVCacheError(f"layer cache at {c.pos} tokens / {c.n_raw} raw rows, session at {N}")
        parts.append(_f32(c.raw))
        if c.ratio:
            parts += [_f32(c.comp, c.n_comp), _f32(c.comp_state.kv), _f32(c.comp_state.score)]
        if c.index is not None:
            rows = _indexer_rows(np.asarray(c.index[: c.n_index].astype(mx.float32)), session.model.numerics)
            parts += [rows.astype("<f4", copy=False).tobytes(), _f32(c.index_state.kv), _f32(c.index_state.score)]
    return b"".join(parts)


class _Reader:
    def __init__(self, data: bytes | memoryview) -> None:
        self.data, self.off = memoryview(data), 0

    def take(self, nbytes: int) -> memoryview:
        if self.off + nbytes > len(self.data):
            raise KVCacheError(f"payload truncated at byte {self.off} (needs {nbytes} more)")
        out = self.data[self.off : self.off + nbytes]
        self.off += nbytes
        return out

    def u32(self, n: int) -> np.ndarray:
        return np.frombuffer(self.take(4 * n), "<u4")

    def f32(self, *shape: int) -> np.ndarray:
        arr = np.frombuffer(self.take(4 * math.prod(shape)), "<f4").reshape(shape)
        if np.isnan(arr).any():  # frontier scores may legitimately hold -inf, never NaN
            raise KVCacheError(f"payload has NaN values before byte {self.off}")
        return arr


def snapshot_from_payload(model, data: bytes | memoryview, *, ctx: int = DEFAULT_CTX):
    """Parse a "DSV4" payload into a :class:`~ds4_mlx.session.SessionSnapshot` for ``model``.

    Validates like ds4's loader (magic/version, saved ctx ≤ ``ctx`` and N < ``ctx``, layer/dim/vocab and raw
    window equal, counts within capacity, payload consumed exactly) except for the recorded prefill chunk, which
    does not change ds4-mlx's state (see :func:`ds4_prefill_chunk`). Indexer rows come back in the form the
    model's numeric profile keeps them in. Nothing is built until everything has been read, so a bad payload
    never yields partial state.
    """
    from .model.attention import LayerCache
    from .model.compressor import CompressorState
    from .session import SessionSnapshot

    cfg = model.cfg
    r = _Reader(data)
    head = [int(x) for x in r.u32(PAYLOAD_HEAD.size // 4)]
    magic, version, f_ctx, f_chunk, raw_cap, window, comp_cap, N, layers, hd, ihd, vocab, R = head
    if magic != PAYLOAD_MAGIC:
        raise KVCacheError(f"payload magic {magic:#x} is not DSV4")
    if version != PAYLOAD_VERSION:
        raise KVCacheError(f"payload version {version} (want {PAYLOAD_VERSION})")
    want = dict(layers=cfg.n_layer, head_dim=cfg.head_dim, indexer_head_dim=cfg.indexer_head_dim, vocab=cfg.n_vocab,
                raw_window=cfg.n_swa, raw_cap=cfg.n_swa)
    got = dict(layers=layers, head_dim=hd, indexer_head_dim=ihd, vocab=vocab, raw_window=window, raw_cap=raw_cap)
    for k, v in want.items():
        if got[k] != v:
            raise KVCacheError(f"incompatible model shape: {k} {got[k]} in the file, {v} in the model")
    if f_ctx > ctx or N >= ctx:
        raise KVCacheError(f"saved with ctx {f_ctx} at {N} tokens; current ctx is {ctx}")
    if f_chunk == 0:
        raise KVCacheError("prefill chunk 0")
    if N == 0 or R != min(N, cfg.n_swa):
        raise KVCacheError(f"raw rows {R} for {N} tokens (window {cfg.n_swa})")
    tokens = r.u32(N)
    if (tokens >= cfg.n_vocab).any():
        raise KVCacheError("token id out of range")
    logits = r.f32(vocab)
    n_comp, n_index = r.u32(layers), r.u32(layers)
    D, ID = cfg.head_dim, cfg.indexer_head_dim
    kv_dtype = mx.float16 if model.numerics.f16_cache else mx.float32
    parts = []
    for il in range(layers):
        ratio = cfg.compress_ratio(il)
        raw = r.f32(R, D)
        comp = state = index = istate = None
        if ratio:
            if n_comp[il] != N // ratio or n_comp[il] > comp_cap:
                raise KVCacheError(f"layer {il}: {n_comp[il]} compressed rows for {N} tokens at ratio {ratio}")
            coff = 2 if ratio == 4 else 1
            comp = r.f32(int(n_comp[il]), D)
            state = (r.f32(coff * ratio, coff * D), r.f32(coff * ratio, coff * D))
        elif n_comp[il]:
            raise KVCacheError(f"layer {il}: compressed rows on an uncompressed layer")
        if cfg.has_indexer(il):
            if n_index[il] != n_comp[il]:
                raise KVCacheError(f"layer {il}: {n_index[il]} indexer rows for {n_comp[il]} compressed rows")
            index = r.f32(int(n_index[il]), ID)
            istate = (r.f32(8, 2 * ID), r.f32(8, 2 * ID))
        elif n_index[il]:
            raise KVCacheError(f"layer {il}: indexer rows on a layer without an indexer")
        parts.append((ratio, raw, comp, state, index, istate))
    if r.off != len(r.data):
        raise KVCacheError(f"{len(r.data) - r.off} trailing bytes after the payload")

    caches = []
    for il, (ratio, raw, comp, state, index, istate) in enumerate(parts):
        # rows come back in the dtype the engine stores them in (f16 rows are f16-exact: lossless)
        c = LayerCache(ratio=ratio, pos=N, raw=mx.array(raw).astype(kv_dtype))
        if ratio:
            c.comp = mx.array(comp).astype(kv_dtype) if len(comp) else mx.zeros((0, D), mx.float32)
            c.n_comp = len(comp)
            c.comp_state = CompressorState.of(mx.array(state[0]), mx.array(state[1]))
        if index is not None:
            c.index = mx.array(_indexer_rows(index, model.numerics)) if len(index) else mx.zeros((0, ID), mx.float32)
            if model.numerics.f16_cache:  # ds4 rounds them to f16 (rows written by the hf profile are not yet)
                c.index = f16r(c.index)
            c.n_index = len(index)
            c.index_state = CompressorState.of(mx.array(istate[0]), mx.array(istate[1]))
        caches.append(c)
    mx.eval([mx.array(logits)] + [a for c in caches for a in (c.raw, c.index) if a is not None])
    caches = model.adopt_caches(caches)  # over several ranks: the others' layers go to them
    return SessionSnapshot(tuple(int(t) for t in tokens), mx.array(logits), tuple(caches))


# --- KVC files (docs/serving.md §5.4) ------------------------------------------------------------------------------
@dataclass
class KVHeader:
    """The 52-byte KVC header."""

    quant_bits: int
    reason: int
    flags: int
    tokens: int
    hits: int
    ctx: int
    model_id: int  # u32 at offset 20, reserved by ds4: 0 as ds4 writes it (an earlier ds4-mlx put a fingerprint here)
    created: int
    last_used: int
    payload_bytes: int
    text_bytes: int
    version: int = KVC_VERSION

    def pack(self) -> bytes:
        return HEADER.pack(KVC_MAGIC, self.version, self.quant_bits, self.reason, self.flags, 0, self.tokens,
                           self.hits, self.ctx, self.model_id, self.created, self.last_used, self.payload_bytes,
                           self.text_bytes)

    @classmethod
    def unpack(cls, data: bytes) -> "KVHeader":
        if len(data) < HEADER.size:
            raise KVCacheError(f"file shorter than the {HEADER.size}-byte header")
        (magic, version, qbits, reason, flags, _res, tokens, hits, ctx, model_id, created, last_used,
         payload_bytes, text_bytes) = HEADER.unpack(data[: HEADER.size])
        if magic != KVC_MAGIC:
            raise KVCacheError("bad magic (not a KVC file)")
        if version != KVC_VERSION:
            raise KVCacheError(f"KVC version {version} (want {KVC_VERSION})")
        if tokens == 0:
            raise KVCacheError("token count 0")
        if qbits == 0:
            raise KVCacheError("quant bits 0")
        return cls(qbits, reason, flags, tokens, hits, ctx, model_id, created, last_used, payload_bytes, text_bytes,
                   version)

    @property
    def reason_name(self) -> str:
        return REASONS.get(self.reason, f"#{self.reason}")

    @property
    def size(self) -> int:
        return HEADER.size + self.text_bytes + self.payload_bytes


@dataclass(frozen=True)
class KVFooter:
    """ds4-mlx's integrity footer, the last :data:`FOOTER` bytes of the files it writes. ds4 reads nothing after
    the payload (or after the tool-id map's counted entries) and its files have no footer; when it rewrites a
    file's tool map it truncates the file after the payload, footer included."""

    fingerprint: int  # model_fingerprint() of the writer
    payload_crc: int  # CRC-32 of the payload
    trailer_crc: int  # CRC-32 of the bytes between the payload and the footer (the tool-id map)
    payload_bytes: int

    def pack(self) -> bytes:
        return FOOTER.pack(FOOTER_MAGIC, FOOTER_VERSION, self.fingerprint, self.payload_crc, self.trailer_crc,
                           self.payload_bytes)

    @classmethod
    def find(cls, tail: bytes, payload_bytes: int) -> "KVFooter | None":
        """The footer that ends ``tail`` (the file's last bytes), or ``None`` when there is none."""
        if len(tail) < FOOTER.size:
            return None
        magic, version, fp, pcrc, tcrc, nbytes = FOOTER.unpack(tail[-FOOTER.size:])
        if magic != FOOTER_MAGIC or version != FOOTER_VERSION or nbytes != payload_bytes:
            return None
        return cls(fp, pcrc, tcrc, nbytes)


def cache_name(text: bytes) -> str:
    """File name of the cache text ``text``: lowercase SHA1 hex + ``.kv``."""
    return hashlib.sha1(text).hexdigest() + ".kv"


def tool_map_bytes(tool_map: dict[str, str]) -> bytes:
    """The optional ``KTM`` trailer: id -> exact DSML block."""
    out = [b"KTM", bytes([1]), struct.pack("<I", len(tool_map))]
    for k, v in tool_map.items():
        kb, vb = k.encode(), v.encode()
        out += [struct.pack("<II", len(kb), len(vb)), kb, vb]
    return b"".join(out)


def parse_tool_map(data: bytes, max_ids: int = 100_000) -> dict[str, str]:
    """Entries of a ``KTM`` trailer, stopping at the first malformed one (§5.4 loader limits)."""
    out: dict[str, str] = {}
    if len(data) < 8 or data[:3] != b"KTM" or data[3] != 1:
        return out
    (count,) = struct.unpack_from("<I", data, 4)
    off = 8
    for _ in range(min(count, 4 * max_ids)):
        if off + 8 > len(data):
            break
        id_len, dsml_len = struct.unpack_from("<II", data, off)
        if not (1 <= id_len <= 256 and 1 <= dsml_len <= 512 << 20) or off + 8 + id_len + dsml_len > len(data):
            break
        try:
            k = data[off + 8 : off + 8 + id_len].decode()
            v = data[off + 8 + id_len : off + 8 + id_len + dsml_len].decode()
        except UnicodeDecodeError:
            break
        out[k] = v
        off += 8 + id_len + dsml_len
    return out


def write_atomic(path: Path, data: list[bytes] | bytes) -> int:
    """Write ``data`` to ``path`` through a unique temp file + fsync + rename; returns the byte count."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp.{os.getpid()}.{threading.get_ident()}")
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    n = 0
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            for c in chunks:
                f.write(c)
                n += len(c)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


def kv_file_bytes(session, text: bytes, *, reason: str | int = "unknown", ctx: int = DEFAULT_CTX, flags: int = 0,
                  tool_map: dict[str, str] | None = None, hits: int = 0) -> list[bytes]:
    """The parts of a KVC file for ``session`` keyed by ``text``."""
    payload = session_payload(session, ctx=ctx)
    now = int(time.time())
    code = REASON_CODES.get(reason, 0) if isinstance(reason, str) else int(reason)
    if tool_map:
        flags |= FLAG_TOOL_MAP
    head = KVHeader(quant_bits(session.model), code, flags, session.pos, hits, ctx, 0, now, now, len(payload),
                    len(text))
    trailer = tool_map_bytes(tool_map) if tool_map else b""
    footer = KVFooter(model_fingerprint(session.model), zlib.crc32(payload), zlib.crc32(trailer), len(payload))
    return [head.pack(), bytes(text), payload, trailer, footer.pack()]


def session_to_file(session, path: str | os.PathLike, *, text: bytes | None = None, tokenizer=None,
                    reason: str = "unknown", ctx: int = DEFAULT_CTX, tool_map: dict[str, str] | None = None) -> int:
    """Save ``session`` to the KVC file ``path`` (atomically); returns the bytes written.

    ``text`` is the cache text (key); by default the decoded bytes of the session's tokens when a ``tokenizer``
    is given, else empty. Pass a directory's ``cache_name(text)`` as the file name for a :class:`DiskCache`.
    """
    if text is None:
        text = tokenizer.decode_bytes(session.tokens) if tokenizer is not None else b""
    return write_atomic(Path(path), kv_file_bytes(session, text, reason=reason, ctx=ctx, tool_map=tool_map))


@dataclass
class KVFile:
    """A parsed KVC file (header, cache text, payload bytes, tool-id map, ds4-mlx's footer if any)."""

    path: Path
    header: KVHeader
    text: bytes
    payload: bytes
    tool_map: dict[str, str]
    footer: KVFooter | None = None
    trailer: bytes = b""  # the raw bytes between the payload and the footer


def _read_header(f) -> tuple[KVHeader, int]:
    """The header of an open KVC file and the file's size; raises :class:`KVCacheError` when truncated."""
    head = KVHeader.unpack(f.read(HEADER.size))
    size = os.fstat(f.fileno()).st_size
    if size < head.size:
        raise KVCacheError(f"truncated: {size} bytes, header says {head.size}")
    return head, size


def read_kv_file(path: str | os.PathLike, *, with_payload: bool = True) -> KVFile:
    """Read and check the framing of a KVC file (raises :class:`KVCacheError`); ``with_payload=False`` reads the
    header, the text and the footer only."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            head, size = _read_header(f)
            text = f.read(head.text_bytes)
            if with_payload:
                payload, rest = f.read(head.payload_bytes), f.read()
            else:
                payload, rest = b"", b""
                if size >= head.size + FOOTER.size:
                    f.seek(size - FOOTER.size)
                    rest = f.read()
    except OSError as e:
        raise KVCacheError(f"unreadable: {e}") from e
    footer = KVFooter.find(rest, head.payload_bytes)
    trailer = rest[: -FOOTER.size] if footer is not None else rest
    tool_map = parse_tool_map(trailer) if with_payload and head.flags & FLAG_TOOL_MAP else {}
    return KVFile(path, head, text, payload, tool_map, footer, trailer if with_payload else b"")


def check_integrity(kf: KVFile, fingerprint: int) -> bool:
    """Check ``kf`` (read with its payload) against its footer: ``True`` when it has one and everything matches,
    ``False`` when it has none (ds4 wrote it, or rewrote its tool map: nothing to check against). A mismatch,
    another model's fingerprint, or a file of an earlier ds4-mlx (a fingerprint in the header and no footer: its
    indexer rows may be in the ``hf`` form) raises :class:`KVCacheError`."""
    f = kf.footer
    if f is None:
        if kf.header.model_id:
            raise KVCacheError("written by an earlier ds4-mlx (no integrity footer)")
        return False
    if f.fingerprint != fingerprint:
        raise KVCacheError("written by a different model (fingerprint mismatch)")
    if zlib.crc32(kf.payload) != f.payload_crc:
        raise KVCacheError("payload checksum mismatch (corrupt file)")
    if zlib.crc32(kf.trailer) != f.trailer_crc:
        raise KVCacheError("tool-id map checksum mismatch (corrupt file)")
    return True


def read_tool_map(path: str | os.PathLike, max_ids: int = 100_000) -> dict[str, str]:
    """Only the tool-id map trailer of a KVC file (seeks past the payload; ``{}`` when absent or unreadable)."""
    try:
        with open(path, "rb") as f:
            head = KVHeader.unpack(f.read(HEADER.size))
            if not head.flags & FLAG_TOOL_MAP:
                return {}
            f.seek(head.size)
            return parse_tool_map(f.read(), max_ids)  # it stops after its counted entries (before a footer)
    except (OSError, KVCacheError):
        return {}


def session_from_file(model, path: str | os.PathLike, *, ctx: int | None = None, chunk_size: int | None = None):
    """A new :class:`~ds4_mlx.session.Session` of ``model`` holding the state saved in ``path`` (by ds4-mlx under
    either numeric profile, or by ds4).

    ``ctx`` defaults to the file's; ``chunk_size`` is the new session's prefill chunk (default: the session's).
    Raises :class:`KVCacheError` for a file that does not fit ``model`` or fails its integrity check.
    """
    from .session import Session

    kf = read_kv_file(path)
    check_integrity(kf, model_fingerprint(model))
    snap = snapshot_from_payload(model, kf.payload, ctx=ctx or max(kf.header.ctx, kf.header.tokens + 1))
    if len(snap.tokens) != kf.header.tokens:
        raise KVCacheError(f"payload holds {len(snap.tokens)} tokens, header says {kf.header.tokens}")
    session = Session(model) if chunk_size is None else Session(model, chunk_size=chunk_size)
    session.restore(snap)
    return session


def remove_stale_tmp(directory: str | os.PathLike, log: Callable[[str], None] | None = None) -> int:
    """Delete the temp files of saves that never finished (``<sha1>.kv.tmp.<pid>[.<tid>]``, left by a process
    killed while writing; they are outside the budget): those whose process is gone, or older than
    :data:`STALE_TMP_S`. A save in progress in a live process keeps its file. Returns how many were deleted."""
    now, removed = time.time(), 0
    for p in Path(directory).iterdir():
        m = TMP_RE.match(p.name)
        if m is None:
            continue
        try:
            stale = not _pid_alive(int(m.group(1))) or now - p.stat().st_mtime > STALE_TMP_S
            if stale:
                p.unlink()
                removed += 1
                if log is not None:
                    log(f"kv: removed {p.name}, the temp file of a save that never finished")
        except OSError:
            continue
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


# --- the directory (docs/serving.md §5.5-5.7) ----------------------------------------------------------------------
@dataclass
class CachePolicy:
    """ds4's disk-cache knobs (server flags ``--kv-*``), with ds4's defaults."""

    space_mb: int = 4096
    min_tokens: int = 512
    cold_max_tokens: int = 30000
    continued_interval_tokens: int = 10000
    boundary_trim_tokens: int = 32
    boundary_align_tokens: int = 2048
    reject_different_quant: bool = False

    def validate(self) -> None:
        if self.space_mb < 1 or self.min_tokens < 1 or self.continued_interval_tokens < 0:
            raise ValueError("--kv-disk-space-mb and --kv-cache-min-tokens must be ≥ 1, the interval ≥ 0")
        if self.cold_max_tokens and self.cold_max_tokens < self.min_tokens:
            raise ValueError("--kv-cache-cold-max-tokens must be 0 or ≥ --kv-cache-min-tokens")
        if self.boundary_trim_tokens < 0 or self.boundary_align_tokens < 0:
            raise ValueError("--kv-cache-boundary-trim/align-tokens must be ≥ 0")

    @property
    def continued_step(self) -> int:
        """Live lengths that are positive multiples of this get a continued save (0 = off)."""
        iv, al = self.continued_interval_tokens, self.boundary_align_tokens
        if iv <= 0:
            return 0
        return -(-iv // al) * al if al else iv

    def cold_length(self, tokens: list[int], user_id: int, assistant_id: int) -> int:
        """Store length for a cold save of ``tokens`` (§5.5): the shared prefix before the first user turn if long
        enough, else the trimmed and aligned length, else the whole prompt."""
        try:
            first_asst = tokens.index(assistant_id)
        except ValueError:
            first_asst = len(tokens)
        users = [i for i in range(first_asst) if tokens[i] == user_id]
        if users and users[-1] >= self.min_tokens:
            return users[-1]
        stable = len(tokens) - self.boundary_trim_tokens
        if self.boundary_align_tokens:
            stable -= stable % self.boundary_align_tokens
        return stable if stable >= self.min_tokens else len(tokens)


@dataclass
class Entry:
    path: Path
    header: KVHeader
    size: int

    @property
    def name(self) -> str:
        return self.path.name


@dataclass
class Lookup:
    """Outcome of :meth:`DiskCache.lookup`: a hit (``snapshot`` set) or a miss with its ``reason``."""

    reason: str
    entry: Entry | None = None
    snapshot: object | None = None
    text_bytes: int = 0
    tool_map: dict[str, str] = field(default_factory=dict)

    @property
    def hit(self) -> bool:
        return self.snapshot is not None


def list_entries(directory: str | os.PathLike, skip: Callable[[str, str], None] | None = None) -> list[Entry]:
    """Every well-framed ``<sha1>.kv`` file of ``directory``; ``skip(name, reason)`` hears about the others."""
    out = []
    for p in sorted(Path(directory).iterdir()):
        if not NAME_RE.match(p.name):
            continue
        try:
            with open(p, "rb") as f:
                head, size = _read_header(f)
        except (OSError, KVCacheError) as e:
            if skip is not None:
                skip(p.name, str(e))
            continue
        out.append(Entry(p, head, size))
    return out


def score(h: KVHeader, size: int, now: float | None = None) -> float:
    """Usefulness of a file (§5.7): ``(effective_hits + 1) * tokens / size``; hits decay with a 6 h half-life."""
    now = time.time() if now is None else now
    age = max(0.0, now - (h.last_used or h.created))
    eff = h.hits * 2.0 ** (-age / HALF_LIFE_S)
    if eff < 0.01:
        eff = 0.0
    return (eff + 1.0) * h.tokens / max(1, size)


def evict_dir(directory: str | os.PathLike, budget: int, *, protect: Path | None = None,
              log: Callable[[str], None] | None = None) -> list[Entry]:
    """Delete the lowest-scoring files (ties: older last use first) while ``directory`` is over ``budget`` bytes.
    ``protect`` (the file just written) goes last, unless it alone exceeds the budget."""
    entries = list_entries(directory)
    total = sum(e.size for e in entries)
    now = time.time()

    def key(e: Entry):
        s = math.inf if protect is not None and e.path == Path(protect) and e.size <= budget else score(
            e.header, e.size, now)
        return (s, e.header.last_used or e.header.created)

    removed = []
    for e in sorted(entries, key=key):
        if total <= budget:
            break
        if key(e)[0] == math.inf:
            continue
        e.path.unlink(missing_ok=True)
        total -= e.size
        removed.append(e)
        if log is not None:
            log(f"kv: evicted {e.name} ({e.header.tokens} tokens, {e.size} bytes, hits {e.header.hits})")
    return removed


class DiskCache:
    """One ``--kv-disk-dir``: save, look up, load, evict; ``stats`` counts every decision.

    ``log(str)`` receives one line per decision (the server passes its ``--trace`` writer).
    """

    def __init__(self, directory: str | os.PathLike, model, *, ctx: int = DEFAULT_CTX,
                 policy: CachePolicy | None = None, log: Callable[[str], None] | None = None) -> None:
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.model, self.ctx = model, ctx
        self.policy = policy or CachePolicy()
        self.policy.validate()
        self.log = log or (lambda s: None)
        self.qbits = quant_bits(model)
        self.fingerprint = model_fingerprint(model)
        self.budget = self.policy.space_mb << 20
        self.stats = Counter()
        self.misses = Counter()
        self.saves = Counter()
        self.skips = Counter()
        self.recent_skips: deque = deque(maxlen=16)  # {"file", "reason"}, newest last
        self.stats["stale_tmp_removed"] = remove_stale_tmp(self.dir, self.log)
        self.evict()

    # -- listing ------------------------------------------------------------------------------------------------
    def entries(self, *, log_skips: bool = False) -> list[Entry]:
        """Every well-framed ``<sha1>.kv`` file (bad ones are logged and skipped, never deleted here)."""
        return list_entries(self.dir, self._skip if log_skips else None)

    def _skip(self, name: str, reason: str) -> None:
        self.skips[reason.split(":")[0]] += 1
        self.recent_skips.append({"file": name, "reason": reason})
        self.log(f"kv: skip {name}: {reason}")

    @property
    def size(self) -> int:
        return sum(e.size for e in self.entries())

    def summary(self) -> dict:
        """Counters for ``/v1/stats``."""
        entries = self.entries()
        return {"dir": str(self.dir), "files": len(entries), "bytes": sum(e.size for e in entries),
                "budget_bytes": self.budget, **dict(self.stats), "misses": dict(self.misses),
                "saves": dict(self.saves), "skipped": dict(self.skips), "last_skips": list(self.recent_skips),
                "policy": {k: getattr(self.policy, k) for k in CachePolicy.__dataclass_fields__}}

    def tool_ids(self, wanted: set[str], max_ids: int = 100_000) -> dict[str, str]:
        """Mappings for the ``wanted`` call ids from every file with a tool-id map (§5.6: exact DSML replay
        survives restarts, whichever checkpoint is used later)."""
        out: dict[str, str] = {}
        for e in self.entries():
            if e.header.flags & FLAG_TOOL_MAP:
                for k, v in read_tool_map(e.path, max_ids).items():
                    if k in wanted:
                        out[k] = v
        return out

    # -- save ---------------------------------------------------------------------------------------------------
    def store(self, session, text: bytes, reason: str, *, flags: int = 0,
              tool_map: dict[str, str] | None = None) -> Path | None:
        """Save the live ``session`` keyed by ``text`` (§5.5); returns the path, or ``None`` when skipped."""
        n = session.pos
        if n < self.policy.min_tokens:
            self.log(f"kv: no {reason} save: {n} tokens < min {self.policy.min_tokens}")
            return None
        path = self.dir / cache_name(text)
        keep = self._same_save(path, text, n)  # §5.5: a file of the same save keeps its history
        if keep is not None and keep.footer is not None:  # and is left alone if it checks out
            if not tool_map or all(keep.tool_map.get(k) == v for k, v in tool_map.items()):
                self.log(f"kv: {reason} save {path.name}: already on disk ({n} tokens)")
                self.saves["already_saved"] += 1
                return path
            tool_map = {**keep.tool_map, **tool_map}
        try:
            parts = kv_file_bytes(session, text, reason=reason, ctx=self.ctx, flags=flags, tool_map=tool_map)
            if keep is not None:  # same save rewritten (new tool map, or a copy without a footer): keep its history
                keep = keep.header
                h = KVHeader.unpack(parts[0])
                h.hits, h.created, h.last_used, h.reason = keep.hits, keep.created, keep.last_used, keep.reason
                parts[0] = h.pack()
        except KVCacheError as e:
            self.log(f"kv: no {reason} save: {e}")
            return None
        size = sum(len(p) for p in parts)
        if size + -(-size // 100) > self.budget:
            self.log(f"kv: no {reason} save: {size} bytes exceed the budget of {self.budget}")
            self.saves["skipped_budget"] += 1
            return None
        try:
            written = write_atomic(path, parts)
        except OSError as e:
            self.log(f"kv: {reason} save failed: {e}")
            self.saves["failed"] += 1
            return None
        self.stats["bytes_written"] += written
        self.saves[reason] += 1
        self.log(f"kv: {reason} save {path.name}: {n} tokens, {len(text)} text bytes, {written} bytes")
        self.evict(protect=path)
        return path

    def _same_save(self, path: Path, text: bytes, n: int) -> KVFile | None:
        """The file at ``path`` if it holds a save of ``text`` at ``n`` tokens that this model can load: either
        intact by its footer, or without a footer (written by ds4) and then its footer is ``None``. ``None`` for a
        file that is missing, for another save, or damaged: those are replaced."""
        if not path.exists():
            return None
        try:
            kf = read_kv_file(path)
            if kf.text != text or kf.header.tokens != n or kf.header.ctx > self.ctx:
                return None
            if not check_integrity(kf, self.fingerprint):
                kf.footer = None
            return kf
        except KVCacheError as e:
            self.log(f"kv: replacing {path.name}: {e}")
            return None

    # -- lookup and load (§5.6) ------------------------------------------------------------------------------
    def lookup(self, prompt: bytes) -> Lookup:
        """The longest cached byte prefix of ``prompt``, loaded and verified; or a miss with its reason."""
        entries = self.entries(log_skips=True)
        if not entries:
            return Lookup("no file")
        cands = []
        for e in entries:
            h = e.header
            if h.tokens < self.policy.min_tokens:
                continue
            if h.text_bytes > len(prompt) or h.ctx > self.ctx:
                continue
            if self.policy.reject_different_quant and h.quant_bits != self.qbits:
                continue
            cands.append(e)
        cands.sort(key=lambda e: (e.header.text_bytes, e.header.tokens), reverse=True)
        incompatible = None
        for e in cands:
            T = e.header.text_bytes
            if hashlib.sha1(prompt[:T]).hexdigest() + ".kv" != e.name:
                continue
            res = self._load(e, prompt)
            if res.hit:
                return res
            incompatible = res
        if incompatible is not None:
            return incompatible
        return Lookup(self._diverged(entries, prompt))

    def _diverged(self, entries: list[Entry], prompt: bytes) -> str:
        """Why nothing matched: the file whose text shares the longest prefix with the prompt."""
        best, best_e = -1, None
        for e in entries[:256]:
            try:
                kf = read_kv_file(e.path, with_payload=False)
            except KVCacheError:
                continue
            t = kf.text[: len(prompt)]
            b = next((i for i, (x, y) in enumerate(zip(t, prompt)) if x != y), min(len(t), len(prompt)))
            if b > best:
                best, best_e = b, e
        if best_e is None:
            return "no file"
        if best >= best_e.header.text_bytes:  # the file's text is a prefix, but it was filtered out
            h = best_e.header
            if h.tokens < self.policy.min_tokens:
                return f"below min tokens ({h.tokens} < {self.policy.min_tokens})"
            if h.ctx > self.ctx:
                return f"incompatible file: ctx {h.ctx} > {self.ctx}"
            return "incompatible file: quant bits differ"
        return f"text diverged at byte {best} (of {best_e.header.text_bytes} in {best_e.name[:12]})"

    def _load(self, e: Entry, prompt: bytes) -> Lookup:
        try:
            kf = read_kv_file(e.path)
            if cache_name(kf.text) != e.name:
                raise KVCacheError("text does not hash to the file name")
            if not prompt.startswith(kf.text):
                raise KVCacheError("text is not a prefix of the prompt")
            verified = check_integrity(kf, self.fingerprint)
            snap = snapshot_from_payload(self.model, kf.payload, ctx=self.ctx)
        except KVCacheError as err:
            self._skip(e.name, str(err))
            return Lookup(f"incompatible file: {err}", e)
        self.stats["bytes_read"] += e.size
        if not verified:
            self.stats["loaded_without_footer"] += 1  # ds4's files: only the payload's own checks apply
        if len(snap.tokens) != kf.header.tokens:
            self._skip(e.name, "token mismatch (deleted)")
            e.path.unlink(missing_ok=True)
            return Lookup(f"token mismatch: payload {len(snap.tokens)} tokens, header {kf.header.tokens}", e)
        cm = self.policy.cold_max_tokens
        if cm and kf.header.tokens > cm:
            e.path.unlink(missing_ok=True)  # consumed: the live session writes fresher checkpoints
            self.log(f"kv: consumed {e.name} ({kf.header.tokens} tokens > cold max {cm})")
        else:
            h = kf.header
            h.hits += 1
            h.last_used = int(time.time())
            try:
                with open(e.path, "r+b") as f:
                    f.write(h.pack()[:48])
            except OSError:
                pass
        return Lookup("disk hit", e, snap, kf.header.text_bytes, kf.tool_map)

    # -- budget (§5.7) ----------------------------------------------------------------------------------------
    score = staticmethod(score)

    def evict(self, protect: Path | None = None, budget: int | None = None) -> list[Path]:
        """Delete the lowest-scoring files while the directory is over ``budget`` (default: the policy's)."""
        removed = evict_dir(self.dir, self.budget if budget is None else budget, protect=protect, log=self.log)
        self.stats["evicted"] += len(removed)
        return [e.path for e in removed]
