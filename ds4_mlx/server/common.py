"""What every API module shares: the parsed request, errors, field checks, thinking resolution (docs/serving.md §4.3),
usage accounting (§4.7), tool ids and the exact-DSML replay map (§6.5)."""

from __future__ import annotations

import json
import math
import secrets
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any

from ..chat import Message, ThinkMode, resolve_think_mode
from .worker import GenParams

MODEL_ID = "deepseek-v4-flash"
MODEL_ALIASES = {"deepseek-v4-flash": None, "deepseek-chat": False, "deepseek-reasoner": True}  # -> thinking
DEFAULT_MAX_BODY_MB = 32  # Anthropic's own request limit: clients with screenshots in the history stay under it


class APIError(Exception):
    """A request error: ``status`` and the message of §4.8, plus extra fields for the error object."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", **extra: Any) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.extra = status, message, type, extra


def invalid(path: str, problem: str) -> APIError:
    """A 400 that names the offending field: ``messages[0].content[1].text: expected a string``."""
    return APIError(400, f"{path}: {problem}", param=path)


_NAMES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", dict: "an object",
          list: "an array", type(None): "null"}


def expect(value: Any, types: type | tuple, path: str) -> Any:
    """``value`` if it is one of ``types`` (a bool is never a number), else a 400 naming ``path``."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, types) and (bool in types or not isinstance(value, bool)):
        return value
    raise invalid(path, "expected " + " or ".join(_NAMES[t] for t in types))


def number(value: Any, path: str) -> float:
    """A finite JSON number as a float (ints too large for a float are out of range)."""
    expect(value, (int, float), path)
    try:
        v = float(value)
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise invalid(path, "number out of range")
    return v


def integer(value: Any, path: str) -> int:
    """A JSON integer (``3.0`` counts as 3)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return expect(value, int, path)


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
def field_of(body: dict, key: str, types: type | tuple, default: Any = None) -> Any:
    """``body[key]`` if present and of ``types`` (``null`` = unset), else a 400 naming ``key``."""
    v = body.get(key)
    if v is None:
        return default
    if types is int:
        return integer(v, key)
    return expect(v, types, key)


def check_model(body: dict, any_model: bool) -> str:
    model = field_of(body, "model", str, MODEL_ID)
    if not any_model and model not in MODEL_ALIASES:
        raise APIError(404, f"The model '{model}' does not exist; use one of: {', '.join(MODEL_ALIASES)}",
                       code="model_not_found", param="model")
    return model


def max_tokens_of(body: dict, *keys: str) -> int | None:
    """The first of ``keys`` that is set (each one that is set must be a positive integer)."""
    values = [field_of(body, k, int) for k in keys]
    for k, v in zip(keys, values):
        if v is not None and v <= 0:
            raise invalid(k, "must be a positive integer")
    return next((v for v in values if v is not None), None)


def stop_of(body: dict, key: str) -> list[str]:
    v = expect(body.get(key), (str, list, type(None)), key)
    if isinstance(v, list):  # (empty strings stop nothing)
        return [s for i, s in enumerate(v) if expect(s, str, f"{key}[{i}]")]
    return [v] if v else []


# the knobs a client may set; docs/serving.md §3 clamps out-of-range values, the server refuses them instead
_RANGES = {"temperature": (lambda v: v >= 0, "must be ≥ 0"), "top_p": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
           "min_p": (lambda v: 0 <= v <= 1, "must be in [0, 1]"), "top_k": (lambda v: v >= 0, "must be ≥ 0")}


def sampling_of(body: dict, defaults: GenParams, *, top_k: bool = True, min_p_seed: bool = True) -> GenParams:
    """The sampling knobs of ``body`` over ``defaults``; ``explicit`` records the ones the client set."""
    p = replace(defaults, explicit=frozenset())
    keys = ("temperature", "top_p") + (("top_k",) if top_k else ()) + (("min_p",) if min_p_seed else ())
    for k in keys:
        v = body.get(k)
        if v is None:
            continue
        v = integer(v, k) if k == "top_k" else number(v, k)
        ok, rule = _RANGES[k]
        if not ok(v):
            raise invalid(k, rule)
        setattr(p, k, v)
        p.explicit |= {k}
    if min_p_seed:
        seed = field_of(body, "seed", int)
        p.seed = seed if seed is not None else p.seed
    return p


_EFFORTS = {"max": ThinkMode.MAX, "xhigh": ThinkMode.HIGH, "high": ThinkMode.HIGH, "medium": ThinkMode.HIGH,
            "low": ThinkMode.HIGH, "minimal": ThinkMode.HIGH, "none": ThinkMode.NONE}


def resolve_thinking(model: str, ctx: int, *, thinking: Any = None, think: Any = None,
                     efforts: dict[str, Any] | None = None, default: ThinkMode = ThinkMode.HIGH,
                     effort_is_explicit: bool = False) -> ThinkMode:
    """§4.3: ``thinking`` (bool or ``{"type": "enabled"|"disabled"}``), ``think`` (bool), effort strings (field
    path -> value); with no explicit switch the model alias decides; then the Think-Max context gate."""
    enabled, effort, explicit = default.thinking, default if default.thinking else ThinkMode.HIGH, False
    expect(thinking, (bool, dict, type(None)), "thinking")
    if isinstance(thinking, bool):
        enabled, explicit = thinking, True
    elif isinstance(thinking, dict):
        t = thinking.get("type")
        if t in ("enabled", "disabled"):
            enabled, explicit = t == "enabled", True
    if expect(think, (bool, type(None)), "think") is not None:
        enabled, explicit = think, True
    for path, e in (efforts or {}).items():
        if e is None:
            continue
        if expect(e, str, path) not in _EFFORTS:
            raise invalid(path, f"unknown effort {e!r}; use one of {', '.join(_EFFORTS)}")
        effort = _EFFORTS[e]
        if effort_is_explicit:
            explicit = True
    if not explicit and MODEL_ALIASES.get(model) is not None:
        enabled = MODEL_ALIASES[model]
    if not enabled or effort is ThinkMode.NONE:
        return ThinkMode.NONE
    return resolve_think_mode(effort, ctx)


def text_of(content: Any, path: str) -> str:
    """Chat content at ``path``: string | null | object | array of strings and objects, concatenated; from an
    object only a string ``text`` is taken (images and other parts carry none and are dropped)."""
    parts = content if isinstance(content, list) else [expect(content, (str, dict, list, type(None)), path)]
    out = []
    for i, part in enumerate(parts):
        where = f"{path}[{i}]" if isinstance(content, list) else path
        if isinstance(expect(part, (str, dict, type(None)), where), dict):
            part = expect(part.get("text"), (str, type(None)), where + ".text")
        out.append(part or "")
    return "".join(out)


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
