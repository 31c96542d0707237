"""The published DS4 GGUF tensor layout (docs/model.md §3) as data, shared by the validator and the factory.

One table answers "which tensors must this file hold, with which row-major shape and GGML type" for any
:class:`~ds4_mlx.config.ModelConfig`, so the tiny models and the real 284B file are checked by the same code.
It also knows how many bytes a decoded token touches (docs/model.md §10), which ``ds4-mlx inspect`` reports.
"""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T

from .config import ModelConfig

#: Types a routed expert tensor may have. gate and up must share one; down may differ (docs/model.md §3.1).
#: The float types are accepted for debugging models (not published, but ds4_mlx runs them).
EXPERT_TYPES = (T.IQ2_XXS, T.Q2_K, T.Q4_K, T.F16, T.BF16, T.F32)

#: ``--experts`` variants of the tiny factory and the routed-expert types they write (gate, up, down).
EXPERT_VARIANTS: dict[str, tuple[T, T, T]] = {
    "q2": (T.IQ2_XXS, T.IQ2_XXS, T.Q2_K),
    "q4": (T.Q4_K, T.Q4_K, T.Q4_K),
    "f16": (T.F16, T.F16, T.F16),
}


@dataclass(frozen=True)
class TensorSpec:
    """One expected tensor: row-major math shape (``ne`` reversed) and accepted GGML types."""

    name: str
    shape: tuple[int, ...]
    types: tuple[T, ...]
    component: str  # for byte accounting: attention, experts, shared, compressor, indexer, ...

    @property
    def fan_in(self) -> int:
        return self.shape[-1]


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    """Bytes a tensor of this row-major shape takes in a GGUF (rows are whole blocks)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n = 1
    for d in shape:
        n *= d
    return n // block * block_bytes


def expected_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Every tensor a DS4 GGUF with this config must contain, in file order (docs/model.md §3.2–3.4).

    ``exp_probs_b.bias`` (the router bias) is listed for every top-k layer; ds4 treats it as optional,
    so :func:`optional_tensors` lists it too and the validator accepts its absence.
    """
    E, V, H, D, HC = cfg.n_embd, cfg.n_vocab, cfg.n_head, cfg.head_dim, cfg.n_hc
    F, NE, G = cfg.n_ff_exp, cfg.n_expert, cfg.n_out_group
    f16, f32, q8, i32 = (T.F16,), (T.F32,), (T.Q8_0,), (T.I32,)
    specs: list[TensorSpec] = []

    def add(name: str, shape: tuple[int, ...], types: tuple[T, ...], component: str) -> None:
        specs.append(TensorSpec(name, shape, types, component))

    add("token_embd.weight", (V, E), f16, "embedding")
    for il in range(cfg.n_layer):
        p = f"blk.{il}."
        for sub in ("attn", "ffn"):
            add(f"{p}hc_{sub}_fn.weight", (cfg.hc_mix_dim, HC * E), f16, "hc")
            add(f"{p}hc_{sub}_scale.weight", (3,), f32, "hc")
            add(f"{p}hc_{sub}_base.weight", (cfg.hc_mix_dim,), f32, "hc")
        add(f"{p}attn_norm.weight", (E,), f32, "norms")
        add(f"{p}attn_q_a.weight", (cfg.q_lora_rank, E), q8, "attention")
        add(f"{p}attn_q_a_norm.weight", (cfg.q_lora_rank,), f32, "norms")
        add(f"{p}attn_q_b.weight", (H * D, cfg.q_lora_rank), q8, "attention")
        add(f"{p}attn_kv.weight", (D, E), q8, "attention")
        add(f"{p}attn_kv_a_norm.weight", (D,), f32, "norms")
        add(f"{p}attn_sinks.weight", (H,), f32, "attention")
        add(f"{p}attn_output_a.weight", (G * cfg.o_lora_rank, H * D // G), q8, "attention")
        add(f"{p}attn_output_b.weight", (E, G * cfg.o_lora_rank), q8, "attention")
        ratio = cfg.compress_ratio(il)
        if ratio:
            cw = cfg.compress_lanes(il) * D
            add(f"{p}attn_compressor_ape.weight", (ratio, cw), f16, "compressor")
            add(f"{p}attn_compressor_kv.weight", (cw, E), f16, "compressor")
            add(f"{p}attn_compressor_gate.weight", (cw, E), f16, "compressor")
            add(f"{p}attn_compressor_norm.weight", (D,), f32, "norms")
        if cfg.has_indexer(il):
            IH, ID = cfg.n_indexer_head, cfg.indexer_head_dim
            add(f"{p}indexer.attn_q_b.weight", (IH * ID, cfg.q_lora_rank), f16, "indexer")
            add(f"{p}indexer.proj.weight", (IH, E), f16, "indexer")
            add(f"{p}indexer_compressor_ape.weight", (ratio, 2 * ID), f16, "indexer_compressor")
            add(f"{p}indexer_compressor_kv.weight", (2 * ID, E), f16, "indexer_compressor")
            add(f"{p}indexer_compressor_gate.weight", (2 * ID, E), f16, "indexer_compressor")
            add(f"{p}indexer_compressor_norm.weight", (ID,), f32, "norms")
        add(f"{p}ffn_norm.weight", (E,), f32, "norms")
        add(f"{p}ffn_gate_inp.weight", (NE, E), f16, "router")
        if cfg.is_hash_layer(il):
            add(f"{p}ffn_gate_tid2eid.weight", (V, cfg.n_expert_used), i32, "router")
        else:
            add(f"{p}exp_probs_b.bias", (NE,), f32, "router")
        add(f"{p}ffn_gate_exps.weight", (NE, F, E), EXPERT_TYPES, "experts")
        add(f"{p}ffn_up_exps.weight", (NE, F, E), EXPERT_TYPES, "experts")
        add(f"{p}ffn_down_exps.weight", (NE, E, F), EXPERT_TYPES, "experts")
        add(f"{p}ffn_gate_shexp.weight", (F, E), q8, "shared")
        add(f"{p}ffn_up_shexp.weight", (F, E), q8, "shared")
        add(f"{p}ffn_down_shexp.weight", (E, F), q8, "shared")
    add("output_hc_fn.weight", (HC, HC * E), f16, "hc")
    add("output_hc_base.weight", (HC,), f32, "hc")
    add("output_hc_scale.weight", (1,), f32, "hc")
    add("output_norm.weight", (E,), f32, "norms")
    add("output.weight", (V, E), q8, "output")
    return {s.name: s for s in specs}


def layout_sizes(cfg: ModelConfig, experts: str = "q2") -> dict[str, int]:
    """Tensor name → bytes for a file of this config with the given ``EXPERT_VARIANTS`` expert layout."""
    types = dict(zip(("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"), EXPERT_VARIANTS[experts]))
    sizes = {}
    for name, spec in expected_tensors(cfg).items():
        qtype = types[name.split(".")[2]] if spec.component == "experts" else spec.types[0]
        sizes[name] = tensor_nbytes(spec.shape, qtype)
    return sizes


def optional_tensors(cfg: ModelConfig) -> dict[str, TensorSpec]:
    """Tensors that may be present or absent: the router bias of every layer (unused in hash layers)."""
    return {
        f"blk.{il}.exp_probs_b.bias": TensorSpec(f"blk.{il}.exp_probs_b.bias", (cfg.n_expert,), (T.F32,), "router")
        for il in range(cfg.n_layer)
    }


def decode_bytes_per_token(cfg: ModelConfig, sizes: dict[str, int], ctx: int) -> dict[str, int]:
    """Bytes one decoded token reads at context ``ctx`` (docs/model.md §10), by component.

    ``sizes`` maps tensor name → bytes (from a file, or computed with :func:`tensor_nbytes`). Routed experts
    count ``n_expert_used / n_expert`` of each expert tensor; the indexer's q_b/proj only once the number of
    compressed rows exceeds ``indexer_top_k`` (ds4 skips the indexer below that); of the embedding one row.
    KV reads assume f16 cache rows.
    """
    out: dict[str, int] = {}

    def add(key: str, n: float) -> None:
        out[key] = out.get(key, 0) + int(n)

    specs = {**expected_tensors(cfg), **optional_tensors(cfg)}
    for name, nbytes in sizes.items():
        spec = specs.get(name)
        if spec is None:
            continue
        c = spec.component
        if c == "experts":
            add("routed experts", nbytes * cfg.n_expert_used / cfg.n_expert)
        elif c == "embedding":
            add("hc, norms, embedding row", nbytes / cfg.n_vocab)
        elif name.endswith("tid2eid.weight"):
            add("router", nbytes / cfg.n_vocab)
        elif c == "indexer":
            if ctx // 4 > cfg.indexer_top_k:
                add("indexer q_b + proj", nbytes)
        elif c in ("hc", "norms"):
            add("hc, norms, embedding row", nbytes)
        else:
            label = {
                "attention": "attention projections",
                "shared": "shared experts",
                "output": "lm head",
                "compressor": "attention compressors",
                "indexer_compressor": "indexer compressors",
                "router": "router",
            }[c]
            add(label, nbytes)
    D, ID = cfg.head_dim, cfg.indexer_head_dim
    kv = cfg.n_layer * min(ctx, cfg.n_swa) * D * 2
    for il in range(cfg.n_layer):
        r = cfg.compress_ratio(il)
        if r == 4:
            kv += min(ctx // 4, cfg.indexer_top_k) * D * 2 + (ctx // 4) * ID * 2
        elif r:
            kv += (ctx // r) * D * 2
    add("kv cache", kv)
    return out
