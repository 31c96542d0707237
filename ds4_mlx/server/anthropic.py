"""Anthropic ``/v1/messages`` (and ``/v1/messages/count_tokens``): request parsing (docs/serving.md §4.3-4.4),
the message object (§4.5) and the event stream ``message_start`` … ``message_stop`` (§4.6)."""

from __future__ import annotations

from typing import Any

from ..chat import Message, ToolCall
from ..dsml import esc_result
from .common import (APIError, ChatRequest, Outcome, check_model, compact, expect, field_of, invalid, max_tokens_of,
                     resolve_thinking, sampling_of, stop_of, text_of)
from .sse import Reasoning, Streamer, Text, ToolArgs, ToolEnd, ToolStart, sse

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def _system(raw: Any) -> str | None:
    if expect(raw, (str, list, type(None)), "system") is None:
        return None
    out = ""
    for i, p in enumerate([raw] if isinstance(raw, str) else raw):
        at = f"system[{i}]"
        text = p if isinstance(expect(p, (str, dict), at), str) else expect(p.get("text"), str, at + ".text")
        if text.startswith("x-anthropic-"):  # billing headers some clients put in the system blocks
            continue
        if out and not out.endswith("\n"):
            out += "\n"
        out += text
    return out


def _string(b: dict, key: str, at: str) -> str:
    return expect(b.get(key), (str, type(None)), f"{at}.{key}") or ""


def _message(m: Any, at: str) -> Message:
    expect(m, dict, at)
    msg = Message(role=expect(m.get("role"), (str, type(None)), at + ".role") or "user")
    content = expect(m.get("content"), (str, list, type(None)), at + ".content")
    if not isinstance(content, list):
        msg.content = content or ""
        return msg
    for i, b in enumerate(content):
        bat = f"{at}.content[{i}]"
        if isinstance(expect(b, (str, dict), bat), str):
            msg.content += b
            continue
        t = b.get("type")
        if t == "text":
            msg.content += _string(b, "text", bat)
        elif t == "thinking":
            msg.reasoning = (msg.reasoning or "") + _string(b, "thinking", bat)
        elif t == "tool_use":
            inp = b.get("input")
            msg.calls.append(ToolCall(_string(b, "id", bat), _string(b, "name", bat),
                                      compact(inp) if inp is not None else "{}"))
        elif t == "tool_result":
            msg.content += "<tool_result>" + esc_result(text_of(b.get("content"), bat + ".content")) + "</tool_result>"
            if _string(b, "tool_use_id", bat):
                msg.tool_call_ids.append(b["tool_use_id"])
        # other blocks (images, documents, redacted thinking, server tools) carry nothing ds4 renders
    return msg


def parse_messages(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    raw = body.get("messages")
    if raw is None:
        raise APIError(400, "missing messages", param="messages")
    if not expect(raw, list, "messages"):
        raise invalid("messages", "must not be empty")
    messages = [_message(m, f"messages[{i}]") for i, m in enumerate(raw)]
    system = _system(body.get("system"))
    if system is not None:
        messages.append(Message(role="system", content=system))
    oc = field_of(body, "output_config", dict, {})
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts={"output_config.effort": oc.get("effort"),
                                     "reasoning_effort": body.get("reasoning_effort")}, default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling, min_p_seed=False)
    params.max_tokens = max_tokens_of(body, "max_tokens")
    params.stop = stop_of(body, "stop_sequences")
    tools = field_of(body, "tools", list, [])
    for i, t in enumerate(tools):
        expect(t, dict, f"tools[{i}]")
    tc = field_of(body, "tool_choice", dict, {})
    return ChatRequest("anthropic", model, messages, mode, params, stream=field_of(body, "stream", bool, False),
                       tools=[compact(t) for t in tools], tool_choice="none" if tc.get("type") == "none" else None)


def usage(P: int, R: int, C: int) -> dict:
    # ds4 reports input_tokens 0 and the uncached part as cache creation; report it as input instead
    return {"input_tokens": P - R, "output_tokens": C, "cache_read_input_tokens": R,
            "cache_creation_input_tokens": 0}


def message_response(req: ChatRequest, oc: Outcome, mid: str) -> dict:
    content: list[dict] = []
    if oc.reasoning:
        content.append({"type": "thinking", "thinking": oc.reasoning, "signature": mid})
    if oc.content:
        content.append({"type": "text", "text": oc.content})
    for c in oc.calls:
        import json

        content.append({"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)})
    if not oc.content and not oc.calls:
        content.append({"type": "text", "text": ""})
    return {"id": mid, "type": "message", "role": "assistant", "model": req.model, "content": content,
            "stop_reason": STOP_REASONS.get(oc.finish, "end_turn"), "stop_sequence": None,
            "usage": usage(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors); 5xx are api_error
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error"}


def error_body(status: int, message: str, type: str = "invalid_request_error", **extra) -> dict:
    """``{"type": "error", "error": {...}}`` with Anthropic's error type for ``status``; OpenAI's ``param`` and
    ``code`` are not part of that shape (the message names the field)."""
    if type in ("invalid_request_error", "server_error"):
        type = "api_error" if status >= 500 else _ERROR_TYPES.get(status, "invalid_request_error")
    extra = {k: v for k, v in extra.items() if k not in ("param", "code")}
    return {"type": "error", "error": {"type": type, "message": message, **extra}}


class MessageStream(Streamer):
    id_prefix = "toolu_"

    def __init__(self, req: ChatRequest, mid: str, *, memory=None) -> None:
        super().__init__(req, memory=memory)
        self.mid = mid
        self.index = -1
        self.open_block: str | None = None  # type of the open content block
        self.sent_thinking = self.sent_text = self.sent_tools = False

    def event(self, name: str, data: dict) -> bytes:
        return sse({"type": name, **data}, event=name)

    def keepalive(self) -> bytes:
        return self.event("ping", {})  # what Anthropic's API sends; the SDKs skip it wherever it comes

    def start(self, info: dict) -> bytes:
        super().start(info)
        return self.event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.req.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage(info["prompt_tokens"], info["cached_tokens"], 0)}})

    def _close(self) -> bytes:
        if self.open_block is None:
            return b""
        out = b""
        if self.open_block == "thinking":
            out += self.event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": self.mid}})
        self.open_block = None
        return out + self.event("content_block_stop", {"index": self.index})

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open_block = block["type"]
        return out + self.event("content_block_start", {"index": self.index, "content_block": block})

    def emit(self, events: list) -> bytes:
        out = []
        for e in events:
            if isinstance(e, Reasoning):
                if self.open_block != "thinking":
                    out.append(self._open({"type": "thinking", "thinking": "", "signature": ""}))
                self.sent_thinking = True
                out.append(self.event("content_block_delta", {"index": self.index,
                                                              "delta": {"type": "thinking_delta", "thinking": e.text}}))
            elif isinstance(e, Text):
                if self.open_block != "text":
                    out.append(self._open({"type": "text", "text": ""}))
                self.sent_text = True
                out.append(self.event("content_block_delta", {"index": self.index,
                                                              "delta": {"type": "text_delta", "text": e.text}}))
            elif isinstance(e, ToolStart):
                self.sent_tools = True
                out.append(self._open({"type": "tool_use", "id": self.tool_id(e.index), "name": e.name, "input": {}}))
            elif isinstance(e, ToolArgs):
                out.append(self.event("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": e.fragment}}))
            elif isinstance(e, ToolEnd):
                out.append(self._close())
        return b"".join(out)

    def end(self, oc: Outcome) -> bytes:
        out = self._close()
        if not self.sent_text and not self.sent_tools:
            out += self._open({"type": "text", "text": ""}) + self._close()
        out += self.event("message_delta", {"delta": {"stop_reason": STOP_REASONS.get(oc.finish, "end_turn"),
                                                      "stop_sequence": None},
                                            "usage": {"output_tokens": oc.completion_tokens}})
        return out + self.event("message_stop", {})

    def error(self, message: str) -> bytes:
        return sse({"type": "error", "error": {"type": "api_error", "message": message}}, event="error")
