"""DeepSeek V4 byte-level BPE tokenizer built from a GGUF's ``tokenizer.*`` keys (docs/serving.md §1).

What this module owns:

* the ds4 "JoyAI" pre-tokenizer (§1.3, normative, the default) and the official Hugging Face pipeline (§1.4,
  ``pretokenizer="official"``);
* byte-level BPE on ``tokenizers.models.BPE`` (§1.5) with an LRU cache per pre-token piece (prompts of
  25k-100k tokens are common and repeat their pieces);
* the two encoding entry points of §1.2: :meth:`Tokenizer.encode` (plain text, never a special) and
  :meth:`Tokenizer.encode_chat` (rendered chat: only the 7 specials of §1.1 are recognised, by scanning);
* decoding to bytes with ds4's rules (§1.6) and a streaming detokenizer that never emits a broken UTF-8
  sequence;
* :meth:`Tokenizer.to_hf_json`, a ``tokenizer.json`` that reproduces the tokenizer in ``tokenizers``.

Text is bytes (UTF-8) throughout. ``str`` input is encoded with the ``"ds4"`` error handler: lone surrogates
U+DC80-U+DCFF are the bytes 0x80-0xFF (Python's ``surrogateescape``, so a body decoded with ``surrogateescape``
re-encodes identically), any other lone surrogate is 3 CESU bytes (``surrogatepass``, what ds4 does with a JSON
``\\uD800``, §1.7). Invalid UTF-8 is never rejected: its bytes are pre-tokenized as letter-like characters (each
invalid byte one character; ds4 instead steps by the lead byte's length, a divergence that only affects malformed
input) and BPE'd as ordinary bytes. A NUL byte is ordinary text here (ds4's C strings would end at it).
"""

from __future__ import annotations

import codecs
import re
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from typing import Literal, Protocol

from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

__all__ = [
    "BOS",
    "EOS",
    "USER",
    "ASSISTANT",
    "THINK",
    "THINK_END",
    "DSML",
    "SPECIAL_TOKENS",
    "DS4_SPLIT",
    "ds4_split",
    "official_split",
    "bytes_to_unicode",
    "check_merges",
    "to_bytes",
    "Tokenizer",
    "StreamingDetokenizer",
]

# -- §1.1 the only 7 strings ever treated as specials (scan order = this order) -----------------------------
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
SPECIAL_TOKENS: tuple[str, ...] = (BOS, EOS, USER, ASSISTANT, THINK, THINK_END, DSML)
_SPECIAL_ATTRS = ("bos_id", "eos_id", "user_id", "assistant_id", "think_id", "think_end_id", "dsml_id")

# -- §1.3 ds4's splitter as a regex (fuzz-validated against ds4.c's C splitter, see the spec) ----------------
_L = r"A-Za-z\u0080-\U0010FFFF"  # letter-like: ASCII letters and every non-ASCII character
_P = r"!-/:-@\[-`{-~"  # ASCII punctuation
DS4_SPLIT = re.compile(
    r"[0-9]{1,3}|[\u3040-\u30ff\u4e00-\u9fa5]+" rf"|[{_P}][A-Za-z]+|[{_L}]+"
    rf"|[\x00-\x09\x0b\x0c\x0e-\x20\x7f][{_L}]+| [{_P}]+[\r\n]*|[{_P}]+[\r\n]*"
    r"|[ \t\n\r\x0b\x0c]*[\r\n]" rf"|[ \t\x0b\x0c]+(?=[ \t\x0b\x0c][{_L}{_P}])"
    r"|[ \t\x0b\x0c]+|[\s\S]"
)

# The same regex in Oniguruma syntax (what `tokenizers.Regex` compiles), used by :meth:`Tokenizer.to_hf_json`.
_L_ONIG = r"A-Za-z\x{80}-\x{10FFFF}"
_DS4_SPLIT_ONIG = (
    r"[0-9]{1,3}|[\x{3040}-\x{30ff}\x{4e00}-\x{9fa5}]+" rf"|[{_P}][A-Za-z]+|[{_L_ONIG}]+"
    rf"|[\x00-\x09\x0b\x0c\x0e-\x20\x7f][{_L_ONIG}]+| [{_P}]+[\r\n]*|[{_P}]+[\r\n]*"
    r"|[ \t\n\r\x0b\x0c]*[\r\n]" rf"|[ \t\x0b\x0c]+(?=[ \t\x0b\x0c][{_L_ONIG}{_P}])"
    r"|[ \t\x0b\x0c]+|[\s\S]"
)

# -- §1.4 the official DeepSeek V3/V4 pre-tokenizer: three isolated Splits, then ByteLevel -----------------
_OFFICIAL_SPLITS = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)

PreTokenizerName = Literal["ds4", "official"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (§1.5): 33-126, 161-172, 174-255 map to themselves, the other
    68 bytes to U+0100 + n in increasing byte order (space -> 'Ġ', newline -> 'Ċ')."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + n)
            n += 1
    return table


_BYTE_TO_CHAR = bytes_to_unicode()
# bytes.decode("latin-1") gives chr(b) per byte; translate maps those to the GPT-2 characters in one C call
_LATIN1_TO_GPT2 = {b: c for b, c in _BYTE_TO_CHAR.items()}
# inverse map for decoding: GPT-2 char -> chr(byte) (latin-1 re-encodes it to the byte); unmapped chars drop
_GPT2_TO_LATIN1: dict[int, str | None] = {ord(c): chr(b) for b, c in _BYTE_TO_CHAR.items()}


def _ds4_errors(exc: UnicodeError) -> tuple[bytes, int]:
    """Encoding error handler for lone surrogates: U+DC80-U+DCFF -> the escaped byte, others -> CESU bytes."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    out = bytearray()
    for ch in exc.object[exc.start : exc.end]:
        cp = ord(ch)
        if 0xDC80 <= cp <= 0xDCFF:
            out.append(cp - 0xDC00)
        else:
            out += ch.encode("utf-8", "surrogatepass")
    return bytes(out), exc.end


codecs.register_error("ds4", _ds4_errors)


def to_bytes(text: str | bytes) -> bytes:
    """UTF-8 bytes of ``text`` (bytes pass through; lone surrogates as described in the module docstring)."""
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    return text.encode("utf-8", "ds4")


def ds4_split(text: str | bytes) -> list[bytes]:
    """ds4's pre-tokenizer (§1.3) as byte pieces; their concatenation is ``to_bytes(text)``."""
    s = to_bytes(text).decode("utf-8", "surrogateescape")
    return [p.encode("utf-8", "surrogateescape") for p in DS4_SPLIT.findall(s)]


def _official_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    splits = [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in _OFFICIAL_SPLITS]
    return pre_tokenizers.Sequence(splits)


_OFFICIAL_PRE = None


def official_split(text: str) -> list[str]:
    """The official DeepSeek V3/V4 pre-tokenizer (§1.4) on valid text, as string pieces."""
    global _OFFICIAL_PRE
    if _OFFICIAL_PRE is None:
        _OFFICIAL_PRE = _official_pre_tokenizer()
    return [p for p, _ in _OFFICIAL_PRE.pre_tokenize_str(text)]


def check_merges(vocab: Container[str], merges: Sequence[str]) -> list[tuple[str, str]]:
    """The merges as ``(A, B)`` pairs; raises ``ValueError`` naming the first one that is not ``"A B"`` with A,
    B and AB in ``vocab`` (``tokenizers`` rejects an unknown A or B, and aborts the process on an unknown AB)."""
    pairs = []
    for rank, m in enumerate(merges):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise ValueError(f"merge #{rank} is not 'A B': {m!r}")
        missing = next((t for t in (parts[0], parts[1], parts[0] + parts[1]) if t not in vocab), None)
        if missing is not None:
            raise ValueError(f"merge #{rank} {m!r}: {missing!r} is not in the vocabulary")
        pairs.append((parts[0], parts[1]))
    return pairs


class TokenizerData(Protocol):
    """What :meth:`Tokenizer.from_gguf` needs (``ds4_mlx.gguf_file.TokenizerData`` has it)."""

    tokens: list[str]
    merges: list[str]


class Tokenizer:
    """DeepSeek V4 tokenizer: byte-level BPE + ds4 (default) or official pre-tokenizer + the 7 specials.

    ``tokens[i]`` is the GPT-2 byte-character spelling of id ``i``; ``merges`` are ``"A B"`` strings, rank = index.
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        *,
        pretokenizer: PreTokenizerName = "ds4",
        cache_size: int = 1 << 16,
    ) -> None:
        if pretokenizer not in ("ds4", "official"):
            raise ValueError(f"pretokenizer must be 'ds4' or 'official', not {pretokenizer!r}")
        self.tokens: list[str] = list(tokens)
        self.merges: list[str] = list(merges)
        self.pretokenizer: PreTokenizerName = pretokenizer
        self.vocab_size = len(self.tokens)

        # specials are found by exact string (§1.1); first occurrence wins like a linear table scan
        index: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            index.setdefault(t, i)
        missing = [s for s in SPECIAL_TOKENS if s not in index]
        if missing:
            raise ValueError(f"tokenizer vocabulary lacks the DeepSeek V4 special token(s): {', '.join(missing)}")
        self.special_ids: dict[str, int] = {s: index[s] for s in SPECIAL_TOKENS}
        for attr, s in zip(_SPECIAL_ATTRS, SPECIAL_TOKENS):
            setattr(self, attr, index[s])
        self.bos_id: int
        self.eos_id: int
        self.user_id: int
        self.assistant_id: int
        self.think_id: int
        self.think_end_id: int
        self.dsml_id: int

        pairs = check_merges(index, self.merges)
        # a token string appearing twice keeps its first id (the specials' lookup rule)
        self._bpe = models.BPE(index, pairs, byte_fallback=False)
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cache_size = cache_size
        self._official: HFTokenizer | None = None
        if pretokenizer == "official":
            self._official = self._build_hf(_official_pre_tokenizer(), specials=False)
        self._id_bytes: list[bytes | None] = [None] * self.vocab_size

    @classmethod
    def from_gguf(cls, data: TokenizerData, *, pretokenizer: PreTokenizerName = "ds4") -> Tokenizer:
        """Build from GGUF ``tokenizer.ggml.tokens`` / ``merges`` (``data.tokens``, ``data.merges``)."""
        if not data.tokens:
            raise ValueError("GGUF has no tokenizer.ggml.tokens")
        if data.merges is None:
            raise ValueError("GGUF has no tokenizer.ggml.merges")
        return cls(data.tokens, data.merges, pretokenizer=pretokenizer)

    # -- encoding ---------------------------------------------------------------------------------------------
    def _bpe_piece(self, piece: bytes) -> tuple[int, ...]:
        """BPE one pre-token piece (§1.5), memoised with an LRU cache."""
        ids = self._cache.get(piece)
        if ids is not None:
            self._cache.move_to_end(piece)
            return ids
        word = piece.decode("latin-1").translate(_LATIN1_TO_GPT2)
        ids = tuple(t.id for t in self._bpe.tokenize(word))
        self._cache[piece] = ids
        if len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return ids

    def _pieces(self, data: bytes) -> list[bytes]:
        if self._official is None:
            return ds4_split(data)
        # official pipeline on valid stretches; a run of invalid bytes is its own piece (no official rule exists)
        s = data.decode("utf-8", "surrogateescape")
        out: list[bytes] = []
        for seg in re.split(r"([\udc80-\udcff]+)", s):
            if not seg:
                continue
            if "\udc80" <= seg[0] <= "\udcff":
                out.append(seg.encode("utf-8", "surrogateescape"))
            else:
                out.extend(p.encode("utf-8") for p in official_split(seg))
        return out

    def encode(self, text: str | bytes) -> list[int]:
        """Plain text -> ids (§1.2 ``tokenize_text``): pre-tokenize + BPE, no special recognition, no BOS."""
        data = to_bytes(text)
        ids: list[int] = []
        for piece in self._pieces(data):
            ids.extend(self._bpe_piece(piece))
        return ids

    def encode_chat(self, rendered: str | bytes) -> list[int]:
        """Rendered chat -> ids (§1.2 ``tokenize_rendered_chat``): the 7 specials become their ids wherever they
        occur (left-to-right scan), the text between them is plain-encoded independently."""
        data = to_bytes(rendered)
        specials = [(s.encode("utf-8"), i) for s, i in self.special_ids.items()]
        ids: list[int] = []
        start = pos = 0
        n = len(data)
        while pos < n:
            # every special starts with '<' (0x3C) or U+FF5C (0xEF): skip ahead to the next candidate byte
            lt, bar = data.find(b"<", pos), data.find(b"\xef", pos)
            cands = [c for c in (lt, bar) if c >= 0]
            if not cands:
                break
            pos = min(cands)
            for sb, sid in specials:
                if data.startswith(sb, pos):
                    ids.extend(self.encode(data[start:pos]))
                    ids.append(sid)
                    pos += len(sb)
                    start = pos
                    break
            else:
                pos += 1
        ids.extend(self.encode(data[start:]))
        return ids

    # -- decoding ---------------------------------------------------------------------------------------------
    def token_bytes(self, token_id: int) -> bytes:
        """Bytes of one id (§1.6): strings with U+FF5C literally, others through the inverse GPT-2 map
        (unmapped code points dropped); out-of-range ids -> ``b""``. May be partial UTF-8."""
        if not 0 <= token_id < self.vocab_size:
            return b""
        b = self._id_bytes[token_id]
        if b is None:
            s = self.tokens[token_id]
            if "｜" in s:
                b = s.encode("utf-8")
            else:
                b = s.translate(_GPT2_TO_LATIN1).encode("latin-1")
            self._id_bytes[token_id] = b
        return b

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        """Concatenated bytes of ``ids`` (what ds4 writes out)."""
        return b"".join(self.token_bytes(int(i)) for i in ids)

    def decode(self, ids: Iterable[int], errors: str = "replace") -> str:
        """Text of ``ids``; invalid UTF-8 becomes U+FFFD (``errors`` as in ``bytes.decode``)."""
        return self.decode_bytes(ids).decode("utf-8", errors)

    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh :class:`StreamingDetokenizer` for this tokenizer."""
        return StreamingDetokenizer(self)

    # -- tokenizers.json export -------------------------------------------------------------------------------
    def _build_hf(self, pre: pre_tokenizers.PreTokenizer, *, specials: bool) -> HFTokenizer:
        vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            vocab.setdefault(t, i)
        pairs = [tuple(m.split(" ")) for m in self.merges]
        tok = HFTokenizer(models.BPE(vocab, pairs, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
        )
        tok.decoder = decoders.ByteLevel()
        if specials:
            from tokenizers import AddedToken

            tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIAL_TOKENS])
        return tok

    def to_hf(self, *, specials: bool = True) -> HFTokenizer:
        """A ``tokenizers.Tokenizer`` with this tokenizer's pre-tokenizer (ds4's splitter as one isolated Split of
        :data:`DS4_SPLIT`, or the official three), BPE, ByteLevel decoder and, if ``specials``, the 7 specials
        as added tokens (so its ``encode`` behaves like :meth:`encode_chat` on valid UTF-8)."""
        if self.pretokenizer == "ds4":
            pre = pre_tokenizers.Split(Regex(_DS4_SPLIT_ONIG), behavior="isolated")
        else:
            pre = _official_pre_tokenizer()
        return self._build_hf(pre, specials=specials)

    def to_hf_json(self) -> str:
        """``tokenizer.json`` text reproducing this tokenizer in ``tokenizers`` (valid UTF-8 input only)."""
        return self.to_hf(specials=True).to_str()


class StreamingDetokenizer:
    """Incremental id -> text that never emits a broken UTF-8 sequence (docs/serving.md §9.11).

    An incomplete trailing sequence is held until its continuation bytes arrive; bytes that can never become
    valid UTF-8 are emitted as U+FFFD, so the concatenation of every chunk plus :meth:`finalize` equals
    ``tokenizer.decode(tokens)``. Mirrors mlx-lm's detokenizer API (``add_token``, ``finalize``,
    ``last_segment``, ``text``, ``tokens``) and also returns each new chunk from :meth:`add_token`.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.text = ""
        self._segment = ""
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def add_token(self, token_id: int) -> str:
        """Append one id; returns the newly completed text (possibly ``""``)."""
        self.tokens.append(int(token_id))
        chunk = self._decoder.decode(self.tokenizer.token_bytes(int(token_id)))
        self.text += chunk
        self._segment += chunk
        return chunk

    def finalize(self) -> str:
        """Flush held bytes at the end of generation (an unfinished sequence becomes U+FFFD)."""
        chunk = self._decoder.decode(b"", final=True)
        self.text += chunk
        self._segment += chunk
        return chunk

    @property
    def pending_bytes(self) -> bytes:
        """Bytes held back because they may still become a complete character."""
        return self._decoder.getstate()[0]

    @property
    def last_segment(self) -> str:
        """Text produced since the previous read of ``last_segment``."""
        seg, self._segment = self._segment, ""
        return seg

