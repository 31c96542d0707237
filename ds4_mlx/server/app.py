"""The ASGI app (Starlette): routes, auth, CORS, errors, and the bridge between requests and the model worker.

Each POST is parsed and rendered by its API module, tokenized off the event loop, checked against the context,
then handed to the :class:`~ds4_mlx.server.worker.Worker` as a :class:`Job`. Streaming answers are SSE
that start with an event at once and send a keepalive *event* of their API (a chat chunk with an empty delta, a
Responses ``response.in_progress``, an Anthropic ``ping``) whenever nothing was written for ``keepalive`` seconds:
agent clients such as Codex count only events as activity, and a cold prefill can take minutes. A client that
goes away cancels its job, which frees the worker within a layer of the prefill or at the next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import hmac
import json
import math
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..chat import ThinkMode, render_chat, render_completion
from . import anthropic, bindings, openai, responses
from .common import DEFAULT_MAX_BODY_MB, MODEL_ALIASES, MODEL_ID, APIError, ChatRequest, ToolMemory, new_id, outcome
from .openapi import openapi_document
from .worker import GenParams, Job, Worker

MODEL_CREATED = 1767225600
MAX_JSON_DEPTH = 256  # ds4's JSON nesting limit (docs/serving.md §4.3)
TEST_HOOKS_ENV = "DS4_MLX_TEST_HOOKS"  # enables the X-DS4-Test-* request headers (tests only)


@dataclass
class ServerConfig:
    ctx: int = 32768
    default_max_tokens: int = 393216
    default_mode: ThinkMode = ThinkMode.HIGH
    sampling: GenParams = field(default_factory=GenParams)
    api_key: str | None = None
    cors: bool = False
    keepalive: float = 5.0
    max_body_bytes: int = DEFAULT_MAX_BODY_MB << 20
    any_model: bool = False
    tool_memory_max_ids: int = 100_000
    test_hooks: bool = field(default_factory=lambda: os.environ.get(TEST_HOOKS_ENV) == "1")


def _model_object(cfg: ServerConfig, model_id: str = MODEL_ID) -> dict:
    return {"id": model_id, "object": "model", "created": MODEL_CREATED, "owned_by": "ds4-mlx",
            "name": "DeepSeek V4 Flash", "context_length": cfg.ctx,
            "top_provider": {"context_length": cfg.ctx, "max_completion_tokens": min(cfg.default_max_tokens, cfg.ctx),
                             "is_moderated": False},
            "supported_parameters": ["tools", "tool_choice", "max_tokens", "temperature", "top_p", "top_k", "min_p",
                                     "stop", "seed", "stream", "reasoning_effort"]}


def error_response(kind: str, status: int, message: str, type: str = "invalid_request_error",
                   headers: dict | None = None, **extra: Any) -> JSONResponse:
    """§4.8 shapes: OpenAI ``{"error": {...}}``; Anthropic ``{"type": "error", "error": {...}}``."""
    if kind == "anthropic":
        return JSONResponse(anthropic.error_body(status, message, type, **extra), status_code=status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": type, **extra}}, status_code=status, headers=headers)


def kind_of(path: str) -> str:
    """Which API's error shape a path answers in."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _finite(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):
        raise ValueError(f"number {text[:40]} is out of range")
    return v


def _depth(obj: Any) -> int:
    """Nesting depth of parsed JSON, walked without recursion; stops counting past :data:`MAX_JSON_DEPTH`."""
    deepest, todo = 0, [(obj, 1)]
    while todo and deepest <= MAX_JSON_DEPTH:
        o, d = todo.pop()
        if isinstance(o, (dict, list)):
            deepest = max(deepest, d)
            todo.extend((v, d + 1) for v in (o.values() if isinstance(o, dict) else o))
    return deepest


def parse_body(raw: bytes) -> dict:
    """A request body as a JSON object: strict JSON (no NaN/Infinity, finite numbers), nested at most
    :data:`MAX_JSON_DEPTH` levels (deeper input would exhaust Python's recursion in the parser or later in
    ``json.dumps``); anything else is a 400."""
    too_deep = APIError(400, f"invalid JSON request: nested deeper than {MAX_JSON_DEPTH} levels")
    try:
        body = json.loads(raw, parse_constant=_no_constant, parse_float=_finite)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"invalid JSON request: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "invalid JSON request: the body must be a JSON object")
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    return body


class SSEResponse(StreamingResponse):
    """A stream that always watches for the client going away and always runs ``on_close`` (cancel the job)."""

    def __init__(self, content, on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def wrap(func) -> None:
                    await func()
                    tg.cancel_scope.cancel()

                tg.start_soon(wrap, partial(self.stream_response, send))
                await wrap(partial(self.listen_for_disconnect, receive))
        except OSError:
            pass
        finally:
            self.on_close()
            await self.body_iterator.aclose()


class Server:
    """Routes and request plumbing around one worker."""

    def __init__(self, worker: Worker, cfg: ServerConfig, trace: Callable[[str], None] | None = None) -> None:
        self.worker, self.cfg = worker, cfg
        self.memory = ToolMemory(cfg.tool_memory_max_ids)
        self.counter = itertools.count(1)
        self.trace = trace or (lambda s: None)

    # -- helpers ---------------------------------------------------------------------------------------------
    async def _body(self, request: Request) -> dict:
        """The JSON body, refused with 413 once it passes ``--max-body-mb`` (before it is parsed or tokenized)."""
        limit = self.cfg.max_body_bytes
        too_large = APIError(413, f"request body larger than {limit} bytes (serve --max-body-mb)")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise too_large
            chunks.append(chunk)
        return parse_body(b"".join(chunks))

    async def _ready(self) -> None:
        while not self.worker.ready.is_set():
            await asyncio.sleep(0.05)
        if self.worker.load_error:
            raise APIError(503, f"model failed to load: {self.worker.load_error}", type="server_error")
        if self.worker.stopping or not self.worker._thread.is_alive():
            raise APIError(503, "server shutting down", type="server_error")

    def _render(self, req: ChatRequest) -> tuple[str, list[int]]:
        if req.kind == "completions":
            text = render_completion(req.prompt or "", mode=req.mode)
        else:
            kv = self.worker.kv
            if kv is not None and self.memory.max_ids > 0:  # §5.6: tool ids replayed from earlier runs
                wanted = {c.id for m in req.messages if m.role == "assistant" for c in (m.calls or [])
                          if c.id not in self.memory}
                if wanted:
                    for i, block in kv.tool_ids(wanted, self.memory.max_ids).items():
                        self.memory.remember([i], block)
            self.memory.apply(req.messages)
            text = render_chat(req.messages, mode=req.mode, tools=req.tools, tool_choice=req.tool_choice)
        with self.worker.tok_lock:
            return text, self.worker.tokenizer.encode_chat(text)

    # -- routes ----------------------------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        w = self.worker
        status = "error" if w.load_error else "ok" if w.ready.is_set() else "loading"
        active = sum(s.job is not None for s in w.slots)
        return JSONResponse({"status": status, "model": MODEL_ID, "ctx": self.cfg.ctx, "busy": w.busy,
                             "queued": w.queued, "served": w.served, "error": w.load_error,
                             "sessions": {"total": w.n_sessions, "active": active, "idle": w.n_sessions - active}},
                            status_code=503 if w.load_error else 200)

    async def stats(self, request: Request) -> Response:
        """Cache decisions and counters (hits, misses by reason, tokens reused/computed, disk cache files)."""
        w = self.worker
        if not w.ready.is_set() or w.load_error:
            return JSONResponse({"status": "loading" if not w.ready.is_set() else "error"}, status_code=503)
        return JSONResponse(w.stats())

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [_model_object(self.cfg)]})

    async def model(self, request: Request) -> Response:
        mid = request.path_params["model_id"]
        if mid not in MODEL_ALIASES and not self.cfg.any_model:
            return error_response("openai", 404, f"The model '{mid}' does not exist", code="model_not_found")
        return JSONResponse(_model_object(self.cfg, mid))

    async def openapi(self, request: Request) -> Response:
        from .. import __version__

        return JSONResponse(openapi_document(__version__, any_model=self.cfg.any_model))

    async def count_tokens(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            req = anthropic.parse_messages({**body, "max_tokens": None, "stream": None}, self.cfg)
            await self._ready()
            _, tokens = await anyio.to_thread.run_sync(self._render, req)
        except APIError as e:
            return error_response("anthropic", e.status, e.message, e.type, **e.extra)
        return JSONResponse({"input_tokens": len(tokens)})

    def endpoint(self, kind: str, parse: Callable[[dict, ServerConfig], ChatRequest]):
        async def handle(request: Request) -> Response:
            try:
                body = await self._body(request)
                req = parse(body, self.cfg)
                await self._ready()
                # §4.8: tool outputs must be replayed with their calls or answer the live ones (else 400)
                requires_live = bindings.check_tool_outputs(req, self.worker.live_call_ids(kind))
                text, tokens = await anyio.to_thread.run_sync(self._render, req)
                if len(tokens) >= self.cfg.ctx:
                    msg = f"Prompt has {len(tokens)} tokens, but the configured context size is {self.cfg.ctx} tokens"
                    extra = {"n_prompt_tokens": len(tokens), "n_ctx": self.cfg.ctx}
                    if kind != "anthropic":
                        extra = {"param": req.param, "code": "context_length_exceeded", **extra}
                    raise APIError(400, msg, **extra)
            except APIError as e:
                return error_response(kind, e.status, e.message, e.type, **e.extra)
            self.trace(f"=== {kind} request: {json.dumps(body, ensure_ascii=False)[:20000]}")
            job = Job(kind, text, tokens, req.mode, req.params, tools_active=req.tools_active,
                      tool_context=req.tool_context, continuation=bindings.continuation(req, requires_live),
                      loop=asyncio.get_running_loop(), events=asyncio.Queue())
            if self.cfg.test_hooks:
                if "x-ds4-test-output" in request.headers:
                    job.test_output = json.loads(request.headers["x-ds4-test-output"])
                job.prefill_delay = float(request.headers.get("x-ds4-test-prefill-delay", 0))
            n = next(self.counter)
            self.worker.submit(job)
            first = None
            if req.stream and requires_live:
                # the worker may still refuse it (409): wait for its verdict before committing to a 200 stream
                first = await self._next_event(job, request)
                if first is None:
                    return Response(status_code=499)
                if first[0] == "error":
                    return error_response(kind, first[1], first[2], *first[3:4])
            if req.stream:
                return SSEResponse(self._stream(kind, req, job, n, first), on_close=job.cancel)
            return await self._complete(kind, req, job, n, request)
        return handle

    async def _next_event(self, job: Job, request: Request):
        """The job's next event, or ``None`` (job cancelled) if the client went away while waiting."""
        while True:
            try:
                return await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return None

    def _bind(self, kind: str, req: ChatRequest, job: Job, result, oc) -> None:
        """§5.3: remember the live frontier of a finished Responses turn (visible text + call ids) or Anthropic
        tool turn (call ids) — before the client can see the answer and send its follow-up."""
        if oc.finish in ("error", "length"):
            return
        ids = [c.id for c in oc.calls]
        if kind == "responses":
            visible = bindings.responses_visible(job.prompt_text, req, oc, exact_dsml=self.memory.max_ids > 0)
            self.worker.bind(kind, result, ids, visible)
        elif kind == "anthropic" and ids:
            self.worker.bind(kind, result, ids)

    async def _complete(self, kind: str, req: ChatRequest, job: Job, n: int, request: Request) -> Response:
        while True:
            try:
                ev = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    job.cancel()
                    return Response(status_code=499)
                continue
            if ev[0] == "error":
                return error_response(kind, ev[1], ev[2], ev[3] if len(ev) > 3 else "server_error")
            if ev[0] != "done":
                continue
            result = ev[1]
            created = int(time.time())
            if kind == "completions":
                oc = outcome(req, result, id_prefix="call_")
                return JSONResponse(openai.completion_response(req, oc, f"cmpl-{n}", created))
            prefix = "toolu_" if kind == "anthropic" else "call_"
            oc = outcome(req, result, id_prefix=prefix, memory=self.memory)
            self._bind(kind, req, job, result, oc)
            if kind == "chat":
                return JSONResponse(openai.chat_response(req, oc, f"chatcmpl-{n}", created))
            if kind == "anthropic":
                return JSONResponse(anthropic.message_response(req, oc, new_id("msg_", 12)))
            return JSONResponse(responses.ResponseBuilder(req).response(oc))

    async def _stream(self, kind: str, req: ChatRequest, job: Job, n: int, first: tuple | None = None):
        created = int(time.time())
        if kind == "chat":
            st = openai.ChatStream(req, f"chatcmpl-{n}", created, memory=self.memory)
        elif kind == "completions":
            st = openai.CompletionStream(req, f"cmpl-{n}", created)
        elif kind == "anthropic":
            st = anthropic.MessageStream(req, new_id("msg_", 12), memory=self.memory)
        else:
            st = responses.ResponseStream(req, memory=self.memory)
        keepalive = self.cfg.keepalive
        last = time.monotonic()
        yield st.open()  # headers and a first event right away: clients' idle timers start now
        while True:
            try:
                if first is not None:
                    ev, first = first, None
                else:
                    ev = await asyncio.wait_for(job.events.get(),
                                                timeout=max(0.01, keepalive - (time.monotonic() - last)))
            except asyncio.TimeoutError:  # queued, prefilling, or text held back: an event the client counts
                last = time.monotonic()
                yield st.keepalive()
                continue
            out = b""
            if ev[0] == "start":
                out = st.start(ev[1])
            elif ev[0] == "prefill":
                continue
            elif ev[0] == "text":
                out = st.text(ev[1])
            elif ev[0] == "done":
                out = st.done(ev[1])
                if getattr(st, "outcome", None) is not None:
                    self._bind(kind, req, job, ev[1], st.outcome)
                yield out
                return
            elif ev[0] == "error":
                yield st.error(ev[2])
                return
            if out:
                last = time.monotonic()
                yield out


def _sent_keys(headers: dict[bytes, bytes]) -> list[bytes]:
    """The keys a request offers: ``Authorization: Bearer KEY`` and ``x-api-key: KEY``."""
    auth = headers.get(b"authorization", b"")
    keys = [headers[b"x-api-key"]] if b"x-api-key" in headers else []
    return keys + ([auth[7:]] if auth[:7].lower() == b"bearer " else [])


def _key_matches(key: str, sent: bytes) -> bool:
    return hmac.compare_digest(key.encode(), sent)  # constant time: no timing oracle for the key's prefix


def _asgi_wrap(app, cfg: ServerConfig):
    """Auth (``--api-key``: Bearer or x-api-key), CORS (``--cors``) and ``OPTIONS`` -> 204, in front of the app."""
    cors = [(b"access-control-allow-origin", b"*"), (b"access-control-allow-methods", b"GET, POST, OPTIONS"),
            (b"access-control-allow-headers", b"*")]

    async def wrapped(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_cors(msg):
            if msg["type"] == "http.response.start" and cfg.cors:
                msg = {**msg, "headers": list(msg.get("headers", [])) + cors}
            await send(msg)

        if scope["method"] == "OPTIONS":
            await send_cors({"type": "http.response.start", "status": 204, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        if cfg.api_key and scope["path"] not in ("/health", "/openapi.json"):
            headers = dict(scope.get("headers") or [])
            if not any(_key_matches(cfg.api_key, sent) for sent in _sent_keys(headers)):
                resp = error_response(kind_of(scope["path"]), 401, "invalid or missing API key", "authentication_error")
                return await resp(scope, receive, send_cors)
        await app(scope, receive, send_cors)

    return wrapped


def create_app(worker: Worker, cfg: ServerConfig, trace: Callable[[str], None] | None = None, *,
               stop_worker: bool = False):
    """The ASGI application. The caller starts the worker (``worker.start()``) or lets the lifespan do it.

    ``stop_worker``: stop the worker when the lifespan ends even if the caller started it (``serve`` does:
    uvicorn re-raises SIGINT/SIGTERM after its shutdown, so the worker's shutdown save must happen inside it).
    """
    srv = Server(worker, cfg, trace)
    worker.tool_memory = srv.memory

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = kind_of(request.url.path)
        if exc.status_code == 405:  # a known route, another method
            return error_response(kind, 405, f"method {request.method} not allowed on {request.url.path}",
                                  headers=exc.headers)
        return error_response(kind, 404, "unknown endpoint")

    async def server_error(request: Request, exc: Exception) -> Response:
        return error_response(kind_of(request.url.path), 500, f"internal error: {type(exc).__name__}", "server_error")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        owned = not worker._thread.is_alive() and not worker.ready.is_set()
        if owned:  # started here -> stopped here; a worker started by the caller is the caller's to stop
            worker.start()
        yield
        if stop_worker:
            await anyio.to_thread.run_sync(worker.stop, 30.0)
        elif owned:
            worker.stopping = True
            worker.jobs.put(None)

    routes = [
        Route("/health", srv.health, methods=["GET"]),
        Route("/openapi.json", srv.openapi, methods=["GET"]),
        Route("/v1/stats", srv.stats, methods=["GET"]),
        Route("/v1/models", srv.models, methods=["GET"]),
        Route("/v1/models/{model_id:path}", srv.model, methods=["GET"]),
        Route("/v1/chat/completions", srv.endpoint("chat", openai.parse_chat), methods=["POST"]),
        Route("/v1/completions", srv.endpoint("completions", openai.parse_completion), methods=["POST"]),
        Route("/v1/responses", srv.endpoint("responses", responses.parse_responses), methods=["POST"]),
        Route("/v1/messages", srv.endpoint("anthropic", anthropic.parse_messages), methods=["POST"]),
        Route("/v1/messages/count_tokens", srv.count_tokens, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: http_error, 405: http_error, Exception: server_error})
    app.state.server = srv
    return _asgi_wrap(app, cfg)
