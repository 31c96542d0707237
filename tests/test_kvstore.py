"""Disk KV cache at the library level: exact payload round trip, KVC framing, lookup, bad files, budget, races."""

from __future__ import annotations

import hashlib
import struct
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx import kvstore
from ds4_mlx.kvstore import (HEADER, CachePolicy, DiskCache, KVCacheError, KVHeader, cache_name, read_kv_file,
                             session_from_file, session_payload, session_to_file)
from ds4_mlx.loader import load
from ds4_mlx.session import Session

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


def test_round_trip_f32_profile(tiny_gguf, ids, tmp_path):
    """The "hf" profile keeps f32 rows: they come back as f32, bit for bit."""
    model, _ = load(tiny_gguf(experts="q2", hca_ratio=16), numerics="hf")
    s = Session(model)
    s.prefill(ids[:21])
    session_to_file(s, tmp_path / "s.kv", text=b"x")
    r = session_from_file(model, tmp_path / "s.kv")
    assert r.caches[2].raw.dtype == mx.float32 and _arrays_equal(r.caches[2].comp_rows, s.caches[2].comp_rows)
    assert session_payload(r) == session_payload(s)
    assert bool(mx.array_equal(r.step(5), s.step(5)).item())


def test_payload_layout_follows_dsv4(model_tok, saved):
    """Header fields and total size as MODEL.md §5.2 lays them out (computed independently here)."""
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
    assert path.stat().st_size == 52 + len(text) + len(payload)
    assert path.name == hashlib.sha1(text).hexdigest() + ".kv"


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
    dc = DiskCache(tmp_path, model, ctx=kvstore.DEFAULT_CTX, chunk_size=512,
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
        d2 = DiskCache(tmp_path / f"o{id(other)}", other, ctx=kvstore.DEFAULT_CTX, chunk_size=512,
                       policy=CachePolicy(min_tokens=8))
        (d2.dir / good_path.name).write_bytes(good_path.read_bytes())
        miss = d2.lookup(prompt)
        assert not miss.hit and miss.reason.startswith("incompatible file") and why in miss.reason
    with pytest.raises(KVCacheError):
        session_from_file(foreign, good_path)


def _with_text(path, text: bytes) -> bytes:
    """The file at ``path`` re-keyed to ``text`` (same payload, so only the fingerprint/text checks differ)."""
    kf = read_kv_file(path)
    h = kf.header
    h.text_bytes = len(text)
    h.model_id = 12345  # another model wrote it
    return h.pack() + text + kf.payload


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
    assert p.cold_length(list(range(100, 11111)), 1, 2) == 10240  # 11011 tokens -> 10240 (SERVING.md §5.5)
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
    fake = SimpleNamespace(model=SimpleNamespace(cfg=cfg), tokens=list(range(N)), pos=N, chunk_size=2048,
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
