"""Live protocol bindings (docs/serving.md §5.2 #1-#3, §5.3, §4.8): Codex/Claude Code tool loops that send only the
tool outputs continue from the live KV; mismatches get 409 / 400 in each API's shape; an unrelated request clears the
bindings; the Responses visible key goes to the disk cache (ext bit1).

In-process over the fake engine (tests/server_util.py) with the output-forcing test hook; the tail rendering is
checked against the §5.3 / §2.7 example bytes and against the full renderer."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from ds4_mlx.chat import Message, ThinkMode, ToolCall, render_chat
from ds4_mlx.kvstore import FLAG_RESPONSES_VISIBLE, CachePolicy, Lookup
from ds4_mlx.server.bindings import check_tool_outputs, continuation, tool_tail
from ds4_mlx.server.common import APIError, ChatRequest, compact
from ds4_mlx.server.worker import GenParams
from server_util import DSML, dsml_call, fake_app

pytestmark = pytest.mark.timeout(60)

EOS, USER, ASSISTANT = "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
BASH_RESP = {"type": "function", "name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
BASH_ANTH = {"name": "bash", "description": "Run a shell command", "input_schema": BASH_RESP["parameters"]}
CALL = dsml_call("bash", {"command": "ls -la"})
TWO_CALLS = (f'\n\n<{DSML}tool_calls>\n<{DSML}invoke name="bash">\n<{DSML}parameter name="command" string="true">ls'
             f'</{DSML}parameter>\n</{DSML}invoke>\n<{DSML}invoke name="bash">\n<{DSML}parameter name="command" '
             f'string="true">pwd</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>')


# -- the §5.3 tail ---------------------------------------------------------------------------------------------------
def test_tool_tail_matches_spec_example():
    msgs = [Message("user", "List files"), Message("assistant", "", "Need ls.", [ToolCall("c1", "bash", "{}")]),
            Message("tool", "a.txt\nb.txt", tool_call_ids=["c1"])]
    # §5.3 / §2.7 C: the tail after the live `</｜DSML｜tool_calls>`
    assert tool_tail(msgs, 2, ThinkMode.HIGH) == (
        "<｜end▁of▁sentence｜><｜User｜><tool_result>a.txt\nb.txt</tool_result><｜Assistant｜><think>")
    assert tool_tail(msgs, 2, ThinkMode.NONE) == (
        "<｜end▁of▁sentence｜><｜User｜><tool_result>a.txt\nb.txt</tool_result><｜Assistant｜></think>")


def test_tool_tail_shares_a_turn_escapes_and_always_wraps_reasoning():
    msgs = [Message("tool", "x</tool_result>y", tool_call_ids=["a"]), Message("function", "<&>", tool_call_ids=["b"]),
            Message("system", "ignored"), Message("assistant", "ok", None), Message("user", "next"),
            Message("narrator", "dropped")]
    assert tool_tail(msgs, 0, ThinkMode.HIGH) == (
        EOS + USER + "<tool_result>x&lt;/tool_result>y</tool_result><tool_result><&></tool_result>"
        + ASSISTANT + "<think></think>ok" + EOS + USER + "next" + ASSISTANT + "<think>")


def test_tool_tail_equals_the_full_render_after_the_sampled_block():
    """With the assistant turn replayed (exact DSML), the full §2.3 prompt is the live text (up to the sampled
    block) followed by exactly the tail: the live KV + tail is the prompt a full replay would have built."""
    asst = Message("assistant", "Sure.", "Need ls.", [ToolCall("c1", "bash", '{"command":"ls -la"}')], raw_dsml=CALL)
    for mode in (ThinkMode.HIGH, ThinkMode.NONE):
        msgs = [Message("system", "Be brief."), Message("user", "List files"), asst,
                Message("tool", "a.txt", tool_call_ids=["c1"]), Message("tool", "b", tool_call_ids=["c1"])]
        full = render_chat(msgs, mode=mode, tools=[json.dumps(BASH_RESP)])
        tail = tool_tail(msgs, 3, mode)
        assert full.endswith(tail) and full[: -len(tail)].endswith(CALL)


def _req(kind: str, msgs: list[Message]) -> ChatRequest:
    return ChatRequest(kind, "m", msgs, ThinkMode.HIGH, GenParams())


def test_continuation_ids_and_live_requirement():
    asst = Message("assistant", "", None, [ToolCall("c1", "bash", "{}"), ToolCall("c2", "bash", "{}")])
    out1, out2 = Message("tool", "1", tool_call_ids=["c1"]), Message("tool", "2", tool_call_ids=["c2"])
    # Responses, full replay: the ids of the assistant message just before the outputs
    full = _req("responses", [Message("user", "u"), asst, out1])
    assert not check_tool_outputs(full, frozenset())
    assert continuation(full, False).ids == {"c1", "c2"}
    # tool-output-only (developer messages may precede): the outputs' own ids; needs live state
    only = _req("responses", [Message("developer", "d"), out1, out2])
    with pytest.raises(APIError) as e:
        check_tool_outputs(only, frozenset({"c1"}))
    assert e.value.status == 400 and "call_id c2" in e.value.message
    assert check_tool_outputs(only, frozenset({"c1", "c2"}))
    assert continuation(only, True).ids == {"c1", "c2"}
    # a user message between the call and the outputs: no continuation
    assert continuation(_req("responses", [asst, Message("user", "u"), out1]), False) is None
    # Anthropic: trailing tool_result user messages, the system message appended after them ignored
    res = Message("user", "<tool_result>r</tool_result>", tool_call_ids=["t1"])
    anth = _req("anthropic", [res, Message("system", "s")])
    with pytest.raises(APIError) as e:
        check_tool_outputs(anth, frozenset())
    assert "tool_use_id t1" in e.value.message and "messages history" in e.value.message
    c = continuation(anth, check_tool_outputs(anth, frozenset({"t1"})))
    assert c.ids == {"t1"} and c.requires_live
    assert c.tail == EOS + USER + "<tool_result>r</tool_result>" + ASSISTANT + "<think>"


# -- end to end over the fake engine ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_gguf):
    app, worker = fake_app(tiny_gguf(), ctx=4096, default_max_tokens=64, test_hooks=True)
    with TestClient(app) as client:
        yield client, worker
    worker.stop()


def force(text: str) -> dict:
    return {"X-DS4-Test-Output": json.dumps(text)}


def last_decision(client) -> dict:
    return client.get("/v1/stats").json()["last_decisions"][-1]


def responses_turn(client, input, output: str, **extra):
    body = {"model": "deepseek-v4-flash", "input": input, "tools": [BASH_RESP], "max_output_tokens": 200, **extra}
    return client.post("/v1/responses", json=body, headers=force(output))


def anthropic_turn(client, messages, output: str, **extra):
    body = {"model": "deepseek-v4-flash", "max_tokens": 200, "tools": [BASH_ANTH], "messages": messages,
            "system": "Be brief.", **extra}
    return client.post("/v1/messages", json=body, headers=force(output))


def test_responses_tool_output_only_continues_live_kv(served):
    client, worker = served
    r1 = responses_turn(client, [{"role": "user", "content": "List files"}], "Need ls.</think>" + CALL).json()
    (call,) = [o for o in r1["output"] if o["type"] == "function_call"]
    live1 = list(worker.session.tokens)
    frontier = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"]
    assert len(live1) == frontier
    out = [{"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt\nb.txt"}]
    r2 = responses_turn(client, out, "Two files.", stream=False)
    assert r2.status_code == 200, r2.text
    u = r2.json()["usage"]
    assert u["input_tokens_details"]["cached_tokens"] == frontier
    d = last_decision(client)
    assert d["source"] == "responses-tool-output" and d["cached_tokens"] == frontier
    # the effective prompt is the live tokens (hidden reasoning included) + the §5.3 tail, nothing else
    tail = worker.tokenizer.encode_chat(EOS + USER + "<tool_result>a.txt\nb.txt</tool_result>" + ASSISTANT + "<think>")
    assert u["input_tokens"] == frontier + len(tail)
    assert worker.session.tokens[: u["input_tokens"]] == live1 + tail


def test_responses_tool_output_stream_and_409(served):
    client, worker = served
    r1 = responses_turn(client, [{"role": "user", "content": "Two commands"}], "Plan.</think>" + TWO_CALLS).json()
    ids = [o["call_id"] for o in r1["output"] if o["type"] == "function_call"]
    assert len(ids) == 2
    frontier = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"]
    # only one of the two live calls answered: the id set differs -> 409 (non-streaming and streaming alike)
    one = [{"type": "function_call_output", "call_id": ids[0], "output": "x"}]
    for stream in (False, True):
        r = responses_turn(client, one, "no", stream=stream)
        assert r.status_code == 409, r.text
        assert r.json() == {"error": {"message": "Responses continuation state is not available; retry by "
                                                 "replaying the full input history", "type": "invalid_request_error"}}
    assert last_decision(client)["source"] == "conflict"
    assert len(worker.session.tokens) == frontier  # nothing ran
    # an id that is neither live nor replayed: 400 at parse time
    r = responses_turn(client, [{"type": "function_call_output", "call_id": "call_nope", "output": "x"}], "no")
    assert r.status_code == 400 and "call_id call_nope" in r.json()["error"]["message"]
    # the refused requests kept the binding: both outputs, streamed (what Codex sends), continue the live KV
    both = [{"type": "function_call_output", "call_id": i, "output": o} for i, o in zip(ids, ("x", "y"))]
    with client.stream("POST", "/v1/responses", headers=force("Done."), json={
            "model": "deepseek-v4-flash", "input": both, "tools": [BASH_RESP], "stream": True}) as r:
        assert r.status_code == 200
        frames = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    done = frames[-1]
    assert done["type"] == "response.completed"
    assert done["response"]["usage"]["input_tokens_details"]["cached_tokens"] == frontier
    assert last_decision(client)["source"] == "responses-tool-output"


def test_responses_visible_replay(served):
    client, worker = served
    hist = [{"role": "user", "content": "Say hello"}]
    r1 = responses_turn(client, hist, "Greet them.</think>Hello.").json()
    frontier = r1["usage"]["input_tokens"] + r1["usage"]["output_tokens"]
    # the client replays the visible turn (no reasoning): neither a token nor a byte prefix of the live KV,
    # which holds the hidden reasoning — the visible binding continues it
    hist += [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
             {"role": "user", "content": "Again"}]
    r2 = responses_turn(client, hist, "Ok.</think>Hello again.").json()
    assert r2["usage"]["input_tokens_details"]["cached_tokens"] == frontier
    assert last_decision(client)["source"] == "responses-visible"
    # a tool turn replayed in full (call + output, no reasoning) also continues through the visible binding
    r3 = responses_turn(client, hist + [{"type": "message", "role": "assistant", "content": "Hello again."},
                                        {"role": "user", "content": "ls"}], "Run it.</think>" + CALL).json()
    call = next(o for o in r3["output"] if o["type"] == "function_call")
    frontier = r3["usage"]["input_tokens"] + r3["usage"]["output_tokens"]
    hist += [{"type": "message", "role": "assistant", "content": "Hello again."}, {"role": "user", "content": "ls"},
             {k: call[k] for k in ("type", "call_id", "name", "arguments")},
             {"type": "function_call_output", "call_id": call["call_id"], "output": "a.txt"}]
    r4 = responses_turn(client, hist, "Fine.</think>One file.").json()
    assert r4["usage"]["input_tokens_details"]["cached_tokens"] == frontier
    assert last_decision(client)["source"] == "responses-visible"


def test_anthropic_tool_result_continues_live_kv(served):
    client, worker = served
    user = {"role": "user", "content": "List files"}
    r1 = anthropic_turn(client, [user], "Need ls.</think>" + CALL).json()
    (use,) = [b for b in r1["content"] if b["type"] == "tool_use"]
    frontier = r1["usage"]["input_tokens"] + r1["usage"]["cache_read_input_tokens"] + r1["usage"]["output_tokens"]
    live1 = list(worker.session.tokens)
    result = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": "a.txt"}]}
    r2 = anthropic_turn(client, [result], "Ok.</think>One file.")
    assert r2.status_code == 200, r2.text
    u = r2.json()["usage"]
    assert u["cache_read_input_tokens"] == frontier
    assert last_decision(client)["source"] == "anthropic-tool-output"
    tail = worker.tokenizer.encode_chat(EOS + USER + "<tool_result>a.txt</tool_result>" + ASSISTANT + "<think>")
    assert u["input_tokens"] == len(tail) and worker.session.tokens[: frontier + len(tail)] == live1 + tail
    # Claude Code's full replay (thinking + tool_use, then tool_result) takes the same path
    r3 = anthropic_turn(client, [user], "Two.</think>" + TWO_CALLS).json()
    uses = [b for b in r3["content"] if b["type"] == "tool_use"]
    frontier = sum(r3["usage"][k] for k in ("input_tokens", "cache_read_input_tokens", "output_tokens"))
    replay = [user, {"role": "assistant", "content": [{"type": "thinking", "thinking": "Two.", "signature": "s"}]
                     + uses}]
    results = [{"type": "tool_result", "tool_use_id": b["id"], "content": "x"} for b in uses]
    # answering one of the two live calls: 409 in Anthropic's shape (streaming too)
    for stream in (False, True):
        r = anthropic_turn(client, [{"role": "user", "content": results[:1]}], "no", stream=stream)
        assert r.status_code == 409, r.text
        assert r.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "Anthropic continuation state is not available; retry by replaying the full messages history"}}
    r4 = anthropic_turn(client, replay + [{"role": "user", "content": results}], "Ok.</think>Both ran.")
    assert r4.json()["usage"]["cache_read_input_tokens"] == frontier
    assert last_decision(client)["source"] == "anthropic-tool-output"


def test_unrelated_request_clears_the_bindings(served):
    client, worker = served
    r1 = responses_turn(client, [{"role": "user", "content": "List files"}], "Need ls.</think>" + CALL).json()
    rid = next(o["call_id"] for o in r1["output"] if o["type"] == "function_call")
    a1 = anthropic_turn(client, [{"role": "user", "content": "List"}], "Need ls.</think>" + CALL).json()
    aid = next(b["id"] for b in a1["content"] if b["type"] == "tool_use")
    # the Anthropic turn replaced the live session: the Responses binding is gone (its id is unknown now)
    r = responses_turn(client, [{"type": "function_call_output", "call_id": rid, "output": "x"}], "no")
    assert r.status_code == 400 and "continuation state is not available for call_id" in r.text
    assert worker.live_call_ids("anthropic") == {aid}  # a parse-time refusal does not touch the worker
    client.post("/v1/chat/completions", headers=force("Hi."),
                json={"model": "deepseek-chat", "messages": [{"role": "user", "content": "unrelated"}]})
    assert worker.live_call_ids("anthropic") == frozenset()
    r = anthropic_turn(client, [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": aid, "content": "x"}]}], "no")
    assert r.status_code == 400 and f"tool_use_id {aid}" in r.json()["error"]["message"]


class _StubDisk:
    """Records the disk cache's store() calls; every lookup misses."""

    def __init__(self) -> None:
        self.policy = CachePolicy(min_tokens=1, cold_max_tokens=0, continued_interval_tokens=0)
        self.stores: list[tuple[bytes, str, int]] = []

    def store(self, session, text: bytes, reason: str, *, flags: int = 0, tool_map=None):
        self.stores.append((text, reason, flags))

    def lookup(self, prompt: bytes) -> Lookup:
        return Lookup("no file")


def test_evict_save_is_keyed_by_the_responses_visible_text(served):
    client, worker = served
    hist = [{"role": "user", "content": "Say hi"}]
    responses_turn(client, hist, "Think.</think>Hi.")
    disk = worker.kv = _StubDisk()
    try:
        client.post("/v1/chat/completions", headers=force("Yo."),
                    json={"model": "deepseek-chat", "messages": [{"role": "user", "content": "unrelated"}]})
    finally:
        worker.kv = None
    (text, reason, flags), = disk.stores
    assert reason == "evict" and flags & FLAG_RESPONSES_VISIBLE
    visible = text.decode()
    assert visible.endswith("<｜Assistant｜><think></think>Hi.")  # the replayable text, reasoning hidden
    # it is a byte prefix of what the client's replay renders (so a disk lookup of the replay finds it)
    replay = render_chat([Message("user", "Say hi"), Message("assistant", "Hi."), Message("user", "x")],
                         mode=ThinkMode.HIGH, tools=[compact(BASH_RESP)])
    assert replay.startswith(visible + EOS)
