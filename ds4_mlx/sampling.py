"""Token sampling exactly as ds4 does it (docs/serving.md §3), plus stop-string handling.

Order of operations (ds4's, not llama.cpp's): temperature first, then top-k (on raw logits), then min-p, then
top-p, then the draw; min-p and top-p both use probabilities normalised over all finite logits (or over the k
survivors) and neither renormalises for the other. Weights are float32 ``w_i = exp((l_i - l_max) / T)``.
Randomness is ds4's xorshift64* generator, so a fixed seed reproduces the same tokens for the same logits.

Logits arrive as an ``mx.array`` float32 ``[V]`` (numpy arrays are accepted too). :func:`sample` runs in numpy
on the host: the walk is sequential by definition, and ties/orders must be deterministic (lowest id first). The
only divergence from ds4.c is at the float32-rounding level of the final walk (a float32 prefix sum is compared
with ``r`` instead of subtracting weight by weight), which is irrelevant since logits never match bit for bit
anyway. Greedy and ds4's default knobs (top-k off, top-p 1) also have a device form, :func:`sample_on_device`
(one kernel launch; MLX ops where there is no GPU): a lazy id that a pipelined decode step takes as its input
before the host has read it (:func:`~ds4_mlx.generate.decode_tokens`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

import mlx.core as mx
import numpy as np

from .backend import kernel_backend

__all__ = [
    "SamplingParams",
    "DEFAULT_PARAMS",
    "THINKING_PARAMS",
    "GREEDY_PARAMS",
    "server_params",
    "XorShift64Star",
    "UniformStream",
    "argmax",
    "sample",
    "on_device",
    "sample_ops",
    "sample_on_device",
    "Sampler",
    "StopStrings",
]

MAX_TOP_K = 1024


@dataclass(frozen=True)
class SamplingParams:
    """Sampler knobs with ds4's defaults (server and CLI): T 1.0, top_p 1.0, min_p 0.05, top_k 0 (off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.05

    def sanitized(self, n_vocab: int) -> SamplingParams:
        """ds4's clamping: top_p outside (0, 1] -> 1; min_p < 0 -> 0; top_k > 1024 -> 1024, then > V -> V;
        top_k <= 0 -> 0 (off)."""
        top_p = self.top_p if 0.0 < self.top_p <= 1.0 else 1.0
        min_p = max(self.min_p, 0.0)
        top_k = min(self.top_k, MAX_TOP_K, n_vocab) if self.top_k > 0 else 0
        return replace(self, top_p=top_p, min_p=min_p, top_k=top_k)


DEFAULT_PARAMS = SamplingParams()
THINKING_PARAMS = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.05)  # DeepSeek API's, §3 rule 1
GREEDY_PARAMS = SamplingParams(temperature=0.0)


def server_params(client: SamplingParams, *, thinking: bool, dsml_structure: bool = False,
                  explicit: Collection[str] = ()) -> SamplingParams:
    """Server override rules (§3), per token: in thinking mode ds4's fixed knobs replace the ones the client did
    not set (``explicit`` names those it did: they win, so temperature 0 stays greedy through the reasoning);
    inside DSML structure (``DSMLTracker.greedy``, tool requests only) sampling is greedy. The CLI does not
    override."""
    if dsml_structure:
        return GREEDY_PARAMS
    if thinking:
        return replace(THINKING_PARAMS, **{k: getattr(client, k) for k in explicit})
    return client


class XorShift64Star:
    """ds4's RNG: xorshift64* with ``U = ((out >> 40) & 0xFFFFFF) / 2**24`` (24-bit uniform in [0, 1))."""

    MASK = (1 << 64) - 1

    def __init__(self, seed: int | None = None) -> None:
        if seed is None:  # time-based like ds4 (time ^ pid ^ clock)
            seed = time.time_ns() ^ os.getpid() ^ time.perf_counter_ns()
        self.state = (int(seed) & self.MASK) or 0x9E3779B97F4A7C15

    def next_u64(self) -> int:
        x = self.state
        x ^= x >> 12
        x ^= (x << 25) & self.MASK
        x ^= x >> 27
        self.state = x
        return (x * 0x2545F4914F6CDD1D) & self.MASK

    def uniform(self) -> float:
        return ((self.next_u64() >> 40) & 0xFFFFFF) / 16777216.0


def _as_numpy(logits) -> np.ndarray:
    return np.asarray(logits, dtype=np.float32).reshape(-1)  # mx.array -> host float32 [V]


def argmax(logits) -> int:
    """Greedy pick: the first id holding the largest value; NaN never wins, +inf does, all -inf/NaN -> 0."""
    x = _as_numpy(logits)
    x = np.where(np.isnan(x), -np.inf, x)
    return int(np.argmax(x))


def _walk(w: np.ndarray, r: np.float32) -> int | None:
    """First index where the running float32 sum of ``w`` reaches ``r`` (ds4 subtracts until ``r <= 0``)."""
    hit = np.flatnonzero(np.cumsum(w, dtype=np.float32) >= r)
    return int(hit[0]) if hit.size else None


def _kept_count(w: np.ndarray, total: np.float32, min_p: float, top_p: float) -> int | None:
    """How many of the sorted candidates min-p/top-p keep: the first always, then while ``w >= min_p``, stopping
    after the one whose cumulative mass ``sum / total`` reaches ``top_p``. ``None`` if every candidate passed
    without reaching ``top_p`` (the caller may need more candidates)."""
    passing = w[1:] >= np.float32(min_p)
    n = 1 + (int(np.argmin(passing)) if not passing.all() else passing.size)
    reached = np.flatnonzero(np.cumsum(w[:n], dtype=np.float32) / total >= np.float32(top_p))
    if reached.size:
        return int(reached[0]) + 1
    return n if n < w.size else None


def _draw_sorted(ids: np.ndarray, w: np.ndarray, n: int, rng: XorShift64Star) -> int:
    """Draw ``r = U * sum(kept)`` and walk the ``n`` kept candidates in their (descending) order."""
    kept_sum = np.cumsum(w[:n], dtype=np.float32)[-1]
    r = np.float32(rng.uniform()) * kept_sum
    i = _walk(w[:n], r)
    return int(ids[i if i is not None else n - 1])


def _sorted_desc(ids: np.ndarray, vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.lexsort((ids, -vals))  # logit descending, then id ascending (ds4's sort is unstable)
    return ids[order], vals[order]


def sample(logits, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.05,
           rng: XorShift64Star | None = None) -> int:
    """Draw one token id from ``logits`` (float32 ``[V]``) with ds4's algorithm (§3)."""
    x = _as_numpy(logits)
    if temperature <= 0:
        return argmax(x)
    p = SamplingParams(temperature, top_p, top_k, min_p).sanitized(x.size)
    rng = rng if rng is not None else XorShift64Star()
    finite = np.isfinite(x)
    if not finite.any():
        return argmax(x)
    t = np.float32(temperature)

    if p.top_k > 0:
        ids = np.flatnonzero(finite)
        vals = x[ids]
        if ids.size > p.top_k:  # k largest, ties at the boundary broken by lower id
            kth = np.partition(vals, ids.size - p.top_k)[ids.size - p.top_k]
            above = ids[vals > kth]
            ids = np.concatenate([above, ids[vals == kth][: p.top_k - above.size]])
            vals = x[ids]
        ids, vals = _sorted_desc(ids, vals)
        w = np.exp((vals - vals[0]) / t, dtype=np.float32)
        total = np.cumsum(w, dtype=np.float32)[-1]
        if not np.isfinite(total) or total == 0:
            return int(ids[0])
        n = _kept_count(w, total, p.min_p, p.top_p)
        return _draw_sorted(ids, w, w.size if n is None else n, rng)

    l_max = x[finite].max()
    w_all = np.zeros_like(x)
    w_all[finite] = np.exp((x[finite] - l_max) / t, dtype=np.float32)
    if p.top_p >= 1.0:
        w = np.where(w_all >= np.float32(p.min_p), w_all, np.float32(0))
        total = np.cumsum(w, dtype=np.float32)[-1]  # float32, id order
        r = np.float32(rng.uniform()) * total
        if not np.isfinite(total) or total == 0:
            return argmax(x)
        i = _walk(w, r)
        return argmax(x) if i is None else i

    total = np.cumsum(w_all, dtype=np.float32)[-1]  # normaliser over every finite logit
    if not np.isfinite(total) or total == 0:
        return argmax(x)
    # candidates that can pass min-p (w >= min_p; the top one always does)
    cand = finite & (w_all >= np.float32(p.min_p))
    cand[np.flatnonzero(finite & (x == l_max))[0]] = True  # min_p > 1 would drop even the top one
    ids_all = np.flatnonzero(cand)
    vals_all = x[ids_all]
    # sort only the best m (all ties of the m-th value included), growing m until the kept prefix is decided
    m = 1024
    while True:
        if m >= ids_all.size:
            ids, vals = ids_all, vals_all
        else:
            kth = np.partition(vals_all, ids_all.size - m)[ids_all.size - m]
            sel = vals_all >= kth
            ids, vals = ids_all[sel], vals_all[sel]
        ids, vals = _sorted_desc(ids, vals)
        w = w_all[ids]
        n = _kept_count(w, total, p.min_p, p.top_p)
        if n is not None or ids.size == ids_all.size:
            return _draw_sorted(ids, w, w.size if n is None else n, rng)
        m *= 8


@lru_cache(maxsize=1)
def _zero_u() -> mx.array:
    # from host data, so already materialized: a lazy mx.zeros would belong to the stream of the thread that
    # first asked, and a later draw in another thread (the server's worker) could not evaluate it
    return mx.array(np.zeros(1, np.float32))


def on_device(p: SamplingParams) -> bool:
    """Whether :func:`sample_on_device` implements these knobs: greedy, or top-k off and top-p 1 (ds4's default)."""
    return p.temperature <= 0 or (p.top_k <= 0 and not 0.0 < p.top_p < 1.0)


def sample_ops(logits: mx.array, temperature: float, min_p: float, u: mx.array) -> mx.array:
    """:func:`sample`'s greedy and top-p-1 branches as lazy MLX ops: the id as int32 ``[1]``.

    ``u`` f32 ``[1]`` is the step's uniform, drawn on the host from the same xorshift64* stream (unused when
    greedy). The result is :func:`sample`'s, but for float32 rounding of the running sum (MLX may add in another
    order) and for logits with no finite value, where the caller consumes a uniform and :func:`sample` does
    not. The fallback and oracle of the one-launch kernel (:func:`sample_on_device`).
    """
    x = logits.reshape(-1).astype(mx.float32)
    best = mx.argmax(mx.where(mx.isnan(x), -mx.inf, x), keepdims=True)  # the first maximum; NaN never wins
    if temperature <= 0:
        return best.astype(mx.int32)
    finite = mx.isfinite(x)
    l_max = mx.max(mx.where(finite, x, -mx.inf))
    w = mx.where(finite, mx.exp((x - l_max) / mx.array(temperature, mx.float32)), 0.0)
    c = mx.cumsum(mx.where(w >= mx.array(min_p, mx.float32), w, 0.0))  # float32, id order
    total = c[-1]
    hit = c >= u * total  # the walk: the first id whose running sum reaches r = U * total
    ok = mx.isfinite(total) & (total > 0) & mx.any(hit)
    return mx.where(ok, mx.argmax(hit, keepdims=True), best).astype(mx.int32)


def sample_on_device(logits: mx.array, temperature: float, min_p: float, u: mx.array) -> mx.array:
    """:func:`sample_ops` in one kernel launch where there is a GPU kernel backend
    (:func:`ds4_mlx.kernels.fused.sample_token`), else as MLX ops: int32 ``[1]``, lazy. ``logits`` may also be a
    numpy array."""
    from .kernels import fused

    x = logits.reshape(-1) if isinstance(logits, mx.array) else mx.array(np.asarray(logits).reshape(-1))
    x = x if x.dtype == mx.float32 else x.astype(mx.float32)
    token = fused.sample_token(x, temperature, min_p, u, backend=kernel_backend())
    return sample_ops(x, temperature, min_p, u) if token is None else token


class UniformStream:
    """ds4's xorshift64* uniforms as one stream for host and device draws: :meth:`uniform` (what :func:`sample`
    calls) and :meth:`device` (an f32 ``[1]`` view for :func:`sample_on_device`) both take the next value, so
    the k-th draw uses the k-th uniform whichever path it takes. Values reach the device in batches of
    :attr:`BATCH`: a new host array every step would be a page fault on the device's critical path under
    MLX-CUDA (:func:`ds4_mlx.kernels.fused.resident`). :meth:`seek` rewinds the stream by up to :attr:`BATCH`
    values (a pipelined decode redrawing ids it had drawn ahead)."""

    BATCH = 256

    def __init__(self, seed: int | None = None) -> None:
        self.rng = XorShift64Star(seed)
        self.pos = 0  # index of the next value
        self._first = 0  # index of _values[0]: the batch before pos's (older values are never read again)
        self._values: list[float] = []
        self._batch: tuple[int, mx.array] | None = None  # (batch index, device values)

    def seek(self, pos: int) -> None:
        """Make ``pos`` the index of the next value: the same values are drawn again from there."""
        if not self._first <= pos:
            raise ValueError(f"uniform {pos} was dropped (the stream keeps values from {self._first} on)")
        self.pos = pos

    def _value(self, i: int) -> float:
        start = i - i % self.BATCH - self.BATCH
        if start > self._first:
            del self._values[: start - self._first]
            self._first = start
        while self._first + len(self._values) <= i:
            self._values.append(self.rng.uniform())
        return self._values[i - self._first]

    def uniform(self) -> float:
        u = self._value(self.pos)
        self.pos += 1
        return u

    def device(self) -> mx.array:
        from .kernels.fused import resident

        b, i = divmod(self.pos, self.BATCH)
        if self._batch is None or self._batch[0] != b:
            vals = [self._value(j) for j in range(b * self.BATCH, (b + 1) * self.BATCH)]
            self._batch = (b, resident(mx.array(vals, dtype=mx.float32)))
        self.pos += 1
        return self._batch[1][i : i + 1]


class Sampler:
    """A seeded sampler: ``Sampler(params, seed)(logits) -> id``. Same seed + same logits -> same ids.

    :meth:`draw` samples on the device instead (a lazy id) where the knobs allow it (:func:`on_device`); host and
    device draws share one stream of uniforms (:class:`UniformStream`).
    """

    def __init__(self, params: SamplingParams = DEFAULT_PARAMS, seed: int | None = None, *,
                 banned: Sequence[int] = ()) -> None:  # fmt: skip
        """``banned``: ids never drawn (their logits count as -inf), e.g. ds4-bench's EOS."""
        self.params = params
        self.rng = UniformStream(seed)
        self.banned = tuple(int(i) for i in banned)
        self._ban_rows: dict[int, tuple[np.ndarray, mx.array]] = {}  # vocabulary size -> -inf at the banned ids

    def _allowed(self, logits):
        """``logits`` with the banned ids at -inf (one add; nothing without banned ids)."""
        if not self.banned:
            return logits
        n = logits.shape[-1]
        if n not in self._ban_rows:
            row = np.zeros(n, np.float32)
            row[[i for i in self.banned if 0 <= i < n]] = -np.inf
            self._ban_rows[n] = (row, mx.array(row))  # made once: a fresh host array a step would fault on CUDA
        host, dev = self._ban_rows[n]
        return logits + (dev if isinstance(logits, mx.array) else host)

    def __call__(self, logits, params: SamplingParams | None = None) -> int:
        p = params or self.params
        return sample(self._allowed(logits), p.temperature, p.top_k, p.top_p, p.min_p, self.rng)

    def draw(self, logits: mx.array, params: SamplingParams | None = None) -> mx.array:
        """The next id as a lazy int32 ``[1]``, drawn on the device (the knobs must pass :func:`on_device`);
        the k-th draw (host or device) uses the k-th uniform."""
        p = params or self.params
        logits = self._allowed(logits)
        if not on_device(p):
            raise ValueError(f"top_k={p.top_k} / top_p={p.top_p} sample on the host only: call the sampler")
        if p.temperature <= 0:
            return sample_on_device(logits, p.temperature, 0.0, _zero_u())
        return sample_on_device(logits, p.temperature, max(p.min_p, 0.0), self.rng.device())

    def next_id(self, logits: mx.array, params: SamplingParams | None = None) -> int:
        """One synchronous draw: on the device where the knobs allow it (no copy of the logits to the host,
        no host arithmetic over the vocabulary), else on the host."""
        p = params or self.params
        return int(self.draw(logits, p).item()) if on_device(p) else self(logits, p)


class StopStrings:
    """Stop sequences matched against the raw generated bytes (reasoning included, §3), across token boundaries.

    ``push(data)`` returns ``(safe_bytes, stopped)``: bytes that can be emitted now (text that might be the start
    of a stop sequence is held back, at most ``maxlen - 1`` bytes); once a stop sequence appears, the text is
    truncated right before it and ``stopped`` is True. ``flush()`` releases the held bytes at the end.
    """

    def __init__(self, stops: Sequence[str | bytes]) -> None:
        self.stops = [s.encode() if isinstance(s, str) else bytes(s) for s in stops if s]
        self._held = b""
        self.stopped = False

    def push(self, data: bytes) -> tuple[bytes, bool]:
        if self.stopped:
            return b"", True
        buf = self._held + data
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self._held = True, b""
            return buf[: min(hits)], True
        keep = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self._held = buf[len(buf) - keep :] if keep else b""
        return buf[: len(buf) - keep], False

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return b"" if self.stopped else held
