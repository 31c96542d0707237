"""The server's OpenAPI 3.1 document (served at ``/openapi.json``; schemathesis tests the server against it).

Written by hand rather than generated: the endpoints accept the loose bodies real clients send (docs/serving.md §11)
and answer bad input with each API's own error shape (§4.8), which a validating framework would replace. Every
constraint written here is one the handlers enforce (a body that breaks it gets a 4xx naming the field); where a
handler is lenient (unknown fields, roles and blocks are ignored) the schema says nothing.
"""

from __future__ import annotations

from .common import MODEL_ALIASES


def _null(*types: str) -> dict:
    return {"type": [*types, "null"]}


_STR = _null("string")
_ANY: dict = {}
_EFFORT = {"enum": ["max", "xhigh", "high", "medium", "low", "minimal", "none", None]}
_MAX_TOKENS = {**_null("integer"), "minimum": 1}
_TEMPERATURE = {**_null("number"), "minimum": 0}
_TOP_P = {**_null("number"), "exclusiveMinimum": 0, "maximum": 1}
_STOP = {"anyOf": [_STR, {"type": "array", "items": {"type": "string"}}]}
_THINKING = {"anyOf": [_null("boolean"), {"type": "object", "description": "type: enabled | disabled (others ignored)"}]}


def _obj(properties: dict, required: tuple = (), **extra) -> dict:
    return {"type": "object", "properties": properties, **({"required": list(required)} if required else {}), **extra}


# chat content: a string, an object or an array of strings and objects; from an object only its text is taken
_PART = {"anyOf": [_STR, _obj({"text": _STR})]}
_CONTENT = {"anyOf": [_PART, {"type": "array", "items": _PART}]}
_SAMPLING = {"temperature": _TEMPERATURE, "top_p": _TOP_P, "stream": _null("boolean"), "thinking": _THINKING,
             "think": _null("boolean"), "reasoning_effort": _EFFORT}
_OPENAI_ONLY = {"top_k": {**_null("integer"), "minimum": 0}, "min_p": {**_null("number"), "minimum": 0, "maximum": 1},
                "seed": _null("integer"), "stop": _STOP,
                "stream_options": {"anyOf": [{"type": "null"}, _obj({"include_usage": _null("boolean")})]}}


def _model(any_model: bool) -> dict:
    return _STR if any_model else {"enum": [*MODEL_ALIASES, None]}


def _chat(any_model: bool) -> dict:
    message = _obj({
        "role": {**_STR, "description": "system, developer, user, assistant, tool; other roles are ignored"},
        "content": _CONTENT, "reasoning_content": _CONTENT, "reasoning": _CONTENT, "tool_call_id": _STR,
        "tool_calls": {"anyOf": [{"type": "null"}, {"type": "array", "items": _obj({
            "id": _STR, "function": {"anyOf": [{"type": "null"}, _obj({"name": _ANY, "arguments": _ANY})]}})}]}})
    return _obj({"model": _model(any_model), **_SAMPLING, **_OPENAI_ONLY,
                 "messages": {"type": "array", "minItems": 1, "items": message},
                 "max_tokens": _MAX_TOKENS, "max_completion_tokens": _MAX_TOKENS,
                 "tools": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "object"}}]},
                 "tool_choice": _null("string", "object")}, ("messages",))


def _completions(any_model: bool) -> dict:
    prompt = {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}}],
              "description": "a string, or the first string of an array (token-id prompts are not supported)"}
    return _obj({"model": _model(any_model), **_SAMPLING, **_OPENAI_ONLY, "prompt": prompt,
                 "max_tokens": _MAX_TOKENS}, ("prompt",))


_TEXT_BLOCK = _obj({"type": {"enum": ["input_text", "output_text", "text", "summary_text", "reasoning_text"]},
                    "text": _STR}, ("type",))
_RESPONSES_CONTENT = {"anyOf": [_STR, {"type": "array", "items": {"anyOf": [{"type": "string"}, _TEXT_BLOCK]}}]}
_STATUS = {"enum": ["completed", None], "description": "items still in progress are not supported"}
_ROLE = {"enum": ["user", "assistant", "system", "developer", None]}
_TEXT_PARTS = {"anyOf": [{"type": "null"}, {"type": "array", "items": _obj({"text": _STR})}]}
_CALLS = ["function_call", "custom_tool_call", "local_shell_call", "web_search_call", "tool_search_call",
          "image_generation_call"]
_ITEM = {"anyOf": [
    _obj({"type": {"const": "message"}, "role": _ROLE, "content": _RESPONSES_CONTENT, "status": _STATUS}, ("type",)),
    _obj({"type": {"type": "null"}, "role": _ROLE, "content": _RESPONSES_CONTENT, "status": _STATUS}, ("role",),
         description="a message without a type"),
    _obj({"type": {"enum": _CALLS}, "call_id": _STR, "id": _STR, "name": _STR, "namespace": _STR,
          "arguments": _ANY, "input": _ANY, "action": _ANY, "status": _STATUS}, ("type",)),
    _obj({"type": {"type": "string", "pattern": "_output$"}, "call_id": _STR, "status": _STATUS,
          "output": {"anyOf": [_null("string", "object", "number", "boolean"),
                               {"type": "array", "items": {"anyOf": [{"type": "string"}, _TEXT_BLOCK]}}]}},
         ("type",)),
    _obj({"type": {"const": "reasoning"}, "summary": _TEXT_PARTS, "content": _TEXT_PARTS, "status": _STATUS},
         ("type",)),
    _obj({"type": {"enum": ["compaction", "context_compaction"]}, "status": _STATUS}, ("type",),
         description="ignored"),
]}


def _responses(any_model: bool) -> dict:
    return _obj({
        "model": _model(any_model), "temperature": _TEMPERATURE, "top_p": _TOP_P, "stream": _null("boolean"),
        "thinking": _THINKING, "think": _null("boolean"),
        "input": {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1, "items": _ITEM}]},
        "instructions": _STR, "max_output_tokens": _MAX_TOKENS, "max_tokens": _MAX_TOKENS,
        "reasoning": {"anyOf": [{"type": "null"}, _obj({"effort": _EFFORT, "summary": {
            **_STR, "description": "auto | concise | detailed stream the reasoning as a summary"}})]},
        "tools": {"anyOf": [{"type": "null"}, {"type": "array", "items": {
            "type": "object", "description": "function, namespace (flattened), tool_search; others ignored"}}]},
        "tool_choice": {"enum": ["none", "auto", None]},
        "previous_response_id": {"type": "null", "description": "not supported: replay the full input"},
        "conversation": {"type": "null", "description": "not supported: replay the full input"},
    }, ("input",))


_ANTHROPIC_BLOCK = {"anyOf": [
    {"type": "string"},
    _obj({"type": {"const": "text"}, "text": _STR}, ("type",)),
    _obj({"type": {"const": "thinking"}, "thinking": _STR}, ("type",)),
    _obj({"type": {"const": "tool_use"}, "id": _STR, "name": _STR, "input": _ANY}, ("type",)),
    _obj({"type": {"const": "tool_result"}, "tool_use_id": _STR, "content": _CONTENT}, ("type",)),
    {"type": "object", "not": _obj({"type": {"enum": ["text", "thinking", "tool_use", "tool_result"]}}, ("type",)),
     "description": "other blocks (images, documents, redacted thinking) are ignored"},
]}
_ANTHROPIC_MESSAGE = _obj({"role": {**_STR, "description": "user, assistant; other roles are ignored"},
                           "content": {"anyOf": [_STR, {"type": "array", "items": _ANTHROPIC_BLOCK}]}})


def _messages(any_model: bool, *, count: bool = False) -> dict:
    props = {
        "model": _model(any_model), "temperature": _TEMPERATURE, "top_p": _TOP_P,
        "top_k": {**_null("integer"), "minimum": 0}, "thinking": _THINKING, "think": _null("boolean"),
        "reasoning_effort": _EFFORT, "messages": {"type": "array", "minItems": 1, "items": _ANTHROPIC_MESSAGE},
        "system": {"anyOf": [_STR, {"type": "array", "items": {"anyOf": [
            {"type": "string"}, _obj({"text": {"type": "string"}}, ("text",))]}}]},
        "stop_sequences": _STOP, "tools": {"anyOf": [{"type": "null"}, {"type": "array", "items": {"type": "object"}}]},
        "tool_choice": _null("object"),
        "output_config": {"anyOf": [{"type": "null"}, _obj({"effort": _EFFORT})]},
    }
    if not count:  # count_tokens ignores both
        props.update(max_tokens=_MAX_TOKENS, stream=_null("boolean"))
    return _obj(props, ("messages",))


_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {"type": "object", "required": ["message"]}}}


def _json(description: str, schema: dict | None = None) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema or {"type": "object"}}}}


_ERRORS = {"400": _json("malformed request (the message names the field)", _ERROR),
           "401": _json("missing or wrong API key (serve --api-key)", _ERROR),
           "404": _json("unknown model", _ERROR),
           "409": _json("tool outputs for live state the server no longer holds", _ERROR),
           "413": _json("request body larger than serve --max-body-mb", _ERROR),
           "503": _json("model loading failed, or the server is shutting down", _ERROR)}


def _post(summary: str, body: dict, errors: dict = _ERRORS) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {"200": {"description": "JSON, or an SSE stream when stream is true",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": _obj({"event": {"type": "string"},
                                                                                "data": {"type": "string"}})}}},
                      **errors},
    }}


def _get(summary: str, responses: dict) -> dict:
    return {"get": {"summary": summary, "responses": responses}}


def openapi_document(version: str, *, any_model: bool = False) -> dict:
    model_id = {"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}
    count = _post("Anthropic token count", _messages(any_model, count=True),
                  {k: v for k, v in _ERRORS.items() if k != "409"})
    count["post"]["responses"]["200"] = _json("count", _obj({"input_tokens": {"type": "integer"}}, ("input_tokens",)))
    return {
        "openapi": "3.1.0",
        "info": {"title": "ds4-mlx serve", "version": version,
                 "description": "OpenAI and Anthropic compatible API for DeepSeek V4 Flash on MLX."},
        "paths": {
            "/health": _get("Liveness and queue state", {"200": _json("ok"), "503": _json("model failed to load")}),
            "/v1/stats": _get("Cache decisions and counters: hits, misses by reason, tokens reused and computed, "
                              "the disk cache", {"200": _json("counters"), "401": _json("no key", _ERROR),
                                                 "503": _json("model loading or failed")}),
            "/v1/models": _get("List models", {"200": _json("model list"), "401": _json("no key", _ERROR)}),
            "/v1/models/{model_id}": {"get": {"summary": "One model", "parameters": [model_id], "responses": {
                "200": _json("model"), "401": _json("no key", _ERROR), "404": _json("unknown model", _ERROR)}}},
            "/v1/chat/completions": _post("OpenAI chat completion", _chat(any_model)),
            "/v1/completions": _post("OpenAI legacy completion (chat-templated)", _completions(any_model)),
            "/v1/responses": _post("OpenAI Responses", _responses(any_model)),
            "/v1/messages": _post("Anthropic Messages", _messages(any_model)),
            "/v1/messages/count_tokens": count,
        },
    }
