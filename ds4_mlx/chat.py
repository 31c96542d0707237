"""DeepSeek V4 prompt rendering, ds4 flavour (docs/serving.md §2): thinking modes, the server chat renderer, the tools
block, DSML history rendering, and the /v1/completions and CLI renderers.

Message model (§2.2) — plain dataclasses; :func:`as_message` also accepts dicts with the same keys:

* :class:`Message` ``role``, ``content`` (str), ``reasoning`` (str | None), ``calls`` (list of :class:`ToolCall`),
  ``tool_call_ids`` (ids a tool result answers), ``raw_dsml`` (exact sampled DSML block for replay, §6.5).
  Roles: ``system``/``developer``, ``user``, ``tool``/``function``, ``assistant``; any other role is dropped.
* :class:`ToolCall` ``id``, ``name``, ``arguments`` — the raw JSON text of the arguments (key order and number
  spelling are preserved when rendering).

Renderers return ``str``; tokenize them with ``Tokenizer.encode_chat`` (only the 7 specials are recognised).
The renderer never trims or normalises content.
"""

from __future__ import annotations

import enum
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .dsml import esc_result, render_tool_calls
from .tokenizer import ASSISTANT, BOS, EOS, THINK, THINK_END, USER

__all__ = [
    "ThinkMode",
    "THINK_MAX_PREFIX",
    "THINK_MAX_MIN_CTX",
    "DEFAULT_SYSTEM",
    "resolve_think_mode",
    "ToolCall",
    "Message",
    "as_message",
    "tools_block",
    "render_dsml",
    "render_chat",
    "render_completion",
    "cli_prompt_tokens",
    "repl_prefix_tokens",
    "repl_turn_tokens",
]


class ThinkMode(enum.Enum):
    """§2.1: NONE = non-thinking, HIGH = thinking (default), MAX = Think Max."""

    NONE = "none"
    HIGH = "high"
    MAX = "max"

    @property
    def thinking(self) -> bool:
        return self is not ThinkMode.NONE


THINK_MAX_MIN_CTX = 393216
THINK_MAX_PREFIX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n"
)
DEFAULT_SYSTEM = "You are a helpful assistant"  # CLI and /v1/completions (no final period, as in ds4)


def resolve_think_mode(mode: ThinkMode | str, ctx: int, *, warn: bool = False) -> ThinkMode:
    """Apply the Think-Max context gate (§2.1): MAX below ``THINK_MAX_MIN_CTX`` tokens becomes HIGH (silently on
    the server; ``warn=True`` prints ds4's CLI warning to stderr)."""
    mode = ThinkMode(mode)
    if mode is ThinkMode.MAX and ctx < THINK_MAX_MIN_CTX:
        if warn:
            print(
                f"ds4-mlx: --think-max needs a context of at least {THINK_MAX_MIN_CTX} tokens "
                f"(have {ctx}); using normal thinking",
                file=sys.stderr,
            )
        return ThinkMode.HIGH
    return mode


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str  # raw JSON text


@dataclass
class Message:
    role: str
    content: str = ""
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)
    tool_call_ids: list[str] = field(default_factory=list)
    raw_dsml: str | None = None


def as_message(m: Message | dict[str, Any]) -> Message:
    """Coerce a dict to :class:`Message` (missing role -> ``user``; missing/null content -> ``""``)."""
    if isinstance(m, Message):
        return m
    calls = [c if isinstance(c, ToolCall) else ToolCall(c.get("id", ""), c["name"], c["arguments"])
             for c in m.get("calls") or []]
    return Message(
        role=m.get("role") or "user",
        content=m.get("content") or "",
        reasoning=m.get("reasoning"),
        calls=calls,
        tool_call_ids=list(m.get("tool_call_ids") or []),
        raw_dsml=m.get("raw_dsml"),
    )


TOOLS_HEADER = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user question. You can invoke tools by writing a "
    '"<｜DSML｜tool_calls>" block like the following:\n\n'
    "<｜DSML｜tool_calls>\n"
    '<｜DSML｜invoke name="$TOOL_NAME">\n'
    '<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    '<｜DSML｜invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    'String parameters should be specified as raw text and set `string="true"`. Preserve characters such as `>`, '
    "`&`, and `&&` exactly; never replace normal string characters with XML or HTML entity escapes. Only if a "
    "string value itself contains the exact closing parameter tag `</｜DSML｜parameter>`, write that tag as "
    "`&lt;/｜DSML｜parameter>` inside the value. For all other types (numbers, booleans, arrays, objects), pass "
    'the value in JSON format and set `string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
)
TOOLS_TAIL = (
    "\n\nYou MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls. "
    "Use the exact parameter names from the schemas."
)


def tools_block(schemas: Sequence[str]) -> str:
    """TOOLS_BLOCK of §2.4: header + raw JSON schemas joined by ``"\\n"`` + tail (no trailing newline)."""
    return TOOLS_HEADER + "\n".join(schemas) + TOOLS_TAIL


def render_dsml(m: Message) -> str:
    """DSML of an assistant message's calls (§2.5): ``raw_dsml`` verbatim if set, else canonical, ``""`` if none."""
    if m.raw_dsml is not None:
        return m.raw_dsml
    return render_tool_calls(m.calls) if m.calls else ""


_ROLES = {"system", "developer", "user", "tool", "function", "assistant"}


def render_chat(
    messages: Iterable[Message | dict[str, Any]],
    *,
    mode: ThinkMode | str = ThinkMode.HIGH,
    tools: Sequence[str] | None = None,
    tool_choice: str | None = None,
) -> str:
    """The server chat prompt (§2.3), byte-exact with ds4.

    ``tools``: raw JSON function schemas (§4.4 says which bytes); active when non-empty and
    ``tool_choice != "none"``. ``mode`` must already be context-gated (:func:`resolve_think_mode`).
    """
    mode = ThinkMode(mode)
    msgs = [m for m in map(as_message, messages) if m.role in _ROLES]
    tools_active = bool(tools) and tool_choice != "none"
    tool_context = (
        tools_active
        or any(m.role == "assistant" and m.calls for m in msgs)
        or any(m.role in ("tool", "function") for m in msgs)
    )
    system = tools_block(tools) if tools_active else ""
    for m in msgs:
        if m.role in ("system", "developer"):
            if system:
                system += "\n\n"
            system += m.content
    last_user = max((i for i, m in enumerate(msgs) if m.role in ("user", "tool", "function")), default=-1)

    out = [BOS, THINK_MAX_PREFIX if mode is ThinkMode.MAX else "", system]
    pending_asst = pending_tool = False
    for i, m in enumerate(msgs):
        if m.role == "user":
            out.append(USER + m.content)
            pending_asst, pending_tool = True, False
        elif m.role in ("tool", "function"):
            if not pending_tool:  # consecutive results share one user turn
                out.append(USER)
            out.append("<tool_result>" + esc_result(m.content) + "</tool_result>")
            pending_asst = pending_tool = True
        elif m.role == "assistant":
            if pending_asst:
                out.append(ASSISTANT)
                if mode.thinking and (tool_context or i > last_user):
                    out.append(THINK + (m.reasoning or "") + THINK_END)
                else:
                    out.append(THINK_END)  # reasoning dropped
            out.append(m.content + render_dsml(m) + EOS)
            pending_asst = pending_tool = False
    if pending_asst:
        out.append(ASSISTANT + (THINK if mode.thinking else THINK_END))
    return "".join(out)


def render_completion(prompt: str, *, mode: ThinkMode | str = ThinkMode.HIGH) -> str:
    """The /v1/completions prompt (§2.6): fixed system text, one user turn, generation prefix."""
    mode = ThinkMode(mode)
    return (
        BOS
        + (THINK_MAX_PREFIX if mode is ThinkMode.MAX else "")
        + DEFAULT_SYSTEM
        + USER
        + prompt
        + ASSISTANT
        + (THINK if mode.thinking else THINK_END)
    )


def cli_prompt_tokens(tokenizer, prompt: str, *, system: str = DEFAULT_SYSTEM,
                      mode: ThinkMode | str = ThinkMode.HIGH) -> list[int]:
    """``ds4 -p`` prompt tokens (§2.6): ``[BOS] + BPE(MAX prefix)? + BPE(system)? + [User] + BPE(prompt) +
    [Assistant] + [<think> | </think>]``, each text part plain-encoded separately. A prompt that starts with the
    literal BOS string is tokenized as rendered chat as it is (system and mode ignored)."""
    if prompt.startswith(BOS):
        return tokenizer.encode_chat(prompt)
    mode = ThinkMode(mode)
    return repl_prefix_tokens(tokenizer, system=system, mode=mode) + repl_turn_tokens(tokenizer, prompt, mode=mode)


def repl_prefix_tokens(tokenizer, *, system: str = DEFAULT_SYSTEM,
                       mode: ThinkMode | str = ThinkMode.HIGH) -> list[int]:
    """REPL transcript start (§2.6): ``[BOS] + BPE(MAX prefix)? + BPE(system)`` (empty system -> nothing)."""
    ids = [tokenizer.bos_id]
    if ThinkMode(mode) is ThinkMode.MAX:
        ids += tokenizer.encode(THINK_MAX_PREFIX)
    if system:
        ids += tokenizer.encode(system)
    return ids


def repl_turn_tokens(tokenizer, text: str, *, mode: ThinkMode | str = ThinkMode.HIGH) -> list[int]:
    """One REPL/CLI turn (§2.6): ``[User] + BPE(text) + [Assistant] + [<think> | </think>]``. After generation
    the caller appends the generated ids and ``[EOS]``."""
    think = tokenizer.think_id if ThinkMode(mode).thinking else tokenizer.think_end_id
    return [tokenizer.user_id] + tokenizer.encode(text) + [tokenizer.assistant_id, think]
