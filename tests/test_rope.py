"""ds4 partial interleaved RoPE + YaRN (docs/model.md §4.5) vs the formula in float64 and vs transformers."""

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.config import ModelConfig
from ds4_mlx.model.rope import Rope, apply_rope, yarn_corr_dims


def make_config(n_layer=6, R=16, **kw) -> ModelConfig:
    base = dict(
        n_layer=n_layer, n_embd=256, n_vocab=512, n_head=4, n_head_kv=1, head_dim=128, n_rot=64, q_lora_rank=64,
        o_lora_rank=64, n_out_group=2, n_expert=16, n_expert_used=6, n_ff_exp=256, n_expert_shared=1,
        n_hash_layer=3, n_swa=16, n_indexer_head=16, indexer_head_dim=128, indexer_top_k=4, n_hc=4,
        n_sinkhorn_iter=20, compress_ratios=tuple([0, 0] + [4, R] * ((n_layer - 2) // 2)),
        swiglu_clamp=(10.0,) * n_layer, rope_freq_base=10000.0, compress_rope_freq_base=160000.0,
        rope_scaling_factor=16.0, rope_orig_ctx=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0,
        expert_weights_scale=1.5, expert_weights_norm=True, rms_eps=1e-6, hc_eps=1e-6,
    )  # fmt: skip
    base.update(kw)
    return ModelConfig(**base)


def theta_f64(p: float, k: int, rope: Rope) -> float:
    """docs/model.md §4.5 in float64, written out per pair."""
    extrap = p * rope.base ** (-2 * k / rope.n_rot)
    if not rope.yarn:
        return extrap
    interp = rope.freq_scale * extrap
    ramp = 1 - min(1.0, max(0.0, (k - rope.corr_low) / max(0.001, rope.corr_high - rope.corr_low)))
    return interp * (1 - ramp) + extrap * ramp


def rope_np(x: np.ndarray, p: int, rope: Rope, inverse=False) -> np.ndarray:
    """Per-pair rotation of the last n_rot dims with float64 angles."""
    y = x.astype(np.float64).copy()
    lead = x.shape[-1] - rope.n_rot
    for k in range(rope.n_rot // 2):
        th = theta_f64(p, k, rope)
        c, s = math.cos(th), math.sin(th) * (-1 if inverse else 1)
        a, b = x[..., lead + 2 * k].astype(np.float64), x[..., lead + 2 * k + 1].astype(np.float64)
        y[..., lead + 2 * k] = a * c - b * s
        y[..., lead + 2 * k + 1] = a * s + b * c
    return y


def test_layer_params_real_shape():
    cfg = make_config(n_layer=43, R=128, head_dim=512)
    assert yarn_corr_dims(64, 65536, 160000.0, 32.0, 1.0) == (15.0, 25.0)
    r0, r2, r3 = Rope.for_layer(cfg, 0), Rope.for_layer(cfg, 2), Rope.for_layer(cfg, 3)
    assert (r0.base, r0.freq_scale, r0.yarn) == (10000.0, 1.0, False)
    assert (r2.base, r2.freq_scale, r2.yarn, r2.corr_low, r2.corr_high) == (160000.0, 1 / 16, True, 15.0, 25.0)
    assert r2 == r3
    ramp = r2.ramp()
    assert np.all(ramp[:16] == 1.0) and np.all(ramp[25:] == 0.0) and np.all(np.diff(ramp[15:26]) < 0)


@pytest.mark.parametrize("il", [0, 2])
@pytest.mark.parametrize("positions", [[0, 1, 7, 130], [49999, 50000, 50001], [1_000_000]])
def test_rope_vs_formula(il, positions):
    cfg = make_config()
    rope = Rope.for_layer(cfg, il)
    rng = np.random.default_rng(il)
    x = rng.standard_normal((len(positions), 3, 128)).astype(np.float32)  # [T, heads, head_dim]
    C, S = rope.tables(positions, 128)
    got = np.array(apply_rope(mx.array(x), C[:, None, :], S[:, None, :]))
    want = np.stack([rope_np(x[i], p, rope) for i, p in enumerate(positions)])
    # f32 angles at position p are off by up to ~p * 6e-8 rad (ds4 computes them in f32 too)
    tol = 1e-5 + 2 * max(positions) * 6e-8 * np.abs(x).max()
    np.testing.assert_allclose(got, want, atol=tol, rtol=0)
    np.testing.assert_array_equal(got[..., :64], x[..., :64])  # leading (nope) dims untouched
    # angles themselves agree with the float64 formula to f32 rounding
    th = rope.angles(positions)
    ref = np.array([[theta_f64(p, k, rope) for k in range(32)] for p in positions])
    np.testing.assert_allclose(th, ref, rtol=4e-7, atol=1e-30)
    # inverse undoes forward
    back = np.array(apply_rope(mx.array(got), C[:, None, :], S[:, None, :], inverse=True))
    np.testing.assert_allclose(back, x, atol=1e-5)
    inv = np.stack([rope_np(x[i], p, rope, inverse=True) for i, p in enumerate(positions)])
    got_inv = np.array(apply_rope(mx.array(x), C[:, None, :], S[:, None, :], inverse=True))
    np.testing.assert_allclose(got_inv, inv, atol=tol, rtol=0)


def test_decode_rows_match_chunk_tables():
    """Decode's one-position rows (Rope.row, resident blocks) equal the chunk tables at those positions, across a
    block boundary; equal Ropes (two layers of a kind) share one pair of arrays, different Ropes do not."""
    cfg = make_config()
    rope, twin, other = Rope.for_layer(cfg, 2), Rope.for_layer(cfg, 2), Rope.for_layer(cfg, 0)
    positions = [0, 255, 256, 1_000_000]
    C, S = rope.tables(positions, 128)
    for i, p in enumerate(positions):
        c, s = rope.row(p, 128)
        assert c.shape == s.shape == (1, 128)
        np.testing.assert_array_equal(np.array(c)[0], np.array(C)[i])
        np.testing.assert_array_equal(np.array(s)[0], np.array(S)[i])
        assert rope.tables([p], 128)[0] is c and twin.row(p, 128)[0] is c and other.row(p, 128)[0] is not c
    assert not np.array_equal(np.array(other.row(300, 128)[1]), np.array(rope.row(300, 128)[1]))


def test_yarn_matters_at_large_positions():
    """A ramp bug must be visible: YaRN angles at p=50000 differ from plain interpolation by radians."""
    cfg = make_config()
    rope = Rope.for_layer(cfg, 2)
    no_blend = Rope(n_rot=64, base=rope.base, freq_scale=rope.freq_scale)  # interpolate every pair
    d = np.abs(rope.angles([50000]) - no_blend.angles([50000]))[0]
    assert d[:25].min() > 0.5 and d[25:].max() == 0.0


def test_recurrence_matches_sequential_f32():
    cfg = make_config()
    for il in (0, 2):
        rope = Rope.for_layer(cfg, il, recurrence=True)
        plain = Rope.for_layer(cfg, il)
        for p in (3, 4097, 50000):
            ts = np.float32(math.pow(rope.base, -2.0 / 64))
            t, ext = np.float32(p), []
            for _ in range(32):
                ext.append(t)
                t = np.float32(t * ts)
            ext = np.array(ext, np.float32)
            if rope.yarn:
                ramp = rope.ramp()
                want = (ext * np.float32(1 / 16)) * (np.float32(1) - ramp) + ext * ramp
            else:
                want = ext
            np.testing.assert_array_equal(rope.angles([p])[0], want.astype(np.float32))
            np.testing.assert_allclose(rope.angles([p])[0], plain.angles([p])[0], rtol=2e-5)


def test_vs_transformers_rotary():
    torch = pytest.importorskip("torch")
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4RotaryEmbedding,
        apply_rotary_pos_emb,
    )

    hf = DeepseekV4Config(
        vocab_size=512, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, q_lora_rank=64, rope_theta=10000.0, compress_rope_theta=160000.0,
        layer_types=["sliding_attention"] * 2 + ["compressed_sparse_attention", "heavily_compressed_attention"] * 2,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
        partial_rotary_factor=0.5, max_position_embeddings=1048576,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0},
    )  # fmt: skip
    rot = DeepseekV4RotaryEmbedding(hf)
    cfg = make_config()
    positions = [0, 5, 300, 50000]
    rng = np.random.default_rng(7)
    x = rng.standard_normal((1, 2, len(positions), 128)).astype(np.float32)  # [B, H, T, D]
    for layer_type, il in (("main", 0), ("compress", 2)):
        cos, sin = rot(torch.zeros(1), torch.tensor([positions]), layer_type=layer_type)
        want = apply_rotary_pos_emb(torch.from_numpy(x), cos, sin).numpy()
        C, S = Rope.for_layer(cfg, il).tables(positions, 128)
        got = np.array(apply_rope(mx.array(x), C[None, None], S[None, None]))
        # transformers blends inv_freq instead of angles and computes p*inv_freq in f32: ~p*6e-8 rad apart
        np.testing.assert_allclose(got, want, atol=1e-5 + 4 * 50000 * 6e-8 * np.abs(x).max(), rtol=0)
        np.testing.assert_allclose(got[:, :, :3], want[:, :, :3], atol=2e-5, rtol=0)


def test_decode_rows_serve_each_thread_its_own(in_other_thread):
    """A row is cached as a lazy slice of the stream it was made on, which only that stream's thread may run
    (MLX streams are per thread): a row made, not yet evaluated, in one thread still serves another (the server
    decodes in a worker thread while a caller's thread may have asked for the same positions)."""
    rope = Rope(n_rot=16, base=10000.0)
    mine = rope.row(7, 32)  # made here, left lazy
    theirs = in_other_thread(lambda: [np.array(a) for a in rope.row(7, 32)])
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_array_equal(np.array(a), b)
