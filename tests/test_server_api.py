"""The HTTP layer end to end — a real ``serve`` subprocess (uvicorn, CLI, worker thread) over the fast fake engine,
driven with the official openai / anthropic SDKs and raw httpx: tool calls in every API, SSE event order, FIFO
under 8 concurrent clients, bad input, auth and CORS. The real tiny model is exercised in test_server.py."""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from server_util import dsml_call, running_server

pytestmark = pytest.mark.timeout(120)

BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command", "parameters": {
    "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
    "required": ["command"]}}}
CALL = dsml_call("bash", {"command": "ls -la && echo \"x\" < y", "timeout": 10})


@pytest.fixture(scope="module")
def base(tiny_gguf):
    with running_server(tiny_gguf(), "--ctx", "4096", "-n", "400", "--keepalive", "0.5", fake=True) as url:
        yield url


def force(text: str) -> dict:
    return {"X-DS4-Test-Output": json.dumps(text)}


def sse_events(raw: bytes) -> list[tuple[str | None, str]]:
    """(event name, data) per SSE frame; comments returned as ('#', text)."""
    out = []
    for frame in raw.decode().split("\n\n"):
        if not frame:
            continue
        name, data = None, []
        for line in frame.split("\n"):
            if line.startswith(":"):
                out.append(("#", line[1:].strip()))
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            out.append((name, "\n".join(data)))
    return out


# -- OpenAI chat ---------------------------------------------------------------------------------------------------
def test_chat_tool_call_round_trip(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "List files"}]
    r = client.chat.completions.create(model="deepseek-chat", messages=msgs, tools=[BASH], tool_choice="auto",
                                       extra_headers=force("Sure." + CALL))
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.content == "Sure."
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and len(call.id) == 5 + 32
    assert call.function.name == "bash"
    assert json.loads(call.function.arguments) == {"command": 'ls -la && echo "x" < y', "timeout": 10}
    first = r.usage
    # the client replays the call with re-serialized JSON (spaces, key order): the exact-DSML replay map must
    # re-render the sampled block, so the whole previous turn is a live-KV prefix hit
    args = json.dumps({"timeout": 10, "command": 'ls -la && echo "x" < y'}, indent=1)
    msgs += [{"role": "assistant", "content": "Sure.", "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "a.txt\nb.txt"}]
    r2 = client.chat.completions.create(model="deepseek-chat", messages=msgs, tools=[BASH], max_tokens=4)
    assert r2.usage.prompt_tokens_details.cached_tokens == first.prompt_tokens + first.completion_tokens
    assert r2.usage.prompt_tokens > r2.usage.prompt_tokens_details.cached_tokens


def test_chat_tool_call_stream(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    two = CALL.replace("</｜DSML｜tool_calls>", "") + (
        '<｜DSML｜invoke name="read">\n<｜DSML｜parameter name="path" string="true">a&amp;b.txt</｜DSML｜parameter>\n'
        "</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    stream = client.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "go"}],
                                            tools=[BASH], stream=True, stream_options={"include_usage": True},
                                            extra_headers=force("ok" + two + "TRAILING NEVER SENT"))
    calls: dict[int, dict] = {}
    content, finish, usage = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            content += c.delta.content or ""
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": None, "name": None, "args": ""})
                slot["id"] = tc.id or slot["id"]
                slot["name"] = (tc.function.name if tc.function and tc.function.name else slot["name"])
                slot["args"] += (tc.function.arguments or "") if tc.function else ""
    assert content == "ok" and finish == "tool_calls"
    assert [calls[i]["name"] for i in sorted(calls)] == ["bash", "read"]
    assert json.loads(calls[0]["args"]) == {"command": 'ls -la && echo "x" < y', "timeout": 10}
    assert json.loads(calls[1]["args"]) == {"path": "a&b.txt"}
    assert calls[0]["id"] != calls[1]["id"]
    assert usage.completion_tokens > 0 and usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_chat_malformed_dsml_is_content(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    bad = "hi\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    r = client.chat.completions.create(model="deepseek-chat", messages=[{"role": "user", "content": "go"}],
                                       tools=[BASH], extra_headers=force(bad))
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == bad and not r.choices[0].message.tool_calls


def test_chat_stream_raw_sse(base):
    body = {"model": "deepseek-reasoner", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}}
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=force("why</think>because"), timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    ev = [e for e in sse_events(r.content) if e[0] != "#"]
    assert ev[-1] == (None, "[DONE]")
    chunks = [json.loads(d) for _, d in ev[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant"}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    reasoning = "".join(c["choices"][0]["delta"].get("reasoning_content", "") for c in chunks if c["choices"])
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert (reasoning, content) == ("why", "because")
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


# -- Anthropic -----------------------------------------------------------------------------------------------------
ANTH_TOOL = {"name": "bash", "description": "Run a shell command", "input_schema": BASH["function"]["parameters"]}


def test_anthropic_tool_use_round_trip(base):
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": [{"type": "text", "text": "List files"}]}]
    with client.messages.stream(model="deepseek-v4-flash", max_tokens=400, messages=msgs, tools=[ANTH_TOOL],
                                system=[{"type": "text", "text": "Be brief."}], thinking={"type": "enabled", "budget_tokens": 1024},
                                extra_headers=force("plan</think>" + CALL)) as s:
        kinds = [e.type for e in s]
        msg = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    assert msg.content[0].thinking == "plan" and msg.content[0].signature == msg.id
    tu = msg.content[1]
    assert tu.id.startswith("toolu_") and tu.name == "bash"
    assert tu.input == {"command": 'ls -la && echo "x" < y', "timeout": 10}
    assert msg.stop_reason == "tool_use"
    first = msg.usage
    assert first.input_tokens > 0 and first.output_tokens > 0
    msgs += [{"role": "assistant", "content": [{"type": "thinking", "thinking": "plan", "signature": msg.id},
                                               {"type": "tool_use", "id": tu.id, "name": "bash", "input": tu.input}]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tu.id, "content": "a.txt"}]}]
    r = client.messages.create(model="deepseek-v4-flash", max_tokens=4, messages=msgs, tools=[ANTH_TOOL],
                               system=[{"type": "text", "text": "Be brief."}],
                               extra_headers=force("a reply longer than four tokens"))  # sampled, an EOS may come first
    assert r.usage.cache_read_input_tokens == first.input_tokens + first.output_tokens
    assert r.usage.input_tokens > 0 and r.stop_reason == "max_tokens"


def test_anthropic_raw_event_order(base):
    body = {"model": "deepseek-v4-flash", "max_tokens": 400, "stream": True,
            "messages": [{"role": "user", "content": "x"}], "tools": [ANTH_TOOL]}
    r = httpx.post(base + "/v1/messages?beta=true", json=body, headers=force("r</think>text" + CALL), timeout=30)
    ev = [(n, json.loads(d)) for n, d in sse_events(r.content) if n not in ("#", "ping")]
    assert all(n == d["type"] for n, d in ev)
    names = [n for n, _ in ev]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    starts = [d["content_block"]["type"] for n, d in ev if n == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = [d["delta"]["type"] for n, d in ev if n == "content_block_delta"]
    assert deltas.index("signature_delta") < deltas.index("text_delta") < deltas.index("input_json_delta")
    assert [d["index"] for n, d in ev if n == "content_block_start"] == [0, 1, 2]
    args = "".join(d["delta"]["partial_json"] for n, d in ev if n == "content_block_delta"
                   and d["delta"]["type"] == "input_json_delta")
    assert json.loads(args) == {"command": 'ls -la && echo "x" < y', "timeout": 10}
    assert ev[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_anthropic_thinking_only_gets_empty_text_block(base):
    client = anthropic.Anthropic(base_url=base, api_key="x", max_retries=0)
    r = client.messages.create(model="deepseek-reasoner", max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               extra_headers=force("just thinking"))
    # no </think>: the non-streaming answer returns the whole text as content (ds4 §4.5)
    assert [b.type for b in r.content] == ["text"] and r.content[0].text == "just thinking"


# -- Responses -----------------------------------------------------------------------------------------------------
RESP_TOOLS = [{"type": "function", "name": "bash", "description": "Run a shell command",
               "parameters": BASH["function"]["parameters"], "strict": False},
              {"type": "namespace", "name": "mcp__fs__", "tools": [
                  {"name": "read", "description": "Read", "parameters": {"type": "object"}}]},
              {"type": "web_search"}]


def test_responses_function_call_stream(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    out = "thought</think>Running." + dsml_call("mcp__fs__read", {"path": "a"})
    stream = client.responses.create(model="deepseek-v4-flash", input=[
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "be careful"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read a"}]}],
        tools=RESP_TOOLS, reasoning={"effort": "high", "summary": "auto"}, store=False, stream=True,
        include=["reasoning.encrypted_content"], extra_headers=force(out))
    events = list(stream)
    types = [e.type for e in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert types.index("response.output_item.added") < types.index("response.reasoning_summary_text.delta")
    assert types.index("response.output_text.delta") < types.index("response.function_call_arguments.done")
    final = events[-1].response
    kinds = [o.type for o in final.output]
    assert kinds == ["reasoning", "message", "function_call"]
    fc = final.output[2]
    assert (fc.name, getattr(fc, "namespace", None) or fc.model_extra.get("namespace")) == ("read", "mcp__fs__")
    assert json.loads(fc.arguments) == {"path": "a"} and fc.call_id.startswith("call_")
    assert final.output[1].content[0].text == "Running."
    assert final.usage.output_tokens > 0

    # Codex replays reasoning + function_call + output
    r2 = client.responses.create(model="deepseek-v4-flash", max_output_tokens=3, input=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "read a"}]},
        {"type": "reasoning", "id": final.output[0].id, "summary": [{"type": "summary_text", "text": "thought"}]},
        {"type": "function_call", "call_id": fc.call_id, "name": "read", "namespace": "mcp__fs__",
         "arguments": fc.arguments},
        {"type": "function_call_output", "call_id": fc.call_id, "output": "contents"}], tools=RESP_TOOLS,
        extra_headers=force("thinking about it for a while"))  # sampled, an EOS may come first
    assert r2.status == "incomplete" and r2.incomplete_details.reason == "max_tokens"


def test_responses_non_stream_text(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    r = client.responses.create(model="deepseek-chat", input="hello", instructions="be nice",
                                extra_headers=force("Hi there"))
    assert r.status == "completed" and r.output_text == "Hi there"
    assert r.id.startswith("resp_") and r.output[0].id.startswith("msg_")


# -- concurrency / FIFO -----------------------------------------------------------------------------------------
def test_eight_concurrent_clients_uninterleaved(base):
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)
    results: dict[int, str] = {}
    errors: list = []

    def run(i: int) -> None:
        try:
            text = f"client {i} says " + "abc " * (i + 3)
            stream = client.chat.completions.create(
                model="deepseek-chat", messages=[{"role": "user", "content": f"hi {i}"}], stream=True,
                extra_headers=force(text))
            results[i] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert not errors
    assert results == {i: f"client {i} says " + "abc " * (i + 3) for i in range(8)}


# -- bad input ---------------------------------------------------------------------------------------------------
CASES = {
    "/v1/chat/completions": ({"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}]}, "messages"),
    "/v1/completions": ({"model": "deepseek-chat", "prompt": "x"}, "prompt"),
    "/v1/responses": ({"model": "deepseek-chat", "input": "x"}, "input"),
    "/v1/messages": ({"model": "deepseek-chat", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]},
                     "messages"),
}


def _check_error(r: httpx.Response, path: str, status: int) -> dict:
    assert r.status_code == status, (path, r.text)
    body = r.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and isinstance(body["error"]["message"], str) and body["error"]["type"]
    else:
        assert isinstance(body["error"]["message"], str) and body["error"]["type"]
    return body


@pytest.mark.parametrize("path", list(CASES))
def test_bad_input(base, path):
    good, field = CASES[path]
    post = lambda **kw: httpx.post(base + path, timeout=30, **kw)  # noqa: E731
    _check_error(post(content=b"{not json"), path, 400)
    _check_error(post(content=b"[1, 2]"), path, 400)
    _check_error(post(json={**good, "temperature": "hot"}), path, 400)
    _check_error(post(json={**good, "stream": "yes"}), path, 400)
    _check_error(post(json={**good, field: 42}), path, 400)
    _check_error(post(json={**good, "model": "gpt-4o"}), path, 404)
    _check_error(post(json={**good, "model": 7}), path, 400)
    if field != "prompt":
        _check_error(post(json={**good, field: []}), path, 400)
    mt = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    _check_error(post(json={**good, mt: 0}), path, 400)
    _check_error(post(json={**good, mt: -5}), path, 400)
    long = "word " * 5000
    big = {"/v1/chat/completions": {"messages": [{"role": "user", "content": long}]}, "/v1/completions": {
        "prompt": long}, "/v1/responses": {"input": long}, "/v1/messages": {
        "messages": [{"role": "user", "content": long}]}}[path]
    body = _check_error(post(json={**good, **big}), path, 400)
    err = body["error"]
    assert err["n_ctx"] == 4096 and err["n_prompt_tokens"] >= 4096
    if path != "/v1/messages":
        assert err["code"] == "context_length_exceeded"
    # the server survived all of that
    assert post(json={**good, mt: 2}).status_code == 200


def test_unknown_endpoint_and_models(base):
    r = httpx.get(base + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "unknown endpoint"
    r = httpx.get(base + "/v1/chat/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and "not allowed" in r.json()["error"]["message"]
    r = httpx.delete(base + "/v1/messages")
    assert r.status_code == 405 and r.json()["type"] == "error"
    models = httpx.get(base + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "deepseek-v4-flash"
    assert models["data"][0]["context_length"] == 4096
    assert httpx.get(base + "/v1/models/deepseek-reasoner").json()["id"] == "deepseek-reasoner"
    assert httpx.get(base + "/v1/models/nope").status_code == 404
    r = httpx.post(base + "/v1/messages/count_tokens", json={"model": "deepseek-v4-flash", "messages": [
        {"role": "user", "content": "hello there"}]})
    assert r.status_code == 200 and r.json()["input_tokens"] > 3


def test_api_key_and_cors(tiny_gguf):
    with running_server(tiny_gguf(), "--api-key", "sekrit", "--cors", fake=True) as url:
        body = CASES["/v1/chat/completions"][0] | {"max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
        assert httpx.post(url + "/v1/messages", json=CASES["/v1/messages"][0],
                          headers={"x-api-key": "wrong"}).json()["type"] == "error"
        assert httpx.post(url + "/v1/chat/completions", json=body,
                          headers={"Authorization": "Bearer sekrit"}).status_code == 200
        a = anthropic.Anthropic(base_url=url, api_key="sekrit", max_retries=0)
        assert a.messages.create(model="deepseek-chat", max_tokens=2, messages=[
            {"role": "user", "content": "x"}]).usage.output_tokens == 2
        r = httpx.options(url + "/v1/chat/completions")
        assert r.status_code == 204 and r.headers["access-control-allow-methods"] == "GET, POST, OPTIONS"
        assert httpx.get(url + "/health").json()["status"] == "ok"


# -- keepalives ----------------------------------------------------------------------------------------------------
KEEPALIVE_BODIES = {  # path -> (body, how a keepalive event of that API looks)
    "/v1/chat/completions": ({"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}]},
                             lambda name, d: d.get("choices") and d["choices"][0]["delta"] == {}),
    "/v1/completions": ({"model": "deepseek-chat", "prompt": "x"},
                        lambda name, d: d.get("choices") and d["choices"][0]["text"] == ""),
    "/v1/responses": ({"model": "deepseek-chat", "input": "x"},
                      lambda name, d: d["type"] == "response.in_progress"),
    "/v1/messages": ({"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 50},
                     lambda name, d: name == "ping" and d == {"type": "ping"}),
}


@pytest.mark.parametrize("path", list(KEEPALIVE_BODIES))
def test_long_prefill_sends_an_event_every_keepalive(base, path):
    """During a slow prefill (2 s, keepalive 0.5 s) a data event of the API's own kind — not an SSE comment,
    which Codex does not count — arrives at least every keepalive interval, from the first byte to the end."""
    body, is_keepalive = KEEPALIVE_BODIES[path]
    t0 = time.monotonic()
    stamps, frames = [], []
    with httpx.stream("POST", base + path, json={**body, "stream": True}, timeout=30,
                      headers={"X-DS4-Test-Prefill-Delay": "2.0", **force("done")}) as r:
        name = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.monotonic() - t0)
                frames.append((name, json.loads(line[6:])))
                name = None
    assert stamps[0] < 0.4  # an event as soon as the stream opens
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    assert stamps[-1] > 2.0 and max(gaps) < 0.5 + 0.35, gaps
    assert sum(1 for f in frames if is_keepalive(*f)) >= 3


def test_thinking_keeps_an_explicit_temperature(base):
    """temperature 0 stays greedy through the reasoning: unseeded thinking runs agree; without it they differ."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)

    def run(**kw) -> str:
        r = client.chat.completions.create(model="deepseek-reasoner", messages=[{"role": "user", "content": "t"}],
                                           max_tokens=12, **kw)
        return (getattr(r.choices[0].message, "reasoning_content", None) or "") + r.choices[0].message.content

    assert len({run(temperature=0) for _ in range(3)}) == 1
    assert len({run() for _ in range(3)}) > 1  # ds4's thinking knobs (temperature 1) fill the omitted one
