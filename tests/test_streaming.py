"""Expert streaming (ds4_mlx/streaming.py, ``--ssd-streaming``): the routed experts read from the GGUF into a cache
of fixed size give the resident model's logits and tokens, the cache never holds more than its size, its counters
add up, and bad sizes or a file cut short end in clear errors."""

from __future__ import annotations

import importlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.generate import decode_tokens
from ds4_mlx.loader import check_expert_cache, load
from ds4_mlx.sampling import GREEDY_PARAMS, Sampler
from ds4_mlx.session import Session
from ds4_mlx.streaming import ExpertCache, parse_cache_size, read_profile, write_profile
from kernel_util import BACKEND, kernel_backend_set, needs_gpu

TOKENS = np.random.default_rng(0).integers(2, 500, 90).tolist()
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gguf(tiny_gguf):
    return tiny_gguf()


@pytest.fixture(scope="module")
def resident(gguf):
    return load(gguf)[0]


@pytest.fixture(scope="module")
def resident_logits(resident):
    done: dict[tuple, np.ndarray] = {}
    return lambda chunks: done.setdefault(tuple(chunks), _logits(resident, chunks))


def _logits(model, chunks: list[int], steps=(7, 8, 9)) -> np.ndarray:
    """Prefill ``TOKENS`` in ``chunks``, then decode ``steps``: every call's logits."""
    caches, i, out = model.make_cache(), 0, []
    for n in chunks:
        out.append(np.array(model(TOKENS[i : i + n], i, caches)))
        i += n
    for t in steps:
        out.append(np.array(model([t], i, caches)))
        i += 1
    return np.stack(out)


# 6 experts: one a layer (6 layers); 12: two; 100%: all 96. 90 tokens in one chunk run on the CPU's numpy path, by
# groups of experts; 30 + 60 on MLX's, by spans of tokens; 5 + 5 are decode-sized calls.
@pytest.mark.parametrize("size, chunks", [("6", [90]), ("6", [30, 60]), ("6", [5, 5]), ("12", [90]),
                                          ("100%", [30, 60])])  # fmt: skip
def test_streamed_logits_equal_the_resident_models(gguf, resident_logits, size, chunks):
    model = load(gguf, expert_cache=size)[0]
    cache = model.expert_cache
    np.testing.assert_array_equal(_logits(model, chunks), resident_logits(chunks))
    st = cache.stats()
    assert cache.slots == {"6": 6, "12": 12, "100%": 96}[size] and st["resident"] <= cache.slots
    assert st["bytes_read"] == st["misses"] * cache.unit_bytes  # each miss read once, a whole expert
    assert st["misses"] >= min(st["resident"], cache.slots) and st["hits"] + st["misses"] > 0
    trio = next(iter(cache.experts.values()))  # every layer's experts have the same types and shapes
    assert all(p.nbytes == cache.slots * t.expert_bytes for p, t in zip(cache.pools, trio))
    assert cache.nbytes == sum(p.nbytes for p in cache.pools) <= parse_cache_size(size, cache.unit_bytes, 96)


@needs_gpu
def test_streamed_chunks_on_the_kernels(gguf, resident):
    """The grouped prefill kernels (the GPU's, or their CUDA text on the CPU) on the pools, a 10-token chunk (past
    the 8 of a decode-sized call) in spans of tokens whose experts fit in 6 slots: the resident model's logits."""
    model = load(gguf, expert_cache="6")[0]
    with kernel_backend_set(BACKEND):
        want = np.array(resident(TOKENS[:10], 0, resident.make_cache(), all_logits=True))
        got = np.array(model(TOKENS[:10], 0, model.make_cache(), all_logits=True))
    np.testing.assert_array_equal(got, want)
    assert model.expert_cache.stats()["calls"] > len(model.layers)  # some layer ran in several spans


def test_streamed_greedy_tokens_equal_the_resident_models(gguf, resident):
    def greedy(model):
        s = Session(model)
        s.prefill(TOKENS[:40])
        return [t for t, _ in decode_tokens(s, Sampler(GREEDY_PARAMS), 12)]

    streamed = load(gguf, expert_cache="6")[0]
    assert greedy(streamed) == greedy(resident)
    # each layer's step up to its router ran as a compiled function, as the resident step does
    assert all(layer._routed_steps and not layer._steps for layer in streamed.layers)


def test_streamed_models_decode_from_one_thread(gguf, resident, monkeypatch):
    generate = importlib.import_module("ds4_mlx.generate")  # the package exports a function of that name
    monkeypatch.setattr(generate, "kernel_backend", lambda: "cuda")
    assert generate.default_encode_thread(Session(resident))
    assert not generate.default_encode_thread(Session(load(gguf, expert_cache="6")[0]))


def _cache_like(gguf, slots: int, half_life: float) -> ExpertCache:
    """A cache of ``slots`` experts over the tiny model's file, with its own eviction half-life."""
    streamed = load(gguf, expert_cache="6")[0].expert_cache
    return ExpertCache(streamed.experts, slots * streamed.unit_bytes, min_slots=6, half_life=half_life)


def test_the_cache_evicts_the_least_recently_used(gguf):
    cache = _cache_like(gguf, 8, half_life=0)
    cache.fetch(0, np.arange(6))  # slots 0..5
    cache.fetch(1, np.array([0, 1]))  # slots 6, 7: full
    cache.fetch(0, np.array([0]))  # layer 0's expert 0 becomes the most recent
    _, slots = cache.fetch(2, np.array([5, 6]))  # evicts layer 0's experts 1 and 2, the least recent
    assert sorted(np.array(slots).tolist()) == [1, 2]
    _, slots = cache.fetch(0, np.array([0, 3]))
    assert np.array(slots).tolist() == [0, 3] and cache.stats()["misses"] == 10 and cache.stats()["hits"] == 3
    weights, slots = cache.fetch(2, np.array([[6, 5], [5, 6]]))  # ids of any shape map to their slots
    assert np.array(slots).tolist() == [[2, 1], [1, 2]] and weights[0].shape[0] == 8
    with pytest.raises(ValueError, match="needs 9 experts at once"):
        cache.fetch(0, np.arange(9))
    with pytest.raises(IndexError, match="out of range"):
        cache.fetch(0, np.array([16]))


@pytest.mark.parametrize("half_life, kept", [(0, False), (256, True)])
def test_the_cache_keeps_what_was_used_most(gguf, half_life, kept):
    """An expert used 30 times, then 4 times six others, then (12 calls later: past the protected rounds) a miss:
    by decayed use the 30-times expert stays and one of the six goes; least-recently-used evicts it instead."""
    cache = _cache_like(gguf, 8, half_life)
    cache.fetch(1, np.array([0]))  # a ticker, to count calls without touching the rest
    for _ in range(30):
        cache.fetch(0, np.array([0]))
    for _ in range(4):
        cache.fetch(0, np.arange(1, 7))  # the cache is full
    for _ in range(2 * len(cache.experts) + 1):
        cache.fetch(1, np.array([0]))
    cache.fetch(2, np.array([0]))  # one miss
    misses = cache.misses
    cache.fetch(0, np.array([0]))
    assert (cache.misses == misses) == kept
    assert cache.stats()["resident"] == 8


def test_the_cache_keeps_what_the_last_steps_used(gguf):
    """An expert used once in the last call outlives experts used 30 times before the protected rounds: tokens
    repeat the experts of the tokens just before them."""
    cache = _cache_like(gguf, 8, half_life=256)
    cache.fetch(1, np.array([0]))
    for _ in range(30):
        cache.fetch(0, np.arange(6))
    for _ in range(2 * len(cache.experts) + 1):
        cache.fetch(1, np.array([0]))
    cache.fetch(2, np.array([0]))  # the cache is full
    cache.fetch(3, np.array([0]))  # one miss
    misses = cache.misses
    cache.fetch(2, np.array([0]))
    assert cache.misses == misses


def test_a_use_profile_fills_the_next_start_with_the_most_used_experts(gguf, resident_logits, tmp_path):
    """A run with a profile counts every expert's uses and writes them; a start with that profile reads the most
    used into the cache first (its logits still the resident model's); the counts add up over runs."""
    profile = tmp_path / "uses.json"
    model = load(gguf, expert_cache="12", expert_profile=profile)[0]
    assert model.expert_cache.stats()["preloaded"] == 0 and not profile.exists()  # nothing used yet
    _logits(model, [30, 60])
    first = model.expert_cache
    first.close()
    uses = read_profile(profile, list(first.experts), first.n_expert)
    assert np.array_equal(uses, first.uses) and uses.sum() == first.hits + first.misses > 0  # each expert asked for

    model = load(gguf, expert_cache="12", expert_profile=profile)[0]
    cache = model.expert_cache
    assert cache.stats()["preloaded"] == 12 and cache.stats()["resident"] == 12 and cache.misses == 0
    rows, experts = np.unravel_index(np.argsort(-uses, axis=None, kind="stable")[:12], uses.shape)
    for row, e in zip(rows, experts):  # the 12 most used are the ones resident
        cache.fetch(list(cache.experts)[row], np.array([e]))
    assert cache.misses == 0 and cache.hits == 12
    np.testing.assert_array_equal(_logits(model, [30, 60]), resident_logits([30, 60]))
    cache.close()
    assert read_profile(profile, list(cache.experts), cache.n_expert).sum() > uses.sum()

    profile.unlink()
    profile.mkdir()  # a profile that can no longer be written: the model runs on, with a warning
    with pytest.warns(UserWarning, match="could not be written"):
        cache.close()

    preset = load(gguf, expert_cache="12", expert_preload=5)[0].expert_cache  # no profile: expert 0 of each layer
    for il in list(preset.experts)[:5]:
        preset.fetch(il, np.array([0]))
    assert preset.stats()["preloaded"] == 5 and preset.misses == 0


def test_a_use_profile_of_another_model_is_a_clear_error(gguf, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not an expert use profile"):
        load(gguf, expert_cache="6", expert_profile=bad)
    other = tmp_path / "other.json"
    write_profile(other, [0, 1], np.ones((2, 16), np.int64))
    with pytest.raises(ValueError, match=r"not an expert use profile of this model \(6 streamed layers of 16"):
        check_expert_cache(gguf, "6", other)
    with pytest.raises(ValueError, match="for streamed experts"):
        load(gguf, expert_preload=3)
    r = _cli("generate", "-m", str(gguf), "-p", "hi", "-n", "2", "--ssd-streaming-profile", str(other))
    assert r.returncode == 2 and "not an expert use profile of this model" in r.stderr
    r = _cli("serve", "-m", str(gguf), "--ssd-streaming-profile", str(tmp_path / "no" / "uses.json"))
    assert r.returncode == 2 and "does not exist" in r.stderr


def test_cache_sizes_parse_or_say_what_is_accepted(gguf):
    assert parse_cache_size("12", 100, 96) == 1200
    assert parse_cache_size("50%", 100, 96) == 4800
    assert parse_cache_size("1.5GB", 100, 96) == 3 << 29
    for bad, why in [("abc", "expected a number of experts"), ("1.5", "must be whole"), ("0%", r"\(0, 100\]"),
                     ("150%", r"\(0, 100\]")]:  # fmt: skip
        with pytest.raises(ValueError, match=why):
            parse_cache_size(bad, 100, 96)
    with pytest.raises(ValueError, match="one token needs 6 at once: give at least 6"):
        check_expert_cache(gguf, "5")
    assert check_expert_cache(gguf, "6") == (6 * 55296, 96 * 55296)


def test_a_file_cut_short_is_a_clear_error(gguf, tmp_path):
    path = tmp_path / "cut.gguf"
    shutil.copy(gguf, path)
    model = load(path, expert_cache="6")[0]
    with open(path, "r+b") as f:
        f.truncate(model.expert_cache.experts[5][2].offset)  # the last layer's down experts are gone
    with pytest.raises(OSError, match="truncated or changed since it was loaded"):
        _logits(model, [90])


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ds4_mlx", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip


def test_the_command_line_refuses_bad_streaming_flags(gguf, tmp_path):
    r = _cli("generate", "-m", str(gguf), "-p", "hi", "-n", "2", "--ssd-streaming-cache-experts", "3")
    assert r.returncode == 2 and "one token needs 6 at once" in r.stderr
    r = _cli("bench", "--random-weights", "tiny", "--ssd-streaming")
    assert r.returncode == 2 and "give -m FILE" in r.stderr
    r = _cli("serve", "-m", str(gguf), "--ssd-streaming-cache-experts", "lots")
    assert r.returncode == 2 and "expected a number of experts" in r.stderr
    r = _cli("generate", "-m", str(gguf), "-p", "hi", "-n", "3", "--ssd-streaming-cache-experts", "12")
    assert r.returncode == 0 and "streamed experts:" in r.stderr and "hit rate" in r.stderr
    profile = tmp_path / "uses.json"
    for _ in range(2):  # the second start reads the first one's most used experts
        r = _cli("generate", "-m", str(gguf), "-p", "hi", "-n", "3", "--ssd-streaming-profile", str(profile))
        assert r.returncode == 0 and profile.exists()
    assert "48 of 96 (" in r.stderr and "48 read at start" in r.stderr


def test_bench_reports_each_rows_decoding_reads(gguf, tmp_path):
    out = tmp_path / "b.json"
    r = _cli("bench", "-m", str(gguf), "--ctx-start", "32", "--ctx-max", "64", "--step-incr", "32", "-n", "5",
             "--ssd-streaming-cache-experts", "12", "--json", str(out))  # fmt: skip
    assert r.returncode == 0 and r.stderr.count("decoding: expert hit rate") == 2
    params = json.loads(out.read_text())["params"]
    rows, unit = params["experts_decoding"], params["experts"]["expert_bytes"]
    assert [row["ctx"] for row in rows] == [32, 64]
    for row in rows:  # 5 tokens, 6 layers, at most 6 distinct experts a layer
        assert 0 < row["hits"] + row["misses"] <= 5 * 6 * 6 and row["bytes_read"] == row["misses"] * unit
        assert row["hit_rate"] == round(row["hits"] / (row["hits"] + row["misses"]), 4)
    total = params["experts"]
    assert sum(row["misses"] for row in rows) < total["misses"]  # the prefills' misses are not a row's


def test_serve_reports_the_streamed_experts(gguf):
    import httpx
    from server_util import start_server, stop_server

    proc, base = start_server(gguf, "--ssd-streaming")
    try:
        assert httpx.get(base + "/v1/stats").json()["experts"]["slots"] == 48  # 50 % of 96
        r = httpx.post(base + "/v1/chat/completions", json={"model": "deepseek-v4-flash", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
        assert r.status_code == 200
        st = httpx.get(base + "/v1/stats").json()["experts"]
        assert st["misses"] > 0 and st["bytes_read"] == st["misses"] * st["expert_bytes"]
    finally:
        stop_server(proc)


def test_streaming_needs_a_gguf(gguf, tmp_path):
    with pytest.raises(ValueError, match="not a converted directory"):
        load(tmp_path, expert_cache="6")
    with pytest.raises(ValueError, match="no routed experts"):
        ExpertCache.from_weights({}, "6")
