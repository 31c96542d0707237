"""Anthropic ``/v1/messages`` (and ``/v1/messages/count_tokens``): request parsing (SERVING.md §4.3-4.4),
the message object (§4.5) and the event stream ``message_start`` … ``message_stop`` (§4.6)."""

from __future__ import annotations

from typing import Any

from ..chat import Message, ToolCall
from ..dsml import esc_result
from .common import (APIError, ChatRequest, Outcome, bad_json, check_model, compact, field_of, max_tokens_of,
                     resolve_thinking, sampling_of, stop_of, text_of)
from .sse import Reasoning, Streamer, Text, ToolArgs, ToolEnd, ToolStart, sse

STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}


def _system(raw: Any) -> str | None:
    if raw is None:
        return None
    parts = [raw] if isinstance(raw, str) else raw
    if not isinstance(parts, list):
        raise bad_json()
    out = ""
    for p in parts:
        text = p if isinstance(p, str) else p.get("text") if isinstance(p, dict) else None
        if not isinstance(text, str):
            raise bad_json()
        if text.startswith("x-anthropic-"):  # billing headers some clients put in the system blocks
            continue
        if out and not out.endswith("\n"):
            out += "\n"
        out += text
    return out


def _message(m: Any) -> Message:
    if not isinstance(m, dict):
        raise bad_json()
    role = m.get("role") or "user"
    if not isinstance(role, str):
        raise bad_json()
    content = m.get("content")
    msg = Message(role=role)
    if content is None or isinstance(content, str):
        msg.content = content or ""
        return msg
    if not isinstance(content, list):
        raise bad_json()
    for b in content:
        if isinstance(b, str):
            msg.content += b
            continue
        if not isinstance(b, dict):
            raise bad_json()
        t = b.get("type")
        if t == "text":
            msg.content += b.get("text") or ""
        elif t == "thinking":
            msg.reasoning = (msg.reasoning or "") + (b.get("thinking") or "")
        elif t == "tool_use":
            inp = b.get("input")
            msg.calls.append(ToolCall(str(b.get("id") or ""), str(b.get("name") or ""),
                                      compact(inp) if inp is not None else "{}"))
        elif t == "tool_result":
            msg.content += "<tool_result>" + esc_result(text_of(b.get("content"))) + "</tool_result>"
            if isinstance(b.get("tool_use_id"), str):
                msg.tool_call_ids.append(b["tool_use_id"])
    return msg


def parse_messages(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "missing messages", param="messages")
    messages = [_message(m) for m in raw]
    system = _system(body.get("system"))
    if system is not None:
        messages.append(Message(role="system", content=system))
    oc = body.get("output_config") if isinstance(body.get("output_config"), dict) else {}
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts=(oc.get("effort"), body.get("reasoning_effort")), default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling, min_p_seed=False)
    params.max_tokens = max_tokens_of(body, "max_tokens")
    params.stop = stop_of(body, "stop_sequences")
    tools = body.get("tools") or []
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise bad_json()
    tc = body.get("tool_choice")
    tool_choice = "none" if isinstance(tc, dict) and tc.get("type") == "none" else None
    return ChatRequest("anthropic", model, messages, mode, params, stream=field_of(body, "stream", bool, False),
                       tools=[compact(t) for t in tools], tool_choice=tool_choice)


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


def error_body(status: int, message: str, type: str = "invalid_request_error", **extra) -> dict:
    if status == 404 and type == "invalid_request_error" and "model" in message:
        type = "not_found_error"
    return {"type": "error", "error": {"type": type, "message": message, **extra}}


class MessageStream(Streamer):
    id_prefix = "toolu_"

    def __init__(self, req: ChatRequest, mid: str, *, memory=None) -> None:
        super().__init__(req, memory=memory)
        self.mid = mid
        self.index = -1
        self.open: str | None = None  # type of the open content block
        self.sent_thinking = self.sent_text = self.sent_tools = False

    def event(self, name: str, data: dict) -> bytes:
        return sse({"type": name, **data}, event=name)

    def start(self, info: dict) -> bytes:
        super().start(info)
        return self.event("message_start", {"message": {
            "id": self.mid, "type": "message", "role": "assistant", "model": self.req.model, "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": usage(info["prompt_tokens"], info["cached_tokens"], 0)}})

    def _close(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open == "thinking":
            out += self.event("content_block_delta", {"index": self.index,
                                                      "delta": {"type": "signature_delta", "signature": self.mid}})
        self.open = None
        return out + self.event("content_block_stop", {"index": self.index})

    def _open(self, block: dict) -> bytes:
        out = self._close()
        self.index += 1
        self.open = block["type"]
        return out + self.event("content_block_start", {"index": self.index, "content_block": block})

    def emit(self, events: list) -> bytes:
        out = []
        for e in events:
            if isinstance(e, Reasoning):
                if self.open != "thinking":
                    out.append(self._open({"type": "thinking", "thinking": "", "signature": ""}))
                self.sent_thinking = True
                out.append(self.event("content_block_delta", {"index": self.index,
                                                              "delta": {"type": "thinking_delta", "thinking": e.text}}))
            elif isinstance(e, Text):
                if self.open != "text":
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
