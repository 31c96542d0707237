"""What every API module shares: the parsed request, errors, field checks, thinking resolution (SERVING.md §4.3),
usage accounting (§4.7), tool ids and the exact-DSML replay map (§6.5)."""

from __future__ import annotations

import json
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from ..chat import Message, ThinkMode, resolve_think_mode
from .worker import GenParams

MODEL_ID = "deepseek-v4-flash"
MODEL_ALIASES = {"deepseek-v4-flash": None, "deepseek-chat": False, "deepseek-reasoner": True}  # -> thinking


class APIError(Exception):
    """A request error: ``status`` and the message of §4.8, plus extra fields for the error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.extra = status, message, type, extra


def bad_json() -> APIError:
    return APIError(400, "invalid JSON request")


@dataclass
class ChatRequest:
    """An API request after parsing: what the renderer and the worker need, plus how to answer."""

    kind: str  # chat | completions | responses | anthropic
    model: str
    messages: list[Message]
    mode: ThinkMode
    params: GenParams
    stream: bool = False
    include_usage: bool = False
    tools: list[str] = field(default_factory=list)  # raw JSON schemas
    tool_choice: str | None = None
    prompt: str | None = None  # /v1/completions
    summary: bool = False  # Responses: reasoning.summary opted in
    wire_names: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # Responses namespaces
    param: str = "messages"  # name of the prompt field, for context errors

    @property
    def tools_active(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def tool_context(self) -> bool:
        return (self.tools_active or any(m.role == "assistant" and m.calls for m in self.messages)
                or any(m.role in ("tool", "function") for m in self.messages))


# -- field access -------------------------------------------------------------------------------------------------
_NUM = (int, float)


def field_of(body: dict, key: str, types: type | tuple, default: Any = None) -> Any:
    """``body[key]`` if present and of ``types`` (``null`` = unset); anything else -> 400 invalid JSON."""
    v = body.get(key)
    if v is None:
        return default
    if types is _NUM or (isinstance(types, tuple) and float in types):
        if isinstance(v, bool) or not isinstance(v, _NUM):
            raise bad_json()
        return v
    if types is int and (isinstance(v, bool) or not isinstance(v, int)):
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise bad_json()
    if not isinstance(v, types):
        raise bad_json()
    return v


def check_model(body: dict, any_model: bool) -> str:
    model = field_of(body, "model", str, MODEL_ID)
    if not any_model and model not in MODEL_ALIASES:
        raise APIError(404, f"The model '{model}' does not exist; use one of: {', '.join(MODEL_ALIASES)}",
                       code="model_not_found", param="model")
    return model


def max_tokens_of(body: dict, *keys: str) -> int | None:
    for k in keys:
        v = field_of(body, k, int)
        if v is not None:
            if v <= 0:
                raise APIError(400, f"{k} must be a positive integer", param=k)
            return v
    return None


def stop_of(body: dict, key: str) -> list[str]:
    v = body.get(key)
    if v is None:
        return []
    if isinstance(v, str):
        return [v] if v else []
    if isinstance(v, list) and all(isinstance(s, str) for s in v):
        return [s for s in v if s]
    raise bad_json()


def sampling_of(body: dict, defaults: GenParams, *, top_k: bool = True, min_p_seed: bool = True) -> GenParams:
    p = GenParams(defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p, defaults.seed,
                  defaults.max_tokens)
    p.temperature = float(field_of(body, "temperature", _NUM, p.temperature))
    p.top_p = float(field_of(body, "top_p", _NUM, p.top_p))
    if top_k:
        p.top_k = field_of(body, "top_k", int, p.top_k)
    if min_p_seed:
        p.min_p = float(field_of(body, "min_p", _NUM, p.min_p))
        seed = field_of(body, "seed", int, None)
        p.seed = seed if seed is not None else p.seed
    return p


_EFFORTS = {"max": ThinkMode.MAX, "xhigh": ThinkMode.HIGH, "high": ThinkMode.HIGH, "medium": ThinkMode.HIGH,
            "low": ThinkMode.HIGH, "minimal": ThinkMode.HIGH, "none": ThinkMode.NONE}


def resolve_thinking(model: str, ctx: int, *, thinking: Any = None, think: Any = None,
                     efforts: tuple = (), default: ThinkMode = ThinkMode.HIGH,
                     effort_is_explicit: bool = False) -> ThinkMode:
    """§4.3: ``thinking`` (bool or ``{"type": "enabled"|"disabled"}``), ``think`` (bool), effort strings; with
    no explicit switch the model alias decides; then the Think-Max context gate."""
    enabled, effort, explicit = default.thinking, default if default.thinking else ThinkMode.HIGH, False
    if isinstance(thinking, bool):
        enabled, explicit = thinking, True
    elif isinstance(thinking, dict):
        t = thinking.get("type")
        if t in ("enabled", "disabled"):
            enabled, explicit = t == "enabled", True
    elif thinking is not None:
        raise bad_json()
    if think is not None:
        if not isinstance(think, bool):
            raise bad_json()
        enabled, explicit = think, True
    for e in efforts:
        if e is None:
            continue
        if not isinstance(e, str) or e not in _EFFORTS:
            raise bad_json()
        effort = _EFFORTS[e]
        if effort_is_explicit:
            explicit = True
    if not explicit and MODEL_ALIASES.get(model) is not None:
        enabled = MODEL_ALIASES[model]
    if not enabled or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    return resolve_think_mode(effort, ctx)


def text_of(content: Any, *, keys: tuple = ("text",)) -> str:
    """Chat content: string | null | array of strings / objects (only their ``text`` taken), concatenated."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        out = []
        for part in content:
            if isinstance(part, str):
                out.append(part)
            elif isinstance(part, dict):
                for k in keys:
                    if isinstance(part.get(k), str):
                        out.append(part[k])
                        break
        return "".join(out)
    if isinstance(content, dict):
        return text_of([content], keys=keys)
    raise bad_json()


def compact(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def usage_openai(P: int, R: int, C: int) -> dict:
    return {"prompt_tokens": P, "completion_tokens": C, "total_tokens": P + C,
            "prompt_tokens_details": {"cached_tokens": R, "cache_write_tokens": P - R}}


def new_id(prefix: str, nbytes: int = 16) -> str:
    return prefix + secrets.token_hex(nbytes)


class ToolMemory:
    """The exact-DSML replay map (§6.5): call id -> the raw DSML block the model sampled (LRU)."""

    def __init__(self, max_ids: int = 100_000) -> None:
        self.max_ids = max_ids
        self._ids: OrderedDict[str, str] = OrderedDict()
        self._blocks: dict[str, str] = {}  # dedupe identical blocks
        self._lock = threading.Lock()

    def remember(self, ids: list[str], raw_dsml: str) -> None:
        if self.max_ids <= 0 or not raw_dsml:
            return
        with self._lock:
            block = self._blocks.setdefault(raw_dsml, raw_dsml)
            for i in ids:
                self._ids[i] = block
                self._ids.move_to_end(i)
            while len(self._ids) > self.max_ids:
                self._ids.popitem(last=False)

    def lookup(self, call_ids: list[str]) -> str | None:
        """The block if every id maps to the same one, else ``None``."""
        if not call_ids:
            return None
        with self._lock:
            blocks = {self._ids.get(i) for i in call_ids}
            for i in call_ids:
                if i in self._ids:
                    self._ids.move_to_end(i)
        if len(blocks) == 1 and None not in blocks:
            return blocks.pop()
        return None

    def __contains__(self, call_id: str) -> bool:
        return call_id in self._ids

    def for_text(self, text: str) -> dict[str, str]:
        """id -> block for every remembered block that occurs in ``text`` (the tool-id map of a KV file, §5.4)."""
        with self._lock:
            found = {b for b in self._blocks if b in text}
            return {i: b for i, b in self._ids.items() if b in found}

    def apply(self, messages: list[Message]) -> None:
        """Give every assistant message whose calls are all remembered its exact sampled block."""
        for m in messages:
            if m.role == "assistant" and m.calls and m.raw_dsml is None:
                m.raw_dsml = self.lookup([c.id for c in m.calls])


@dataclass
class Call:
    id: str
    name: str
    arguments: str  # compact JSON object text


@dataclass
class Outcome:
    """A finished turn as every API reports it (§4.5, §6.3)."""

    finish: str
    content: str
    reasoning: str | None
    calls: list[Call]
    raw_dsml: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    think_closed: bool = True


def outcome(req: ChatRequest, result, *, id_prefix: str, streamed_ids: list[str] | None = None,
            memory: ToolMemory | None = None) -> Outcome:
    """Final parse of the raw text (§6.3), finish reason, tool ids (streamed ids reused) and replay memory."""
    from ..dsml import final_finish_reason, parse_output

    thinking = req.mode.thinking
    if req.kind == "completions":
        return Outcome(result.finish, result.text, None, [], None, result.prompt_tokens, result.cached_tokens,
                       result.completion_tokens)
    parsed = parse_output(result.text, thinking=thinking)
    finish = final_finish_reason(parsed, result.finish, tools_active=req.tools_active)
    if result.finish == "error" and finish != "tool_calls":
        finish = "error"
    streamed_ids = streamed_ids or []
    calls = []
    for i, c in enumerate(parsed.calls):
        cid = streamed_ids[i] if i < len(streamed_ids) else new_id(id_prefix)
        calls.append(Call(cid, c.name, c.arguments_json))
    if memory is not None and calls and parsed.raw_dsml:
        memory.remember([c.id for c in calls], parsed.raw_dsml)
    return Outcome(finish, parsed.content, parsed.reasoning or None, calls, parsed.raw_dsml, result.prompt_tokens,
                   result.cached_tokens, result.completion_tokens, think_closed=(not thinking) or "</think>" in result.text)
