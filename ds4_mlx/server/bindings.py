"""Live protocol bindings (docs/serving.md §5.2 rows #1-#3, §5.3): the live KV is richer than the client's replay.

After a Responses turn the server remembers the *visible* transcript the client will replay, the call ids and
the live frontier; after an Anthropic tool turn the call ids and the frontier. A later request whose tool
outputs answer exactly the live call ids continues from the live KV with only the §5.3 tail appended
(``EOS + tool results + generation prefix``) — the hidden reasoning and the exact sampled DSML stay in the KV
even when the client sends nothing but the tool outputs.

This module holds the request-side half: which ids a request answers, the tail to append, whether the
request *requires* live tool state (outputs whose calls are not replayed), and the visible text to remember.
The worker owns the bindings themselves and decides (it alone knows the live frontier at execution time).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..chat import Message, ThinkMode
from ..dsml import esc_result, render_tool_calls
from ..tokenizer import ASSISTANT, EOS, THINK, THINK_END, USER
from .common import APIError, ChatRequest, Outcome
from .worker import LOST

_SYSTEM = ("system", "developer")
_TOOL = ("tool", "function")
_ROLES = {"system", "developer", "user", "tool", "function", "assistant"}

@dataclass
class Continuation:
    """A request's candidate for a tool-output continuation (§5.2 #2/#3)."""

    ids: frozenset[str]  # the id set that must equal the live call-id set
    tail: str  # §5.3 tail appended to the live tokens
    requires_live: bool  # tool outputs without their replayed calls: no other way to serve it (else 409)


def tool_tail(messages: list[Message], start: int, mode: ThinkMode) -> str:
    """§5.3 tail: ``EOS`` + the messages from ``start`` rendered as §2.3 (assistant reasoning always wrapped when
    thinking) + the generation prefix. The live KV ends right after the sampled tool block (no EOS)."""
    out = [EOS]
    pending_asst = pending_tool = False
    for m in messages[start:]:
        if m.role not in _ROLES or m.role in _SYSTEM:
            continue
        if m.role == "user":
            out.append(USER + m.content)
            pending_asst, pending_tool = True, False
        elif m.role in _TOOL:
            if not pending_tool:
                out.append(USER)
            out.append("<tool_result>" + esc_result(m.content) + "</tool_result>")
            pending_asst = pending_tool = True
        else:  # assistant
            if pending_asst:
                out.append(ASSISTANT + (THINK + (m.reasoning or "") + THINK_END if mode.thinking else THINK_END))
            out.append(m.content + (m.raw_dsml if m.raw_dsml is not None else render_tool_calls(m.calls)
                                    if m.calls else "") + EOS)
            pending_asst = pending_tool = False
    if pending_asst:
        out.append(ASSISTANT + (THINK if mode.thinking else THINK_END))
    return "".join(out)


def _answered_ids(m: Message) -> list[str]:
    return [i for i in m.tool_call_ids if i]


def _is_result(kind: str, m: Message) -> bool:
    """A message that carries tool outputs: Responses ``*_output`` items, Anthropic user ``tool_result`` blocks."""
    if kind == "responses":
        return m.role in _TOOL
    return m.role == "user" and bool(_answered_ids(m))


def _replayed(messages: list[Message], before: int, cid: str) -> bool:
    return any(m.role == "assistant" and any(c.id == cid for c in m.calls) for m in messages[:before])


def check_tool_outputs(req: ChatRequest, live_ids: frozenset[str]) -> bool:
    """Parse-time check (§4.8): every tool output id is either replayed in the request or live, else 400.
    Returns whether the request requires live tool state (some output's call is not replayed)."""
    if req.kind not in LOST:
        return False
    requires = False
    for i, m in enumerate(req.messages):
        if not _is_result(req.kind, m):
            continue
        for cid in _answered_ids(m):
            if _replayed(req.messages, i, cid):
                continue
            if cid not in live_ids:
                if req.kind == "responses":
                    raise APIError(400, f"Responses continuation state is not available for call_id {cid}; "
                                        "retry by replaying the full input history")
                raise APIError(400, f"Anthropic continuation state is not available for tool_use_id {cid}; "
                                    "retry by replaying the full messages history")
            requires = True
    return requires


def continuation(req: ChatRequest, requires_live: bool) -> Continuation | None:
    """The trailing tool outputs of a Responses/Anthropic request as a live continuation candidate (§5.2 #2/#3).

    Responses: the trailing tool-output messages; their id set is the call ids of the assistant message just
    before them, or — when nothing but system/developer messages precede them (a tool-output-only request) —
    the outputs' own ids. Anthropic: the trailing user messages carrying ``tool_result`` ids (trailing system
    messages ignored; the ``system`` field is appended after the messages); their ids."""
    msgs = req.messages
    if req.kind == "responses":
        start = len(msgs)
        while start > 0 and msgs[start - 1].role in _TOOL:
            start -= 1
        if start == len(msgs):
            return None
        anchor = next((j for j in range(start - 1, -1, -1) if msgs[j].role not in _SYSTEM), None)
        if anchor is None:  # tool-output-only
            ids = [i for m in msgs[start:] for i in _answered_ids(m)]
        elif msgs[anchor].role == "assistant" and msgs[anchor].calls and anchor == start - 1:
            ids = [c.id for c in msgs[anchor].calls]
        else:
            return None
    elif req.kind == "anthropic":
        end = len(msgs)
        while end > 0 and msgs[end - 1].role in _SYSTEM:
            end -= 1
        start = end
        while start > 0 and _is_result("anthropic", msgs[start - 1]):
            start -= 1
        if start == end:
            return None
        ids = [i for m in msgs[start:] for i in _answered_ids(m)]
    else:
        return None
    if not ids:
        return None
    return Continuation(frozenset(ids), tool_tail(msgs, start, req.mode), requires_live)


def responses_visible(prompt_text: str, req: ChatRequest, oc: Outcome, *, exact_dsml: bool) -> str:
    """§5.3: the transcript a Responses client replays after this turn, without the final EOS: the prompt +
    (reasoning, only if the summary was opted in and the turn had tool calls) + ``</think>`` (thinking) +
    content + DSML (the exact sampled block, or canonical when exact replay is off)."""
    out = prompt_text
    if req.mode.thinking:
        if req.summary and oc.calls:
            out += oc.reasoning or ""
        out += THINK_END
    out += oc.content
    if oc.calls:
        out += oc.raw_dsml if exact_dsml and oc.raw_dsml else render_tool_calls(oc.calls)
    return out
