"""The prefill paths that run kernels (the routed experts' grouped products, the fused index scores, the dense
products on decoded weights), in the model, against the pure-MLX fallback: on the GPU's kernels, or else on the
sim backend's (their CUDA text on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import ds4_mlx.kernels as kernels
from ds4_mlx.backend import set_kernel_backend
from ds4_mlx.loader import load
from ds4_mlx.model.attention import make_layer_cache
from kernel_util import BACKEND, needs_gpu

pytestmark = needs_gpu


@pytest.fixture(scope="module")
def model(tiny_gguf):
    m, _ = load(tiny_gguf(experts="q2", hca_ratio=16), numerics="ds4")
    return m


def _rel(a, ref) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _on(backend: str, fn):
    set_kernel_backend(backend)
    try:
        return np.array(fn())
    finally:
        set_kernel_backend(None)


@pytest.mark.parametrize("il", [0, 3])  # a hash-routed layer and a top-k routed one
def test_routed_experts_of_a_chunk(model, il):
    """The chunk's routed experts: two grouped launches (gate+up with the SwiGLU, down) over pairs sorted once, and
    the k products summed, as the fallback computes them but for the f16 tiles."""
    ffn = model.layers[il].ffn
    rng = np.random.default_rng(il)
    T = 40  # 240 pairs over 16 experts: tiles of 32, experts with more pairs than a tile
    n = mx.array(rng.standard_normal((T, model.cfg.n_embd)).astype(np.float32))
    sel, w = ffn.route(n, mx.array(rng.integers(2, 500, T).astype(np.int32)))
    want = _on("fallback", lambda: ffn.routed(n, sel, w))
    got = _on(BACKEND, lambda: ffn.routed(n, sel, w))
    assert np.isfinite(got).all()
    assert _rel(got, want) < 2e-2  # f16 operands (each 2^-11), f32 accumulation, on O(1) activations


_routes = kernels.routes_for


def test_routed_chunk_runs_the_grouped_kernels(model, monkeypatch):
    """A chunk (more than MV_MAX_TOKENS tokens) takes the grouped path: the routes are made once for both launches."""
    import ds4_mlx.model.moe as moe

    calls = []
    monkeypatch.setattr(moe, "routes_for", lambda *a, **k: calls.append(a[0].size) or _routes(*a, **k))
    ffn = model.layers[3].ffn
    rng = np.random.default_rng(9)
    n = mx.array(rng.standard_normal((12, model.cfg.n_embd)).astype(np.float32))
    sel, w = ffn.route(n, mx.array(np.arange(2, 14, dtype=np.int32)))
    _on(BACKEND, lambda: ffn.routed(n, sel, w))
    assert calls == [12 * model.cfg.n_expert_used]
    calls.clear()
    _on(BACKEND, lambda: ffn.routed(n[:4], sel[:4], w[:4]))  # decode-sized: the matvec launches
    assert calls == []


def test_attention_chunk_with_fused_index_scores(model, monkeypatch):
    """A ratio-4 layer's chunk deep enough that the indexer selects: the fused index scores (bf16-exact FP4 inputs
    in the ds4 profile), the selected rows of every query and the chunk's one attention launch (f16 tiles) give the
    fallback's output."""
    import ds4_mlx.model.indexer as indexer

    il = 2
    attn = model.layers[il].attn
    assert attn.indexer is not None
    used = []
    monkeypatch.setattr(indexer, "index_scores_chunk", lambda *a: used.append(a[0].shape) or kernels.index_scores_chunk(*a))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((40, model.cfg.n_embd)).astype(np.float32)
    T0 = 24  # 6 compressed rows before the chunk: queries see more than top_k = 4

    def run():
        cache = make_layer_cache(model.cfg, il)
        attn.forward(mx.array(x[:T0]), 0, cache)
        return attn.forward(mx.array(x[T0:]), T0, cache)

    want = _on("fallback", run)
    got = _on(BACKEND, run)
    assert used and used[-1][0] == len(x) - T0  # the second chunk (the first selects from its 16th query on)
    assert _rel(got, want) < 1e-2  # the projections' operands and products, q and the probabilities in f16


def test_decode_sized_chunks_through_the_attention_kernel(model):
    """Chunks of 7 and 5 tokens: attn_chunk's grouped f16 output goes to the matvec output projection (as float32),
    and the result is the fallback's."""
    attn = model.layers[1].attn
    x = np.random.default_rng(6).standard_normal((12, model.cfg.n_embd)).astype(np.float32)

    def run():
        cache = make_layer_cache(model.cfg, 1)
        first = attn.forward(mx.array(x[:7]), 0, cache)
        return mx.concatenate([first, attn.forward(mx.array(x[7:]), 7, cache)])

    assert _rel(_on(BACKEND, run), _on("fallback", run)) < 1e-2  # the projections' operands and products in f16


@pytest.mark.slow
def test_chunked_prefill_equals_one_shot_on_the_kernels(model):
    """Chunks of 13 and 29 tokens against one 42-token call, on the kernels: each token's grouped product sums K in
    the same order whatever tile it lands in, so the chunking changes the logits by rounding only."""
    tokens = [0] + np.random.default_rng(5).integers(2, 512, 41).tolist()

    def chunked(sizes):
        caches, out, i = model.make_cache(), None, 0
        for c in sizes:
            out = model(tokens[i : i + c], i, caches)
            i += c
        return out

    one = _on(BACKEND, lambda: chunked([42]))
    parts = _on(BACKEND, lambda: chunked([13, 29]))
    assert _rel(parts, one) < 1e-3
