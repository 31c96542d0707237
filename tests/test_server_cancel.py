"""Cancellation inside a prefill chunk: the model checks ``should_stop`` between layers, the session undoes the
chunk in progress, and a client that disconnects during a long prefill frees the server's worker within a
second on the demo model (it used to run the whole 512-token chunk: 37-39 s on a CPU)."""

from __future__ import annotations

import time

import httpx
import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.loader import load
from ds4_mlx.session import DEFAULT_CHUNK, PrefillCancelled, Session
from server_util import start_server, stop_server

CANCEL_LATENCY_S = 1.0


def _equal(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and bool(mx.array_equal(x, y).item()) for x, y in zip(a, b))


def test_cancelled_prefill_rolls_back_to_the_chunk_boundary(tiny_gguf):
    model, _ = load(tiny_gguf())
    ids = [int(t) for t in np.random.default_rng(5).integers(0, 512, 100)]
    layers = model.cfg.n_layer
    calls = []

    def stop_in_second_chunk() -> bool:
        calls.append(1)
        return len(calls) == layers + 3  # after the third layer of the second 40-token chunk

    s = Session(model, chunk_size=40)
    with pytest.raises(PrefillCancelled):
        s.prefill(ids[:90], should_stop=stop_in_second_chunk)
    assert s.pos == 40 and s.tokens == ids[:40]
    ref = Session(model, chunk_size=40)
    ref.prefill(ids[:40])
    assert _equal(s.state_arrays(), ref.state_arrays())  # exactly the state of a prefill that ended there
    # and it continues like an uninterrupted run
    full = Session(model, chunk_size=40)
    want = full.prefill(ids[:90])
    got = s.prefill(ids[40:90], should_stop=lambda: False)
    assert bool(mx.array_equal(want, got).item()) and _equal(s.state_arrays(), full.state_arrays())


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_disconnect_during_a_long_prefill_frees_the_worker(tiny_gguf):
    """A streaming client leaves in the middle of a multi-chunk prefill on the real tiny model: the worker is free
    (``/health`` busy false) within :data:`CANCEL_LATENCY_S`, the live session ends at the chunk boundary before
    the chunk in progress, and the next request is served from it."""
    chunk = DEFAULT_CHUNK  # the server's sessions prefill in chunks of the default size
    proc, base = start_server(tiny_gguf(), "--ctx", str(6 * chunk), timeout=120)
    try:
        prompt = " ".join(f"w{i % 97}" for i in range(4 * chunk // 3))  # ~2.9 tokens a word: about 4 chunks
        body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": prompt}], "max_tokens": 1,
                "stream": True, "temperature": 0}
        stats = lambda: httpx.get(base + "/v1/stats").json()  # noqa: E731
        with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            deadline = time.monotonic() + 300
            while stats()["prefill_tokens_computed"] < chunk:  # the first chunk is done: the second one runs
                assert time.monotonic() < deadline
                time.sleep(0.02)
        t0 = time.monotonic()  # the connection is closed here
        while httpx.get(base + "/health").json()["busy"]:
            time.sleep(0.02)
        latency = time.monotonic() - t0
        print(f"worker free {latency:.2f} s after the disconnect")
        assert latency < CANCEL_LATENCY_S
        live = stats()["live_tokens"]
        r2 = httpx.post(base + "/v1/chat/completions", json={**body, "stream": False}, timeout=600).json()
        assert chunk <= live < r2["usage"]["prompt_tokens"] and live % chunk == 0  # stopped mid-prefill, rolled back
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == live
    finally:
        stop_server(proc)
