"""OpenAI ``/v1/responses`` (what Codex speaks): input items -> messages (docs/serving.md §4.4), the response object
(§4.5) and the lifecycle event stream with ``sequence_number`` (§4.6)."""

from __future__ import annotations

import json
import time
from typing import Any

from ..chat import Message, ToolCall
from .common import (APIError, ChatRequest, Outcome, check_model, compact, expect, field_of, invalid, max_tokens_of,
                     new_id, resolve_thinking, sampling_of)
from .sse import Reasoning, Streamer, Text, sse

_TEXT_BLOCKS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")  # a tuple: no hashing of "type"
_HOSTED = {"local_shell_call": "local_shell", "web_search_call": "web_search", "tool_search_call": "tool_search",
           "image_generation_call": "image_generation"}


def _block_text(content: Any, path: str) -> str:
    """Message content: string | null | array of strings and typed text blocks (any other block -> 400)."""
    if not isinstance(expect(content, (str, list, type(None)), path), list):
        return content or ""
    out = []
    for i, b in enumerate(content):
        at = f"{path}[{i}]"
        if isinstance(expect(b, (str, dict), at), str):
            out.append(b)
        elif b.get("type") in _TEXT_BLOCKS:
            out.append(expect(b.get("text"), (str, type(None)), at + ".text") or "")
        else:
            raise invalid(at + ".type", f"unsupported content block type {b.get('type')!r}")
    return "".join(out)


def _raw_json(v: Any) -> str:
    return v if isinstance(v, str) else compact(v if v is not None else {})


def _string(it: dict, key: str, at: str) -> str:
    return expect(it.get(key), (str, type(None)), f"{at}.{key}") or ""


def _reasoning_text(it: dict, at: str) -> str:
    """A reasoning item's text: its summary parts, then its content parts, one per line."""
    parts = []
    for key in ("summary", "content"):
        for i, part in enumerate(expect(it.get(key), (list, type(None)), f"{at}.{key}") or []):
            parts.append(_string(expect(part, dict, f"{at}.{key}[{i}]"), "text", f"{at}.{key}[{i}]"))
    return "\n".join(parts)


def _items(items: list, messages: list[Message]) -> None:
    held: str | None = None  # reasoning waiting for the next assistant message / call

    def flush_reasoning() -> None:
        nonlocal held
        if held is not None:
            messages.append(Message(role="assistant", reasoning=held))
            held = None

    for i, it in enumerate(items):
        at = f"input[{i}]"
        expect(it, dict, at)
        t = expect(it.get("type"), (str, type(None)), at + ".type")
        if t is None and "role" in it:
            t = "message"
        status = it.get("status")
        if status is not None and status != "completed":
            raise invalid(at + ".status", f"input item with status {status!r} is not supported")
        if t == "message":
            role = _string(it, "role", at) or "user"
            if role not in ("user", "assistant", "system", "developer"):
                raise invalid(at + ".role", f"unsupported role {role!r}")
            m = Message(role=role, content=_block_text(it.get("content"), at + ".content"))
            if role == "assistant":
                m.reasoning, held = held, None
            else:
                flush_reasoning()
            messages.append(m)
        elif t in ("function_call", "custom_tool_call") or t in _HOSTED:
            call_id, item_id, ns, name = (_string(it, k, at) for k in ("call_id", "id", "namespace", "name"))
            cid = call_id or item_id
            if t in _HOSTED:
                name = _HOSTED[t]
                args = _raw_json(next((it[k] for k in ("action", "arguments", "input") if k in it), {}))
            else:
                name = ns + name
                args = _raw_json(it.get("arguments", it.get("input")))
            call = ToolCall(cid, name, args)
            if messages and messages[-1].role == "assistant" and held is None:
                messages[-1].calls.append(call)
            else:
                messages.append(Message(role="assistant", reasoning=held, calls=[call]))
                held = None
        elif isinstance(t, str) and t.endswith("_output"):
            flush_reasoning()
            out = it.get("output")
            text = _block_text(out, at + ".output") if isinstance(out, (str, list)) else _raw_json(out)
            messages.append(Message(role="tool", content=text, tool_call_ids=[_string(it, "call_id", at)]))
        elif t == "reasoning":
            held = (held + "\n" if held else "") + _reasoning_text(it, at)
        elif t in ("compaction", "context_compaction"):
            continue
        else:
            raise invalid(at + ".type", f"unsupported input item type {t!r}")
    flush_reasoning()


def _tools(body: dict) -> tuple[list[str], dict]:
    schemas, wire = [], {}
    for i, t in enumerate(field_of(body, "tools", list, [])):
        at = f"tools[{i}]"
        kind = expect(t, dict, at).get("type")
        if kind == "function":
            schemas.append(compact(t))
        elif kind == "namespace":
            ns = _string(t, "name", at)
            for j, f in enumerate(expect(t.get("tools"), (list, type(None)), at + ".tools") or []):
                fat = f"{at}.tools[{j}]"
                name = ns + _string(expect(f, dict, fat), "name", fat)
                schemas.append(compact({"name": name, "description": f.get("description", ""),
                                        "parameters": f.get("parameters", {})}))
                wire[name] = (_string(f, "name", fat), ns)
        elif kind == "tool_search":
            schemas.append(compact({"name": "tool_search", "description": t.get("description", "Search for tools"),
                                    "parameters": t.get("parameters", {"type": "object"})}))
            wire["tool_search"] = ("tool_search", None)
    return schemas, wire


def parse_responses(body: dict, cfg) -> ChatRequest:
    model = check_model(body, cfg.any_model)
    for key in ("previous_response_id", "conversation"):
        if body.get(key) is not None:
            raise invalid(key, "not supported; replay the full input instead")
    raw = expect(body.get("input"), (str, list, type(None)), "input")
    messages: list[Message] = []
    instructions = field_of(body, "instructions", str)
    if instructions:
        messages.append(Message(role="system", content=instructions))
    if isinstance(raw, str):
        messages.append(Message(role="user", content=raw))
    elif raw:
        _items(raw, messages)
    else:
        raise APIError(400, "missing input", param="input")
    reasoning = field_of(body, "reasoning", dict, {})
    mode = resolve_thinking(model, cfg.ctx, thinking=body.get("thinking"), think=body.get("think"),
                            efforts={"reasoning.effort": reasoning.get("effort")}, default=cfg.default_mode,
                            effort_is_explicit=True)
    summary = expect(reasoning.get("summary"), (str, type(None)), "reasoning.summary")
    params = sampling_of(body, cfg.sampling, top_k=False, min_p_seed=False)
    params.max_tokens = max_tokens_of(body, "max_output_tokens", "max_tokens")
    tc = body.get("tool_choice")
    if tc is not None and tc not in ("none", "auto"):
        raise invalid("tool_choice", f"tool_choice={tc} is not supported (none, auto)" if isinstance(tc, str)
                      else "forced tool_choice is not supported")
    schemas, wire = _tools(body)
    return ChatRequest("responses", model, messages, mode, params, stream=field_of(body, "stream", bool, False),
                       tools=schemas, tool_choice=tc, summary=summary in ("auto", "concise", "detailed"),
                       wire_names=wire, param="input")


def usage(P: int, R: int, C: int) -> dict:
    return {"input_tokens": P, "input_tokens_details": {"cached_tokens": R, "cache_write_tokens": P - R},
            "output_tokens": C, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": P + C}


def _status(finish: str) -> str:
    return {"length": "incomplete", "error": "failed"}.get(finish, "completed")


class ResponseBuilder:
    """Ids and items of one response, shared by the plain and the streamed form."""

    def __init__(self, req: ChatRequest) -> None:
        self.req = req
        self.id = new_id("resp_", 12)
        self.rs_id, self.msg_id = new_id("rs_", 12), new_id("msg_", 12)
        self.created = int(time.time())

    def envelope(self, status: str, output: list, oc: Outcome | None = None) -> dict:
        r: dict[str, Any] = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                             "model": self.req.model}
        if oc is not None and oc.finish == "error":
            r["error"] = {"code": "server_error", "message": "generation failed"}
        elif oc is not None and oc.finish == "length":
            r["incomplete_details"] = {"reason": "max_tokens"}
        r["output"] = output
        if oc is not None:
            r["usage"] = usage(oc.prompt_tokens, oc.cached_tokens, oc.completion_tokens)
        return r

    def reasoning_item(self, text: str, status: str) -> dict:
        return {"id": self.rs_id, "type": "reasoning", "status": status,
                "summary": [{"type": "summary_text", "text": text}] if text else []}

    def message_item(self, text: str, status: str) -> dict:
        return {"id": self.msg_id, "type": "message", "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": []}] if text is not None else []}

    def call_item(self, call, status: str, fc_id: str, arguments: str | None = None) -> dict:
        if call.name == "tool_search" and "tool_search" in self.req.wire_names:
            return {"id": fc_id, "type": "tool_search_call", "status": status, "call_id": call.id,
                    "execution": "client", "arguments": json.loads(call.arguments)}
        name, ns = self.req.wire_names.get(call.name, (call.name, None))
        item = {"id": fc_id, "type": "function_call", "status": status, "name": name}
        if ns:
            item["namespace"] = ns
        item.update(call_id=call.id, arguments=call.arguments if arguments is None else arguments)
        return item

    def response(self, oc: Outcome) -> dict:
        st = "incomplete" if oc.finish in ("length", "error") else "completed"
        out = []
        if oc.reasoning and self.req.summary:
            out.append(self.reasoning_item(oc.reasoning, st))
        if oc.content:
            out.append(self.message_item(oc.content, st))
        out += [self.call_item(c, st, new_id("fc_", 12)) for c in oc.calls]
        return self.envelope(_status(oc.finish), out, oc)


class ResponseStream(Streamer):
    def __init__(self, req: ChatRequest, *, memory=None) -> None:
        super().__init__(req, memory=memory)
        self.b = ResponseBuilder(req)
        self.seq = 0
        self.next_index = 0
        self.rs_index = self.msg_index = None
        self.reasoning = self.text_buf = ""

    def event(self, type: str, **data) -> bytes:
        ev = {"type": type, "sequence_number": self.seq, **data}
        self.seq += 1
        return sse(ev)

    def open(self) -> bytes:
        return self.event("response.created", response=self.b.envelope("in_progress", [])) + self.keepalive()

    def keepalive(self) -> bytes:
        # a lifecycle event with the same id and no output: the SDK's accumulator keeps the items it has
        return self.event("response.in_progress", response=self.b.envelope("in_progress", []))

    def emit(self, events: list) -> bytes:
        out = []
        for e in events:
            if isinstance(e, Reasoning) and self.req.summary:
                if self.rs_index is None:
                    self.rs_index, self.next_index = self.next_index, self.next_index + 1
                    out.append(self.event("response.output_item.added", output_index=self.rs_index,
                                          item=self.b.reasoning_item("", "in_progress")))
                    out.append(self.event("response.reasoning_summary_part.added", item_id=self.b.rs_id,
                                          output_index=self.rs_index, summary_index=0,
                                          part={"type": "summary_text", "text": ""}))
                self.reasoning += e.text
                out.append(self.event("response.reasoning_summary_text.delta", item_id=self.b.rs_id,
                                      output_index=self.rs_index, summary_index=0, delta=e.text))
            elif isinstance(e, Text) and e.text:
                if self.msg_index is None:
                    self.msg_index, self.next_index = self.next_index, self.next_index + 1
                    out.append(self.event("response.output_item.added", output_index=self.msg_index,
                                          item=self.b.message_item(None, "in_progress")))
                    out.append(self.event("response.content_part.added", item_id=self.b.msg_id,
                                          output_index=self.msg_index, content_index=0,
                                          part={"type": "output_text", "text": "", "annotations": []}))
                self.text_buf += e.text
                out.append(self.event("response.output_text.delta", item_id=self.b.msg_id,
                                      output_index=self.msg_index, content_index=0, delta=e.text))
        return b"".join(out)

    def end(self, oc: Outcome) -> bytes:
        st = "incomplete" if oc.finish in ("length", "error") else "completed"
        out, output = [], []
        if self.rs_index is not None:
            part = {"type": "summary_text", "text": self.reasoning}
            out.append(self.event("response.reasoning_summary_text.done", item_id=self.b.rs_id,
                                  output_index=self.rs_index, summary_index=0, text=self.reasoning))
            out.append(self.event("response.reasoning_summary_part.done", item_id=self.b.rs_id,
                                  output_index=self.rs_index, summary_index=0, part=part))
            item = self.b.reasoning_item(self.reasoning, "completed" if oc.think_closed else "incomplete")
            output.append(item)
            out.append(self.event("response.output_item.done", output_index=self.rs_index, item=item))
        if self.msg_index is not None:
            part = {"type": "output_text", "text": self.text_buf, "annotations": []}
            out.append(self.event("response.output_text.done", item_id=self.b.msg_id, output_index=self.msg_index,
                                  content_index=0, text=self.text_buf))
            out.append(self.event("response.content_part.done", item_id=self.b.msg_id, output_index=self.msg_index,
                                  content_index=0, part=part))
            item = self.b.message_item(self.text_buf, st)
            output.append(item)
            out.append(self.event("response.output_item.done", output_index=self.msg_index, item=item))
        for c in oc.calls:
            idx, self.next_index = self.next_index, self.next_index + 1
            fc_id = new_id("fc_", 12)
            added = self.b.call_item(c, "in_progress", fc_id, arguments="")
            out.append(self.event("response.output_item.added", output_index=idx, item=added))
            if added["type"] == "function_call":
                out.append(self.event("response.function_call_arguments.delta", item_id=fc_id, output_index=idx,
                                      delta=c.arguments))
                done = {"item_id": fc_id, "output_index": idx, "name": added["name"], "arguments": c.arguments}
                if "namespace" in added:
                    done["namespace"] = added["namespace"]
                out.append(self.event("response.function_call_arguments.done", **done))
            item = self.b.call_item(c, st, fc_id)
            output.append(item)
            out.append(self.event("response.output_item.done", output_index=idx, item=item))
        final = {"completed": "response.completed", "incomplete": "response.incomplete",
                 "failed": "response.failed"}[_status(oc.finish)]
        out.append(self.event(final, response=self.b.envelope(_status(oc.finish), output, oc)))
        return b"".join(out)

    def error(self, message: str) -> bytes:
        return sse({"error": {"message": message, "type": "server_error"}}, event="error")
