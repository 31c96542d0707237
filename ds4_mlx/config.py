"""Model configuration parsed from a DS4 GGUF's ``deepseek4.*`` metadata (MODEL.md §2).

Every dimension comes from the file, never from constants, so the tiny test models and the real
284B model run the same code. Validation of the raw metadata lives in :mod:`ds4_mlx.gguf_file`;
this module only holds the parsed values and the small derived helpers the graph needs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
        """``coff``: 2 overlapping lanes for ratio-4 (CSA) layers, 1 otherwise (MODEL.md §4.6)."""
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
