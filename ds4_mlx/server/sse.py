"""Server-sent events and the streaming split of generated text (docs/serving.md §4.6).

:class:`DeltaSplitter` turns the raw generated text, fed as it arrives, into API-neutral events — reasoning
deltas, visible text deltas, live tool-call starts and argument fragments — holding back whatever may still
turn into a marker (``</think>``, a DSML start tag, a partial closing tag or entity). Each API module maps
these events to its own wire format.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..dsml import _OPEN_MARKERS, END_MARKERS, partial_marker_len, unescape_entities

THINK, THINK_END = "<think>", "</think>"
_TAG_PREFIXES = ("｜DSML｜", "DSML｜", "")
_ENTITY_NAMES = ("&amp;", "&lt;", "&gt;", "&quot;", "&apos;")


def sse(data: Any, event: str | None = None) -> bytes:
    """One SSE frame: optional ``event:`` line, then ``data: <compact json>``."""
    body = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, separators=(",", ":"))
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {body}\n\n".encode()


def comment(text: str) -> bytes:
    return f": {text}\n\n".encode()


# -- events ------------------------------------------------------------------------------------------------------
@dataclass
class Reasoning:
    text: str


@dataclass
class Text:
    text: str


@dataclass
class ToolStart:
    index: int
    name: str


@dataclass
class ToolArgs:
    index: int
    fragment: str


@dataclass
class ToolEnd:
    index: int


def _json_body(s: str) -> str:
    """JSON string escaping without the surrounding quotes (per character, so fragments concatenate)."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


def _held_entity(s: str) -> int:
    """Length of a trailing partial entity (``&am``) that must wait for more text."""
    i = s.rfind("&", max(0, len(s) - 6))
    if i < 0:
        return 0
    tail = s[i:]
    return len(tail) if any(e.startswith(tail) and e != tail for e in _ENTITY_NAMES) else 0


def live_tool_calls(block: str) -> list[tuple[str, str, bool]]:
    """The calls visible so far in a (possibly unfinished) tool block: ``(name, args_prefix, closed)``.

    ``args_prefix`` is the compact JSON built as §4.6 says (``{"k":"v","n":10}``); it only ever grows as
    more text arrives, so successive calls give append-only fragments. Scanning stops at the first thing
    that is incomplete or not DSML (the final parse decides about malformed blocks)."""
    out: list[tuple[str, str, bool]] = []
    m = re.match(r"\s*<(?:｜DSML｜|DSML｜)?tool_calls>", block)
    if not m:
        return out
    pos = m.end()
    ws = re.compile(r"[ \t\r\n]*")
    while True:
        pos = ws.match(block, pos).end()
        im = re.match(r"<(｜DSML｜|DSML｜|)invoke[\s>]", block[pos:])
        if not im:
            return out
        gt = block.find(">", pos)
        if gt < 0:
            return out
        attrs = dict(re.findall(r'([\w-]+)\s*=\s*"([^"]*)"', block[pos:gt]))
        if "name" not in attrs:
            return out
        name, args, first = unescape_entities(attrs["name"]), "{", True
        pos = gt + 1
        while True:
            pos = ws.match(block, pos).end()
            rest = block[pos:]
            close = next((c for c in (f"</{p}invoke>" for p in _TAG_PREFIXES) if rest.startswith(c)), None)
            if close:
                out.append((name, args + "}", True))
                pos += len(close)
                break
            pm = re.match(r"<(｜DSML｜|DSML｜|)parameter[\s>]", rest)
            gt = block.find(">", pos)
            if not pm or gt < 0:
                out.append((name, args, False))
                return out
            pattrs = dict(re.findall(r'([\w-]+)\s*=\s*"([^"]*)"', block[pos:gt]))
            if "name" not in pattrs:
                out.append((name, args, False))
                return out
            is_string = pattrs.get("string", "true") != "false"
            args += ("" if first else ",") + json.dumps(unescape_entities(pattrs["name"]), ensure_ascii=False) + ":"
            args += '"' if is_string else ""
            first = False
            end_tag = f"</{pm.group(1)}parameter>"
            body_start = gt + 1
            end = block.find(end_tag, body_start)
            if end < 0:
                body = block[body_start:]
                body = body[: len(body) - partial_marker_len(body, [end_tag])]
                if is_string:
                    body = body[: len(body) - _held_entity(body)]
                    args += _json_body(unescape_entities(body))
                else:
                    args += body
                out.append((name, args, False))
                return out
            body = block[body_start:end]
            args += _json_body(unescape_entities(body)) + '"' if is_string else body
            pos = end + len(end_tag)


class DeltaSplitter:
    """Raw generated text -> reasoning / text / tool-call events, as a stream (§4.6 hold rules).

    ``thinking``: the prompt ended with ``<think>`` (text starts as reasoning). ``tools``: tools are active, so
    DSML blocks are recognised live and the text before them is held back as §4.6 asks."""

    def __init__(self, *, thinking: bool, tools: bool) -> None:
        self.phase = "reasoning" if thinking else "content"
        self.tools = tools
        self.buf = ""
        self.block = ""
        self.at_start = True
        self.think_closed = not thinking
        self.calls: list[list] = []  # [name, args_sent, closed]

    def feed(self, text: str) -> list:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list:
        """Flush what is held (end of generation)."""
        return self._drain(final=True)

    @property
    def in_tools(self) -> bool:
        return self.phase == "tools"

    def _drain(self, final: bool) -> list:
        ev: list = []
        if self.phase == "reasoning":
            if self.at_start:
                if THINK.startswith(self.buf) and not final:
                    return ev
                if self.buf.startswith(THINK):  # the model repeated the prompt's <think>
                    self.buf = self.buf[len(THINK):]
                self.at_start = False
            cut = self.buf.find(THINK_END)
            if cut >= 0:
                if cut:
                    ev.append(Reasoning(self.buf[:cut]))
                self.buf = self.buf[cut + len(THINK_END):]
                self.phase, self.think_closed = "content", True
            else:
                keep = 0 if final else partial_marker_len(self.buf, [THINK_END])
                if len(self.buf) > keep:
                    ev.append(Reasoning(self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep:]
                return ev
        if self.phase == "content":
            if self.tools:
                starts = [(i, m) for m in _OPEN_MARKERS if (i := self.buf.find(m)) >= 0]
                if starts:
                    i, _ = min(starts)
                    head = self.buf[:i].rstrip()
                    if head:
                        ev.append(Text(head))
                    self.block, self.buf, self.phase = self.buf[i:], "", "tools"
                elif final:
                    if self.buf:
                        ev.append(Text(self.buf))
                    self.buf = ""
                    return ev
                else:
                    # hold trailing whitespace and everything from the last '<' in the final 80 chars
                    safe = len(self.buf.rstrip())
                    lt = self.buf.rfind("<", max(0, len(self.buf) - 80))
                    if lt >= 0:  # whitespace right before a possible DSML tag is syntax, never content
                        safe = min(safe, len(self.buf[:lt].rstrip()))
                    if safe:
                        ev.append(Text(self.buf[:safe]))
                        self.buf = self.buf[safe:]
                    return ev
            else:
                if self.buf:
                    ev.append(Text(self.buf))
                self.buf = ""
                return ev
        # tools phase
        self.block += self.buf
        self.buf = ""
        for i, (name, args, closed) in enumerate(live_tool_calls(self.block)):
            if i >= len(self.calls):
                self.calls.append([name, "", False])
                ev.append(ToolStart(i, name))
            sent = self.calls[i][1]
            if len(args) > len(sent) and args.startswith(sent):
                ev.append(ToolArgs(i, args[len(sent):]))
                self.calls[i][1] = args
            if closed and not self.calls[i][2]:
                self.calls[i][2] = True
                ev.append(ToolEnd(i))
        return ev


def is_block_end(text: str) -> bool:
    return any(e in text for e in END_MARKERS)


class Streamer:
    """Base of the per-API stream formatters: feeds the splitter, reconciles the final parse (§4.6 item 4, the
    'flush the suppressed raw tail' rule) and leaves the wire format to :meth:`emit` / :meth:`end`."""

    id_prefix = "call_"

    def __init__(self, req, *, memory=None) -> None:
        self.req = req
        self.memory = memory
        self.splitter = DeltaSplitter(thinking=req.mode.thinking, tools=req.tools_active)
        self.tool_ids: list[str] = []
        self.usage = None  # the worker's "start" info
        self.outcome = None  # the final parse, once done

    def open(self) -> bytes:
        """The first event, sent as soon as the stream opens (before the job leaves the queue)."""
        return self.keepalive()

    def start(self, info: dict) -> bytes:
        """The worker took the job (``info``: prompt and cached token counts); prefill starts now."""
        self.usage = info
        return b""

    def text(self, t: str) -> bytes:
        return self.emit(self.splitter.feed(t))

    def tool_id(self, index: int) -> str:
        from .common import new_id

        while len(self.tool_ids) <= index:
            self.tool_ids.append(new_id(self.id_prefix))
        return self.tool_ids[index]

    def done(self, result) -> bytes:
        from .common import outcome

        out = self.emit(self.splitter.finish())
        streamed = len(self.splitter.calls)
        oc = outcome(self.req, result, id_prefix=self.id_prefix, streamed_ids=self.tool_ids[:streamed],
                     memory=self.memory)
        self.outcome = oc
        ev: list = []
        if not oc.calls and self.splitter.in_tools and self.splitter.block:
            ev.append(Text(self.splitter.block))  # malformed DSML: the held raw text becomes content
        for i, c in enumerate(oc.calls):
            if i >= streamed:
                del self.tool_ids[i:]
                self.tool_ids.append(c.id)
                ev += [ToolStart(i, c.name), ToolArgs(i, c.arguments), ToolEnd(i)]
            else:
                name, sent, closed = self.splitter.calls[i]
                if len(c.arguments) > len(sent) and c.arguments.startswith(sent):
                    ev.append(ToolArgs(i, c.arguments[len(sent):]))
                if not closed:
                    ev.append(ToolEnd(i))
        out += self.emit(ev)
        return out + self.end(oc)

    # -- per API -------------------------------------------------------------------------------------------------
    def keepalive(self) -> bytes:
        """An event that carries nothing but that the API's clients count as activity (SSE comments are not:
        Codex drops a Responses stream after 300 s without an event)."""
        raise NotImplementedError

    def emit(self, events: list) -> bytes:
        raise NotImplementedError

    def end(self, oc) -> bytes:
        raise NotImplementedError

    def error(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error"}}, event="error")
