"""GGUF reading and layout validation: every bad file gets one clear message (file, what, expected vs found)."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from gguf import GGUFWriter, GGMLQuantizationType as T
from typer.testing import CliRunner

from ds4_mlx.cli import app
from ds4_mlx.gguf_file import DS4FormatError, load_weights, open_gguf
from ds4_mlx.layout import expected_tensors
from ds4_mlx.testing import random_tensors, tiny_config, tiny_tokenizer, write_gguf


def _write(path, *, drop=(), add=None, replace=None, metadata=None, cfg=None, tokenizer=None, arch="deepseek4"):
    cfg = cfg or tiny_config()
    tensors = random_tensors(cfg, np.random.default_rng(0), "q2")
    for name in drop:
        del tensors[name]
    tensors.update(replace or {})
    tensors.update(add or {})
    return write_gguf(path, cfg, tensors, tokenizer or tiny_tokenizer(cfg.n_vocab), metadata=metadata, arch=arch)


def test_good_file_binds_every_tensor(tiny_gguf):
    m = open_gguf(tiny_gguf())
    cfg = m.config
    assert set(m.tensors) == set(expected_tensors(cfg))
    assert cfg.n_layer == 6 and cfg.compress_ratios == (0, 0, 4, 16, 4, 16) and cfg.n_vocab == 512
    assert cfg.experts_label == "q2"
    t = m.tensors["blk.2.ffn_gate_exps.weight"]
    assert t.qtype == T.IQ2_XXS and t.shape == (16, 256, 256) and t.data.dtype == np.uint8
    assert t.nbytes == t.data.nbytes
    # tokenizer: specials by string, BOS/EOS at 0/1 like the real vocab
    assert m.tokenizer.tokens[0] == "<｜begin▁of▁sentence｜>" and m.tokenizer.tokens[1] == "<｜end▁of▁sentence｜>"
    assert len(m.tokenizer.tokens) == 512 and len(m.tokenizer.merges) > 200


@pytest.mark.parametrize("experts,types", [("q2", ("IQ2_XXS", "IQ2_XXS", "Q2_K")), ("q4", ("Q4_K",) * 3), ("f16", ("F16",) * 3)])
@pytest.mark.parametrize("ratio", [16, 128])
def test_variants_open(tiny_gguf, experts, types, ratio):
    m = open_gguf(tiny_gguf(experts=experts, hca_ratio=ratio))
    assert m.config.expert_types == types
    assert m.config.compress_ratios == (0, 0, 4, ratio, 4, ratio)
    # HCA layers have a ratio-R compressor with one lane; CSA layers two lanes and an indexer
    assert m.tensors["blk.3.attn_compressor_ape.weight"].shape == (ratio, 128)
    assert m.tensors["blk.2.attn_compressor_ape.weight"].shape == (4, 256)
    assert "blk.3.indexer.proj.weight" not in m.tensors and "blk.4.indexer.proj.weight" in m.tensors


def test_load_weights_kinds(tiny_gguf):
    import mlx.core as mx

    from ds4_mlx.weights import QuantWeight

    m = open_gguf(tiny_gguf())
    w = load_weights(m)
    assert isinstance(w["blk.0.attn_q_a.weight"], QuantWeight)
    assert isinstance(w["token_embd.weight"], QuantWeight)
    assert w["blk.0.attn_norm.weight"].dtype == mx.float32 and w["blk.0.attn_norm.weight"].shape == (256,)
    tid = w["blk.1.ffn_gate_tid2eid.weight"]
    assert tid.dtype == mx.int32 and tid.shape == (512, 6)
    assert set(w) == set(m.tensors)


# ---- bad files ---------------------------------------------------------------------------------------

def _bad_files(tmp):
    """(label, path, substrings the message must contain) for every validation error."""
    good = _write(tmp / "good.gguf")
    data = good.read_bytes()
    cases = []

    p = tmp / "text.gguf"
    p.write_text("hello, this is not a model\n")
    cases.append(("not gguf", p, ["not a GGUF file"]))

    p = tmp / "random.bin"
    p.write_bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    cases.append(("random bytes", p, ["not a GGUF file"]))

    p = tmp / "trunc_data.gguf"
    p.write_bytes(data[: len(data) // 2])
    cases.append(("truncated data", p, ["truncated", f"{len(data) // 2} bytes"]))

    p = tmp / "trunc_header.gguf"
    p.write_bytes(data[:300])
    cases.append(("truncated header", p, ["truncated"]))

    p = tmp / "llama.gguf"
    w = GGUFWriter(str(p), "llama")
    w.add_uint32("llama.block_count", 2)
    w.add_tensor("token_embd.weight", np.ones((8, 4), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    cases.append(("llama", p, ["general.architecture", "'llama'", "'deepseek4'"]))

    cases.append(("missing tensor", _write(tmp / "missing.gguf", drop=["blk.4.attn_kv.weight"]),
                  ["missing tensor blk.4.attn_kv.weight"]))
    cases.append(("unexpected tensor", _write(tmp / "extra.gguf", add={"blk.0.mystery.weight": (np.ones(8, np.float32), T.F32)}),
                  ["unexpected tensor blk.0.mystery.weight"]))
    rng = np.random.default_rng(2)
    cases.append(("wrong dtype", _write(tmp / "dtype.gguf", replace={
        "blk.1.attn_q_a.weight": (rng.standard_normal((64, 256)).astype(np.float16), T.F16)}),
        ["blk.1.attn_q_a.weight", "type F16", "expected Q8_0"]))
    cases.append(("wrong shape", _write(tmp / "shape.gguf", replace={
        "blk.0.attn_norm.weight": (np.ones(128, np.float32), T.F32)}),
        ["blk.0.attn_norm.weight", "shape [128]", "expected [256]"]))
    f16_up = rng.standard_normal((16, 256, 256)).astype(np.float16)
    cases.append(("gate/up types differ", _write(tmp / "gateup.gguf", replace={"blk.3.ffn_up_exps.weight": (f16_up, T.F16)}),
                  ["blk.3.ffn_gate_exps.weight is IQ2_XXS", "ffn_up_exps is F16"]))
    cases.append(("short compress_ratios", _write(tmp / "ratios.gguf", metadata={
        "deepseek4.attention.compress_ratios": ("add_array", [0, 0, 4])}),
        ["deepseek4.attention.compress_ratios", "3 entries", "at least 6"]))
    cases.append(("top-k > experts", _write(tmp / "topk.gguf", metadata={
        "deepseek4.expert_used_count": ("add_uint32", 32)}),
        ["inconsistent metadata", "deepseek4.expert_used_count 32 > deepseek4.expert_count 16"]))
    cases.append(("missing key", _write(tmp / "nokey.gguf", metadata={"deepseek4.attention.q_lora_rank": None}),
                  ["missing metadata key deepseek4.attention.q_lora_rank"]))
    cases.append(("key type", _write(tmp / "keytype.gguf", metadata={"deepseek4.block_count": ("add_string", "six")}),
                  ["deepseek4.block_count", "STRING", "expected int"]))
    cases.append(("hash layers > layers", _write(tmp / "hash.gguf", metadata={
        "deepseek4.hash_layer_count": ("add_uint32", 9)}), ["hash_layer_count 9 > deepseek4.block_count 6"]))
    tok = tiny_tokenizer(512)
    short_tok = type(tok)(tok.tokens[:500], tok.merges, None)
    cases.append(("vocab mismatch", _write(tmp / "vocab.gguf", tokenizer=short_tok),
                  ["tokenizer.ggml.tokens has 500 entries", "vocab_size 512"]))
    no_special = type(tok)(tok.tokens[:-1] + ["plain"], tok.merges, None)
    cases.append(("missing special", _write(tmp / "special.gguf", tokenizer=no_special), ["special token", "DSML"]))
    # values that load but make every logit NaN, never finish, or read past the experts
    for label, key, method, value, needles in [
        ("rms eps -1", "attention.layer_norm_rms_epsilon", "add_float32", -1.0, ["layer_norm_rms_epsilon = -1.0", "> 0"]),
        ("rms eps nan", "attention.layer_norm_rms_epsilon", "add_float32", float("nan"), ["layer_norm_rms_epsilon = nan", "finite"]),
        ("rope base 0", "rope.freq_base", "add_float32", 0.0, ["deepseek4.rope.freq_base = 0.0", "> 1"]),
        ("yarn beta 0", "rope.scaling.yarn_beta_fast", "add_float32", 0.0, ["yarn_beta_fast = 0.0"]),
        ("sinkhorn 4e9", "hyper_connection.sinkhorn_iterations", "add_uint32", 4_000_000_000, ["sinkhorn_iterations = 4000000000", "at most 100"]),
        ("window 0", "attention.sliding_window", "add_uint32", 0, ["deepseek4.attention.sliding_window = 0"]),
    ]:
        cases.append((label, _write(tmp / f"{label.replace(' ', '_')}.gguf", metadata={f"deepseek4.{key}": (method, value)}), needles))
    nan_norm = np.ones(256, np.float32)
    nan_norm[7] = np.nan
    cases.append(("nan norm", _write(tmp / "nan_norm.gguf", replace={"blk.2.attn_norm.weight": (nan_norm, T.F32)}),
                  ["tensor blk.2.attn_norm.weight holds nan at index 7", "finite"]))
    tid = np.zeros((512, 6), np.int32)
    tid[3, 2] = 16
    cases.append(("expert id", _write(tmp / "tid.gguf", replace={"blk.0.ffn_gate_tid2eid.weight": (tid, T.I32)}),
                  ["blk.0.ffn_gate_tid2eid.weight holds expert id 16", "0..15"]))
    merges = list(tok.merges)
    cases.append(("merge not 'A B'", _write(tmp / "merge1.gguf", tokenizer=type(tok)(tok.tokens, merges[:5] + ["abc"] + merges[6:], None)),
                  ["tokenizer.ggml.merges", "merge #5 is not 'A B'"]))
    cases.append(("merge of unknown tokens", _write(tmp / "merge2.gguf", tokenizer=type(tok)(tok.tokens, ["q一 z丁"] + merges[1:], None)),
                  ["tokenizer.ggml.merges", "merge #0", "not in the vocabulary"]))
    return cases


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory):
    return _bad_files(tmp_path_factory.mktemp("bad"))


def test_each_bad_file_raises_one_clear_error(bad_files):
    assert len(bad_files) == 27
    for label, path, needles in bad_files:
        with pytest.raises(DS4FormatError) as ei:
            open_gguf(path)
        msg = str(ei.value)
        assert msg.startswith(str(path)), (label, msg)
        assert "\n" not in msg, (label, msg)
        for n in needles:
            assert n in msg, (label, n, msg)


def test_inspect_exits_2_with_one_line(bad_files):
    runner = CliRunner()
    for label, path, needles in bad_files:
        r = runner.invoke(app, ["inspect", str(path)])
        assert r.exit_code == 2, (label, r.output)
        err = r.stderr.strip()
        assert err.count("\n") == 0 and err.startswith("error:"), (label, err)
        assert needles[0] in err, (label, err)
        assert "Traceback" not in r.output + r.stderr


def test_inspect_subprocess_no_traceback(bad_files, tmp_path):
    label, path, needles = next(c for c in bad_files if c[0] == "wrong dtype")
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "inspect", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error:") and "Traceback" not in r.stderr and needles[1] in r.stderr
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "inspect", str(tmp_path / "nope.gguf")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no such file" in r.stderr


def test_metadata_float_keys_accept_f64_and_int_arrays(tmp_path):
    """ds4 reads float keys as f32/f64/u32/i32 and compress_ratios as u32 or i32 arrays."""
    cfg = tiny_config()
    p = _write(tmp_path / "f64.gguf", metadata={
        "deepseek4.rope.freq_base": ("add_float64", 10000.0),
        "deepseek4.expert_weights_scale": ("add_uint32", 2),
    })
    m = open_gguf(p)
    assert m.config.rope_freq_base == 10000.0 and m.config.expert_weights_scale == 2.0
    assert m.config.compress_ratios == cfg.compress_ratios


def test_bias_is_optional(tmp_path):
    p = _write(tmp_path / "nobias.gguf", drop=["blk.4.exp_probs_b.bias"])
    m = open_gguf(p)
    assert "blk.4.exp_probs_b.bias" not in m.tensors and "blk.5.exp_probs_b.bias" in m.tensors
