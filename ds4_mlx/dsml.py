"""DSML, DeepSeek V4's tool-call markup: canonical rendering (docs/serving.md §2.5), the final parse of generated text
with ds4's repair rules (§6.3), and the small state machines a server needs while generating (§6.2).

The model writes::

    \\n\\n<｜DSML｜tool_calls>
    <｜DSML｜invoke name="NAME">
    <｜DSML｜parameter name="KEY" string="true">raw text</｜DSML｜parameter>
    <｜DSML｜parameter name="KEY2" string="false">JSON</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

``｜DSML｜`` is one special token. The parser also accepts the short form (``<DSML｜invoke``) and plain XML
(``<invoke``). All functions work on ``str``.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "TOOL_CALLS_START",
    "TOOL_CALLS_END",
    "START_MARKERS",
    "END_MARKERS",
    "OPEN_MARKERS",
    "unescape_entities",
    "esc_attr",
    "esc_result",
    "minify_json",
    "json_object_items",
    "render_tool_calls",
    "ParsedCall",
    "ParsedOutput",
    "parse_output",
    "final_finish_reason",
    "partial_marker_len",
    "DecodeState",
    "DSMLTracker",
    "ToolCallDetector",
]

DSML = "｜DSML｜"
TOOL_CALLS_START = "<｜DSML｜tool_calls>"
TOOL_CALLS_END = "</｜DSML｜tool_calls>"
PARAM_END = "</｜DSML｜parameter>"
_TAG_PREFIXES = ("｜DSML｜", "DSML｜", "")  # full, short (first bar missing), plain XML
# §6.3 step 2: block start by precedence, not by position
START_MARKERS = (
    "\n\n<｜DSML｜tool_calls>",
    "<｜DSML｜tool_calls>",
    "\n\n<DSML｜tool_calls>",
    "<DSML｜tool_calls>",
    "\n\n<tool_calls>",
    "<tool_calls>",
)
END_MARKERS = tuple(f"</{p}tool_calls>" for p in _TAG_PREFIXES)
OPEN_MARKERS = tuple(f"<{p}tool_calls>" for p in _TAG_PREFIXES)  # start tags, without the "\n\n"
_OPEN_MARKERS = OPEN_MARKERS  # old private name, still imported by server/sse.py


# -- escaping ---------------------------------------------------------------------------------------------------
def esc_attr(s: str) -> str:
    """Attribute escaping of §2.5: ``& < > "`` become entities."""
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace('"', "&quot;")


def esc_result(s: str) -> str:
    """Tool-result escaping of §2.3: only ``</tool_result>`` is escaped (as ``&lt;/tool_result>``)."""
    return s.replace("</tool_result>", "&lt;/tool_result>")


_ENTITIES = {"&amp;": "&", "&lt;": "<", "&gt;": ">", "&quot;": '"', "&apos;": "'"}
_ENTITY_RE = re.compile("|".join(map(re.escape, _ENTITIES)))


def unescape_entities(s: str) -> str:
    """Decode the five XML entities in one pass; any other ``&`` stays as it is (§6.3 step 4)."""
    return _ENTITY_RE.sub(lambda m: _ENTITIES[m.group(0)], s)


# -- span-preserving JSON helpers (Python's json loses key order of duplicates and number spelling) -----------
_JSON_WS = " \t\n\r"


def _string_end(s: str, i: int) -> int:
    """Index just past the JSON string literal starting at ``s[i] == '"'`` (or ``len(s)`` if unterminated)."""
    i += 1
    while i < len(s):
        c = s[i]
        if c == "\\":
            i += 2
        elif c == '"':
            return i + 1
        else:
            i += 1
    return len(s)


def minify_json(raw: str) -> str:
    """Remove whitespace outside string literals; numbers, escapes and key order are kept byte for byte."""
    out, i, n = [], 0, len(raw)
    while i < n:
        c = raw[i]
        if c == '"':
            j = _string_end(raw, i)
            out.append(raw[i:j])
            i = j
        else:
            if c not in _JSON_WS:
                out.append(c)
            i += 1
    return "".join(out)


def _reject_constant(name: str) -> Any:
    raise ValueError(f"not JSON: {name}")


def _is_json(raw: str) -> Any:
    """The parsed value if ``raw`` is strict JSON (no NaN/Infinity), else ``_INVALID``."""
    try:
        return json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return _INVALID


_INVALID = object()


def _value_end(s: str, i: int) -> int:
    """End of the (valid) JSON value starting at ``s[i]``."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth = 0
        while i < len(s):
            c = s[i]
            if c == '"':
                i = _string_end(s, i)
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return len(s)
    while i < len(s) and s[i] not in ",}]" + _JSON_WS:
        i += 1
    return i


def json_object_items(raw: str) -> list[tuple[str, str]] | None:
    """Top-level ``(key, raw value text)`` pairs of a JSON object in source order (duplicates kept), or ``None``
    if ``raw`` is not a strict JSON object."""
    if not isinstance(_is_json(raw), dict):
        return None
    items, i = [], raw.index("{") + 1
    while True:
        while raw[i] in _JSON_WS + ",":
            i += 1
        if raw[i] == "}":
            return items
        k_end = _string_end(raw, i)
        key = json.loads(raw[i:k_end])
        i = k_end
        while raw[i] in _JSON_WS + ":":
            i += 1
        v_end = _value_end(raw, i)
        items.append((key, raw[i:v_end]))
        i = v_end


# -- canonical rendering (§2.5) -----------------------------------------------------------------------------
def _param(name: str, string: bool, value: str) -> str:
    flag = "true" if string else "false"
    return f'<｜DSML｜parameter name="{esc_attr(name)}" string="{flag}">{value}{PARAM_END}\n'


def _render_invoke(name: str, arguments: str) -> str:
    out = f'<｜DSML｜invoke name="{esc_attr(name)}">\n'
    items = json_object_items(arguments)
    if items is None:  # not a JSON object: one raw string parameter
        out += _param("arguments", True, arguments.replace(PARAM_END, "&lt;/｜DSML｜parameter>"))
    for key, raw in items or ():
        if raw.startswith('"'):
            value = json.loads(raw).replace(PARAM_END, "&lt;/｜DSML｜parameter>")
            out += _param(key, True, value)
        else:
            out += _param(key, False, minify_json(raw).replace(PARAM_END, "\\u003c/｜DSML｜parameter>"))
    return out + "</｜DSML｜invoke>\n"


def render_tool_calls(calls: Iterable[Any]) -> str:
    """Canonical DSML block for an assistant message's calls (objects or dicts with ``name`` and ``arguments``,
    the raw JSON text). Starts with ``"\\n\\n"``, ends with the closing ``tool_calls`` tag."""
    body = ""
    for c in calls:
        name = c["name"] if isinstance(c, dict) else c.name
        args = c["arguments"] if isinstance(c, dict) else c.arguments
        body += _render_invoke(name, args)
    return f"\n\n{TOOL_CALLS_START}\n{body}{TOOL_CALLS_END}"


# -- final parse (§6.3) -------------------------------------------------------------------------------------
@dataclass
class ParsedCall:
    """One parsed invoke. ``arguments`` is the JSON text as ds4 builds it (``{"k": "v", "k2": 10}``)."""

    name: str
    arguments: str

    @property
    def arguments_json(self) -> str:
        """Compact arguments for the API response; ``{}`` if they are not a valid JSON object (§6.3 step 5)."""
        if not isinstance(_is_json(self.arguments), dict):
            return "{}"
        return minify_json(self.arguments)

    def arguments_object(self) -> dict:
        """Arguments as a Python dict (``{}`` when invalid), e.g. for Anthropic ``tool_use.input``."""
        return json.loads(self.arguments_json)


@dataclass
class ParsedOutput:
    """Result of :func:`parse_output`.

    ``start_seen``: a tool block start marker was found (after the last ``</think>`` in thinking mode);
    ``valid``: the block parsed; ``terminated``: its end marker was present. ``raw_dsml`` is the exact block text
    (with its leading ``"\\n\\n"`` when matched) for the replay map (§6.5)."""

    content: str
    reasoning: str | None = None
    calls: list[ParsedCall] = field(default_factory=list)
    raw_dsml: str | None = None
    start_seen: bool = False
    valid: bool = True
    terminated: bool = True


class _ParseError(Exception):
    pass


class _Parser:
    """Cursor over the block text; any grammar failure raises :class:`_ParseError`."""

    def __init__(self, s: str, pos: int) -> None:
        self.s, self.pos = s, pos

    def ws(self) -> None:
        while self.pos < len(self.s) and self.s[self.pos] in " \t\r\n":
            self.pos += 1

    def at_open(self, name: str) -> str | None:
        """Tag prefix style if an opening ``<{prefix}{name}`` tag starts here (followed by space, ``>`` or ``/``)."""
        for p in _TAG_PREFIXES:
            t = f"<{p}{name}"
            if self.s.startswith(t, self.pos):
                nxt = self.s[self.pos + len(t) : self.pos + len(t) + 1]
                if nxt in (" ", ">", "\t", "\n", "/"):
                    return p
        return None

    def at_close(self, name: str) -> str | None:
        for p in _TAG_PREFIXES:
            if self.s.startswith(f"</{p}{name}>", self.pos):
                return f"</{p}{name}>"
        return None

    def open_tag(self, name: str) -> tuple[str, dict[str, str]]:
        """Consume ``<{prefix}{name} attrs>``; returns (prefix, entity-decoded attributes)."""
        prefix = self.at_open(name)
        assert prefix is not None
        start = self.pos + len(f"<{prefix}{name}")
        end = self.s.find(">", start)
        if end < 0:
            raise _ParseError(f"missing '>' after <{name}")
        attrs = {k: unescape_entities(v) for k, v in re.findall(r'([\w-]+)\s*=\s*"([^"]*)"', self.s[start:end])}
        self.pos = end + 1
        return prefix, attrs

    def block(self) -> list[ParsedCall]:
        calls = []
        while True:
            self.ws()
            if self.pos >= len(self.s):
                raise _ParseError("unterminated tool call block")
            end = self.at_close("tool_calls")
            if end:
                self.pos += len(end)
                return calls
            if self.at_open("invoke") is None:
                raise _ParseError("stray text in tool call block")
            calls.append(self.invoke())

    def invoke(self) -> ParsedCall:
        _, attrs = self.open_tag("invoke")
        if "name" not in attrs:
            raise _ParseError("invoke without name")
        return ParsedCall(attrs["name"], self.params("invoke"))

    def params(self, closing: str | None) -> str:
        """Parameters up to ``</…{closing}>`` (or, for nested params with ``closing=None``, up to the first
        non-parameter); returns the built JSON object text."""
        parts = []
        while True:
            self.ws()
            if self.pos >= len(self.s):
                raise _ParseError("unterminated invoke")
            if closing is not None:
                end = self.at_close(closing)
                if end:
                    self.pos += len(end)
                    break
            if self.at_open("parameter") is None:
                if closing is None:
                    break
                raise _ParseError("stray text in invoke")
            key, value = self.param()
            parts.append(f"{json.dumps(key, ensure_ascii=False)}: {value}")
        return "{" + ", ".join(parts) + "}"

    def param(self) -> tuple[str, str]:
        prefix, attrs = self.open_tag("parameter")
        if "name" not in attrs:
            raise _ParseError("parameter without name")
        close = f"</{prefix}parameter>"
        string = attrs.get("string")
        if string is None:
            body_start = self.pos
            self.ws()
            if self.at_open("parameter") is not None:  # loose-XML recovery: nested params form an object
                value = self.params(None)
                self.ws()
                end = self.at_close("parameter")
                if end:
                    self.pos += len(end)
                return attrs["name"], value
            self.pos = body_start
            string = "true"
        end = self.s.find(close, self.pos)
        if end < 0:
            raise _ParseError("unterminated parameter")
        body = self.s[self.pos : end]
        self.pos = end + len(close)
        if string == "true":
            return attrs["name"], json.dumps(unescape_entities(body), ensure_ascii=False)
        raw = minify_json(body)
        return attrs["name"], raw if raw else "null"


def _split_reasoning(text: str) -> tuple[str | None, str]:
    """Thinking-mode split: strip a leading ``<think>``, reasoning up to the first ``</think>``, content after."""
    if text.startswith("<think>"):
        text = text[len("<think>") :]
    cut = text.find("</think>")
    if cut < 0:
        return None, text
    return text[:cut], text[cut + len("</think>") :]


def parse_output(text: str, *, thinking: bool) -> ParsedOutput:
    """Final parse of the full raw generated text (§6.3), run for every chat request.

    * thinking mode with no ``</think>``: everything is content, no reasoning (§4.5 quirk);
    * the tool block is searched after the last ``</think>`` (thinking) by marker precedence;
    * content before the block loses its trailing whitespace;
    * a grammar failure (or a block without its end marker) returns the whole raw text as content, no calls
      (§6.3 step 6, taken literally: no reasoning split either).
    """
    if thinking and "</think>" not in text:
        return ParsedOutput(content=text)
    search_from = text.rfind("</think>") + len("</think>") if thinking else 0
    start = -1
    for marker in START_MARKERS:
        start = text.find(marker, search_from)
        if start >= 0:
            break
    if start < 0:
        reasoning, content = _split_reasoning(text) if thinking else (None, text)
        return ParsedOutput(content=content, reasoning=reasoning)

    body = start + len(marker)
    parser = _Parser(text, body)
    try:
        calls = parser.block()
    except _ParseError:
        terminated = any(text.find(e, body) >= 0 for e in END_MARKERS)
        return ParsedOutput(content=text, start_seen=True, valid=False, terminated=terminated)
    head = text[:start].rstrip(" \t\n\r\x0b\x0c")  # C isspace(), not Unicode whitespace
    reasoning, content = _split_reasoning(head) if thinking else (None, head)
    return ParsedOutput(
        content=content, reasoning=reasoning, calls=calls, raw_dsml=text[start : parser.pos], start_seen=True
    )


def final_finish_reason(parsed: ParsedOutput, finish: str, *, tools_active: bool) -> str:
    """Finish reason after the final parse: parsed calls -> ``tool_calls`` (even without declared tools, §6.3
    step 7); with tools active, a block that never closed -> ``error`` (§3, §9.8), a malformed one -> ``stop``
    (``length`` kept); otherwise ``finish`` unchanged."""
    if parsed.calls:
        return "tool_calls"
    if tools_active and parsed.start_seen:
        if not parsed.terminated:
            return "error"
        return "length" if finish == "length" else "stop"
    return finish


# -- during generation (§6.2) ---------------------------------------------------------------------------------
def partial_marker_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of one of ``markers`` (text a streaming
    server must hold back because it may still become a marker)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


class DecodeState(enum.Enum):
    OUTSIDE = "outside"
    STRUCTURAL = "structural"
    STRING_BODY = "string_body"
    JSON_STRUCTURAL = "json_structural"
    JSON_STRING = "json_string"
    DONE = "done"


_PARAM_CLOSES = tuple(f"</{p}parameter>" for p in _TAG_PREFIXES)
_PARAM_OPEN_RE = re.compile(r"<(?:｜DSML｜|DSML｜)?parameter[\s>/]")


class DSMLTracker:
    """Decoding-state tracker that drives greedy sampling inside DSML structure (§6.2).

    Feed generated text with :meth:`feed`; :attr:`greedy` says whether the next token must be sampled with
    temperature 0. Payload (``string="true"`` bodies, JSON string literals of ``string="false"`` values) uses the
    normal settings. Quirk kept: not gated by ``<think>``; once DONE it does not restart.
    """

    def __init__(self) -> None:
        self.state = DecodeState.OUTSIDE
        self._tail = ""  # recent text: marker detection in OUTSIDE, the current tag in STRUCTURAL, bodies
        self._in_tag = False
        self._escape = False

    def feed(self, text: str) -> DecodeState:
        for ch in text:
            self._step(ch)
        return self.state

    def _step(self, ch: str) -> None:
        st = self.state
        if st is DecodeState.DONE:
            return
        if st is DecodeState.OUTSIDE:
            self._tail = (self._tail + ch)[-32:]
            if any(self._tail.endswith(m) for m in _OPEN_MARKERS):
                self.state, self._tail, self._in_tag = DecodeState.STRUCTURAL, "", False
            return
        if st is DecodeState.STRUCTURAL:
            if ch == "<":
                self._in_tag, self._tail = True, "<"
            elif self._in_tag:
                self._tail += ch
                if ch == ">":
                    self._in_tag = False
                    tag = self._tail
                    if any(tag == e for e in END_MARKERS):
                        self.state = DecodeState.DONE
                    elif _PARAM_OPEN_RE.match(tag):
                        m = re.search(r'string\s*=\s*"([^"]*)"', tag)
                        if m is None or m.group(1) == "true":
                            self.state = DecodeState.STRING_BODY
                        else:
                            self.state, self._escape = DecodeState.JSON_STRUCTURAL, False
                    self._tail = ""
            return
        if st is DecodeState.STRING_BODY:
            self._tail = (self._tail + ch)[-32:]
            if any(self._tail.endswith(c) for c in _PARAM_CLOSES):
                self.state, self._tail = DecodeState.STRUCTURAL, ""
            return
        if st is DecodeState.JSON_STRING:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self.state = DecodeState.JSON_STRUCTURAL
            return
        # JSON_STRUCTURAL
        if ch == '"':
            self.state, self._tail = DecodeState.JSON_STRING, ""
            return
        self._tail = (self._tail + ch)[-32:]
        if any(self._tail.endswith(c) for c in _PARAM_CLOSES):
            self.state, self._tail = DecodeState.STRUCTURAL, ""

    @property
    def greedy(self) -> bool:
        """True when the next token is DSML structure (sample with temperature 0)."""
        st = self.state
        if st in (DecodeState.STRUCTURAL, DecodeState.JSON_STRUCTURAL):
            return True
        if st is DecodeState.STRING_BODY:  # >= 2 bytes of a partial closing tag pending -> structure
            k = partial_marker_len(self._tail, _PARAM_CLOSES)
            return len(self._tail[len(self._tail) - k :].encode()) >= 2 if k else False
        return False


class ToolCallDetector:
    """Think-aware tool-block detection during generation (§6.2): markers inside ``<think>`` are ignored; the
    first start marker outside it enters tool mode, the matching end marker ends generation (``done``).

    ``in_think`` starts from the prompt tail (True when the prompt ends with ``<think>``)."""

    def __init__(self, *, in_think: bool = False) -> None:
        self.in_think = in_think
        self.tool_mode = False
        self.done = False
        self.stray_end = False  # an end marker with no start was seen (ds4 logs and ignores it)
        self._tail = ""

    def feed(self, text: str) -> None:
        for ch in text:
            if self.done:
                return
            self._tail = (self._tail + ch)[-32:]
            t = self._tail
            if t.endswith("<think>"):
                self.in_think = True
            elif t.endswith("</think>"):
                self.in_think = False
            elif self.in_think:
                continue
            elif any(t.endswith(m) for m in _OPEN_MARKERS):
                self.tool_mode = True
            elif any(t.endswith(m) for m in END_MARKERS):
                if self.tool_mode:
                    self.done = True
                else:
                    self.stray_end = True
