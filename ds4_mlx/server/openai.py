"""OpenAI ``/v1/chat/completions`` and ``/v1/completions``: request parsing (docs/serving.md §4.3-4.4), responses
(§4.5) and stream chunks (§4.6)."""

from __future__ import annotations

from typing import Any

from ..chat import Message, ToolCall
from .common import (APIError, ChatRequest, Outcome, check_model, compact, expect, field_of, invalid, max_tokens_of,
                     resolve_thinking, sampling_of, stop_of, text_of, usage_openai)
from .sse import Reasoning, Streamer, Text, ToolArgs, ToolStart, sse


def _tools(body: dict) -> list[str]:
    out = []
    for i, t in enumerate(expect(body.get("tools"), (list, type(None)), "tools") or []):
        expect(t, dict, f"tools[{i}]")
        fn = t.get("function") if t.get("type", "function") == "function" else None
        out.append(compact(fn if isinstance(fn, dict) else t))
    return out


def _tool_choice(body: dict) -> str | None:
    tc = expect(body.get("tool_choice"), (str, dict, type(None)), "tool_choice")
    if isinstance(tc, dict):
        return tc.get("type") if isinstance(tc.get("type"), str) else "function"
    return tc


def _messages(raw: Any) -> list[Message]:
    if raw is None:
        raise APIError(400, "missing messages", param="messages")
    if not expect(raw, list, "messages"):
        raise invalid("messages", "must not be empty")
    out = []
    for i, m in enumerate(raw):
        at = f"messages[{i}]"
        expect(m, dict, at)
        role = expect(m.get("role"), (str, type(None)), at + ".role") or "user"
        reasoning = [text_of(m[k], f"{at}.{k}") for k in ("reasoning_content", "reasoning") if m.get(k) is not None]
        msg = Message(role=role, content=text_of(m.get("content"), at + ".content"),
                      reasoning=reasoning[0] if reasoning else None)
        for j, c in enumerate(expect(m.get("tool_calls"), (list, type(None)), at + ".tool_calls") or []):
            cat = f"{at}.tool_calls[{j}]"
            expect(c, dict, cat)
            cid = expect(c.get("id"), (str, type(None)), cat + ".id") or ""
            fn = expect(c.get("function"), (dict, type(None)), cat + ".function") or {}
            name, args = fn.get("name"), fn.get("arguments")
            if not isinstance(name, str) or args is None:
                continue  # entries lacking name or arguments are dropped (§4.4)
            msg.calls.append(ToolCall(cid, name, args if isinstance(args, str) else compact(args)))
        tcid = expect(m.get("tool_call_id"), (str, type(None)), at + ".tool_call_id")
        if tcid:
            msg.tool_call_ids.append(tcid)
        out.append(msg)
    return out


def _include_usage(body: dict) -> bool:
    opts = field_of(body, "stream_options", dict, {})
    return bool(expect(opts.get("include_usage"), (bool, type(None)), "stream_options.include_usage"))


def parse_chat(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    messages = _messages(body.get("messages"))
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts={"reasoning_effort": body.get("reasoning_effort")}, default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling)
    params.max_tokens = max_tokens_of(body, "max_completion_tokens", "max_tokens")
    params.stop = stop_of(body, "stop")
    return ChatRequest("chat", model, messages, mode, params, stream=field_of(body, "stream", bool, False),
                       include_usage=_include_usage(body), tools=_tools(body), tool_choice=_tool_choice(body))


def parse_completion(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    prompt = expect(body.get("prompt"), (str, list, type(None)), "prompt")
    if isinstance(prompt, list):  # §4.4: the first of an array of strings (token-id prompts are not supported)
        prompt = next(iter([expect(p, str, f"prompt[{i}]") for i, p in enumerate(prompt)]), None)
    if prompt is None:
        raise APIError(400, "missing prompt", param="prompt")
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts={"reasoning_effort": body.get("reasoning_effort")}, default=cfg.default_mode)
    params = sampling_of(body, cfg.sampling)
    params.max_tokens = max_tokens_of(body, "max_tokens")
    params.stop = stop_of(body, "stop")
    return ChatRequest("completions", model, [], mode, params, stream=field_of(body, "stream", bool, False),
                       include_usage=_include_usage(body), prompt=prompt, param="prompt")


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

    def open(self) -> bytes:
        return self.chunk({"role": "assistant"})

    def keepalive(self) -> bytes:
        return self.chunk({})  # an empty delta, like the final chunk's: every chat client takes it

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

    def keepalive(self) -> bytes:
        return self.chunk("")

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
