"""Sampling tests (docs/serving.md §3): greedy = argmax rules, a loop-by-loop transcription of §3's prose as the
reference (same RNG, random logits with NaN/inf and out-of-range knobs), fixed-seed statistics, truncation by
min_p / top_p / top_k, server overrides and stop strings."""

from __future__ import annotations

import math
import random

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.sampling import (
    DEFAULT_PARAMS,
    GREEDY_PARAMS,
    Sampler,
    SamplingParams,
    StopStrings,
    UniformStream,
    XorShift64Star,
    argmax,
    on_device,
    sample,
    sample_ops,
    server_params,
)
from ds4_mlx.kernels import fused
from kernel_util import BACKEND, kernel_backend_set, needs_gpu

F = np.float32


# -- independent reference ------------------------------------------------------------------------------------
class RefRng:
    def __init__(self, seed: int) -> None:
        self.s = seed % 2**64 or 0x9E3779B97F4A7C15

    def u(self) -> float:
        x = self.s
        x ^= x >> 12
        x = (x ^ (x << 25)) % 2**64
        x ^= x >> 27
        self.s = x
        out = (x * 0x2545F4914F6CDD1D) % 2**64
        return ((out >> 40) & 0xFFFFFF) / 16777216.0


def ref_argmax(l: list[float]) -> int:
    best = 0
    for i, v in enumerate(l):
        if not math.isnan(v) and (math.isnan(l[best]) or v > l[best]):
            best = i
    return best


def ref_sample(l: list[float], T: float, top_k: int, top_p: float, min_p: float, rng: RefRng) -> int:
    """§3 transcribed with explicit loops and float32 scalars."""
    if T <= 0:
        return ref_argmax(l)
    if not 0 < top_p <= 1:
        top_p = 1.0
    min_p = max(min_p, 0.0)
    if top_k > 1024:
        top_k = 1024
    if top_k > len(l):
        top_k = len(l)
    fin = [i for i, v in enumerate(l) if math.isfinite(v)]
    if not fin:
        return ref_argmax(l)
    T32 = F(T)

    def walk(cands, ws, kept_sum):
        r = F(rng.u()) * kept_sum
        for i, w in zip(cands, ws):
            r = F(r - w)
            if r <= 0:
                return i
        return None

    def minp_topp(cands, ws, total):
        kept, kw, cum = [cands[0]], [ws[0]], ws[0]
        if not F(cum) / total >= F(top_p):
            for i, w in zip(cands[1:], ws[1:]):
                if not w >= F(min_p):
                    break
                kept.append(i)
                kw.append(w)
                cum = F(cum + w)
                if F(cum) / total >= F(top_p):
                    break
        kept_sum = F(0)
        for w in kw:
            kept_sum = F(kept_sum + w)
        got = walk(kept, kw, kept_sum)
        return kept[-1] if got is None else got

    if top_k > 0:
        cands = sorted(fin, key=lambda i: (-l[i], i))[:top_k]
        ws = [F(np.exp(F(F(l[i]) - F(l[cands[0]])) / T32)) for i in cands]
        total = F(0)
        for w in ws:
            total = F(total + w)
        if total == 0 or not math.isfinite(total):
            return cands[0]
        return minp_topp(cands, ws, total)
    lmax = max(F(l[i]) for i in fin)
    w = {i: F(np.exp(F(F(l[i]) - lmax) / T32)) for i in fin}
    if top_p >= 1:
        kept = [i for i in fin if w[i] >= F(min_p)]
        total = F(0)
        for i in kept:
            total = F(total + w[i])
        if total == 0 or not math.isfinite(total):
            rng.u()
            return ref_argmax(l)
        got = walk(kept, [w[i] for i in kept], total)
        return ref_argmax(l) if got is None else got
    total = F(0)
    for i in fin:
        total = F(total + w[i])
    cands = sorted(fin, key=lambda i: (-l[i], i))
    return minp_topp(cands, [w[i] for i in cands], total)


# -- tests ----------------------------------------------------------------------------------------------------
def test_defaults():
    assert DEFAULT_PARAMS == SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.05)
    assert SamplingParams(top_p=0.0, min_p=-1, top_k=5000).sanitized(2000) == SamplingParams(1.0, 1.0, 1024, 0.0)
    assert SamplingParams(top_p=1.5, top_k=600).sanitized(512) == SamplingParams(1.0, 1.0, 512, 0.05)
    assert SamplingParams(top_k=-3).sanitized(10).top_k == 0


def test_rng_matches_reference_and_zero_seed():
    a, b = XorShift64Star(12345), RefRng(12345)
    assert [a.uniform() for _ in range(1000)] == [b.u() for _ in range(1000)]
    z, g = XorShift64Star(0), XorShift64Star(0x9E3779B97F4A7C15)
    assert [z.next_u64() for _ in range(5)] == [g.next_u64() for _ in range(5)]
    assert XorShift64Star(2**64 + 7).state == 7
    us = [XorShift64Star(9).uniform() for _ in range(3)]
    assert len(set(us)) == 1 and 0 <= us[0] < 1


def test_greedy_is_argmax():
    rng = np.random.default_rng(0)
    for _ in range(200):
        x = rng.standard_normal(300).astype(np.float32)
        assert sample(mx.array(x), temperature=0.0) == int(np.argmax(x))
        assert sample(x, temperature=-1.0) == int(np.argmax(x))
    x = np.array([1, 5, np.nan, 5, 2], np.float32)
    assert argmax(x) == 1  # first maximum, NaN never wins
    assert argmax(np.array([1, np.inf, 3, np.inf], np.float32)) == 1  # +inf wins in the greedy branch
    assert argmax(np.array([-np.inf, np.nan, -np.inf], np.float32)) == 0
    assert Sampler(GREEDY_PARAMS, seed=1)(mx.array(x)) == 1


def _rand_case(rng: random.Random):
    n = rng.choice([1, 2, 5, 30, 200])
    scale = rng.choice([0.5, 2.0, 8.0])
    l = [rng.gauss(0, scale) for _ in range(n)]
    if rng.random() < 0.3:
        for _ in range(rng.randint(1, 3)):
            l[rng.randrange(n)] = rng.choice([float("nan"), float("-inf"), float("inf")])
    if rng.random() < 0.2:  # exact ties
        v = max(x for x in l if math.isfinite(x)) if any(math.isfinite(x) for x in l) else 0.0
        for _ in range(3):
            l[rng.randrange(n)] = v
    T = rng.choice([0.0, 0.3, 1.0, 1.7, -1.0])
    top_k = rng.choice([0, 0, 1, 3, 40, 5000, -2])
    top_p = rng.choice([1.0, 1.0, 0.9, 0.5, 0.2, 0.0, 1.5, -0.1])
    min_p = rng.choice([0.05, 0.0, 0.2, 0.9, -0.5, 1.5])
    return l, T, top_k, top_p, min_p


def test_matches_spec_transcription():
    rng = random.Random(0)
    for case in range(1500):
        l, T, top_k, top_p, min_p = _rand_case(rng)
        seed = rng.getrandbits(64)
        ours, ref = XorShift64Star(seed), RefRng(seed)
        x = mx.array(np.array(l, np.float32))
        for draw in range(4):
            got = sample(x, T, top_k, top_p, min_p, ours)
            want = ref_sample([float(F(v)) for v in l], T, top_k, top_p, min_p, ref)
            assert got == want, (case, draw, l, T, top_k, top_p, min_p)


def test_matches_spec_transcription_large_vocab():
    """Large candidate sets (> 1024 kept by top-p, many tied logits) exercise the partial-sort path."""
    rng = random.Random(1)
    for case in range(8):
        n = 6000
        l = [round(rng.gauss(0, rng.choice([0.05, 0.5, 2.0])), 2) for _ in range(n)]
        T, top_p, min_p, top_k = rng.choice([0.7, 1.0, 3.0]), rng.choice([0.3, 0.9, 0.99]), 0.0, 0
        seed = rng.getrandbits(64)
        ours, ref = XorShift64Star(seed), RefRng(seed)
        x = mx.array(np.array(l, np.float32))
        for draw in range(2):
            got = sample(x, T, top_k, top_p, min_p, ours)
            assert got == ref_sample([float(F(v)) for v in l], T, top_k, top_p, min_p, ref), (case, draw)


def _freqs(logits, n=20000, seed=1, **kw) -> np.ndarray:
    s = Sampler(SamplingParams(**kw), seed=seed)
    x = mx.array(np.asarray(logits, np.float32))
    counts = np.bincount([s(x) for _ in range(n)], minlength=len(logits))
    return counts / n


def _softmax(l, T=1.0):
    e = np.exp((np.asarray(l, np.float64) - np.max(l)) / T)
    return e / e.sum()


def test_fixed_seed_statistics():
    l = [1.0, 0.5, -0.2, 2.0, 0.0]
    for T in (1.0, 0.5, 2.0):
        f = _freqs(l, temperature=T, min_p=0.0)
        assert np.abs(f - _softmax(l, T)).max() < 0.015, (T, f)
    # reproducible per seed, different across seeds
    a, b, c = Sampler(seed=7), Sampler(seed=7), Sampler(seed=8)
    x = mx.array(np.random.default_rng(3).standard_normal(1000).astype(np.float32))
    ra, rb, rc = [a(x) for _ in range(50)], [b(x) for _ in range(50)], [c(x) for _ in range(50)]
    assert ra == rb and ra != rc


def test_min_p_is_relative_and_applied_after_temperature():
    l = np.log(np.array([0.5, 0.3, 0.15, 0.04, 0.01]))
    f = _freqs(l, min_p=0.1)  # keep p >= 0.05: first three, renormalised among themselves by the draw
    assert f[3] == 0 and f[4] == 0
    assert np.abs(f[:3] - np.array([0.5, 0.3, 0.15]) / 0.95).max() < 0.015
    # at T=0.5, p ~ p^2: token 2 (0.15) has relative weight 0.09 < 0.1 and drops out
    f = _freqs(l, temperature=0.5, min_p=0.1)
    assert f[2] == 0 and f[1] > 0


def test_top_p_truncation_uses_full_normaliser():
    l = np.log(np.array([0.05, 0.5, 0.3, 0.15], np.float64))
    f = _freqs(l, top_p=0.75, min_p=0.0)  # 0.5 < 0.75 <= 0.8: keeps ids 1 and 2 (inclusive)
    assert f[0] == 0 and f[3] == 0
    assert abs(f[1] - 0.5 / 0.8) < 0.015
    f = _freqs(l, top_p=0.4, min_p=0.0)  # the first candidate alone reaches it
    assert f[1] == 1.0
    # min-p and top-p do not renormalise for each other: min_p drops 0.05, top_p still sees mass / 1.0
    f = _freqs(l, top_p=0.9, min_p=0.4)  # kept 0.5, 0.3 (0.15 < 0.4*0.5 fails min-p, 0.8 < 0.9)
    assert f[0] == 0 and f[3] == 0 and abs(f[1] - 0.625) < 0.015


def test_top_k_truncation_on_raw_logits_with_id_ties():
    l = [3.0, 1.0, 3.0, 2.0, 2.0, -1.0]
    f = _freqs(l, top_k=3, min_p=0.0, temperature=5.0)  # k=3: ids 0, 2 and the lower-id 2.0 (3)
    assert f[1] == 0 and f[4] == 0 and f[5] == 0 and min(f[0], f[2], f[3]) > 0.1
    w = np.exp((np.array([3.0, 3.0, 2.0]) - 3.0) / 5.0)
    assert np.abs(f[[0, 2, 3]] - w / w.sum()).max() < 0.015
    assert _freqs(l, top_k=1, n=200)[0] == 1.0


def test_non_finite_logits():
    x = np.array([np.nan, 0.0, np.inf, -np.inf, 0.0], np.float32)
    f = _freqs(x, n=4000, min_p=0.0)
    assert f[0] == f[2] == f[3] == 0 and abs(f[1] - 0.5) < 0.05
    assert sample(np.array([np.nan, -np.inf, np.inf], np.float32), 1.0, rng=XorShift64Star(1)) == 2  # fallback
    assert sample(np.array([np.nan, np.nan], np.float32), 1.0, top_k=2, rng=XorShift64Star(1)) == 0


def test_server_overrides():
    client = SamplingParams(temperature=0.2, top_p=0.5, top_k=5, min_p=0.3)
    assert server_params(client, thinking=False) == client
    assert server_params(client, thinking=True) == SamplingParams(1.0, 1.0, 0, 0.05)
    assert server_params(client, thinking=True, dsml_structure=True).temperature == 0.0


# -- stop strings ---------------------------------------------------------------------------------------------
def test_stop_strings_across_chunks():
    s = StopStrings(["STOP", "\n\nEND"])
    out, stopped = s.push(b"hello ST")
    assert (out, stopped) == (b"hello ", False)  # "ST" held: could start STOP
    out, stopped = s.push(b"ILL\n")
    assert (out, stopped) == (b"STILL", False)  # "\n" held
    out, stopped = s.push(b"\nEN")
    assert (out, stopped) == (b"", False)
    out, stopped = s.push(b"D tail")
    assert (out, stopped) == (b"", True) and s.stopped
    assert s.push(b"more") == (b"", True) and s.flush() == b""


def test_stop_strings_random_against_reference():
    rng = random.Random(5)
    for _ in range(500):
        stops = ["".join(rng.choice("ab\n") for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        text = "".join(rng.choice("abc\n") for _ in range(rng.randint(0, 30))).encode()
        s, out, stopped = StopStrings(stops), b"", False
        i = 0
        while i < len(text) and not stopped:
            n = rng.randint(1, 4)
            chunk, stopped = s.push(text[i : i + n])
            out += chunk
            i += n
        out += s.flush()
        cut = min([text.find(x.encode()) for x in stops if text.find(x.encode()) >= 0], default=-1)
        assert out == (text[:cut] if cut >= 0 else text), (stops, text)
        assert stopped == (cut >= 0)


def test_stop_strings_empty_list():
    s = StopStrings([])
    assert s.push(b"abc") == (b"abc", False) and s.flush() == b""


@pytest.mark.parametrize("n", [129280])
def test_full_vocab_speed(n):
    """One draw over the real vocab size stays cheap (ms), in every branch."""
    import time

    x = mx.array(np.random.default_rng(0).standard_normal(n).astype(np.float32) * 3)
    s = Sampler(seed=1)
    for p in (DEFAULT_PARAMS, SamplingParams(top_p=0.9), SamplingParams(top_k=40), SamplingParams(min_p=0.0)):
        t = time.perf_counter()
        for _ in range(10):
            s(x, p)
        assert (time.perf_counter() - t) / 10 < 0.05, p


# -- on the device: the MLX-op form and the one-launch kernel --------------------------------------------------
def _device_case(rng: np.random.Generator, V: int, scale: float):
    """Random logits (NaN/±inf in 30 % of the cases) and knobs, out-of-range ones included."""
    x = (rng.standard_normal(V) * scale).astype(np.float32)
    if rng.random() < 0.3:
        for _ in range(3):
            x[rng.integers(V)] = rng.choice([np.nan, -np.inf, np.inf])
    T = float(rng.choice([0.0, 0.3, 1.0, 1.7, -1.0]))
    min_p = float(rng.choice([0.05, 0.0, 0.2, 0.9, 1.5]))
    return x, T, min_p


def test_sample_ops_is_the_host_sampler():
    """Greedy and top-p-1 draws as MLX ops pick what :func:`sample` picks from the same uniforms."""
    rng = np.random.default_rng(0)
    for case in range(800):
        x, T, min_p = _device_case(rng, int(rng.choice([1, 2, 5, 30, 200, 3000])), float(rng.choice([0.5, 2.0, 8.0])))
        if T > 0 and not np.isfinite(x).any():
            continue  # documented: the device form consumes a uniform here, the host one does not
        seed = int(rng.integers(1, 2**63))
        host, dev = XorShift64Star(seed), XorShift64Star(seed)
        for draw in range(2):
            u = mx.array([dev.uniform() if T > 0 else 0.0], mx.float32)
            got = int(sample_ops(mx.array(x), T, max(min_p, 0.0), u).item())
            assert got == sample(x, T, 0, 1.0, min_p, host), (case, draw, T, min_p)
    assert on_device(DEFAULT_PARAMS) and on_device(GREEDY_PARAMS) and on_device(SamplingParams(top_p=1.5))
    assert not on_device(SamplingParams(top_k=40)) and not on_device(SamplingParams(top_p=0.9))
    with pytest.raises(ValueError, match="host only"):
        Sampler(SamplingParams(top_k=3)).draw(mx.zeros((4,)))


def _walk_ok(x: np.ndarray, T: float, min_p: float, u: float, got: int) -> bool:
    """``got`` is where the walk lands up to float32 rounding of the running sum: its interval of the float64
    running sum of the weights holds r = u * total (within 1e-5 of the total)."""
    fin = np.isfinite(x)
    w = np.zeros(x.size)
    w[fin] = np.exp((x[fin].astype(np.float64) - x[fin].max()) / T)
    w[w < min_p] = 0
    c = np.cumsum(w)
    r, tol = u * c[-1], 1e-5 * c[-1]
    return w[got] > 0 and (c[got - 1] if got else 0.0) <= r + tol and c[got] >= r - tol


@needs_gpu
@pytest.mark.parametrize("V", [1, 33, 1000, 5000, 129280])
def test_sample_kernel(V):
    """The one-launch kernel against the MLX ops: the same greedy id always (NaN, ±inf, ties); sampled ids
    the same where the logits are peaked, and always where the walk lands up to rounding (flat logits over
    the real vocabulary: the kernel's chunked sums and MLX's sequential cumsum round differently)."""
    rng = np.random.default_rng(V)
    same = sampled = 0
    cases = 40 if V < 129280 else 12
    for case in range(cases):
        x, T, min_p = _device_case(rng, V, float(rng.choice([0.05, 2.0, 8.0])))
        if rng.random() < 0.2:
            x[rng.integers(V, size=3)] = np.nanmax(np.where(np.isfinite(x), x, np.nan)) if np.isfinite(x).any() else 1.0
        u = mx.array([rng.random()], mx.float32)
        want = int(sample_ops(mx.array(x), T, max(min_p, 0.0), u).item())
        got = int(fused.sample_token(mx.array(x), T, max(min_p, 0.0), u, backend=BACKEND).item())
        if T <= 0 or not np.isfinite(x).any():
            assert got == want, (case, T)
            continue
        same, sampled = same + (got == want), sampled + 1
        w_ok = _walk_ok(x, T, max(min_p, 0.0), float(u.item()), got)
        greedy_fallback = got == int(np.argmax(np.where(np.isnan(x), -np.inf, x)))
        assert w_ok or (greedy_fallback and got == want), (case, T, min_p, got, want)
    assert same >= 0.6 * sampled, (same, sampled)


@needs_gpu
def test_sample_kernel_frequencies():
    """Drawn through the kernel with a seeded Sampler, ids follow the softmax of the logits over T."""
    l = np.array([1.0, 0.5, -0.2, 2.0, 0.0], np.float32)
    with kernel_backend_set(BACKEND):
        s = Sampler(SamplingParams(temperature=0.7, min_p=0.0), seed=3)
        x = mx.array(l)
        ids = np.array([int(s.draw(x).item()) for _ in range(3000)])
    f = np.bincount(ids, minlength=5) / ids.size
    assert np.abs(f - _softmax(l, 0.7)).max() < 0.03, f


def test_host_and_device_draws_share_one_stream_of_uniforms():
    """A sampler whose knobs change from token to token (as the server's do) uses the k-th uniform for its
    k-th draw on either path: the ids are the host sampler's with one RNG."""
    rng = np.random.default_rng(5)
    knobs = [DEFAULT_PARAMS, SamplingParams(top_k=5), GREEDY_PARAMS, SamplingParams(top_p=0.9), DEFAULT_PARAMS,
             SamplingParams(temperature=0.6, min_p=0.0)] * 60  # past one device batch of uniforms
    s, ref = Sampler(seed=11), XorShift64Star(11)
    for i, p in enumerate(knobs):
        x = rng.standard_normal(300).astype(np.float32) * 2
        logits = x if i % 2 else mx.array(x)  # numpy logits are accepted on both paths (the server's fake engine)
        assert s.next_id(logits, p) == sample(x, p.temperature, p.top_k, p.top_p, p.min_p, ref), i
    assert s.rng.pos > UniformStream.BATCH


def test_uniform_stream_seek_replays_values():
    """A rewound stream gives the same values again, host and device, across a batch boundary; values older
    than the previous batch are dropped and seeking to them is an error."""
    B = UniformStream.BATCH
    s, ref = UniformStream(21), XorShift64Star(21)
    want = [ref.uniform() for _ in range(3 * B)]
    got = [s.uniform() for _ in range(B + 5)]
    s.seek(B - 3)  # back into the previous batch
    got_dev = [float(s.device().item()) for _ in range(8)]
    assert got == want[: B + 5]
    np.testing.assert_array_equal(np.float32(got_dev), np.float32(want[B - 3 : B + 5]))
    assert [s.uniform() for _ in range(B + 10)] == want[B + 5 : 2 * B + 15]
    with pytest.raises(ValueError, match="dropped"):
        s.seek(B - 1)  # two batches back


def test_cached_draw_constants_serve_any_thread(in_other_thread):
    """The greedy draw's cached uniform is made in whichever thread draws first (a test, the CLI) and reused by
    others (the server's worker): it must hold data, not a lazy op of the first thread's own stream."""
    from ds4_mlx import sampling

    sampling._zero_u.cache_clear()
    sampling._zero_u()  # made here
    assert in_other_thread(lambda: (sampling._zero_u() + 1).item()) == 1.0
