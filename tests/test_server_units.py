"""Unit tests of the server's pure parts: streaming split of generated text, live tool-call fragments, the
exact-DSML replay map and thinking resolution."""

from __future__ import annotations

import json
import random

import pytest

from ds4_mlx.chat import Message, ThinkMode, ToolCall
from ds4_mlx.dsml import parse_output
from ds4_mlx.server.common import APIError, ToolMemory, resolve_thinking
from ds4_mlx.server.sse import DeltaSplitter, Reasoning, Text, ToolArgs, ToolEnd, ToolStart, live_tool_calls

D = "｜DSML｜"
BLOCK = (f'\n\n<{D}tool_calls>\n<{D}invoke name="bash">\n<{D}parameter name="cmd" string="true">'
         f'a &amp;&amp; b "q" \\ é</{D}parameter>\n<{D}parameter name="n" string="false">[1, {{"x": 2}}]'
         f'</{D}parameter>\n</{D}invoke>\n<{D}invoke name="x&amp;y">\n</{D}invoke>\n</{D}tool_calls>')


def _run(text: str, *, thinking: bool, tools: bool, seed: int) -> list:
    rng = random.Random(seed)
    sp, events, i = DeltaSplitter(thinking=thinking, tools=tools), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        events += sp.feed(text[i:i + n])
        i += n
    return events + sp.finish()


@pytest.mark.parametrize("seed", range(20))
def test_split_matches_final_parse(seed):
    text = "<think>why < not</think>Answer: x <y" + BLOCK
    ev = _run(text, thinking=True, tools=True, seed=seed)
    parsed = parse_output(text, thinking=True)
    assert "".join(e.text for e in ev if isinstance(e, Reasoning)) == parsed.reasoning == "why < not"
    assert "".join(e.text for e in ev if isinstance(e, Text)) == parsed.content == "Answer: x <y"
    starts = [(e.index, e.name) for e in ev if isinstance(e, ToolStart)]
    assert starts == [(0, "bash"), (1, "x&y")]
    for i, call in enumerate(parsed.calls):
        args = "".join(e.fragment for e in ev if isinstance(e, ToolArgs) and e.index == i)
        assert json.loads(args) == json.loads(call.arguments_json)
    assert [e.index for e in ev if isinstance(e, ToolEnd)] == [0, 1]
    # order: reasoning, then text, then tool events; DSML markup is never text
    kinds = [type(e).__name__ for e in ev]
    assert kinds.index("Text") > max(i for i, k in enumerate(kinds) if k == "Reasoning")
    assert all("DSML" not in e.text for e in ev if isinstance(e, Text))


def test_split_without_tools_streams_text_as_is():
    ev = _run("plain  text\n\n<b>", thinking=False, tools=False, seed=1)
    assert "".join(e.text for e in ev) == "plain  text\n\n<b>"
    ev = _run("<think>r</think>", thinking=True, tools=False, seed=2)
    assert [type(e) for e in ev] == [Reasoning] and ev[0].text == "r"


def test_live_tool_calls_hold_partial_entities_and_tags():
    head = f'<{D}tool_calls>\n<{D}invoke name="f">\n<{D}parameter name="s" string="true">a&am'
    assert live_tool_calls(head) == [("f", '{"s":"a', False)]
    assert live_tool_calls(head + "p;b</" + D) == [("f", '{"s":"a&b', False)]
    assert live_tool_calls(head + f"p;b</{D}parameter>\n</{D}invoke>") == [("f", '{"s":"a&b"}', True)]


def test_tool_memory_replays_only_a_shared_block():
    mem = ToolMemory(max_ids=3)
    mem.remember(["a", "b"], "BLOCK1")
    mem.remember(["c"], "BLOCK2")
    assert mem.lookup(["a", "b"]) == "BLOCK1"
    assert mem.lookup(["a", "c"]) is None and mem.lookup(["zz"]) is None
    msgs = [Message("assistant", calls=[ToolCall("c", "f", "{}")]), Message("assistant", calls=[ToolCall("q", "f", "{}")])]
    mem.apply(msgs)
    assert msgs[0].raw_dsml == "BLOCK2" and msgs[1].raw_dsml is None
    mem.remember(["d"], "BLOCK3")  # LRU: over 3 ids evicts the least recently used
    assert len([i for i in "abcd" if i in mem]) == 3


def test_resolve_thinking():
    assert resolve_thinking("deepseek-chat", 32768) is ThinkMode.NONE
    assert resolve_thinking("deepseek-reasoner", 32768) is ThinkMode.HIGH
    assert resolve_thinking("deepseek-v4-flash", 32768) is ThinkMode.HIGH
    assert resolve_thinking("deepseek-chat", 32768, thinking={"type": "enabled"}) is ThinkMode.HIGH
    assert resolve_thinking("deepseek-v4-flash", 32768, thinking={"type": "adaptive"}) is ThinkMode.HIGH
    assert resolve_thinking("deepseek-v4-flash", 32768, think=False) is ThinkMode.NONE
    assert resolve_thinking("deepseek-v4-flash", 32768, efforts={"reasoning_effort": "none"}) is ThinkMode.NONE
    assert resolve_thinking("deepseek-v4-flash", 32768, efforts={"reasoning_effort": "max"}) is ThinkMode.HIGH  # ctx gate
    assert resolve_thinking("deepseek-v4-flash", 400000, efforts={"reasoning_effort": "max"}) is ThinkMode.MAX
    with pytest.raises(APIError):
        resolve_thinking("deepseek-v4-flash", 32768, efforts={"reasoning_effort": "extreme"})


def test_model_loader_reserves_the_context(tiny_gguf):
    """The server's session sizes its compressed-row buffers for --ctx at their first write: they do not grow
    (a copy, a retrace and GPU kernel JITs mid-generation) while a conversation stays within the context."""
    from ds4_mlx.server.cli import model_loader

    ctx = 1000
    session, tokenizer = model_loader(tiny_gguf(), ctx)()
    assert session.reserve == ctx and tokenizer is not None
    session.prefill(list(range(5, 41)))
    caches = [c for c in session.caches if c.ratio]
    assert caches and all(c.n_comp > 0 and c.comp.shape[0] == -(-ctx // c.ratio) for c in caches)


def test_thinking_fills_only_the_knobs_the_client_left_out():
    """§3 as ds4 now does it: in thinking mode the client's explicit knobs win (temperature 0 stays greedy through
    the reasoning); ds4's fixed thinking defaults fill the omitted ones; DSML structure is greedy either way."""
    from ds4_mlx.sampling import THINKING_PARAMS, SamplingParams, server_params
    from ds4_mlx.server.common import sampling_of
    from ds4_mlx.server.worker import GenParams

    server_defaults = GenParams(temperature=0.6, top_p=0.9, top_k=40, min_p=0.1)  # serve --temp ... (non-thinking)
    p = sampling_of({"temperature": 0, "top_k": 7}, server_defaults)
    assert p.explicit == {"temperature", "top_k"} and (p.temperature, p.top_k, p.top_p) == (0.0, 7, 0.9)
    client = SamplingParams(p.temperature, p.top_p, p.top_k, p.min_p)
    assert server_params(client, thinking=True, explicit=p.explicit) == SamplingParams(0.0, 1.0, 7, 0.05)
    assert server_params(client, thinking=True) == THINKING_PARAMS
    assert server_params(client, thinking=False, explicit=p.explicit) == client
    assert server_params(client, thinking=True, dsml_structure=True, explicit=p.explicit).temperature == 0.0
    assert sampling_of({"temperature": None}, server_defaults).explicit == frozenset()


def test_trace_file_is_private(tmp_path):
    """The --trace log holds every prompt: created 0600, and an existing file is narrowed to 0600."""
    import os
    import stat

    from ds4_mlx.server.cli import _tracer

    new = tmp_path / "new.log"
    _tracer(new)("hello")
    assert stat.S_IMODE(new.stat().st_mode) == 0o600 and "hello" in new.read_text()
    old = tmp_path / "old.log"
    old.write_text("before\n")
    os.chmod(old, 0o644)
    _tracer(old)("after")
    assert stat.S_IMODE(old.stat().st_mode) == 0o600 and old.read_text().startswith("before\n")


def test_api_key_checks(monkeypatch):
    """Bearer or x-api-key, compared in constant time; the key can come from DS4_MLX_API_KEY."""
    import hmac
    import inspect

    from ds4_mlx.server import app
    from ds4_mlx.server.cli import serve

    calls = []
    real = hmac.compare_digest
    monkeypatch.setattr(app.hmac, "compare_digest", lambda a, b: calls.append((a, b)) or real(a, b))
    match = lambda headers: any(app._key_matches("s3cret", k) for k in app._sent_keys(headers))  # noqa: E731
    assert match({b"authorization": b"Bearer s3cret"}) and match({b"authorization": b"bearer s3cret"})
    assert match({b"x-api-key": b"s3cret"}) and match({b"x-api-key": b"no", b"authorization": b"Bearer s3cret"})
    assert not match({b"authorization": b"Bearer s3cre"}) and not match({b"authorization": b"s3cret"})
    assert not match({b"x-api-key": b"s3cret\xff"}) and not match({})
    assert calls and all(a == b"s3cret" for a, _ in calls)
    assert inspect.signature(serve).parameters["api_key"].default.envvar == "DS4_MLX_API_KEY"
