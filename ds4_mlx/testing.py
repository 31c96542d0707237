"""Tiny random-weight DS4 GGUFs in the real layout (docs/model.md §9) — the project's test bed.

The real model is 81 GB; these files have the same metadata keys, tensor names, dtypes and structural
features (hash layers, CSA/HCA compression, indexer, q2/q4/f16 experts) at a size that runs on a laptop CPU.

Weight scales follow one rule, chosen from fan-in so activations stay O(1) through every layer:
every matrix ``W[out][in]`` has entries of standard deviation ``1/sqrt(in)`` (so ``W @ x`` keeps the
RMS of a unit-RMS input), the embedding rows have unit variance, norm weights are drawn from
U(0.8, 1.2), and the small per-layer vectors (HC base/scale, sinks, APE, router bias) are O(1) random.
For the K-quant and IQ2 types, whose values cannot be drawn directly, random valid blocks are written
with their f16 scale fields set so the dequantized weights have that standard deviation (and roughly
zero mean). Everything derives from one ``numpy.random.Generator`` seed, so a seed gives identical bytes.

The tokenizer is a real byte-level BPE: 256 byte tokens, merges learned from a small embedded
English+code+CJK corpus, and the 7 DS4 special strings (BOS id 0, EOS id 1).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFWriter, GGMLQuantizationType as T
from gguf import quants as gquants

from .config import ModelConfig
from .gguf_file import _FLOAT_KEYS, _INT_KEYS, ARCH, TokenizerData
from .layout import EXPERT_VARIANTS, expected_tensors
from .tokenizer import DS4_SPLIT, SPECIAL_TOKENS, bytes_to_unicode

Tensors = dict[str, tuple[np.ndarray, T]]


@dataclass(frozen=True)
class LazyTensor:
    """A tensor :func:`write_gguf` makes only when its turn to be written comes, so a file larger than memory
    can be written: its stored shape (elements for plain types, ``(..., row_bytes)`` uint8 for block types), its
    numpy dtype, its GGML type, and the function that makes it."""

    shape: tuple[int, ...]
    dtype: np.dtype
    qtype: T
    make: Callable[[], np.ndarray]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(self.dtype).itemsize


def tiny_config(hca_ratio: int = 16, layers: int = 6, **overrides) -> ModelConfig:
    """The tiny config of docs/model.md §9.1: ratios 0,0 then alternating 4/R; 3 hash layers."""
    ratios = tuple([0, 0] + [4 if il % 2 == 0 else hca_ratio for il in range(2, layers)])
    values = dict(
        n_layer=layers, n_embd=256, n_vocab=512, n_head=4, n_head_kv=1, head_dim=128, n_rot=64,
        q_lora_rank=64, o_lora_rank=64, n_out_group=2, n_expert=16, n_expert_used=6, n_ff_exp=256,
        n_expert_shared=1, n_hash_layer=min(3, layers), n_swa=16, n_indexer_head=16, indexer_head_dim=128,
        indexer_top_k=4, n_hc=4, n_sinkhorn_iter=20, compress_ratios=ratios, swiglu_clamp=(10.0,) * layers,
        rope_freq_base=10000.0, compress_rope_freq_base=160000.0, rope_scaling_factor=16.0,
        rope_orig_ctx=65536, yarn_beta_fast=32.0, yarn_beta_slow=1.0, expert_weights_scale=1.5,
        expert_weights_norm=True, rms_eps=1e-6, hc_eps=1e-6, context_length=1048576,
    )
    values.update(overrides)
    return ModelConfig(**values)


def make_tiny_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    experts: str = "q2",
    hca_ratio: int = 16,
    layers: int = 6,
    router_skew: float = 0.0,
    **overrides,
) -> Path:
    """Write a tiny random-weight DS4 GGUF to ``path`` and return the path.

    ``experts`` picks the routed-expert layout: ``q2`` (IQ2_XXS gate/up, Q2_K down, like the published
    2-bit file), ``q4`` (Q4_K) or ``f16``. ``router_skew``: see :func:`lazy_random_tensors`. ``overrides``
    replace :func:`tiny_config` fields.
    """
    if experts not in EXPERT_VARIANTS:
        raise ValueError(f"experts must be one of {sorted(EXPERT_VARIANTS)}, got {experts!r}")
    cfg = tiny_config(hca_ratio=hca_ratio, layers=layers, **overrides)
    rng = np.random.default_rng(seed)
    tensors = random_tensors(cfg, rng, experts, router_skew=router_skew)
    name = f"ds4-mlx tiny (seed {seed}, {experts} experts{_skew_label(router_skew)}, HCA ratio {hca_ratio})"
    return write_gguf(path, cfg, tensors, tiny_tokenizer(cfg.n_vocab), name=name)


def make_full_width_gguf(
    path: str | Path,
    *,
    layers: int,
    seed: int = 0,
    experts: str = "q2",
    router_skew: float = 0.0,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-weight GGUF of the real V4 Flash width with ``layers`` layers (the real file's layout, its
    first ``layers`` layers), tensor by tensor: memory stays at one tensor (the largest, the F16 embedding, is
    1 GB), whatever the file's size (~2 GB a layer with q2 experts). ``progress(bytes written, total)`` after
    each tensor. Drawn the fast way (:func:`lazy_random_tensors` ``fast``): ~2 GB a layer to make and write.
    ``router_skew``: see :func:`lazy_random_tensors`.
    """
    if not 1 <= layers <= 43:
        raise ValueError(f"layers must be 1..43, got {layers}")
    from .random_model import shape_config

    cfg = shape_config("full", layers)
    rng = np.random.default_rng(seed)
    tensors = dict(lazy_random_tensors(cfg, rng, experts, fast=True, router_skew=router_skew))
    name = f"ds4-mlx full width, {layers} layers (seed {seed}, {experts} experts{_skew_label(router_skew)})"
    return write_gguf(path, cfg, tensors, padded_tokenizer(cfg.n_vocab), name=name, progress=progress)


# ---- writing ---------------------------------------------------------------------------------------


def config_metadata(cfg: ModelConfig) -> dict[str, tuple[str, object]]:
    """The ``deepseek4.*`` keys for ``cfg`` as ``key -> (writer method, value)`` (types as ds4 expects)."""
    p = ARCH + "."
    md: dict[str, tuple[str, object]] = {}
    for field, key in _INT_KEYS.items():
        md[p + key] = ("add_uint32", getattr(cfg, field))
    for field, key in _FLOAT_KEYS.items():
        md[p + key] = ("add_float32", getattr(cfg, field))
    md[p + "context_length"] = ("add_uint64", cfg.context_length)
    md[p + "attention.value_length"] = ("add_uint32", cfg.head_dim)
    md[p + "attention.compress_ratios"] = ("add_array", list(cfg.compress_ratios))
    md[p + "swiglu_clamp_exp"] = ("add_array", [float(c) for c in cfg.swiglu_clamp])
    md[p + "expert_weights_norm"] = ("add_bool", cfg.expert_weights_norm)
    return md


def write_gguf(
    path: str | Path,
    cfg: ModelConfig,
    tensors: Tensors,
    tokenizer: TokenizerData,
    *,
    name: str = "ds4-mlx tiny",
    metadata: dict[str, tuple[str, object] | None] | None = None,
    arch: str = ARCH,
    progress: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a GGUF with ``cfg``'s metadata, the tokenizer keys and ``tensors`` (name → (array, type), or a
    :class:`LazyTensor`, made when written).

    ``metadata`` adds or replaces keys (``None`` as a value drops the key): tests use it to write bad files.
    Quantized tensors are given as raw block bytes (uint8 ``(..., row_bytes)``). ``progress(bytes written,
    total)`` is called after each tensor.
    """
    path = Path(path)
    md = config_metadata(cfg)
    md["general.name"] = ("add_string", name)
    md["tokenizer.ggml.model"] = ("add_string", "gpt2")
    md["tokenizer.ggml.pre"] = ("add_string", "joyai-llm")
    md["tokenizer.ggml.tokens"] = ("add_array", tokenizer.tokens)
    md["tokenizer.ggml.merges"] = ("add_array", tokenizer.merges)
    if tokenizer.token_types is not None:
        md["tokenizer.ggml.token_type"] = ("add_array", tokenizer.token_types)
    md["tokenizer.ggml.bos_token_id"] = ("add_uint32", 0)
    md["tokenizer.ggml.eos_token_id"] = ("add_uint32", 1)
    md.update(metadata or {})
    w = GGUFWriter(str(path), arch)
    for key, entry in md.items():
        if entry is not None:
            method, value = entry
            getattr(w, method)(key, value)
    items = [(n, t if isinstance(t, LazyTensor) else _ready(*t)) for n, t in tensors.items()]
    for tname, t in items:
        w.add_tensor_info(tname, t.shape, np.dtype(t.dtype), t.nbytes,
                          raw_dtype=None if t.qtype in (T.F32, T.F16, T.I32) else t.qtype)  # fmt: skip
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total, done = sum(t.nbytes for _, t in items), 0
    for tname, t in items:  # one tensor in memory at a time
        arr = t.make()
        if arr.shape != t.shape or arr.dtype != t.dtype:
            raise ValueError(f"{tname}: made {arr.dtype}{arr.shape}, announced {np.dtype(t.dtype)}{t.shape}")
        w.write_tensor_data(arr)
        done += t.nbytes
        if progress is not None:
            progress(done, total)
    w.close()
    return path


def _ready(arr: np.ndarray, qtype: T) -> LazyTensor:
    """An array already in memory, as a :class:`LazyTensor`."""
    return LazyTensor(tuple(arr.shape), arr.dtype, qtype, lambda: arr)


# ---- random weights --------------------------------------------------------------------------------


def short_name(name: str) -> str:
    """A tensor name without layer prefix and suffix: ``blk.3.attn_q_a.weight`` → ``attn_q_a``."""
    return re.sub(r"^blk\.\d+\.|\.(weight|bias)$", "", name)


def weight_init(name: str, shape: tuple[int, ...]) -> tuple[str, float, float]:
    """The init rule of one tensor (module docstring): ``("normal", mean, std)`` or ``("uniform", lo, hi)``.

    Shared by this factory (numpy) and :mod:`ds4_mlx.random_model` (weights built in device memory).
    """
    short = short_name(name)
    if len(shape) >= 2:
        if name == "token_embd.weight":
            return "normal", 0.0, 1.0
        return "normal", 0.0, 0.5 if short.endswith("_ape") else shape[-1] ** -0.5
    rules = {"norm": ("uniform", 0.8, 1.2), "scale": ("uniform", 0.5, 1.5), "base": ("normal", 0.0, 0.5)}
    for suffix, rule in rules.items():
        if short.endswith(suffix):
            return rule
    if short == "attn_sinks":
        return "normal", 0.0, 1.0
    if short == "exp_probs_b":
        return "normal", 0.0, 0.1
    raise AssertionError(f"no init rule for {name}")


def expert_type(name: str, experts: str) -> T:
    """The GGML type of a routed-expert tensor in an ``EXPERT_VARIANTS`` layout."""
    gate_t, up_t, down_t = EXPERT_VARIANTS[experts]
    return {"ffn_gate_exps": gate_t, "ffn_up_exps": up_t, "ffn_down_exps": down_t}[short_name(name)]


def random_tensors(cfg: ModelConfig, rng: np.random.Generator, experts: str = "q2", *,
                   router_skew: float = 0.0) -> Tensors:  # fmt: skip
    """Random weights for every tensor of the layout, scaled as the module docstring describes (``router_skew``:
    see :func:`lazy_random_tensors`)."""
    return {name: (t.make(), t.qtype) for name, t in lazy_random_tensors(cfg, rng, experts, router_skew=router_skew)}


def lazy_random_tensors(cfg: ModelConfig, rng: np.random.Generator, experts: str = "q2", *,
                        fast: bool = False, router_skew: float = 0.0) -> Iterator[tuple[str, LazyTensor]]:  # fmt: skip
    """:func:`random_tensors` one :class:`LazyTensor` at a time; made in this order from the one ``rng``, they give
    the same values. ``fast`` (for full-width files): f32 Gaussian draws, block bytes from ``rng.bytes`` and Q8_0
    as random valid blocks instead of quantized draws: the same scales, other values, ~10x faster.

    ``router_skew`` s > 0: the experts of a layer are popular in a random order, the expert of rank r chosen about
    as often as ``(r + 1) ** -s`` (a Zipf law), as traffic that repeats experts would choose them: the routers'
    bias is :func:`skewed_router_bias`, and the hash layers' tables draw each token's experts by popularity.
    Uniform token ids then meet skewed routing (the expert cache's benchmarks). 0: unbiased, as the real
    model's load-balanced routers are over a broad corpus."""
    for name, spec in expected_tensors(cfg).items():
        shape, qtype = spec.shape, spec.types[0]
        if spec.component == "experts":
            qtype = expert_type(name, experts)
        yield name, _random_tensor(name, shape, qtype, cfg, rng, fast, router_skew)


def _random_tensor(name: str, shape: tuple[int, ...], qtype: T, cfg: ModelConfig, rng: np.random.Generator,
                   fast: bool, skew: float = 0.0) -> LazyTensor:  # fmt: skip
    if qtype == T.I32:  # tid2eid: distinct experts per token row, the k of lowest keys
        def keys() -> np.ndarray:
            u = rng.random((shape[0], cfg.n_expert))
            if skew <= 0:
                return u
            # drawn by popularity without repeats: Gumbel noise over the log shares
            return np.log(-np.log(u)) + skew * np.log1p(_popularity_rank(name, cfg))

        return LazyTensor(shape, np.dtype(np.int32), qtype,
                          lambda: np.argsort(keys(), axis=1)[:, : shape[1]].astype(np.int32))  # fmt: skip
    if skew > 0 and short_name(name) == "exp_probs_b":
        unskewed = _random_tensor(name, shape, qtype, cfg, rng, fast)  # drawn all the same: later tensors keep theirs
        bias = skewed_router_bias(cfg.n_expert, cfg.n_expert_used, skew)[_popularity_rank(name, cfg)]
        return LazyTensor(shape, unskewed.dtype, qtype, lambda: (unskewed.make(), bias.astype(unskewed.dtype))[1])
    dist, a, b = weight_init(name, shape)
    if qtype in (T.F32, T.F16):
        dtype = np.dtype(np.float16 if qtype == T.F16 else np.float32)
        if dist == "uniform":
            draw = lambda: rng.uniform(a, b, shape)  # noqa: E731
        elif fast:  # f32 draws: the 0.5 G-element embedding in 2 GB, not 4
            draw = lambda: rng.standard_normal(shape, dtype=np.float32) * np.float32(b) + np.float32(a)  # noqa: E731
        else:
            draw = lambda: rng.normal(a, b, shape)  # noqa: E731
        return LazyTensor(shape, dtype, qtype, lambda: draw().astype(dtype))
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    stored = (*shape[:-1], shape[-1] // block * block_bytes)
    if qtype == T.Q8_0 and not fast:
        return LazyTensor(stored, np.dtype(np.uint8), qtype,
                          lambda: gquants.quantize(rng.normal(a, b, shape).astype(np.float32), T.Q8_0))
    return LazyTensor(stored, np.dtype(np.uint8), qtype, lambda: random_weight_blocks(rng, qtype, shape, b, fast))


def _skew_label(skew: float) -> str:
    return f", router skew {skew:g}" if skew > 0 else ""


def _popularity_rank(name: str, cfg: ModelConfig) -> np.ndarray:
    """Each expert's rank in the popularity order of the layer of tensor ``name`` (a random order of its own)."""
    order = np.random.default_rng([POPULARITY_SEED, int(name.split(".")[1])]).permutation(cfg.n_expert)
    return np.argsort(order)  # order[r] is the expert of rank r


#: Seeds each layer's popularity order of a skewed model (with the layer index), apart from the weights' seed.
POPULARITY_SEED = 0x5EED


@lru_cache(maxsize=None)
def skewed_router_bias(n_expert: int, k: int, skew: float, samples: int = 4096, rounds: int = 80) -> np.ndarray:
    """A router bias ``[n_expert]`` in rank order under which the top-``k`` of ``sqrt(softplus(z)) + bias``, z of
    unit variance (the logits of a random router on a normed input), picks the expert of rank r about as often as
    ``(r + 1) ** -skew`` (no expert more than once a token): fitted on ``samples`` draws of z, each round moving
    every expert's bias by the log of how far its count is from its share."""
    want = k * _capped_shares((np.arange(n_expert) + 1.0) ** -skew, k)
    z = np.random.default_rng(POPULARITY_SEED).standard_normal((samples, n_expert))
    score = np.sqrt(np.logaddexp(0.0, z))  # the router's sqrt(softplus(logits))
    bias = np.zeros(n_expert)
    for _ in range(rounds):
        picked = np.argpartition(-(score + bias), k, axis=1)[:, :k]
        got = np.bincount(picked.ravel(), minlength=n_expert) / samples
        bias += 0.05 * (np.log(want) - np.log(got + 0.5 / samples))  # 0.05: about the scores' spread at the top
    return bias.astype(np.float32)


def _capped_shares(weights: np.ndarray, k: int) -> np.ndarray:
    """``weights`` as shares of ``k`` picks a token, none above one pick (the excess spread over the others)."""
    share = weights / weights.sum()
    for _ in range(len(share)):
        over = share * k > 1
        if not over.any():
            break
        share[~over] += (share[over].sum() - over.sum() / k) * share[~over] / share[~over].sum()
        share[over] = 1 / k
    return share


# Where each block type keeps its f16 super-scales: (byte offset of d, byte offset of dmin or None, dmin/d).
# dmin/d is chosen so the dequantized weights have roughly zero mean (E[d·sc·q] = E[dmin·m]).
SCALE_FIELDS = {T.Q8_0: (0, None, 0.0), T.IQ2_XXS: (0, None, 0.0), T.Q2_K: (80, 82, 1.5), T.Q4_K: (0, 2, 7.5)}


def random_weight_blocks(rng: np.random.Generator, qtype: T, shape: tuple[int, ...], std: float,
                         fast: bool = False) -> np.ndarray:  # fmt: skip
    """Random but valid GGUF blocks (docs/quants.md §5.2) whose dequantized values have standard deviation ≈ std.

    Returns uint8 of shape ``(*shape[:-1], row_bytes)``. Uniform random bytes (``fast``: from ``rng.bytes``,
    several times quicker than ``rng.integers``, other values), then the f16 scale fields overwritten with
    finite values: d = std / rms_per_unit_d × U(0.5, 1.5) per block.
    """
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    n_blocks = int(np.prod(shape)) // block
    if fast:
        raw = np.frombuffer(bytearray(rng.bytes(n_blocks * block_bytes)), np.uint8).reshape(n_blocks, block_bytes)
    else:
        raw = rng.integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)
    d_off, m_off, m_ratio = SCALE_FIELDS[qtype]
    d = (std / unit_rms(qtype)) * rng.uniform(0.5, 1.5, n_blocks)
    raw[:, d_off : d_off + 2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if m_off is not None:
        raw[:, m_off : m_off + 2] = (d * m_ratio).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return raw.reshape(*shape[:-1], shape[-1] // block * block_bytes)


@lru_cache(maxsize=None)
def unit_rms(qtype: T) -> float:
    """RMS of dequantized random blocks with d = 1 (and dmin = ratio): calibrates :func:`random_weight_blocks`."""
    rng = np.random.default_rng(1234)
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (256, block_bytes), dtype=np.uint8)
    d_off, m_off, m_ratio = SCALE_FIELDS[qtype]
    raw[:, d_off : d_off + 2] = np.full(256, 1.0, np.float16).view(np.uint8).reshape(256, 2)
    if m_off is not None:
        raw[:, m_off : m_off + 2] = np.full(256, m_ratio, np.float16).view(np.uint8).reshape(256, 2)
    w = gquants.dequantize(raw, qtype)
    return float(np.sqrt(np.mean(w.astype(np.float64) ** 2)))


# ---- tokenizer ---------------------------------------------------------------------------------------

@lru_cache(maxsize=8)
def tiny_tokenizer(vocab_size: int = 512) -> TokenizerData:
    """A deterministic byte-level BPE vocabulary of exactly ``vocab_size`` tokens.

    Layout: BOS (id 0), EOS (id 1), the 256 byte tokens, learned merges, then the other 5 specials.
    Merges are learned greedily (most frequent pair; ties by the pair's text) over the pieces of the
    embedded corpus, so the same vocabulary comes out on every machine.
    """
    specials = list(SPECIAL_TOKENS)
    n_fixed = 256 + len(specials)
    if vocab_size < n_fixed:
        raise ValueError(f"vocab_size must be >= {n_fixed} (256 bytes + 7 specials), got {vocab_size}")
    b2c = [bytes_to_unicode()[b] for b in range(256)]
    text = resources.files("ds4_mlx").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8")
    words = Counter(tuple(b2c[b] for b in piece.encode("utf-8")) for piece in DS4_SPLIT.findall(text))
    vocab = specials[:2] + b2c
    known = set(vocab)
    merges: list[str] = []
    while len(vocab) < vocab_size - (len(specials) - 2):
        pairs: Counter = Counter()
        for word, freq in words.items():
            for a, b in zip(word, word[1:]):
                pairs[(a, b)] += freq
        if not pairs:
            raise ValueError(f"the tiny corpus supports at most {len(vocab) + 5} tokens, asked for {vocab_size}")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(f"{best[0]} {best[1]}")
        joined = best[0] + best[1]
        if joined not in known:
            vocab.append(joined)
            known.add(joined)
        words = Counter({_merge_word(w, best, joined): f for w, f in words.items()})
    tokens = vocab + specials[2:]
    types = [3 if t in SPECIAL_TOKENS else 1 for t in tokens]
    return TokenizerData(tokens, merges, types)


def padded_tokenizer(n_vocab: int) -> TokenizerData:
    """:func:`tiny_tokenizer` (512 tokens) padded with unused tokens (type 5) to ``n_vocab``: the token count a
    full-width file's metadata requires; text encodes to the first 512 ids only."""
    base = tiny_tokenizer(512)
    if n_vocab < len(base.tokens):
        raise ValueError(f"n_vocab must be >= {len(base.tokens)}, got {n_vocab}")
    pad = [f"<|unused_{i}|>" for i in range(n_vocab - len(base.tokens))]
    return TokenizerData(base.tokens + pad, base.merges, base.token_types + [5] * len(pad))


def _merge_word(word: tuple[str, ...], pair: tuple[str, str], joined: str) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(joined)
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def flash_config() -> ModelConfig:
    """The real DeepSeek V4 Flash shape (docs/model.md §1), for benchmarks with in-memory random weights."""
    ratios = tuple([0, 0] + [4 if il % 2 == 0 else 128 for il in range(2, 43)])
    return tiny_config(
        layers=43, n_embd=4096, n_vocab=129280, n_head=64, head_dim=512, q_lora_rank=1024, o_lora_rank=1024,
        n_out_group=8, n_expert=256, n_ff_exp=2048, n_swa=128, n_indexer_head=64, indexer_top_k=512,
        compress_ratios=ratios, name="DeepSeek V4 Flash (shape only)",
    )
