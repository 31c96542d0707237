"""Malformed request bodies, route by route: every one gets a 4xx in the shape of the API it came to (OpenAI
``{"error": {...}}``, Anthropic ``{"type": "error", "error": {...}}``) naming the field; none gets a 5xx. The
leniency real clients rely on (unknown roles, blocks and fields, ``null`` for unset) stays. In-process over the
fake engine."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient

from server_util import fake_app

ROUTES = {  # a minimal good body of each route
    "/v1/chat/completions": {"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    "/v1/completions": {"model": "deepseek-chat", "prompt": "x", "max_tokens": 2},
    "/v1/responses": {"model": "deepseek-chat", "input": "x", "max_output_tokens": 2},
    "/v1/messages": {"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "deepseek-chat", "messages": [{"role": "user", "content": "x"}]},
}
DEEP = b"[" * 100_000


@pytest.fixture(scope="module")
def client(tiny_gguf):
    app, worker = fake_app(tiny_gguf(), ctx=4096, default_max_tokens=8, max_body_bytes=1 << 20)
    yield TestClient(app, raise_server_exceptions=False)
    worker.stop()


def check_error(r, path: str, status: int = 400, field: str | None = None) -> str:
    """The error's message, after checking status and shape (and that it names ``field``)."""
    assert r.status_code == status, (path, r.status_code, r.text[:300])
    body = r.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) >= {"type", "message"}, body
        assert "param" not in body["error"] and body["error"]["type"] != "server_error"
    else:
        assert set(body) == {"error"} and body["error"]["type"] and isinstance(body["error"]["message"], str), body
        if field is not None:
            assert body["error"]["param"] == field, body
    message = body["error"]["message"]
    if field is not None:
        assert message.startswith(field + ":"), message
    return message


# (body change, the field the error names or None); applied to every route's good body
COMMON = [
    ({"temperature": -0.5}, "temperature"), ({"temperature": "hot"}, "temperature"), ({"temperature": True},
                                                                                      "temperature"),
    ({"temperature": 10 ** 400}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_p": [1]}, "top_p"), ({"stream": "yes"}, "stream"), ({"model": 7}, "model"),
    ({"thinking": "yes"}, "thinking"), ({"think": 1}, "think"),
]
OPENAI_SAMPLING = [({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"), ({"top_k": -1}, "top_k"),
                   ({"top_k": 2.5}, "top_k"), ({"seed": "x"}, "seed"), ({"stop": 5}, "stop"),
                   ({"stop": ["a", 5]}, "stop[1]"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                   ({"reasoning_effort": 5}, "reasoning_effort"), ({"stream_options": 5}, "stream_options"),
                   ({"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage")]


def _chat_msg(**m):
    return {"messages": [{"role": "user", "content": "x", **m}]}


PER_ROUTE = {
    "/v1/chat/completions": OPENAI_SAMPLING + [
        ({"messages": 42}, "messages"), ({"messages": []}, "messages"), ({"messages": [5]}, "messages[0]"),
        (_chat_msg(role=5), "messages[0].role"), (_chat_msg(content=5), "messages[0].content"),
        (_chat_msg(content=[5]), "messages[0].content[0]"),
        (_chat_msg(content=[{"type": "text", "text": 5}]), "messages[0].content[0].text"),
        (_chat_msg(reasoning_content=7), "messages[0].reasoning_content"),
        (_chat_msg(tool_calls=5), "messages[0].tool_calls"), (_chat_msg(tool_calls=[5]), "messages[0].tool_calls[0]"),
        (_chat_msg(tool_calls=[{"id": 5}]), "messages[0].tool_calls[0].id"),
        (_chat_msg(tool_calls=[{"function": "f"}]), "messages[0].tool_calls[0].function"),
        (_chat_msg(tool_call_id=5), "messages[0].tool_call_id"), ({"tools": {}}, "tools"), ({"tools": [5]}, "tools[0]"),
        ({"tool_choice": 5}, "tool_choice"), ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "5"}, "max_tokens"),
        ({"max_completion_tokens": 3, "max_tokens": -1}, "max_tokens"),
    ],
    "/v1/completions": OPENAI_SAMPLING + [
        ({"prompt": 5}, "prompt"), ({"prompt": [5]}, "prompt[0]"), ({"prompt": ["a", 5]}, "prompt[1]"),
        ({"prompt": [[1, 2, 3]]}, "prompt[0]"), ({"prompt": {"a": 1}}, "prompt"), ({"prompt": []}, None),
    ],
    "/v1/responses": [
        ({"input": 5}, "input"), ({"input": []}, None), ({"input": [5]}, "input[0]"),
        ({"input": [{"type": ["message"]}]}, "input[0].type"), ({"input": [{"type": "weird"}]}, "input[0].type"),
        ({"input": [{"type": "message", "role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]}, "input[0].content[0].text"),
        ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": 5}]}, "input[0].content"),
        ({"input": [{"role": "user", "content": "x", "status": "in_progress"}]}, "input[0].status"),
        ({"input": [{"type": "reasoning", "summary": 5}]}, "input[0].summary"),
        ({"input": [{"type": "reasoning", "summary": [5]}]}, "input[0].summary[0]"),
        ({"input": [{"type": "reasoning", "summary": [{"type": "summary_text", "text": 5}]}]},
         "input[0].summary[0].text"),
        ({"input": [{"type": "reasoning", "content": [{"text": {}}]}]}, "input[0].content[0].text"),
        ({"input": [{"type": "function_call", "call_id": "a", "id": 5, "name": "f"}]}, "input[0].id"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": 5}]}, "input[0].name"),
        ({"input": [{"type": "function_call", "call_id": "a", "name": "f", "namespace": 5}]}, "input[0].namespace"),
        ({"input": [{"type": "function_call_output", "call_id": 5, "output": "x"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_text", "text": 5}]}]},
         "input[0].output[0].text"),
        ({"tools": [{"type": "namespace", "name": "ns", "tools": True}]}, "tools[0].tools"),
        ({"tools": [{"type": "namespace", "name": "ns", "tools": [5]}]}, "tools[0].tools[0]"),
        ({"tools": [{"type": "namespace", "name": 5, "tools": []}]}, "tools[0].name"), ({"tools": 5}, "tools"),
        ({"instructions": 5}, "instructions"), ({"reasoning": 5}, "reasoning"),
        ({"reasoning": {"effort": 5}}, "reasoning.effort"), ({"reasoning": {"summary": 5}}, "reasoning.summary"),
        ({"tool_choice": "required"}, "tool_choice"), ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"previous_response_id": "resp_1"}, "previous_response_id"), ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 3, "max_tokens": "x"}, "max_tokens"),
    ],
}
ANTHROPIC = [
    ({"messages": 42}, "messages"), ({"messages": []}, "messages"), ({"messages": ["x"]}, "messages[0]"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [5]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages[0].content[0].text"),
    ({"messages": [{"role": "assistant", "content": [{"type": "thinking", "thinking": ["x"]}]}]},
     "messages[0].content[0].thinking"),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": 5, "name": "f"}]}]},
     "messages[0].content[0].id"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": 5}]}]},
     "messages[0].content[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": 5}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"system": 5}, "system"), ({"system": [5]}, "system[0]"), ({"system": [{"type": "text", "text": 5}]},
                                                                   "system[0].text"),
    ({"tools": 5}, "tools"), ({"tools": [5]}, "tools[0]"), ({"tool_choice": "auto"}, "tool_choice"),
    ({"top_k": -3}, "top_k"), ({"stop_sequences": [1]}, "stop_sequences[0]"), ({"output_config": 5}, "output_config"),
    ({"output_config": {"effort": "x"}}, "output_config.effort"),
]
PER_ROUTE["/v1/messages"] = ANTHROPIC + [({"max_tokens": -1}, "max_tokens")]
PER_ROUTE["/v1/messages/count_tokens"] = ANTHROPIC
CASES = [(path, change, field) for path in ROUTES for change, field in COMMON + PER_ROUTE[path]
         if not (path.endswith("count_tokens") and "stream" in change)]  # count_tokens ignores stream


@pytest.mark.parametrize("path,change,field", CASES, ids=[f"{p[4:]}-{json.dumps(c)[:60]}" for p, c, _ in CASES])
def test_malformed_field(client, path, change, field):
    check_error(client.post(path, json={**ROUTES[path], **change}), path, 400, field)


@pytest.mark.parametrize("path", list(ROUTES))
def test_malformed_json(client, path):
    post = lambda raw: client.post(path, content=raw, headers={"content-type": "application/json"})  # noqa: E731
    good = json.dumps(ROUTES[path])
    for raw in (b"{not json", b"[1, 2]", b'"x"', b"", DEEP, b"{" * 5000, b"\xff\xfe{}",
                good[:-1].encode() + b', "temperature": NaN}', good[:-1].encode() + b', "top_p": Infinity}',
                good[:-1].encode() + b', "temperature": -Infinity}', good[:-1].encode() + b', "temperature": 1e999}'):
        assert "invalid JSON request" in check_error(post(raw), path), raw[:40]
    # nested deeper than ds4's 256 levels inside an otherwise good body (parses, but is refused)
    nested = good[:-1] + ', "metadata": ' + "[" * 300 + "]" * 300 + "}"
    assert "nested deeper than 256" in check_error(post(nested.encode()), path)
    assert client.post(path, json={**ROUTES[path], "metadata": [[[[[]]]]]}).status_code == 200  # 5 levels: fine


@pytest.mark.parametrize("path", list(ROUTES))
def test_body_size_limit(client, path):
    """413 before the body is parsed or tokenized: by Content-Length, and counted for a chunked upload."""
    big = json.dumps({**ROUTES[path], "padding": "x" * (1 << 20)}).encode()
    message = check_error(client.post(path, content=big, headers={"content-type": "application/json"}), path, 413)
    assert "--max-body-mb" in message
    if path.startswith("/v1/messages"):
        assert client.post(path, content=big).json()["error"]["type"] == "request_too_large"
    chunks = (big[i : i + 65536] for i in range(0, len(big), 65536))  # no Content-Length
    check_error(client.post(path, content=chunks, headers={"content-type": "application/json"}), path, 413)


@pytest.mark.parametrize("path", list(ROUTES))
def test_lenient_inputs_stay_accepted(client, path):
    """What real clients send and ds4 skips: unknown fields, ``null`` for unset, unknown roles and blocks."""
    body = {**ROUTES[path], "temperature": None, "top_p": None, "stream": None, "metadata": {"x": 1},
            "user": "u", "n": 1, "presence_penalty": 0.3, "stream_options": None}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "robot", "content": "ignored"},
                            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:"}},
                                                         {"type": "text", "text": "x"}, "y", None]}]
    elif path == "/v1/responses":
        body["input"] = [{"type": "compaction", "encrypted_content": "..."},
                         {"role": "user", "content": [{"type": "input_text", "text": "x"}]}]
        body["tools"] = [{"type": "web_search"}, {"type": "namespace", "name": "ns", "tools": [{"name": "f"}]}]
    elif path.startswith("/v1/messages"):
        body["messages"] = [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "data": "AAAA"}}, {"type": "redacted_thinking"},
            {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]
        body["system"] = [{"type": "text", "text": "x-anthropic-billing-header: y"}, "be brief"]
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_sampling_bounds_are_inclusive_where_they_should_be(client):
    body = {**ROUTES["/v1/chat/completions"], "temperature": 0, "top_p": 1, "min_p": 0, "top_k": 0}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    body.update(min_p=1, top_k=100000, temperature=7.5, seed=2 ** 80)
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_methods_and_unknown_paths(client):
    for path in ROUTES:
        r = client.get(path)
        assert r.headers["allow"] == "POST"
        check_error(r, path, 405)
    for path in ("/v1/models", "/v1/stats", "/health"):
        r = client.post(path, json={})
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD"}
    check_error(client.get("/v1/nothing"), "/v1/nothing", 404)
    assert client.get("/v1/messages/nothing").json()["error"]["type"] == "not_found_error"


def test_internal_errors_answer_in_the_api_shape(client, monkeypatch):
    """A bug is a 500 in the shape of the API it came to (never OpenAI's on /v1/messages)."""
    from ds4_mlx.server import app as app_module

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(app_module, "render_chat", broken)
    r = client.post("/v1/messages", json=ROUTES["/v1/messages"])
    assert r.status_code == 500 and r.json()["type"] == "error" and r.json()["error"]["type"] == "api_error"
    r = client.post("/v1/chat/completions", json=ROUTES["/v1/chat/completions"])
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
