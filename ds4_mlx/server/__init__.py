"""``ds4-mlx serve``: OpenAI (chat, completions, responses) and Anthropic (messages) APIs over one model worker.

``app`` (ASGI routes) · ``worker`` (the single model thread, prefix reuse, generation) · ``openai`` /
``responses`` / ``anthropic`` (request parsing and wire formats) · ``sse`` (events, streaming text split) ·
``common`` (shared request model, errors, usage, tool replay memory) · ``cli`` (the ``serve`` command).
Nothing is imported here, so ``ds4-mlx`` commands other than ``serve`` never load the ASGI stack.
"""
