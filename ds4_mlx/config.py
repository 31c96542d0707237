"""Model configuration parsed from a DS4 GGUF's ``deepseek4.*`` metadata (docs/model.md §2).

Every dimension comes from the file, never from constants, so the tiny test models and the real
284B model run the same code. :func:`check_config` holds the rules every config must meet, whether it
comes from a GGUF (:mod:`ds4_mlx.gguf_file`) or a converted directory's ``config.json``
(:mod:`ds4_mlx.mlx_dir`); reading the raw metadata lives in those modules.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

# The V4 Flash GGUFs run 20 Sinkhorn iterations; far more would only make every token slower (the loop
# runs per token and layer), so a larger count is taken for a corrupt file.
MAX_SINKHORN_ITER = 100


class DS4FormatError(ValueError):
    """A file that is not a usable DS4 model. The message names the file and what is wrong."""


@dataclass(frozen=True)
class ModelConfig:
    """DeepSeek V4 Flash hyper-parameters (names follow ds4.c / the GGUF keys)."""

    n_layer: int  # deepseek4.block_count
    n_embd: int  # embedding_length (width of one HC stream)
    n_vocab: int  # vocab_size
    n_head: int  # attention.head_count
    n_head_kv: int  # attention.head_count_kv (always 1: one shared K=V row)
    head_dim: int  # attention.key_length (== value_length)
    n_rot: int  # rope.dimension_count (RoPE on the *last* n_rot dims of a head)
    q_lora_rank: int
    o_lora_rank: int  # attention.output_lora_rank (per output group)
    n_out_group: int  # attention.output_group_count
    n_expert: int
    n_expert_used: int
    n_ff_exp: int  # expert_feed_forward_length (routed and shared width)
    n_expert_shared: int
    n_hash_layer: int  # first n layers route by token id (tid2eid)
    n_swa: int  # attention.sliding_window, including the current token
    n_indexer_head: int
    indexer_head_dim: int
    indexer_top_k: int
    n_hc: int  # hyper_connection.count (streams)
    n_sinkhorn_iter: int
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding only), 4 (CSA) or R (HCA)
    swiglu_clamp: tuple[float, ...]  # per layer
    rope_freq_base: float
    compress_rope_freq_base: float
    rope_scaling_factor: float
    rope_orig_ctx: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    expert_weights_scale: float
    expert_weights_norm: bool
    rms_eps: float
    hc_eps: float
    context_length: int = 0  # display only (ds4 never validates it)
    name: str = ""
    # Layer-independent facts read from the tensors, not the metadata.
    expert_types: tuple[str, str, str] = field(default=("", "", ""))  # gate, up, down GGML type names

    # ---- derived ---------------------------------------------------------------------------
    def compress_ratio(self, il: int) -> int:
        return self.compress_ratios[il]

    def compress_lanes(self, il: int) -> int:
        """``coff``: 2 overlapping lanes for ratio-4 (CSA) layers, 1 otherwise (docs/model.md §4.6)."""
        return 2 if self.compress_ratios[il] == 4 else 1

    def has_indexer(self, il: int) -> bool:
        return self.compress_ratios[il] == 4

    def is_hash_layer(self, il: int) -> bool:
        return il < self.n_hash_layer

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def hc_mix_dim(self) -> int:
        """Width of the HC mixing vector: pre (n_hc) + post (n_hc) + comb (n_hc²)."""
        return 2 * self.n_hc + self.n_hc * self.n_hc

    @property
    def heads_per_group(self) -> int:
        return self.n_head // self.n_out_group

    @property
    def attn_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def experts_label(self) -> str:
        """Short name of the routed-expert quantization: ``q2``, ``q4``, ``f16``... or the raw types."""
        g, u, d = self.expert_types
        if (g, u, d) == ("IQ2_XXS", "IQ2_XXS", "Q2_K"):
            return "q2"
        if (g, u, d) == ("Q4_K", "Q4_K", "Q4_K"):
            return "q4"
        if g == u == d and g in ("F16", "F32", "BF16"):
            return g.lower()
        return "/".join(self.expert_types)


_INT_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.type == "int")
_FLOAT_FIELDS = tuple(f.name for f in fields(ModelConfig) if f.type == "float")
_PER_LAYER = {"compress_ratios": int, "swiglu_clamp": float}


def check_config(cfg: ModelConfig, where: str, names: Mapping[str, str] | None = None) -> None:
    """Raise :class:`DS4FormatError` unless ``cfg`` has the types and the relations the graph relies on
    (docs/model.md §9.2); values that would make every logit NaN or never finish count as errors too.

    ``where`` names the file; ``names`` maps a field to the key the file spells it with (the GGUF's
    ``deepseek4.*`` keys; a ``config.json`` uses the field names themselves). One message, naming the key.
    """
    names = names or {}

    def key(name: str) -> str:
        return names.get(name, name)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise DS4FormatError(f"{where}: inconsistent metadata: {what}")

    for name in _INT_FIELDS:
        v = getattr(cfg, name)
        need(type(v) is int, f"{key(name)} = {v!r}, expected an integer")
        lo = 0 if name in ("n_hash_layer", "context_length") else 1
        need(v >= lo, f"{key(name)} = {v}, expected " + ("> 0" if lo else ">= 0"))
    for name in _FLOAT_FIELDS:
        v = getattr(cfg, name)
        need(type(v) in (int, float) and math.isfinite(v), f"{key(name)} = {v!r}, expected a finite number")
    need(type(cfg.expert_weights_norm) is bool, f"{key('expert_weights_norm')} = {cfg.expert_weights_norm!r}, expected a bool")
    need(type(cfg.name) is str, f"{key('name')} = {cfg.name!r}, expected a string")
    for name, kind in _PER_LAYER.items():
        v = getattr(cfg, name)
        need(type(v) is tuple, f"{key(name)} = {v!r}, expected a list of one value per layer")
        need(len(v) == cfg.n_layer, f"{key(name)} has {len(v)} entries, expected one per layer ({cfg.n_layer})")
        for il, x in enumerate(v):
            ok = type(x) is int if kind is int else type(x) in (int, float) and math.isfinite(x)
            need(ok, f"{key(name)}[{il}] = {x!r}, expected {'an integer' if kind is int else 'a finite number'}")

    need(cfg.rms_eps > 0, f"{key('rms_eps')} = {cfg.rms_eps}, expected > 0 (every RMSNorm divides by it)")
    need(cfg.hc_eps >= 0, f"{key('hc_eps')} = {cfg.hc_eps}, expected >= 0")
    for name in ("rope_freq_base", "compress_rope_freq_base"):
        need(getattr(cfg, name) > 1, f"{key(name)} = {getattr(cfg, name)}, expected > 1")
    for name in ("rope_scaling_factor", "yarn_beta_fast", "yarn_beta_slow"):
        need(getattr(cfg, name) > 0, f"{key(name)} = {getattr(cfg, name)}, expected > 0")
    need(cfg.n_sinkhorn_iter <= MAX_SINKHORN_ITER,
         f"{key('n_sinkhorn_iter')} = {cfg.n_sinkhorn_iter}, expected at most {MAX_SINKHORN_ITER} (V4 Flash uses 20)")
    need(cfg.n_head_kv == 1, f"{key('n_head_kv')} = {cfg.n_head_kv}, expected 1 (one shared K=V head)")
    need(cfg.n_expert_used <= cfg.n_expert, f"{key('n_expert_used')} {cfg.n_expert_used} > {key('n_expert')} {cfg.n_expert}")
    need(cfg.n_expert_shared == 1, f"{key('n_expert_shared')} = {cfg.n_expert_shared}, expected 1")
    need(cfg.n_hash_layer <= cfg.n_layer, f"{key('n_hash_layer')} {cfg.n_hash_layer} > {key('n_layer')} {cfg.n_layer}")
    need(cfg.n_head % cfg.n_out_group == 0,
         f"{key('n_head')} {cfg.n_head} not divisible by {key('n_out_group')} {cfg.n_out_group}")
    need(cfg.n_rot % 2 == 0 and cfg.n_rot <= min(cfg.head_dim, cfg.indexer_head_dim),
         f"{key('n_rot')} {cfg.n_rot} must be even and <= key lengths")
    need(cfg.nope_dim > 0 and cfg.nope_dim % 64 == 0,
         f"{key('head_dim')} - {key('n_rot')} = {cfg.nope_dim}, expected a positive multiple of 64 (FP8 blocks)")
    need(cfg.indexer_head_dim == 128, f"{key('indexer_head_dim')} = {cfg.indexer_head_dim}, expected 128 (Hadamard-128)")
    need(cfg.n_embd % 256 == 0 and cfg.n_ff_exp % 256 == 0,
         f"{key('n_embd')} {cfg.n_embd} and {key('n_ff_exp')} {cfg.n_ff_exp} must be multiples of 256")
    need(cfg.q_lora_rank % 32 == 0 and cfg.o_lora_rank % 32 == 0,
         f"{key('q_lora_rank')}/{key('o_lora_rank')} must be multiples of 32 (Q8_0 rows)")
    for il, r in enumerate(cfg.compress_ratios):
        need(r >= 0, f"{key('compress_ratios')}[{il}] = {r}, expected >= 0")
    need(all(c > 0 for c in cfg.swiglu_clamp), f"{key('swiglu_clamp')} must be positive")
