"""The ``hf`` profile against transformers ``DeepseekV4ForCausalLM`` (float32, eager), docs/model.md §9.3.

Both models get the same random weights from one tiny GGUF: ds4_mlx through its own loader, transformers
through ``gguf.GGUFReader`` + ``gguf.quants.dequantize`` (an independent decoding path) and the name map of
docs/model.md §3. Every transformers parameter and buffer is overwritten from the file (the factory writes
random nonzero sinks, HC base/scale, APE, router bias and tid2eid), which the tests check.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as QT, GGUFReader  # noqa: E402
from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from ds4_mlx.gguf_file import load_weights, open_gguf  # noqa: E402
from ds4_mlx.model.hyper import hc_post, hc_pre  # noqa: E402
from ds4_mlx.model.moe import MoE  # noqa: E402
from ds4_mlx.numerics import get_numerics  # noqa: E402

pytestmark = pytest.mark.reference

# GGUF name (without "blk.N." and ".weight"/".bias") -> transformers name (without "model.layers.N.").
LAYER_MAP = {
    "hc_attn_fn": "attn_hc.fn", "hc_attn_scale": "attn_hc.scale", "hc_attn_base": "attn_hc.base",
    "attn_norm": "input_layernorm.weight",
    "attn_q_a": "self_attn.q_a_proj.weight", "attn_q_a_norm": "self_attn.q_a_norm.weight",
    "attn_q_b": "self_attn.q_b_proj.weight", "attn_kv": "self_attn.kv_proj.weight",
    "attn_kv_a_norm": "self_attn.kv_norm.weight", "attn_sinks": "self_attn.sinks",
    "attn_output_a": "self_attn.o_a_proj.weight", "attn_output_b": "self_attn.o_b_proj.weight",
    "hc_ffn_fn": "ffn_hc.fn", "hc_ffn_scale": "ffn_hc.scale", "hc_ffn_base": "ffn_hc.base",
    "ffn_norm": "post_attention_layernorm.weight", "ffn_gate_inp": "mlp.gate.weight",
    "exp_probs_b": "mlp.gate.e_score_correction_bias", "ffn_gate_tid2eid": "mlp.gate.tid2eid",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj.weight", "ffn_up_shexp": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp": "mlp.shared_experts.down_proj.weight",
    "attn_compressor_ape": "self_attn.compressor.position_bias",
    "attn_compressor_kv": "self_attn.compressor.kv_proj.weight",
    "attn_compressor_gate": "self_attn.compressor.gate_proj.weight",
    "attn_compressor_norm": "self_attn.compressor.kv_norm.weight",
    "indexer.attn_q_b": "self_attn.compressor.indexer.q_b_proj.weight",
    "indexer.proj": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "indexer_compressor_ape": "self_attn.compressor.indexer.position_bias",
    "indexer_compressor_kv": "self_attn.compressor.indexer.kv_proj.weight",
    "indexer_compressor_gate": "self_attn.compressor.indexer.gate_proj.weight",
    "indexer_compressor_norm": "self_attn.compressor.indexer.kv_norm.weight",
}
GLOBAL_MAP = {
    "token_embd.weight": "model.embed_tokens.weight", "output_hc_fn.weight": "model.hc_head.hc_fn",
    "output_hc_base.weight": "model.hc_head.hc_base", "output_hc_scale.weight": "model.hc_head.hc_scale",
    "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight",
}


def hf_config(R: int, n_layer: int = 6):
    """docs/model.md §9.3, verbatim."""
    return transformers.DeepseekV4Config(
        vocab_size=512, hidden_size=256, moe_intermediate_size=256, num_hidden_layers=n_layer,
        num_attention_heads=4, num_key_value_heads=1, head_dim=128, q_lora_rank=64, num_experts_per_tok=6,
        n_routed_experts=16, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, rope_theta=10000.0, compress_rope_theta=160000.0,
        layer_types=["sliding_attention"] * 2
        + ["compressed_sparse_attention", "heavily_compressed_attention"] * ((n_layer - 2) // 2),
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": R},
        mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (n_layer - 3), hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6,
        swiglu_limit=10.0, sliding_window=16, o_groups=2, o_lora_rank=64, index_n_heads=16,
        index_head_dim=128, index_topk=4, rms_norm_eps=1e-6, partial_rotary_factor=0.5,
        max_position_embeddings=1048576,
        rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                         "beta_fast": 32.0, "beta_slow": 1.0},
        tie_word_embeddings=False,
    )


def gguf_tensors_f32(path) -> dict[str, np.ndarray]:
    """Every tensor of the file, dequantized by gguf-py, in row-major math shape (I32 stays integer)."""
    out = {}
    for t in GGUFReader(str(path)).tensors:
        shape = tuple(int(s) for s in reversed(t.shape))
        if t.tensor_type == QT.I32:
            out[t.name] = np.asarray(t.data).reshape(shape)
        else:
            out[t.name] = gguf_dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
    return out


def hf_model_from_gguf(path, R: int):
    """A float32 eager transformers model holding the GGUF's weights; asserts every state entry was set."""
    torch.manual_seed(0)
    model = transformers.DeepseekV4ForCausalLM._from_config(hf_config(R), attn_implementation="eager",
                                                            torch_dtype=torch.float32).eval()
    state = model.state_dict()
    src = gguf_tensors_f32(path)
    new: dict[str, torch.Tensor] = {}
    for name, arr in src.items():
        if name in GLOBAL_MAP:
            new[GLOBAL_MAP[name]] = torch.from_numpy(arr)
            continue
        m = re.fullmatch(r"blk\.(\d+)\.(.+)\.(weight|bias)", name)
        il, short = int(m.group(1)), m.group(2)
        p = f"model.layers.{il}."
        if short in ("ffn_gate_exps", "ffn_up_exps"):
            continue  # stacked below
        target = p + LAYER_MAP[short]
        if target not in state:  # the hash router has no e_score_correction_bias (docs/model.md §9.3)
            assert short == "exp_probs_b", name
            continue
        new[target] = torch.from_numpy(arr.astype(np.int64) if short == "ffn_gate_tid2eid" else arr)
    for il in range(hf_config(R).num_hidden_layers):
        g, u = src[f"blk.{il}.ffn_gate_exps.weight"], src[f"blk.{il}.ffn_up_exps.weight"]
        new[f"model.layers.{il}.mlp.experts.gate_up_proj"] = torch.from_numpy(np.concatenate([g, u], axis=1))
    assert set(new) == set(state), (set(state) - set(new), set(new) - set(state))
    for k, v in new.items():
        assert tuple(v.shape) == tuple(state[k].shape), (k, v.shape, state[k].shape)
    model.load_state_dict(new, strict=True)
    return model


def hf_logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long), use_cache=False)
    return out.logits[0].float().numpy()


def prompt(T: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [0] + rng.integers(2, 512, T - 1).tolist()  # BOS then random ids


@pytest.fixture(scope="module")
def hf16(tiny_gguf):
    path = tiny_gguf(experts="q2", hca_ratio=16)
    return path, hf_model_from_gguf(path, 16)


# ---- sublayers: checks the weight transfer and the HC/MoE code independently of attention ------------


def test_hf_sublayers_match(hf16):
    """HC pre/post and the MoE sublayer of every layer, ds4_mlx (hf profile) vs transformers modules."""
    path, hf = hf16
    g = open_gguf(path)
    cfg, weights = g.config, load_weights(g)
    rng = np.random.default_rng(1)
    T = 11
    tokens = rng.integers(0, cfg.n_vocab, T)
    for il in range(cfg.n_layer):
        layer = hf.model.layers[il]
        S = rng.standard_normal((T, cfg.n_hc, cfg.n_embd)).astype(np.float32)
        x, post, comb = hc_pre(mx.array(S), *(weights[f"blk.{il}.hc_attn_{k}.weight"] for k in ("fn", "scale", "base")), cfg)
        with torch.no_grad():
            hpost, hcomb, hx = layer.attn_hc(torch.from_numpy(S)[None])
        np.testing.assert_allclose(np.array(x), hx[0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.array(post), hpost[0].numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.array(comb), hcomb[0].numpy(), rtol=1e-5, atol=1e-6)
        y = rng.standard_normal((T, cfg.n_embd)).astype(np.float32)
        s_new = hc_post(mx.array(S), mx.array(y), post, comb)
        h_new = hpost[0, :, :, None] * torch.from_numpy(y)[:, None] + hcomb[0].transpose(-1, -2) @ torch.from_numpy(S)
        np.testing.assert_allclose(np.array(s_new), h_new.numpy(), rtol=1e-5, atol=1e-5)

        xf = (rng.standard_normal((T, cfg.n_embd)) * 2).astype(np.float32)
        moe = MoE(cfg, il, weights, get_numerics("hf"))
        ym = np.array(moe(mx.array(xf), mx.array(tokens.astype(np.int32))))
        with torch.no_grad():
            yh = layer.mlp(layer.post_attention_layernorm(torch.from_numpy(xf)[None]),
                           input_ids=torch.from_numpy(tokens)[None])[0].numpy()
        assert np.abs(ym - yh).max() / np.abs(yh).max() < 1e-5, il


# ---- whole model ------------------------------------------------------------------------------------------


def _mlx_all_logits(path, tokens, numerics="hf") -> np.ndarray:
    from ds4_mlx.loader import load

    model, _ = load(path, numerics=numerics)
    caches = model.make_cache()
    return np.array(model(tokens, 0, caches, all_logits=True))


def _check_against_hf(path, hf, T):
    tokens = prompt(T)
    ref = hf_logits(hf, tokens)  # [T, V]
    got = _mlx_all_logits(path, tokens)
    scale = float(np.sqrt((ref**2).mean()))  # logit scale (RMS over all positions and vocab)
    err = np.abs(got - ref).max(axis=-1) / scale  # per position
    assert scale > 0.5  # non-degenerate logits
    assert err.max() <= 1e-4, f"worst position {int(err.argmax())}: rel err {err.max():.2e} (scale {scale:.3f})"
    return err


def test_hf_profile_matches_transformers_r16(hf16):
    path, hf = hf16
    # > 2R (2 HCA rows), > 4*top_k + 4 (indexer selection), > window 16
    _check_against_hf(path, hf, T=45)


@pytest.mark.slow
def test_hf_profile_matches_transformers_r128(tiny_gguf):
    path = tiny_gguf(experts="q2", hca_ratio=128)
    _check_against_hf(path, hf_model_from_gguf(path, 128), T=2 * 128 + 13)
