"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``: request parsing (SERVING.md §4.3-4.4), responses
(§4.5) and stream chunks (§4.6)."""

from __future__ import annotations

from typing import Any

from ..chat import Message, ToolCall
from .common import (APIError, ChatRequest, Outcome, bad_json, check_model, compact, field_of, max_tokens_of,
                     resolve_thinking, sampling_of, stop_of, text_of, usage_openai)
from .sse import Reasoning, Streamer, Text, ToolArgs, ToolStart, sse


def _tools(body: dict) -> list[str]:
    tools = body.get("tools")
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise bad_json()
    out = []
    for t in tools:
        if not isinstance(t, dict):
            raise bad_json()
        fn = t.get("function") if t.get("type", "function") == "function" else None
        out.append(compact(fn if isinstance(fn, dict) else t))
    return out


def _tool_choice(body: dict) -> str | None:
    tc = body.get("tool_choice")
    if tc is None:
        return None
    if isinstance(tc, str):
        return tc
    if isinstance(tc, dict):
        return tc.get("type") if isinstance(tc.get("type"), str) else "function"
    raise bad_json()


def _messages(raw: Any) -> list[Message]:
    if not isinstance(raw, list) or not raw:
        raise APIError(400, "missing messages", param="messages")
    out = []
    for m in raw:
        if not isinstance(m, dict):
            raise bad_json()
        role = m.get("role") or "user"
        if not isinstance(role, str):
            raise bad_json()
        reasoning = m.get("reasoning_content", m.get("reasoning"))
        msg = Message(role=role, content=text_of(m.get("content")),
                      reasoning=text_of(reasoning) if reasoning is not None else None)
        calls = m.get("tool_calls") or []
        if not isinstance(calls, list):
            raise bad_json()
        for c in calls:
            if not isinstance(c, dict):
                raise bad_json()
            fn = c.get("function") if isinstance(c.get("function"), dict) else {}
            name, args = fn.get("name"), fn.get("arguments")
            if not isinstance(name, str) or args is None:
                continue  # entries lacking name or arguments are dropped (§4.4)
            msg.calls.append(ToolCall(str(c.get("id") or ""), name, args if isinstance(args, str) else compact(args)))
        tcid = m.get("tool_call_id")
        if isinstance(tcid, str):
            msg.tool_call_ids.append(tcid)
        out.append(msg)
    return out


def parse_chat(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    messages = _messages(body.get("messages"))
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts=(body.get("reasoning_effort"),), default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling)
    params.max_tokens = max_tokens_of(body, "max_completion_tokens", "max_tokens")
    params.stop = stop_of(body, "stop")
    opts = field_of(body, "stream_options", dict, {})
    return ChatRequest("chat", model, messages, mode, params, stream=field_of(body, "stream", bool, False),
                       include_usage=bool(opts.get("include_usage")), tools=_tools(body),
                       tool_choice=_tool_choice(body))


def parse_completion(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        prompt = next((p for p in prompt if isinstance(p, str)), None)
    if not isinstance(prompt, str):
        raise APIError(400, "missing prompt", param="prompt")
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts=(body.get("reasoning_effort"),), default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling)
    params.max_tokens = max_tokens_of(body, "max_tokens")
    params.stop = stop_of(body, "stop")
    opts = field_of(body, "stream_options", dict, {})
    return ChatRequest("completions", model, [], mode, params, stream=field_of(body, "stream", bool, False),
                       include_usage=bool(opts.get("include_usage")), prompt=prompt, param="prompt")


# -- non-streaming -----------------------------------------------------------------------------------------------
def chat_response(req: ChatRequest, oc: Outcome, rid: str, created: int) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": oc.content}
    if oc.reasoning:
        msg["reasoning_content"] = oc.reasoning
    if oc.calls:
        msg["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                             for c in oc.calls]
    return {"id": rid, "object": "chat.completion", "created": created, "model": req.model,
            "choices": [{"index": 0, "message": msg, "finish_reason": oc.finish}],
            "usage": usage_openai(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)}


def completion_response(req: ChatRequest, oc: Outcome, rid: str, created: int) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": req.model,
            "choices": [{"text": oc.content, "index": 0, "finish_reason": oc.finish}],
            "usage": usage_openai(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)}


# -- streaming ---------------------------------------------------------------------------------------------------
class ChatStream(Streamer):
    def __init__(self, req: ChatRequest, rid: str, created: int, *, memory=None) -> None:
        super().__init__(req, memory=memory)
        self.rid, self.created = rid, created

    def chunk(self, delta: dict, finish: str | None = None) -> bytes:
        return sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                    "model": self.req.model, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    def start(self, info: dict) -> bytes:
        super().start(info)
        return self.chunk({"role": "assistant"})

    def emit(self, events: list) -> bytes:
        out = []
        for e in events:
            if isinstance(e, Reasoning):
                out.append(self.chunk({"reasoning_content": e.text}))
            elif isinstance(e, Text):
                out.append(self.chunk({"content": e.text}))
            elif isinstance(e, ToolStart):
                out.append(self.chunk({"tool_calls": [{"index": e.index, "id": self.tool_id(e.index),
                                                       "type": "function",
                                                       "function": {"name": e.name, "arguments": ""}}]}))
            elif isinstance(e, ToolArgs):
                out.append(self.chunk({"tool_calls": [{"index": e.index, "function": {"arguments": e.fragment}}]}))
        return b"".join(out)

    def end(self, oc: Outcome) -> bytes:
        out = self.chunk({}, oc.finish)
        if self.req.include_usage:
            out += sse({"id": self.rid, "object": "chat.completion.chunk", "created": self.created,
                        "model": self.req.model, "choices": [],
                        "usage": usage_openai(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)})
        return out + b"data: [DONE]\n\n"


class CompletionStream(Streamer):
    """Completions stream the raw text (reasoning, ``</think>`` and answer), no splitting (§2.6)."""

    def __init__(self, req: ChatRequest, rid: str, created: int, *, memory=None) -> None:
        super().__init__(req, memory=memory)
        self.rid, self.created = rid, created

    def chunk(self, text: str, finish: str | None = None) -> bytes:
        return sse({"id": self.rid, "object": "text_completion", "created": self.created, "model": self.req.model,
                    "choices": [{"text": text, "index": 0, "finish_reason": finish}]})

    def text(self, t: str) -> bytes:
        return self.chunk(t) if t else b""

    def done(self, result) -> bytes:
        oc = Outcome(result.finish, result.text, None, [], None, result.prompt_tokens, result.cached_tokens,
                     result.completion_tokens)
        out = self.chunk("", oc.finish)
        if self.req.include_usage:
            out += sse({"id": self.rid, "object": "text_completion", "created": self.created,
                        "model": self.req.model, "choices": [],
                        "usage": usage_openai(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)})
        return out + b"data: [DONE]\n\n"
