"""The tiny-model factory: deterministic bytes, fan-in weight scales, valid blocks, a real BPE vocabulary."""

from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants as gquants

from ds4_mlx.gguf_file import open_gguf
from ds4_mlx.loader import load
from ds4_mlx.tokenizer import SPECIAL_TOKENS, bytes_to_unicode
from ds4_mlx.layout import decode_bytes_per_token, expected_tensors, layout_sizes
from ds4_mlx.testing import (
    LazyTensor,
    flash_config,
    lazy_random_tensors,
    make_full_width_gguf,
    make_tiny_gguf,
    random_tensors,
    random_weight_blocks,
    tiny_config,
    tiny_tokenizer,
    write_gguf,
)


def _sha(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    a = make_tiny_gguf(tmp_path / "a.gguf", seed=7)
    b = make_tiny_gguf(tmp_path / "b.gguf", seed=7)
    c = make_tiny_gguf(tmp_path / "c.gguf", seed=8)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)


@pytest.mark.parametrize("qtype", [T.IQ2_XXS, T.Q2_K, T.Q4_K, T.Q8_0])
def test_random_weight_blocks_are_valid_and_scaled_by_fan_in(qtype):
    rng = np.random.default_rng(3)
    for fan_in in (256, 2048):
        raw = random_weight_blocks(rng, qtype, (64, fan_in), 1 / np.sqrt(fan_in))
        w = gquants.dequantize(raw, qtype).astype(np.float64)
        assert w.shape == (64, fan_in) and np.isfinite(w).all()
        std = w.std() * np.sqrt(fan_in)
        assert 0.7 < std < 1.4, (qtype, fan_in, std)
        assert abs(w.mean()) < 0.25 * w.std(), (qtype, w.mean(), w.std())


@pytest.mark.parametrize("experts", ["q2", "q4", "f16"])
def test_every_matrix_has_fan_in_scale(tiny_gguf, experts):
    m = open_gguf(tiny_gguf(experts=experts))
    specs = expected_tensors(m.config)
    for name, t in m.tensors.items():
        if len(t.shape) < 2 or t.qtype == T.I32 or name.endswith("_ape.weight"):
            continue
        w = gquants.dequantize(np.asarray(t.data), t.qtype).astype(np.float64).reshape(t.shape)
        assert np.isfinite(w).all(), name
        want = 1.0 if name == "token_embd.weight" else 1 / np.sqrt(specs[name].fan_in)
        assert 0.7 < w.std() / want < 1.4, (name, w.std(), want)


def test_small_vectors_are_random_not_identity(tiny_gguf):
    m = open_gguf(tiny_gguf())
    for key in ("blk.0.attn_sinks.weight", "blk.2.hc_attn_base.weight", "blk.4.exp_probs_b.bias", "output_hc_base.weight"):
        v = np.asarray(m.tensors[key].data, np.float64)
        assert v.std() > 0.05 and np.unique(v).size == v.size, key
    norm = np.asarray(m.tensors["blk.0.attn_norm.weight"].data)
    assert (norm > 0.79).all() and (norm < 1.21).all() and norm.std() > 0.05
    tid = np.asarray(m.tensors["blk.0.ffn_gate_tid2eid.weight"].data)
    assert tid.min() >= 0 and tid.max() < 16
    assert all(len(set(row)) == 6 for row in tid.tolist())  # distinct experts per token


def test_tokenizer_is_real_bpe():
    tok = tiny_tokenizer(512)
    assert len(tok.tokens) == 512 and len(set(tok.tokens)) == 512
    assert tok.tokens[:2] == list(SPECIAL_TOKENS[:2])
    assert set(SPECIAL_TOKENS) <= set(tok.tokens)
    b2c = [bytes_to_unicode()[b] for b in range(256)]
    assert tok.tokens[2:258] == b2c  # all 256 byte tokens
    vocab = set(tok.tokens)
    for m in tok.merges:  # every merge joins two known tokens into a known token
        a, b = m.split(" ")
        assert a in vocab and b in vocab and a + b in vocab
    # merges learned from English, code and CJK text
    assert "Ġthe" in vocab and any(ord(c) >= 0x100 and len(t) >= 3 for t in tok.merges[:200] for c in t)
    assert tok.token_types[0] == 3 and tok.token_types[10] == 1


def test_tokenizer_round_trips_with_hf_tokenizers():
    """The vocabulary loads in the `tokenizers` library and round-trips real text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = tiny_tokenizer(512)
    vocab = {t: i for i, t in enumerate(tok.tokens)}
    merges = [tuple(m.split(" ")) for m in tok.merges]
    hf = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    text = "Hello world! def f(x): return x + 1  # 你好，世界 😀"
    ids = hf.encode(text).ids
    assert hf.decode(ids) == text
    assert len(ids) < len(text.encode())  # merges actually compress


def test_layout_reproduces_published_sizes():
    """docs/model.md §3.5 / §10: 1328 tensors, 86,714,775,900 bytes (q2), 9.196 GB read per short-context token."""
    cfg = flash_config()
    q2, q4 = layout_sizes(cfg, "q2"), layout_sizes(cfg, "q4")
    assert len(q2) == 1328
    assert sum(q2.values()) == 86_714_775_900 and sum(q4.values()) == 164_628_167_004
    short = decode_bytes_per_token(cfg, q2, 2048)
    long = decode_bytes_per_token(cfg, q2, 32768)
    assert abs((sum(short.values()) - short["kv cache"]) / 1e9 - 9.196) < 0.001
    assert abs((sum(long.values()) - long["kv cache"]) / 1e9 - 9.559) < 0.001
    assert abs(long["kv cache"] / 1e6 - 66) < 1  # ~66 MB of KV reads at 32k
    assert abs(short["routed experts"] / 1e6 - 1826.1) < 0.1


def test_tiny_config_matches_spec():
    cfg = tiny_config(hca_ratio=128)
    assert cfg.compress_ratios == (0, 0, 4, 128, 4, 128)
    assert [cfg.compress_lanes(i) for i in range(6)] == [1, 1, 2, 1, 2, 1]
    assert [cfg.has_indexer(i) for i in range(6)] == [False, False, True, False, True, False]
    assert cfg.hc_mix_dim == 24 and cfg.nope_dim == 64 and cfg.heads_per_group == 2


def test_lazy_tensors_are_made_one_at_a_time_in_file_order(tmp_path):
    """write_gguf makes each LazyTensor only when its data is written (one tensor in memory at a time), and the
    file equals the one written from arrays in memory."""
    cfg = tiny_config()
    made, sizes = [], []
    path = tmp_path / "lazy.gguf"

    def spy(name, t):
        def make():
            made.append(name)
            sizes.append(path.stat().st_size)  # everything before it is on disk already
            return t.make()
        return LazyTensor(t.shape, t.dtype, t.qtype, make)

    lazy = {n: spy(n, t) for n, t in lazy_random_tensors(cfg, np.random.default_rng(5))}
    write_gguf(path, cfg, lazy, tiny_tokenizer(cfg.n_vocab))
    assert made == list(expected_tensors(cfg))
    assert all(a < b for a, b in zip(sizes, sizes[1:]))  # the file grew between two makes
    ref = write_gguf(tmp_path / "ref.gguf", cfg, random_tensors(cfg, np.random.default_rng(5)), tiny_tokenizer(cfg.n_vocab))
    assert _sha(path) == _sha(ref)


def test_lazy_tensor_of_the_wrong_shape_is_refused(tmp_path):
    cfg = tiny_config()
    lazy = dict(lazy_random_tensors(cfg, np.random.default_rng(0)))
    name, t = next(iter(lazy.items()))
    lazy[name] = LazyTensor(t.shape, t.dtype, t.qtype, lambda: np.zeros((3,), t.dtype))
    with pytest.raises(ValueError, match=f"{name}: made"):
        write_gguf(tmp_path / "bad.gguf", cfg, lazy, tiny_tokenizer(cfg.n_vocab))


@pytest.mark.slow
def test_full_width_file_reads_back(tmp_path):
    """The streaming writer at the real width (1 layer, ~3.6 GB): open_gguf validates it (layout, metadata, a
    tokenizer of the full vocabulary), and its tensors hold the announced, finite values."""
    path = make_full_width_gguf(tmp_path / "full1.gguf", layers=1, seed=2)
    m = open_gguf(path)
    assert m.config.n_embd == 4096 and m.config.n_layer == 1 and m.config.n_vocab == len(m.tokenizer.tokens)
    assert set(m.tensors) == set(expected_tensors(m.config))
    for name in ("blk.0.attn_norm.weight", "blk.0.attn_q_a.weight", "output_norm.weight"):
        t = m.tensors[name]
        w = gquants.dequantize(np.asarray(t.data), t.qtype)
        assert np.isfinite(w).all() and w.std() > 0, name
    path.unlink()


def _top_share(model, seed: int = 3, tokens: int = 2000) -> list[float]:
    """Per layer: the share of its router's picks that go to its most picked 10 % of experts, over random normed
    inputs and token ids."""
    rng, shares = np.random.default_rng(seed), []
    for layer in model.layers:
        n = mx.array(rng.standard_normal((tokens, model.cfg.n_embd)).astype(np.float32))
        sel, _ = layer.ffn.route(layer.ffn.norm(n), mx.array(rng.integers(0, model.cfg.n_vocab, tokens)))
        counts = np.sort(np.bincount(np.array(sel).ravel(), minlength=model.cfg.n_expert))[::-1]
        shares.append(counts[: model.cfg.n_expert // 10].sum() / counts.sum())
    return shares


def test_router_skew_concentrates_the_routing_and_nothing_else(tmp_path):
    """64 experts, 6 a token: unbiased, the top tenth of them takes 12-27 % of the picks; at skew 1.4 a Zipf law
    gives them ~60 % (capped at one pick a token), in the hash layers (their tables) and the others (the bias)."""
    plain = make_tiny_gguf(tmp_path / "plain.gguf", n_expert=64, seed=4)
    skewed = make_tiny_gguf(tmp_path / "skewed.gguf", n_expert=64, seed=4, router_skew=1.4)
    assert max(_top_share(load(plain)[0])) < 0.35
    assert min(_top_share(load(skewed)[0])) > 0.5
    a, b = open_gguf(plain).tensors, open_gguf(skewed).tensors
    changed = {n for n in a if not np.array_equal(np.asarray(a[n].data), np.asarray(b[n].data))}
    assert changed == {n for n in a if n.endswith(("exp_probs_b.bias", "ffn_gate_tid2eid.weight"))}
