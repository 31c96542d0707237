"""The server's OpenAPI 3.0 document (served at ``/openapi.json``; schemathesis tests against it).

Written by hand rather than generated: the endpoints accept the loose bodies real clients send (SERVING.md §11)
and answer bad input with each API's own error shape (§4.8), which a validating framework would replace.
"""

from __future__ import annotations

_str_or_parts = {"oneOf": [{"type": "string"}, {"type": "array", "items": {
    "oneOf": [{"type": "string"}, {"type": "object", "properties": {"type": {"type": "string"},
                                                                   "text": {"type": "string"}}}]}}]}
_sampling = {
    "model": {"type": "string"},
    "temperature": {"type": "number"},
    "top_p": {"type": "number"},
    "top_k": {"type": "integer"},
    "min_p": {"type": "number"},
    "seed": {"type": "integer"},
    "stream": {"type": "boolean"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "reasoning_effort": {"type": "string", "enum": ["max", "xhigh", "high", "medium", "low", "minimal", "none"]},
    "thinking": {"oneOf": [{"type": "boolean"}, {"type": "object", "properties": {
        "type": {"type": "string", "enum": ["enabled", "disabled", "adaptive"]}}}]},
}
_tool = {"type": "object", "properties": {"type": {"type": "string"}, "function": {"type": "object", "properties": {
    "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}
_error = {"type": "object", "properties": {"error": {"type": "object"}}}


def _op(summary: str, body: dict, required: list[str]) -> dict:
    return {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "properties": body, "required": required}}}},
        "responses": {"200": {"description": "JSON, or an SSE stream when stream is true",
                              "content": {"application/json": {"schema": {"type": "object"}},
                                          "text/event-stream": {"schema": {"type": "string"}}}},
                      "400": {"description": "bad request", "content": {"application/json": {"schema": _error}}},
                      "404": {"description": "unknown model", "content": {"application/json": {"schema": _error}}}},
    }


def openapi_document(version: str) -> dict:
    chat = {**_sampling,
            "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": _str_or_parts, "reasoning_content": {"type": "string"},
                "tool_call_id": {"type": "string"},
                "tool_calls": {"type": "array", "items": {"type": "object", "properties": {
                    "id": {"type": "string"}, "type": {"type": "string"},
                    "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                                  "arguments": {"type": "string"}}}}}}},
                "required": ["role"]}},
            "max_tokens": {"type": "integer", "minimum": 1},
            "max_completion_tokens": {"type": "integer", "minimum": 1},
            "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
            "tools": {"type": "array", "items": _tool},
            "tool_choice": {"oneOf": [{"type": "string"}, {"type": "object"}]}}
    completions = {**_sampling, "prompt": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
                   "max_tokens": {"type": "integer", "minimum": 1},
                   "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}}}
    responses = {**_sampling,
                 "input": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object", "properties": {
                     "type": {"type": "string"}, "role": {"type": "string"}, "content": _str_or_parts,
                     "call_id": {"type": "string"}, "name": {"type": "string"}, "arguments": {"type": "string"},
                     "output": {"type": "string"}}}}]},
                 "instructions": {"type": "string"},
                 "max_output_tokens": {"type": "integer", "minimum": 1},
                 "reasoning": {"type": "object", "properties": {
                     "effort": {"type": "string", "enum": ["max", "xhigh", "high", "medium", "low", "minimal", "none"]},
                     "summary": {"type": "string", "enum": ["auto", "concise", "detailed"]}}},
                 "tools": {"type": "array", "items": {"type": "object"}},
                 "tool_choice": {"type": "string", "enum": ["none", "auto"]}}
    messages = {**{k: v for k, v in _sampling.items() if k not in ("stop", "min_p", "seed")},
                "messages": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
                    "role": {"type": "string", "enum": ["user", "assistant"]},
                    "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]}},
                    "required": ["role", "content"]}},
                "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "object"}}]},
                "max_tokens": {"type": "integer", "minimum": 1},
                "stop_sequences": {"type": "array", "items": {"type": "string"}},
                "tools": {"type": "array", "items": {"type": "object"}},
                "tool_choice": {"type": "object"}}
    models = {"summary": "List models", "responses": {"200": {"description": "model list", "content": {
        "application/json": {"schema": {"type": "object"}}}}}}
    return {
        "openapi": "3.0.3",
        "info": {"title": "ds4-mlx serve", "version": version,
                 "description": "OpenAI and Anthropic compatible API for DeepSeek V4 Flash on MLX."},
        "paths": {
            "/health": {"get": {"summary": "Liveness and queue state", "responses": {"200": {
                "description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}}}},
            "/v1/models": {"get": models},
            "/v1/models/{model_id}": {"get": {
                "summary": "One model", "parameters": [{"name": "model_id", "in": "path", "required": True,
                                                        "schema": {"type": "string"}}],
                "responses": {"200": {"description": "model", "content": {"application/json": {"schema": {
                    "type": "object"}}}}, "404": {"description": "unknown model", "content": {
                        "application/json": {"schema": _error}}}}}},
            "/v1/chat/completions": {"post": _op("OpenAI chat completion", chat, ["messages"])},
            "/v1/completions": {"post": _op("OpenAI legacy completion (chat-templated)", completions, ["prompt"])},
            "/v1/responses": {"post": _op("OpenAI Responses", responses, ["input"])},
            "/v1/messages": {"post": _op("Anthropic Messages", messages, ["messages", "max_tokens"])},
            "/v1/messages/count_tokens": {"post": {
                "summary": "Anthropic token count",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"model": {"type": "string"}, "messages": messages["messages"],
                                                     "system": messages["system"]}, "required": ["messages"]}}}},
                "responses": {"200": {"description": "count", "content": {"application/json": {"schema": {
                    "type": "object", "properties": {"input_tokens": {"type": "integer"}}}}}},
                              "400": {"description": "bad request", "content": {"application/json": {
                                  "schema": _error}}}}}},
        },
    }
