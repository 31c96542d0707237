"""Disk KV cache at the library level: exact payload round trip, KVC framing, lookup, bad files, budget, races."""

from __future__ import annotations

import dataclasses
import hashlib
import struct
import threading
import time
import zlib

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import kvstore
from ds4_mlx.kvstore import (HEADER, CachePolicy, DiskCache, KVCacheError, KVHeader, cache_name, read_kv_file,
                             session_from_file, session_payload, session_to_file)
from ds4_mlx.loader import load
from ds4_mlx.numerics import hadamard128
from ds4_mlx.session import Session, _arrays

N_PREFIX = 37  # > window (16), not a multiple of the ratios: partial compressor frontiers are saved too


@pytest.fixture(scope="module")
def model_tok(tiny_gguf):
    return load(tiny_gguf(experts="q2", hca_ratio=16))


@pytest.fixture(scope="module")
def ids():
    return [int(t) for t in np.random.default_rng(7).integers(0, 512, 60)]


@pytest.fixture(scope="module")
def saved(model_tok, ids, tmp_path_factory):
    """A session at N_PREFIX tokens, its payload, and its KVC file keyed by its decoded text."""
    model, tok = model_tok
    s = Session(model)
    s.prefill(ids[:N_PREFIX])
    text = tok.decode_bytes(s.tokens)
    path = tmp_path_factory.mktemp("kv") / cache_name(text)
    session_to_file(s, path, text=text, reason="cold")
    return s, session_payload(s), path, text


def _arrays_equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


def test_payload_round_trip_is_exact(model_tok, ids, saved):
    model, _ = model_tok
    s, payload, path, _ = saved
    r = session_from_file(model, path)
    assert r.tokens == s.tokens and r.chunk_size == s.chunk_size
    assert _arrays_equal(r.logits, s.logits)
    for a, b in zip(s.caches, r.caches, strict=True):
        assert (a.pos, a.ratio, a.n_comp, a.n_index) == (b.pos, b.ratio, b.n_comp, b.n_index)
        assert _arrays_equal(a.raw, b.raw) and _arrays_equal(a.comp_rows, b.comp_rows)
        assert _arrays_equal(a.index_rows, b.index_rows)
        for sa, sb in ((a.comp_state, b.comp_state), (a.index_state, b.index_state)):
            assert (sa is None) == (sb is None)
            if sa is not None:
                assert _arrays_equal(sa.kv, sb.kv) and _arrays_equal(sa.score, sb.score)
    assert session_payload(r) == payload  # serializing the loaded state gives the same bytes


def test_logits_after_restore_equal_uninterrupted_run(model_tok, ids, saved):
    """Continue a restored session (prefill + decode) and an uninterrupted one: the logits are identical."""
    model, _ = model_tok
    _, _, path, _ = saved
    full = Session(model)
    full.prefill(ids[:N_PREFIX])
    a = full.prefill(ids[N_PREFIX:45])
    r = session_from_file(model, path)
    b = r.prefill(ids[N_PREFIX:45])
    assert bool(mx.array_equal(a, b).item())
    for t in ids[45:47]:
        a, b = full.step(t), r.step(t)
        assert bool(mx.array_equal(a, b).item())


@pytest.fixture(scope="module")
def profiles(tiny_gguf):
    """The tiny model under both numeric profiles (same weights, same fingerprint)."""
    path = tiny_gguf(experts="q2", hca_ratio=16)
    return {name: load(path, numerics=name)[0] for name in ("ds4", "hf")}


def _index_rows(session) -> list:
    return [c.index_rows for c in session.caches if c.index is not None]


def _rest_of_state(session) -> list:
    """Every state array but the indexer rows."""
    return _arrays([session.logits] + [(c.raw, c.comp_rows, c.comp_state, c.index_state) for c in session.caches])


def _continue(session, ids, start: int) -> list:
    """Logits of a prefill of ``ids[start:start + 12]`` then three decode steps (selection by the indexer included:
    37 tokens give 9 compressed rows on the ratio-4 layers, more than the top-4 it keeps)."""
    out = [session.prefill(ids[start : start + 12])]
    return out + [session.step(t) for t in ids[start + 12 : start + 15]]


def _all_equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(_arrays_equal(x, y) for x, y in zip(a, b))


def test_hf_profile_round_trip(profiles, ids, tmp_path):
    """The ``hf`` profile keeps its indexer rows unrotated and f32: it writes them in ds4's rotated form and reads
    them back (Hadamard-128 both ways, exact up to f32 rounding); the rest of the state comes back bit for bit and
    the continuation's logits equal an uninterrupted run's."""
    hf = profiles["hf"]
    s = Session(hf)
    s.prefill(ids[:N_PREFIX])
    session_to_file(s, tmp_path / "s.kv", text=b"x")
    stored = _payload_index_rows(tmp_path / "s.kv", hf.cfg)
    for rows, mine in zip(stored, _index_rows(s), strict=True):  # ds4's form on disk
        np.testing.assert_allclose(rows, np.asarray(hadamard128(mine)), rtol=2e-6, atol=1e-6)
    r = session_from_file(hf, tmp_path / "s.kv")
    assert r.caches[2].raw.dtype == mx.float32 and _all_equal(_rest_of_state(r), _rest_of_state(s))
    for a, b in zip(_index_rows(r), _index_rows(s), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-6)
    assert _all_equal(_continue(r, ids, N_PREFIX), _continue(s, ids, N_PREFIX))


def test_files_cross_profiles(profiles, ids, tmp_path):
    """A file written under ``ds4``, read under ``hf`` (its indexer rows unrotated), written again there and read
    back under ``ds4``: the state is the original's (bit for bit but for f32 rounding in the indexer rows) and
    continues like an uninterrupted ``ds4`` run. The ``hf`` session in between holds ds4's rows in its own form
    (H·rows)."""
    ds4, hf = profiles["ds4"], profiles["hf"]
    s = Session(ds4)
    s.prefill(ids[:N_PREFIX])
    session_to_file(s, tmp_path / "a.kv", text=b"x")
    h = session_from_file(hf, tmp_path / "a.kv")
    for a, b in zip(_index_rows(h), _index_rows(s), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(hadamard128(b)), rtol=2e-6, atol=1e-6)
    session_to_file(h, tmp_path / "b.kv", text=b"x")
    back = session_from_file(ds4, tmp_path / "b.kv")
    assert _all_equal(_rest_of_state(back), _rest_of_state(s))
    for a, b in zip(_index_rows(back), _index_rows(s), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-6, atol=1e-7)
    assert _all_equal(_continue(back, ids, N_PREFIX), _continue(s, ids, N_PREFIX))
    # and the same ds4 file continued under hf selects as an hf session does: its rows are converted, not
    # taken as they are (the rotated rows gave other selections: max |Δlogit| 1.2 on the full model)
    h2 = session_from_file(hf, tmp_path / "a.kv")
    wrong = session_from_file(hf, tmp_path / "a.kv")
    for c, rows in zip([c for c in wrong.caches if c.index is not None], _index_rows(s), strict=True):
        c.index = rows  # what loading without the conversion gave
    assert not _all_equal(_continue(h2, ids, N_PREFIX), _continue(wrong, ids, N_PREFIX))


def _payload_index_rows(path, cfg) -> list[np.ndarray]:
    """The indexer rows as stored in a file's payload (walked with the §5.2 layout)."""
    payload = read_kv_file(path).payload
    head = struct.unpack_from("<13I", payload)
    N, R = head[7], head[12]
    off = 52 + 4 * N + 4 * cfg.n_vocab
    n_comp = struct.unpack_from(f"<{cfg.n_layer}I", payload, off)
    n_index = struct.unpack_from(f"<{cfg.n_layer}I", payload, off + 4 * cfg.n_layer)
    off += 8 * cfg.n_layer
    out = []
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        off += 4 * R * cfg.head_dim
        if r:
            c = 2 if r == 4 else 1
            off += 4 * n_comp[il] * cfg.head_dim + 2 * 4 * (c * cfg.head_dim * c * r)
        if cfg.has_indexer(il):
            out.append(np.frombuffer(payload, "<f4", n_index[il] * cfg.indexer_head_dim, off).reshape(-1, 128))
            off += 4 * n_index[il] * cfg.indexer_head_dim + 2 * 4 * (2 * cfg.indexer_head_dim * 2 * 4)
    assert off == len(payload)
    return out


def test_payload_layout_follows_dsv4(model_tok, saved):
    """Header fields and total size as docs/model.md §5.2 lays them out (computed independently here)."""
    model, _ = model_tok
    s, payload, _, _ = saved
    cfg = model.cfg
    head = struct.unpack_from("<13I", payload)
    N, R = N_PREFIX, min(N_PREFIX, cfg.n_swa)
    assert head[0] == 0x34565344 and head[1] == 1
    assert head[7:] == (N, cfg.n_layer, cfg.head_dim, cfg.indexer_head_dim, cfg.n_vocab, R)
    size = 13 * 4 + 4 * N + 4 * cfg.n_vocab + 8 * cfg.n_layer
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        size += 4 * R * cfg.head_dim
        if r:
            c = 2 if r == 4 else 1
            size += 4 * (N // r) * cfg.head_dim + 2 * 4 * (c * cfg.head_dim * c * r)
        if r == 4:
            size += 4 * (N // 4) * cfg.indexer_head_dim + 2 * 4 * (2 * cfg.indexer_head_dim * 2 * 4)
    assert len(payload) == size
    # the token ids and the logits sit right after the header
    assert list(np.frombuffer(payload, "<u4", N, 52)) == s.tokens
    np.testing.assert_array_equal(np.frombuffer(payload, "<f4", cfg.n_vocab, 52 + 4 * N), np.asarray(s.logits))


def test_kvc_header_and_framing(saved):
    s, payload, path, text = saved
    kf = read_kv_file(path)
    h = kf.header
    assert path.read_bytes()[:3] == b"KVC" and h.version == 1 and h.reason_name == "cold"
    assert (h.tokens, h.text_bytes, h.payload_bytes, h.hits) == (N_PREFIX, len(text), len(payload), 0)
    assert h.quant_bits == 2 and kf.text == text and kf.payload == payload
    assert path.stat().st_size == 52 + len(text) + len(payload) + kvstore.FOOTER.size
    assert path.name == hashlib.sha1(text).hexdigest() + ".kv"
    assert kf.footer == kvstore.KVFooter(kvstore.model_fingerprint(s.model), zlib.crc32(payload), zlib.crc32(b""),
                                         len(payload))


def test_tool_map_trailer_round_trip(model_tok, saved, tmp_path):
    model, _ = model_tok
    s, _, _, text = saved
    tm = {"call_abc": "\n\n<｜DSML｜tool_calls>x</｜DSML｜tool_calls>", "toolu_9": "y" * 300}
    p = tmp_path / cache_name(text)
    session_to_file(s, p, text=text, tool_map=tm)
    kf = read_kv_file(p)
    assert kf.header.flags & kvstore.FLAG_TOOL_MAP and kf.tool_map == tm
    # a malformed entry ends the map; the entries before it stay
    bad = kvstore.tool_map_bytes(tm)[:-10]
    assert kvstore.parse_tool_map(bad) == {"call_abc": tm["call_abc"]}
    assert session_from_file(model, p).tokens == s.tokens


def _cache(tmp_path, model, **policy) -> DiskCache:
    logs: list[str] = []
    dc = DiskCache(tmp_path, model, ctx=kvstore.DEFAULT_CTX,
                   policy=CachePolicy(**{"min_tokens": 8, **policy}), log=logs.append)
    dc.logs = logs
    return dc


def test_lookup_picks_longest_prefix_and_explains_misses(model_tok, ids, tmp_path):
    model, tok = model_tok
    s = Session(model)
    s.prefill(ids[:20])
    short = tok.decode_bytes(s.tokens)
    dc = _cache(tmp_path, model)
    assert dc.lookup(short + b"tail").reason == "no file"
    dc.store(s, short, "cold")
    s.prefill(ids[20:30])
    long = tok.decode_bytes(s.tokens)
    dc.store(s, long, "continued")
    hit = dc.lookup(long + b"more")
    assert hit.hit and len(hit.snapshot.tokens) == 30 and hit.text_bytes == len(long)
    hit = dc.lookup(short + b"zzzz")
    assert hit.hit and len(hit.snapshot.tokens) == 20
    assert read_kv_file(tmp_path / cache_name(short)).header.hits == 1
    B = len(short) - 3
    miss = dc.lookup(short[:B] + b"\xff" * 40)
    assert not miss.hit and miss.reason.startswith(f"text diverged at byte {B}")
    # below min tokens: a 20-token file is ignored by a cache that needs 25
    assert "below min tokens" in _cache(tmp_path, model, min_tokens=25).lookup(short + b"x").reason
    assert dc.stats["bytes_read"] > 0 and dc.saves["cold"] == 1 and dc.saves["continued"] == 1


def _valid_looking(text: bytes, payload: bytes, tokens: int = 20) -> bytes:
    now = int(time.time())
    return KVHeader(2, 1, 0, tokens, 0, 4096, 0, now, now, len(payload), len(text)).pack() + text + payload


def test_bad_files_are_skipped_with_a_reason(model_tok, saved, tmp_path, tiny_gguf):
    """Truncated, random-payload, bad-magic, foreign-model and foreign-shape files: a miss and a logged reason,
    never an exception; a good shorter file is still used."""
    model, _ = model_tok
    s, payload, good_path, text = saved
    prompt = text + b" and then some more text" * 4
    dc = _cache(tmp_path, model)
    (tmp_path / good_path.name).write_bytes(good_path.read_bytes())
    rng = np.random.default_rng(1)

    def plant(T: int, data: bytes) -> None:
        (tmp_path / cache_name(prompt[:T])).write_bytes(data)

    T = len(text)
    plant(T + 1, _valid_looking(prompt[: T + 1], rng.bytes(len(payload))))  # random bytes, valid-looking header
    plant(T + 2, _valid_looking(prompt[: T + 2], payload)[:-100])  # truncated
    plant(T + 3, b"XYZ" + _valid_looking(prompt[: T + 3], payload)[3:])  # bad magic
    plant(T + 4, _valid_looking(prompt[: T + 4], payload, tokens=N_PREFIX + 1))  # header/payload token mismatch
    bad_payload = bytearray(payload)
    struct.pack_into("<I", bad_payload, 4 * 8, 999)  # layer count
    plant(T + 5, _valid_looking(prompt[: T + 5], bytes(bad_payload)))
    foreign, _ = load(tiny_gguf(experts="q2", hca_ratio=16, seed=1))
    plant(T + 6, _with_text(good_path, prompt[: T + 6]))  # written by another model (fingerprint)
    other_shape, _ = load(tiny_gguf(experts="q2", hca_ratio=128))

    hit = dc.lookup(prompt)
    assert hit.hit and len(hit.snapshot.tokens) == N_PREFIX  # fell back to the good file
    log = "\n".join(dc.logs)
    assert "payload magic" in log  # random bytes
    assert "truncated" in log
    assert "layers 999" in log
    assert "different model" in log
    assert "token mismatch" in log and not (tmp_path / cache_name(prompt[: T + 4])).exists()  # deleted
    assert dc.skips  # counted for /v1/stats
    # the same (good) file under another model: fingerprint mismatch; under another shape: payload mismatch
    for other, why in ((foreign, "different model"), (other_shape, "")):
        d2 = DiskCache(tmp_path / f"o{id(other)}", other, ctx=kvstore.DEFAULT_CTX,
                       policy=CachePolicy(min_tokens=8))
        (d2.dir / good_path.name).write_bytes(good_path.read_bytes())
        miss = d2.lookup(prompt)
        assert not miss.hit and miss.reason.startswith("incompatible file") and why in miss.reason
    with pytest.raises(KVCacheError):
        session_from_file(foreign, good_path)


def _with_text(path, text: bytes) -> bytes:
    """The file at ``path`` re-keyed to ``text`` and signed by another model (same payload: only the fingerprint
    check differs)."""
    kf = read_kv_file(path)
    h = kf.header
    h.text_bytes = len(text)
    return h.pack() + text + kf.payload + kvstore.KVFooter(12345, *dataclasses.astuple(kf.footer)[1:]).pack()


def test_budget_eviction_removes_least_useful(model_tok, saved, tmp_path):
    model, _ = model_tok
    s, payload, good_path, text = saved
    size = good_path.stat().st_size
    now = int(time.time())
    names = {}
    for i, (hits, tokens, age) in enumerate([(0, 20, 0), (5, 20, 0), (0, 35, 0), (5, 20, 100 * 3600)]):
        t = text + bytes([65 + i])
        h = KVHeader(2, 1, 0, tokens, hits, 4096, 0, now - age, now - age, len(payload), len(t))
        data = h.pack() + t + payload
        (tmp_path / cache_name(t)).write_bytes(data)
        names[(hits, tokens, age)] = tmp_path / cache_name(t)
    dc = _cache(tmp_path, model, space_mb=1024)
    removed = dc.evict(budget=2 * size + 10)
    # scores: (0,20) -> 20, (5,20,new) -> 120, (0,35) -> 35, (5,20,100h old) -> ~20 but older -> goes first
    assert removed == [names[(5, 20, 100 * 3600)], names[(0, 20, 0)]]
    # the protected (just written) file survives even with the lowest score
    removed = dc.evict(protect=names[(0, 35, 0)], budget=size + 10)
    assert removed == [names[(5, 20, 0)]] and names[(0, 35, 0)].exists()


def test_racing_saves_leave_one_valid_file(model_tok, saved, tmp_path):
    model, _ = model_tok
    s, _, _, text = saved
    caches = [_cache(tmp_path, model) for _ in range(4)]
    barrier = threading.Barrier(4)

    def save(dc):
        barrier.wait()
        for _ in range(3):
            dc.store(s, text, "cold")

    threads = [threading.Thread(target=save, args=(dc,)) for dc in caches]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == [cache_name(text)]  # no temp files left
    assert session_from_file(model, tmp_path / cache_name(text)).tokens == s.tokens


def test_store_policy_min_tokens_and_budget(model_tok, saved, tmp_path):
    model, _ = model_tok
    s, _, _, text = saved
    assert _cache(tmp_path, model, min_tokens=N_PREFIX + 1).store(s, text, "cold") is None
    tiny_budget = _cache(tmp_path, model, space_mb=1)
    tiny_budget.budget = 1000
    assert tiny_budget.store(s, text, "cold") is None and not list(tmp_path.glob("*.kv"))


def test_cold_and_continued_boundaries():
    p = CachePolicy()
    assert p.cold_length(list(range(100, 11111)), 1, 2) == 10240  # 11011 tokens -> 10240 (docs/serving.md §5.5)
    assert p.cold_length(list(range(100, 1795)), 1, 2) == 1695  # too short to align -> the whole prompt
    toks = [0] + [9] * 600 + [1] + [9] * 5 + [2] + [9] * 10  # BOS, system, <User> at 601, <Assistant>
    assert p.cold_length(toks, 1, 2) == 601
    assert p.continued_step == 10240
    assert CachePolicy(continued_interval_tokens=100, boundary_align_tokens=0).continued_step == 100
    assert CachePolicy(continued_interval_tokens=0).continued_step == 0
    with pytest.raises(ValueError):
        CachePolicy(min_tokens=512, cold_max_tokens=100).validate()


def test_header_rejects(tmp_path):
    with pytest.raises(KVCacheError, match="magic"):
        KVHeader.unpack(b"\0" * HEADER.size)
    h = KVHeader(2, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0)
    with pytest.raises(KVCacheError, match="token count 0"):
        KVHeader.unpack(h.pack())
    with pytest.raises(KVCacheError, match="shorter"):
        KVHeader.unpack(b"KVC\x01")


def test_full_shape_payload_size_matches_ds4():
    """At the V4 Flash shape and N = 2048 the serializer writes exactly ds4-bench's kvcache_bytes (52,184,460)."""
    from types import SimpleNamespace

    from ds4_mlx.model.attention import make_layer_cache
    from ds4_mlx.numerics import get_numerics
    from ds4_mlx.random_model import shape_config

    cfg = shape_config("full")
    N = 2048
    caches = []
    for il in range(cfg.n_layer):
        c = make_layer_cache(cfg, il)
        c.pos, c.raw = N, mx.zeros((cfg.n_swa, cfg.head_dim), mx.float16)
        if c.ratio:
            c.n_comp = N // c.ratio
            c.comp = mx.zeros((c.n_comp + 3, cfg.head_dim), mx.float16)  # capacity beyond n_comp is not written
        if c.index is not None:
            c.n_index = N // 4
            c.index = mx.zeros((c.n_index, cfg.indexer_head_dim), mx.float32)
        caches.append(c)
    model = SimpleNamespace(cfg=cfg, numerics=get_numerics("ds4"), layer_caches=list)
    fake = SimpleNamespace(model=model, tokens=list(range(N)), pos=N,
                           logits=mx.zeros((cfg.n_vocab,), mx.float32), caches=caches)
    assert len(session_payload(fake)) == 52_184_460


def test_resaving_the_same_prefix_keeps_its_history(model_tok, saved, tmp_path):
    """§5.5: a compatible file with the same text is not rewritten (hits survive); a new tool id updates only the
    map, keeping hits and times."""
    model, _ = model_tok
    s, _, _, text = saved
    dc = _cache(tmp_path, model)
    path = dc.store(s, text, "cold")
    assert dc.lookup(text + b"!").hit
    assert read_kv_file(path).header.hits == 1
    mtime = path.stat().st_mtime_ns
    assert dc.store(s, text, "evict") == path and path.stat().st_mtime_ns == mtime
    assert dc.saves["already_saved"] == 1
    dc.store(s, text, "evict", tool_map={"call_1": "block"})
    kf = read_kv_file(path)
    assert kf.tool_map == {"call_1": "block"} and kf.header.hits == 1 and kf.header.reason_name == "cold"


# --- interop with ds4's files and integrity --------------------------------------------------------------------
def _ds4_reads(path, *, ctx: int, n_swa: int, layers: int, quant_bits=(2, 4)) -> dict:
    """ds4's loader rules (ds4_kvstore_read_header/read_entry_file, ds4_session_load_payload; docs/serving.md §5.4),
    written out independently: what ds4 would accept of a file, or an AssertionError."""
    data = path.read_bytes()
    assert data[:4] == b"KVC\x01" and data[4] in quant_bits
    tokens, _hits, f_ctx = struct.unpack_from("<III", data, 8)
    payload_bytes, text_bytes = struct.unpack_from("<QI", data, 40)
    assert tokens != 0 and len(data) >= 52 + text_bytes + payload_bytes
    p = 52 + text_bytes
    h = struct.unpack_from("<13I", data, p)
    assert h[0] == 0x34565344 and h[1] == 1
    assert h[2] <= ctx and h[7] < ctx and h[8] == layers
    assert h[3] == (2048 if ctx > 2048 else ctx), "prefill chunk layout does not match current runtime"
    assert h[5] == min(n_swa, ctx) and h[12] == min(h[7], h[5]) and h[12] <= h[4]
    assert h[6] <= ctx // 4 + 2
    flags = data[6]
    end = p + payload_bytes
    tool_ids = []
    if flags & 1:  # the KTM trailer: its counted entries, whatever follows them
        assert data[end : end + 4] == b"KTM\x01"
        (count,) = struct.unpack_from("<I", data, end + 4)
        off = end + 8
        for _ in range(count):
            id_len, dsml_len = struct.unpack_from("<II", data, off)
            tool_ids.append(data[off + 8 : off + 8 + id_len].decode())
            off += 8 + id_len + dsml_len
    return {"tokens": tokens, "ctx": f_ctx, "reserved": (data[7], data[20:24]), "tool_ids": tool_ids}


def test_files_are_written_as_ds4_writes_them(model_tok, saved, tmp_path):
    """Header bytes and payload fields as ds4 writes them (reserved bytes 0, ds4's prefill chunk for the context,
    raw and compressed capacities), the fingerprint kept in the footer: ds4's loader rules accept the file."""
    model, _ = model_tok
    s, _, path, text = saved
    cfg = model.cfg
    got = _ds4_reads(path, ctx=kvstore.DEFAULT_CTX, n_swa=cfg.n_swa, layers=cfg.n_layer)
    assert got == {"tokens": N_PREFIX, "ctx": kvstore.DEFAULT_CTX, "reserved": (0, b"\0\0\0\0"), "tool_ids": []}
    with_map = tmp_path / "m.kv"
    session_to_file(s, with_map, text=text, ctx=1000, tool_map={"call_1": "<dsml block>"})
    assert _ds4_reads(with_map, ctx=1000, n_swa=cfg.n_swa, layers=cfg.n_layer)["tool_ids"] == ["call_1"]
    assert struct.unpack_from("<13I", read_kv_file(with_map).payload)[3] == 1000  # ctx ≤ 2048: the whole context
    assert read_kv_file(with_map).footer.fingerprint == kvstore.model_fingerprint(model)


def _as_ds4_wrote_it(path, *, chunk: int | None = None) -> bytes:
    """A file of ds4-mlx's as ds4 would have written it: no footer, optionally another prefill chunk."""
    kf = read_kv_file(path)
    payload = bytearray(kf.payload)
    if chunk is not None:
        struct.pack_into("<I", payload, 12, chunk)
    return kf.header.pack() + kf.text + bytes(payload) + kf.trailer


@pytest.mark.parametrize("chunk", [2048, 512, 4096])
def test_a_ds4_file_with_any_prefill_chunk_continues_exactly(model_tok, ids, saved, tmp_path, chunk):
    """ds4's own files (no footer) are used, whatever prefill chunk they record: ds4-mlx's prefill gives the same
    state for any chunking, so the continuation equals an uninterrupted run's."""
    model, _ = model_tok
    _, _, path, text = saved
    dc = _cache(tmp_path, model)
    (tmp_path / path.name).write_bytes(_as_ds4_wrote_it(path, chunk=chunk))
    hit = dc.lookup(text + b" more")
    assert hit.hit and dc.stats["loaded_without_footer"] == 1
    r = Session(model)
    r.restore(hit.snapshot)
    full = Session(model)
    full.prefill(ids[:N_PREFIX])
    assert _all_equal(_continue(r, ids, N_PREFIX), _continue(full, ids, N_PREFIX))


def _flip(path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def test_corrupt_files_are_skipped_with_a_reason(model_tok, saved, tmp_path):
    """A flipped bit inside the KV rows (which the payload's own checks cannot see) or in the tool-id map: the
    footer's CRC refuses the file, the miss and /v1/stats say why, and the file stays until a save replaces it."""
    model, _ = model_tok
    s, payload, _, text = saved
    dc = _cache(tmp_path, model)
    path = dc.store(s, text, "cold")
    _flip(path, 52 + len(text) + len(payload) // 2)  # inside the rows
    miss = dc.lookup(text + b"!")
    assert not miss.hit and "payload checksum mismatch" in miss.reason
    summary = dc.summary()
    assert summary["skipped"] == {"payload checksum mismatch (corrupt file)": 1}
    assert summary["last_skips"] == [{"file": path.name, "reason": "payload checksum mismatch (corrupt file)"}]
    assert path.exists()
    # the next save of the same prefix replaces it (it used to say "already on disk" and keep the broken file)
    assert dc.store(s, text, "evict") == path and dc.saves.get("already_saved", 0) == 0
    assert dc.lookup(text + b"!").hit
    # the tool-id map is covered too
    dc.store(s, text, "evict", tool_map={"call_9": "block"})
    _flip(path, path.stat().st_size - kvstore.FOOTER.size - 3)
    assert "tool-id map checksum mismatch" in dc.lookup(text + b"!").reason


def test_a_file_with_a_valid_header_but_an_unusable_payload_is_replaced(model_tok, saved, tmp_path):
    model, _ = model_tok
    s, payload, _, text = saved
    dc = _cache(tmp_path, model)
    bad = _valid_looking(text, np.random.default_rng(3).bytes(len(payload)), tokens=N_PREFIX)
    (tmp_path / cache_name(text)).write_bytes(bad)
    assert not dc.lookup(text + b"?").hit
    path = dc.store(s, text, "evict")
    assert path.read_bytes() != bad and dc.lookup(text + b"?").hit


def test_an_earlier_ds4_mlx_file_is_refused(model_tok, saved, tmp_path):
    """A fingerprint in the reserved header bytes and no footer: written before the footer existed, when the hf
    profile wrote unrotated indexer rows; refused with a reason rather than possibly read wrong."""
    model, _ = model_tok
    _, _, path, text = saved
    kf = read_kv_file(path)
    kf.header.model_id = kvstore.model_fingerprint(model)
    (tmp_path / path.name).write_bytes(kf.header.pack() + kf.text + kf.payload)
    miss = _cache(tmp_path, model).lookup(text + b"!")
    assert not miss.hit and "earlier ds4-mlx" in miss.reason


def test_stale_temp_files_are_removed_at_start(model_tok, saved, tmp_path):
    """Temp files of saves killed half-way (outside the budget): removed and counted when the cache opens, unless
    a live process may still be writing them."""
    import os
    import subprocess
    import sys

    model, _ = model_tok
    _, _, path, _ = saved
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    sha = path.name[:-3]
    stale = [f"{sha}.kv.tmp.{dead.pid}.140001", f"{sha}.kv.tmp.{dead.pid}"]  # ds4-mlx's and ds4's names
    old_live = f"{'1' * 40}.kv.tmp.{os.getpid()}.7"
    live = f"{'2' * 40}.kv.tmp.{os.getpid()}.7"
    for name in stale + [old_live, live, "notes.txt"]:
        (tmp_path / name).write_bytes(b"x" * 100)
    two_hours_ago = time.time() - 7200
    os.utime(tmp_path / old_live, (two_hours_ago, two_hours_ago))
    dc = _cache(tmp_path, model)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live, "notes.txt"])
    assert dc.summary()["stale_tmp_removed"] == 3
