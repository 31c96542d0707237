"""``ds4-mlx serve``: OpenAI (chat, completions, responses) and Anthropic (messages) APIs over one model worker.

``app`` (ASGI routes) · ``worker`` (the single model thread, prefix reuse, generation) · ``openai`` /
``responses`` / ``anthropic`` (request parsing and wire formats) · ``sse`` (events, streaming text split) ·
``common`` (shared request model, errors, usage, tool replay memory) · ``cli`` (the ``serve`` command).
"""

from .app import ServerConfig, create_app
from .cli import run_server, serve
from .worker import GenParams, Job, Worker

__all__ = ["ServerConfig", "create_app", "run_server", "serve", "GenParams", "Job", "Worker"]
