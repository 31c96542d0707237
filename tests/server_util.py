"""Helpers for the server tests: a real ``ds4-mlx serve`` subprocess on a free port, and a fast fake engine for
in-process tests (schemathesis, auth/CORS) that only need the HTTP layer."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DSML = "｜DSML｜"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: Path, *args: str, fake: bool = False, timeout: float = 90.0) -> tuple[subprocess.Popen, str]:
    """Start ``ds4-mlx serve -m model --port P args…`` with the test hooks on; -> (process, base URL) once ready.

    ``fake=True`` serves the same HTTP stack over :class:`FakeSession` (the GGUF gives only the tokenizer)."""
    port = free_port()
    # the repository first, then whatever the caller's PYTHONPATH holds (MLX may be found only through it)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "DS4_MLX_TEST_HOOKS": "1", "PYTHONPATH": path}
    entry = ("from tests.server_util import serve_fake; serve_fake()" if fake
             else "from ds4_mlx.server.cli import main; main()")
    cmd = [sys.executable, "-c", entry, "-m", str(model), "--port", str(port), *args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {proc.stdout.read().decode(errors='replace')}")
        try:
            if httpx.get(base + "/health", timeout=2).json()["status"] == "ok":
                return proc, base
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError("server did not become ready")
        time.sleep(0.2)


def stop_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)
    proc.stdout.close()


@contextlib.contextmanager
def running_server(model: Path, *args: str, fake: bool = False, timeout: float = 90.0):
    """:func:`start_server` as a context: yield the base URL, stop the server at the end."""
    proc, base = start_server(model, *args, fake=fake, timeout=timeout)
    try:
        yield base
    finally:
        stop_server(proc)


def dsml_call(name: str, params: dict, *, prefix: str = "") -> str:
    """Text of one DSML tool-call block as the model writes it (string params raw, others JSON)."""
    import json

    body = ""
    for k, v in params.items():
        if isinstance(v, str):
            body += f'<{DSML}parameter name="{k}" string="true">{v}</{DSML}parameter>\n'
        else:
            body += f'<{DSML}parameter name="{k}" string="false">{json.dumps(v)}</{DSML}parameter>\n'
    return (f'{prefix}\n\n<{DSML}tool_calls>\n<{DSML}invoke name="{name}">\n{body}</{DSML}invoke>\n'
            f"</{DSML}tool_calls>")


class FakeSession:
    """Session-shaped stand-in with pseudo-random logits from (position, last token): microseconds per token."""

    chunk_size = 64

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.reset()

    def sibling(self) -> FakeSession:
        return FakeSession(self.vocab)

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.logits = None

    @property
    def pos(self) -> int:
        return len(self.tokens)

    def _logits(self):
        rng = np.random.default_rng(self.pos * 1_000_003 + (self.tokens[-1] if self.tokens else 0))
        return rng.standard_normal(self.vocab).astype(np.float32) * 3

    def prefill(self, tokens, should_stop=None) -> np.ndarray:
        self.tokens.extend(int(t) for t in tokens)
        self.logits = self._logits()
        return self.logits

    def step(self, token) -> np.ndarray:
        return self.prefill([int(token.item()) if hasattr(token, "item") else token])  # a drawn id (mx.array)

    def rewind_point(self):
        return list(self.tokens), self.logits

    def rewind(self, point) -> None:
        self.tokens, self.logits = list(point[0]), point[1]

    def state_arrays(self) -> list:
        return []  # no MLX state (a StepEncoder has nothing to settle first)


def fake_loader(gguf: Path):
    def load():
        from ds4_mlx.gguf_file import open_gguf
        from ds4_mlx.tokenizer import Tokenizer

        tok = Tokenizer.from_gguf(open_gguf(gguf).tokenizer)
        return FakeSession(tok.vocab_size), tok

    return load


def fake_app(gguf: Path, **cfg):
    """An in-process ASGI app over the fake engine (its worker thread already started and loaded)."""
    from ds4_mlx.server.app import ServerConfig, create_app
    from ds4_mlx.server.worker import Worker

    config = ServerConfig(**cfg)
    worker = Worker(fake_loader(gguf), ctx=config.ctx, default_max_tokens=config.default_max_tokens)
    worker.start()
    worker.ready.wait(60)
    return create_app(worker, config), worker


def serve_fake(argv: list[str] | None = None) -> None:
    """``serve`` with the fake engine: the real command line, but the model loader swapped."""
    from ds4_mlx.server import cli

    cli.model_loader = lambda path, ctx, *_: fake_loader(path)
    cli.main(argv)
