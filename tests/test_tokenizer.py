"""Tokenizer tests (docs/serving.md §1) on a small real byte-level BPE vocabulary trained here with `tokenizers`.

References are independent of the code under test: a hand-written port of §1.3's nine prose rules (not the
regex), a naive leftmost-lowest-rank BPE (§1.5), the GPT-2 byte map rebuilt from its prose definition, and the
official pipeline assembled here from §1.4's text.
"""

from __future__ import annotations

import json
import random
import unicodedata
from dataclasses import dataclass

import pytest
from tokenizers import Regex, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers, trainers

from ds4_mlx.tokenizer import (
    SPECIAL_TOKENS,
    DS4_SPLIT,
    StreamingDetokenizer,
    Tokenizer,
    ds4_split,
    official_split,
)

# -- a real vocabulary ----------------------------------------------------------------------------------------
EXTRA_CONTROL = "<｜tool▁calls▁begin｜>"  # a control string of the real vocab that must never be produced
WORDS = [
    "hello", "world", "the", "token", "Python", "编程", "日本語", "ひらがな", "カタカナ", "😀", "👍🏽", "naïve", "über",
    "def", "return", "    ", "\n\n", "int", "x²", "“quote”", "e\u0301", "Ωμέγα", "Привет", "if (x) {", "};\n",
    "123456", "3.14", "_bar", ".foo", "\t", "\r\n", "a\u00a0b", "tool_result", "DSML", "<｜", "｜>", "&lt;",
]


def _corpus(rng: random.Random) -> list[str]:
    return ["".join(rng.choice(WORDS) + rng.choice(["", " ", "  "]) for _ in range(30)) for _ in range(400)]


@dataclass
class _GGUFTokenizerData:
    tokens: list[str]
    merges: list[str]
    token_types: list[int] | None = None


@pytest.fixture(scope="module")
def data() -> _GGUFTokenizerData:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(
        vocab_size=900,
        special_tokens=list(SPECIAL_TOKENS) + [EXTRA_CONTROL],  # BOS id 0, EOS id 1
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    hf.train_from_iterator(_corpus(random.Random(1)), trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    assert tokens[0] == SPECIAL_TOKENS[0] and tokens[1] == SPECIAL_TOKENS[1]
    assert len(merges) > 300  # the vocabulary really merges things
    return _GGUFTokenizerData(tokens, merges)


@pytest.fixture(scope="module")
def tok(data) -> Tokenizer:
    return Tokenizer.from_gguf(data)


# -- independent references -----------------------------------------------------------------------------------
def ref_byte_map() -> dict[int, str]:
    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    rest = [b for b in range(256) if b not in printable]
    assert len(rest) == 68
    m = {b: chr(b) for b in printable}
    m.update({b: chr(0x100 + n) for n, b in enumerate(rest)})
    return m


def ref_bpe(piece: bytes, ranks: dict[tuple[str, str], int], vocab: dict[str, int]) -> list[int]:
    bm = ref_byte_map()
    syms = [bm[b] for b in piece]
    while len(syms) > 1:
        best, best_i = None, -1
        for i in range(len(syms) - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None and (best is None or r < best):
                best, best_i = r, i
        if best is None:
            break
        syms[best_i : best_i + 2] = [syms[best_i] + syms[best_i + 1]]
    return [vocab[s] for s in syms]


def _is_cjk(c: str) -> bool:
    return "\u3040" <= c <= "\u30ff" or "\u4e00" <= c <= "\u9fa5"


def _is_letter(c: str) -> bool:
    return ("A" <= c <= "Z") or ("a" <= c <= "z") or ord(c) >= 0x80


def _is_ascii_letter(c: str) -> bool:
    return ("A" <= c <= "Z") or ("a" <= c <= "z")


def _is_punct(c: str) -> bool:
    o = ord(c)
    return 0x21 <= o <= 0x2F or 0x3A <= o <= 0x40 or 0x5B <= o <= 0x60 or 0x7B <= o <= 0x7E


def _is_space(c: str) -> bool:
    return c in " \t\n\r\x0b\x0c"


def ref_ds4_split(s: str) -> list[str]:
    """§1.3's nine rules, transcribed from the prose."""
    out, p, n = [], 0, len(s)

    def run(q: int, pred) -> int:
        while q < n and pred(s[q]):
            q += 1
        return q

    while p < n:
        c = s[p]
        if c.isascii() and c.isdigit():  # 1
            q = p
            while q < n and q - p < 3 and s[q].isascii() and s[q].isdigit():
                q += 1
        elif _is_cjk(c):  # 2
            q = run(p, _is_cjk)
        elif _is_punct(c) and p + 1 < n and _is_ascii_letter(s[p + 1]):  # 3
            q = run(p + 1, _is_ascii_letter)
        elif _is_letter(c):  # 4
            q = run(p, _is_letter)
        elif c not in "\n\r" and not _is_punct(c) and p + 1 < n and _is_letter(s[p + 1]):  # 5
            q = run(p + 1, _is_letter)
        elif c == " " and p + 1 < n and _is_punct(s[p + 1]):  # 6
            q = run(run(p + 1, _is_punct), lambda x: x in "\r\n")
        elif _is_punct(c):  # 7
            q = run(run(p, _is_punct), lambda x: x in "\r\n")
        elif _is_space(c):  # 8
            end = run(p, _is_space)
            nl = [i for i in range(p, end) if s[i] in "\r\n"]
            if nl:
                q = nl[-1] + 1
            elif end - p >= 2 and end < n and (_is_letter(s[end]) or _is_punct(s[end])):
                q = end - 1
            else:
                q = end
        else:  # 9
            q = p + 1
        out.append(s[p:q])
        p = q
    return out


def official_hf_pre() -> pre_tokenizers.PreTokenizer:
    """§1.4's official pre-tokenizer, assembled from the spec text."""
    regexes = [
        r"\p{N}{1,3}",
        r"[一-龥぀-ゟ゠-ヿ]+",
        r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ]
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes])


# -- random text ----------------------------------------------------------------------------------------------
ALPHABETS = {
    "ascii": [chr(c) for c in range(0x20, 0x7F)] + list("\t\n\r\x0b\x0c"),
    "control": [chr(c) for c in range(0, 0x20)] + ["\x7f", " ", "a", "Z", ".", "\n"],
    "latin": list("aeiouAEIOU ,.éèüñçÅØßœ'\n"),
    "cjk": ["\u3040", "\u30ff", "\u4e00", "\u9fa5", "\u9fa6", "日", "本", "語", "ひ", "カ", "、", "。", "゠", "ー"],
    "mixed": list("ab Z09.,;_<>\n\t ") + ["日本", "😀", "👍🏽", "e\u0301", "\u00a0", "\u0085", "\u2028", "²", "Ａ", "“", "”"],
}


def rand_text(rng: random.Random, alphabet: str, n: int | None = None) -> str:
    chars = ALPHABETS[alphabet]
    return "".join(rng.choice(chars) for _ in range(n if n is not None else rng.randint(0, 40)))


def rand_unicode(rng: random.Random) -> str:
    pools = [
        lambda: chr(rng.randint(0x20, 0x7E)),
        lambda: chr(rng.randint(0x00, 0x1F)),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),  # emoji
        lambda: chr(rng.randint(0x0300, 0x036F)),  # combining marks
        lambda: chr(rng.randint(0x80, 0x7FF)),
        lambda: chr(rng.choice([rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0xFFFF)])),
        lambda: chr(rng.randint(0x10000, 0x10FFFF)),
        lambda: rng.choice(["\u200d", "\ufe0f", "\U0001f1fa\U0001f1f8", " ", "  ", "\n", "\r\n", "1234"]),
    ]
    return "".join(rng.choice(pools)() for _ in range(rng.randint(0, 60)))


# -- splitter -------------------------------------------------------------------------------------------------
SPEC_EXAMPLES = [
    (">;\n", [">;\n"]),
    ("    int", ["   ", " int"]),
    (".foo_bar", [".foo", "_bar"]),
    (" 日本", [" 日本"]),
    ("  日本", [" ", " 日本"]),
    ("Python编程", ["Python编程"]),
    ("\x01\x02", ["\x01", "\x02"]),
    ("  \x01", ["  ", "\x01"]),
    ("\x01abc", ["\x01abc"]),
    ("12345", ["123", "45"]),
    ("a\n\n  b", ["a", "\n\n", " ", " b"]),
    (" word", [" word"]),
    ("x = (y);\r\n", ["x", " =", " (", "y", ");\r\n"]),
    ("日本語abc", ["日本語", "abc"]),
]


@pytest.mark.parametrize("text,pieces", SPEC_EXAMPLES)
def test_ds4_split_spec_examples(text, pieces):
    assert ref_ds4_split(text) == pieces  # the prose reference agrees with the examples
    assert [p.decode() for p in ds4_split(text)] == pieces


@pytest.mark.parametrize("alphabet", sorted(ALPHABETS))
def test_ds4_split_matches_prose_rules(alphabet):
    rng = random.Random(hash(alphabet) & 0xFFFF)
    for _ in range(1500):
        s = rand_text(rng, alphabet)
        assert DS4_SPLIT.findall(s) == ref_ds4_split(s), repr(s)
        assert b"".join(ds4_split(s)) == s.encode()


@pytest.mark.parametrize("alphabet", ["ascii", "latin", "cjk"])
def test_ds4_split_equals_official_where_spec_says(alphabet):
    rng = random.Random(7)
    pre = official_hf_pre()
    for _ in range(1000):
        s = rand_text(rng, alphabet)
        if alphabet == "cjk":  # "pure CJK text": CJK *letters* (U+3040 is unassigned and U+30A0/U+30FB are
            # punctuation; the official third Split cuts those out, ds4 does not)
            s = "".join(c for c in s if _is_cjk(c) and unicodedata.category(c).startswith("L"))
        assert DS4_SPLIT.findall(s) == [p for p, _ in pre.pre_tokenize_str(s)], repr(s)


@pytest.mark.parametrize(
    "text,ds4,official",
    [
        ("\x01\x02", ["\x01", "\x02"], ["\x01\x02"]),
        ("  \x01", ["  ", "\x01"], [" ", " ", "\x01"]),
        (" 日本", [" 日本"], [" ", "日本"]),
        ("  日本", [" ", " 日本"], ["  ", "日本"]),
        ("Python编程", ["Python编程"], ["Python", "编程"]),
        ("\x01abc", ["\x01abc"], ["\x01abc"]),  # agree
    ],
)
def test_ds4_vs_official_differences(text, ds4, official):
    assert DS4_SPLIT.findall(text) == ds4
    assert official_split(text) == official
    assert [p for p, _ in official_hf_pre().pre_tokenize_str(text)] == official


# -- encoding -------------------------------------------------------------------------------------------------
def test_special_ids_and_vocab(tok, data):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    for attr, s in zip(
        ["bos_id", "eos_id", "user_id", "assistant_id", "think_id", "think_end_id", "dsml_id"], SPECIAL_TOKENS
    ):
        assert data.tokens[getattr(tok, attr)] == s
    assert tok.vocab_size == len(data.tokens)


def test_missing_special_is_a_clear_error(data):
    broken = _GGUFTokenizerData([t if t != "</think>" else "</thonk>" for t in data.tokens], data.merges)
    with pytest.raises(ValueError, match="</think>"):
        Tokenizer.from_gguf(broken)


def test_encode_matches_reference_bpe(tok, data):
    vocab = {t: i for i, t in enumerate(data.tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(data.merges)}
    rng = random.Random(3)
    texts = ["".join(rng.choice(WORDS) for _ in range(8)) for _ in range(200)] + [rand_unicode(rng) for _ in range(200)]
    for s in texts:
        want = [i for piece in ref_ds4_split(s) for i in ref_bpe(piece.encode(), ranks, vocab)]
        assert tok.encode(s) == want, repr(s)
    # merges really happen (a test vocabulary with no merges would make this check vacuous)
    assert len(tok.encode("hello world")) < len("hello world")


def test_roundtrip_random_unicode(tok):
    rng = random.Random(11)
    for _ in range(800):
        s = rand_unicode(rng)
        ids = tok.encode(s)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == s
        assert tok.decode_bytes(ids) == s.encode()
        assert tok.encode(s.encode()) == ids  # bytes and str input agree


def test_roundtrip_invalid_bytes(tok):
    rng = random.Random(12)
    for _ in range(500):
        b = bytes(rng.randrange(256) for _ in range(rng.randint(0, 40)))
        ids = tok.encode(b)
        assert tok.decode_bytes(ids) == b
        assert tok.decode(ids) == b.decode("utf-8", "replace")
    # CESU lone surrogates (JSON "\ud800", §1.7) and surrogate-escaped bytes in str input
    assert tok.decode_bytes(tok.encode("a\ud800b")) == b"a\xed\xa0\x80b"
    assert tok.decode_bytes(tok.encode(b"\xff\xfe".decode("utf-8", "surrogateescape"))) == b"\xff\xfe"


def test_specials_only_in_encode_chat(tok):
    for s, sid in zip(SPECIAL_TOKENS, [tok.bos_id, tok.eos_id, tok.user_id, tok.assistant_id, tok.think_id,
                                        tok.think_end_id, tok.dsml_id]):
        plain = tok.encode(s)
        assert sid not in plain and len(plain) > 1
        assert tok.decode(plain) == s
        assert tok.encode_chat(s) == [sid]
    control_id = tok.tokens.index(EXTRA_CONTROL)
    assert control_id not in tok.encode_chat(EXTRA_CONTROL + "x" + EXTRA_CONTROL)
    assert tok.decode(tok.encode_chat(EXTRA_CONTROL)) == EXTRA_CONTROL


def test_encode_chat_segments_independently(tok):
    rng = random.Random(5)
    for _ in range(300):
        text = ""
        for _ in range(rng.randint(1, 5)):
            text += rng.choice(["", "hello", " world ", "日本", "<", "｜", "<think", "DSML｜", rand_unicode(rng)])
            if rng.random() < 0.7:
                text += SPECIAL_TOKENS[rng.randrange(7)]
        assert tok.encode_chat(text) == _ref_chat(tok, text)
        assert tok.decode(tok.encode_chat(text)) == text


def _ref_chat(tok: Tokenizer, text: str) -> list[int]:
    out, buf, p = [], "", 0
    while p < len(text):
        for s in SPECIAL_TOKENS:
            if text.startswith(s, p):
                out += tok.encode(buf) + [tok.special_ids[s]]
                buf, p = "", p + len(s)
                break
        else:
            buf += text[p]
            p += 1
    return out + tok.encode(buf)


def test_decode_rules(tok):
    assert tok.decode([tok.user_id, tok.think_id, tok.dsml_id]) == "<｜User｜><think>｜DSML｜"
    assert tok.decode_bytes([-1, tok.vocab_size, 10**9]) == b""
    space = tok.encode(" ")
    assert len(space) == 1 and tok.tokens[space[0]] == "Ġ" and tok.decode(space) == " "


# -- streaming detokenizer ------------------------------------------------------------------------------------
def test_streaming_detokenizer_never_breaks_utf8(tok):
    rng = random.Random(21)
    # ids of single bytes of multi-byte characters, so sequences split characters across tokens
    byte_ids = [i for i in range(tok.vocab_size) if len(tok.token_bytes(i)) == 1]
    for trial in range(300):
        if trial % 2:
            ids = tok.encode(rand_unicode(rng))
            ids = [j for i in ids for j in (tok.encode(tok.decode_bytes([i])) if rng.random() < 0.5 else [i])]
        else:
            ids = [rng.choice(byte_ids) for _ in range(rng.randint(0, 30))]
        total = tok.decode_bytes(ids)
        det = StreamingDetokenizer(tok)
        chunks = [det.add_token(i) for i in ids]
        chunks.append(det.finalize())
        assert "".join(chunks) == tok.decode(ids) == det.text
        valid = True
        try:
            total.decode("utf-8")
        except UnicodeDecodeError:
            valid = False
        if valid:
            assert all("\ufffd" not in c for c in chunks)
            emitted = b""
            for c in chunks:
                emitted += c.encode()
                assert total.startswith(emitted)


def test_streaming_holds_partial_character(tok):
    b = "日".encode()
    ids = [tok.encode(bytes([x]))[0] for x in b]
    det = tok.detokenizer()
    assert det.add_token(ids[0]) == "" and det.add_token(ids[1]) == ""
    assert det.pending_bytes == b[:2]
    assert det.add_token(ids[2]) == "日"
    assert det.last_segment == "日" and det.last_segment == ""


# -- official pipeline and tokenizer.json ---------------------------------------------------------------------
def test_official_pretokenizer_option(data):
    off = Tokenizer.from_gguf(data, pretokenizer="official")
    ref = HFTokenizer(models.BPE({t: i for i, t in enumerate(data.tokens)},
                                 [tuple(m.split(" ")) for m in data.merges]))
    ref.pre_tokenizer = pre_tokenizers.Sequence(
        [official_hf_pre(), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    ref.decoder = decoders.ByteLevel()
    rng = random.Random(31)
    for _ in range(300):
        s = rand_unicode(rng)
        assert off.encode(s) == ref.encode(s).ids, repr(s)
        assert off.decode(off.encode(s)) == s
    assert off.encode_chat("a<｜User｜>b")[1] == off.user_id
    with pytest.raises(ValueError):
        Tokenizer.from_gguf(data, pretokenizer="llama")


@pytest.mark.parametrize("mode", ["ds4", "official"])
def test_hf_json_reproduces_tokenizer(data, mode):
    tok = Tokenizer.from_gguf(data, pretokenizer=mode)
    hf = HFTokenizer.from_str(tok.to_hf_json())
    rng = random.Random(41)
    for _ in range(400):
        s = rand_unicode(rng) + rng.choice(["", "<｜User｜>", "</think>", "｜DSML｜"]) + rand_text(rng, "mixed")
        ids = hf.encode(s).ids
        assert ids == tok.encode_chat(s), repr(s)
        assert hf.decode(ids, skip_special_tokens=False) == tok.decode(ids)


def test_project_tiny_vocabulary():
    """The tiny GGUFs' vocabulary (``ds4_mlx.testing.tiny_tokenizer``) loads and round-trips."""
    testing = pytest.importorskip("ds4_mlx.testing")
    data = testing.tiny_tokenizer(512)
    tok = Tokenizer.from_gguf(data)
    assert tok.vocab_size == 512 and (tok.bos_id, tok.eos_id) == (0, 1)
    vocab = {t: i for i, t in enumerate(data.tokens)}
    ranks = {tuple(m.split(" ")): r for r, m in enumerate(data.merges)}
    rng = random.Random(51)
    for _ in range(200):
        s = rand_unicode(rng) + " the model " + rand_text(rng, "mixed")
        ids = tok.encode(s)
        assert tok.decode(ids) == s
        assert ids == [i for p in ref_ds4_split(s) for i in ref_bpe(p.encode(), ranks, vocab)]
    chat = "<｜begin▁of▁sentence｜><｜User｜>Hello<｜Assistant｜><think>"
    assert tok.encode_chat(chat)[:2] == [tok.bos_id, tok.user_id]
