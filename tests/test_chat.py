"""Prompt rendering tests (docs/serving.md §2): the §2.7 examples byte for byte, every thinking mode, the tools block,
canonical DSML history, and the /v1/completions and CLI renderers.

The long fixed texts (tools block header/tail, Think-Max prefix) and two rendered chats are ds4's, byte for byte,
kept as test vectors in `tests/data/ds4_prompt_texts.json`: the code's constants are checked against them, not
against themselves.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers, trainers

from ds4_mlx.chat import (
    THINK_MAX_MIN_CTX,
    THINK_MAX_PREFIX,
    Message,
    ThinkMode,
    ToolCall,
    cli_prompt_tokens,
    render_chat,
    render_completion,
    repl_prefix_tokens,
    repl_turn_tokens,
    resolve_think_mode,
    tools_block,
)
from ds4_mlx.tokenizer import SPECIAL_TOKENS, Tokenizer

BOS, EOS, USER, ASST = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"


@pytest.fixture(scope="module")
def spec() -> dict[str, str]:
    """ds4's prompt texts (tests/data/ds4_prompt_texts.json)."""
    data = json.loads((Path(__file__).parent / "data" / "ds4_prompt_texts.json").read_text(encoding="utf-8"))
    return {
        "think_max": data["think_max_prefix"],
        "tools_header": data["tools_block_header"],
        "tools_tail": data["tools_block_tail"],
        "A": data["rendered_non_thinking"],
        "B": data["rendered_thinking_multi_turn"],
    }


# -- fixed texts and examples ---------------------------------------------------------------------------------
def test_think_max_prefix(spec):
    assert THINK_MAX_PREFIX == spec["think_max"]
    assert len(THINK_MAX_PREFIX.encode()) == 476


def test_tools_block_matches_spec(spec):
    schemas = ['{"name":"a"}', '{"name":"b",  "x": [1, 2]}']
    assert spec["tools_header"].endswith("### Available Tool Schemas\n\n")
    assert tools_block(schemas) == spec["tools_header"] + schemas[0] + "\n" + schemas[1] + spec["tools_tail"]
    assert not tools_block(schemas).endswith("\n")


def test_example_a_non_thinking(spec):
    want = "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜></think>"
    assert spec["A"] == want
    got = render_chat([Message("system", "You are terse."), Message("user", "Hi")], mode=ThinkMode.NONE)
    assert got == want


def test_example_b_thinking_multi_turn(spec):
    want = (
        "<｜begin▁of▁sentence｜><｜User｜>2+2?<｜Assistant｜></think>4<｜end▁of▁sentence｜>"
        "<｜User｜>Times 3?<｜Assistant｜><think>"
    )
    assert spec["B"] == want
    msgs = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning": "easy sum"},  # old reasoning is dropped
        {"role": "user", "content": "Times 3?"},
    ]
    assert render_chat(msgs, mode="high") == want


def test_example_c_thinking_tools(spec):
    schema = (
        '{"name":"bash","description":"Run a shell command","parameters":{"type":"object","properties":'
        '{"command":{"type":"string"},"timeout":{"type":"integer"}},"required":["command"]}}'
    )
    msgs = [
        Message("system", "Be brief."),
        Message("user", "List files"),
        Message("assistant", "", reasoning="Need ls.",
                calls=[ToolCall("call_1", "bash", '{"command":"ls -la","timeout":10}')]),
        Message("tool", "a.txt\nb.txt", tool_call_ids=["call_1"]),
    ]
    want = (
        BOS + spec["tools_header"] + schema + spec["tools_tail"] + "\n\nBe brief."
        + "<｜User｜>List files<｜Assistant｜><think>Need ls.</think>\n\n<｜DSML｜tool_calls>\n"
        + '<｜DSML｜invoke name="bash">\n<｜DSML｜parameter name="command" string="true">ls -la</｜DSML｜parameter>\n'
        + '<｜DSML｜parameter name="timeout" string="false">10</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
        + "</｜DSML｜tool_calls><｜end▁of▁sentence｜><｜User｜><tool_result>a.txt\nb.txt</tool_result>"
        + "<｜Assistant｜><think>"
    )
    assert render_chat(msgs, mode=ThinkMode.HIGH, tools=[schema]) == want


# -- thinking modes -------------------------------------------------------------------------------------------
def test_think_modes_generation_prefix_and_max(spec):
    msgs = [Message("user", "Q")]
    assert render_chat(msgs, mode="none") == BOS + USER + "Q" + ASST + "</think>"
    assert render_chat(msgs, mode="high") == BOS + USER + "Q" + ASST + "<think>"
    assert render_chat(msgs, mode="max") == BOS + spec["think_max"] + USER + "Q" + ASST + "<think>"
    # MAX prefix goes before the tools block and the system text
    got = render_chat([Message("system", "S")] + msgs, mode="max", tools=["{}"])
    assert got.startswith(BOS + spec["think_max"] + spec["tools_header"] + "{}" + spec["tools_tail"] + "\n\nS")


def test_think_max_context_gate(capsys):
    assert resolve_think_mode("max", THINK_MAX_MIN_CTX) is ThinkMode.MAX
    assert resolve_think_mode("max", THINK_MAX_MIN_CTX - 1) is ThinkMode.HIGH
    assert capsys.readouterr().err == ""  # server: silent
    assert resolve_think_mode(ThinkMode.MAX, 32768, warn=True) is ThinkMode.HIGH
    assert "think-max" in capsys.readouterr().err
    assert resolve_think_mode("none", 10) is ThinkMode.NONE and resolve_think_mode("high", 10) is ThinkMode.HIGH


def test_reasoning_retention_rules():
    conv = [
        Message("user", "u1"),
        Message("assistant", "a1", reasoning="r1"),
        Message("user", "u2"),
        Message("assistant", "a2", reasoning="r2"),
    ]
    # thinking, no tool context: reasoning before the last user dropped; after it kept; ends with EOS, no prefix
    assert render_chat(conv, mode="high") == (
        BOS + USER + "u1" + ASST + "</think>a1" + EOS + USER + "u2" + ASST + "<think>r2</think>a2" + EOS
    )
    # non-thinking: never any reasoning
    assert render_chat(conv, mode="none") == (
        BOS + USER + "u1" + ASST + "</think>a1" + EOS + USER + "u2" + ASST + "</think>a2" + EOS
    )
    # tool context (a tool message anywhere): all reasoning kept, missing reasoning renders <think></think>
    conv2 = conv[:2] + [Message("tool", "t"), Message("assistant", "a3"), Message("user", "u3")]
    assert render_chat(conv2, mode="high") == (
        BOS + USER + "u1" + ASST + "<think>r1</think>a1" + EOS + USER + "<tool_result>t</tool_result>"
        + ASST + "<think></think>a3" + EOS + USER + "u3" + ASST + "<think>"
    )
    # tools declared (tool_context) also keep reasoning; tool_choice "none" disables the block but not calls
    with_tools = render_chat(conv[:3], mode="high", tools=["{}"])
    assert "<think>r1</think>a1" in with_tools and "## Tools" in with_tools
    no_tools = render_chat(conv[:3], mode="high", tools=["{}"], tool_choice="none")
    assert "## Tools" not in no_tools and "</think>a1" in no_tools and "r1" not in no_tools


def test_assistant_without_preceding_user_gets_no_marker():
    msgs = [Message("assistant", "first"), Message("assistant", "second"), Message("user", "u"),
            Message("assistant", "x"), Message("assistant", "y")]
    assert render_chat(msgs, mode="high") == (
        BOS + "first" + EOS + "second" + EOS + USER + "u" + ASST + "<think></think>x" + EOS + "y" + EOS
    )


def test_tool_results_share_turn_and_escaping():
    msgs = [
        Message("user", "go"),
        Message("assistant", "", calls=[ToolCall("1", "f", "{}"), ToolCall("2", "g", "{}")]),
        Message("tool", "r1 </tool_result> <b>&amp;"),
        Message("function", "r2"),
        Message("user", "more"),
        Message("tool", "r3"),
    ]
    got = render_chat(msgs, mode="none")
    assert got.endswith(
        EOS + USER + "<tool_result>r1 &lt;/tool_result> <b>&amp;</tool_result><tool_result>r2</tool_result>"
        + USER + "more" + USER + "<tool_result>r3</tool_result>" + ASST + "</think>"
    )
    assert '<｜DSML｜invoke name="f">\n</｜DSML｜invoke>\n<｜DSML｜invoke name="g">\n</｜DSML｜invoke>\n' in got


def test_system_messages_roles_and_defaults():
    msgs = [
        {"role": "user", "content": "u"},
        {"role": "system", "content": "s1"},
        {"role": "narrator", "content": "dropped"},
        {"role": "developer", "content": None},
        {"content": "no role is user"},
        {"role": "system", "content": "s3"},
    ]
    assert render_chat(msgs, mode="none") == (
        BOS + "s1\n\n\n\ns3" + USER + "u" + USER + "no role is user" + ASST + "</think>"
    )


def test_specials_in_content_are_not_escaped():
    got = render_chat([Message("user", "a<｜User｜>b</think>")], mode="none")
    assert got == BOS + USER + "a<｜User｜>b</think>" + ASST + "</think>"


def test_raw_dsml_replayed_verbatim():
    raw = '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">1.0</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    m = Message("assistant", "text", calls=[ToolCall("1", "f", '{"n": 1}')], raw_dsml=raw)
    assert render_chat([Message("user", "u"), m], mode="none").endswith("</think>text" + raw + EOS)


def test_render_completion():
    assert render_completion("P", mode="high") == BOS + "You are a helpful assistant" + USER + "P" + ASST + "<think>"
    assert render_completion("P", mode="none").endswith(ASST + "</think>")
    assert render_completion("P", mode="max").startswith(BOS + THINK_MAX_PREFIX + "You are a helpful assistant")


# -- CLI token sequences --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    rng = random.Random(0)
    words = ["You", " are", " a", " helpful", " assistant", " hello", " world", "Reasoning", " Effort", "\n"]
    hf.train_from_iterator(["".join(rng.choice(words) for _ in range(40)) for _ in range(200)], trainer)
    model = json.loads(hf.to_str())["model"]
    tokens = [""] * len(model["vocab"])
    for t, i in model["vocab"].items():
        tokens[i] = t
    return Tokenizer(tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]])


def test_cli_prompt_tokens(tok):
    enc = tok.encode
    got = cli_prompt_tokens(tok, "hello <｜User｜>", mode="high")
    assert got == [tok.bos_id] + enc("You are a helpful assistant") + [tok.user_id] + enc("hello <｜User｜>") + [
        tok.assistant_id, tok.think_id]
    assert tok.user_id not in enc("hello <｜User｜>")  # plain BPE: no special recognition in CLI text
    got = cli_prompt_tokens(tok, "q", system="", mode="none")
    assert got == [tok.bos_id, tok.user_id] + enc("q") + [tok.assistant_id, tok.think_end_id]
    got = cli_prompt_tokens(tok, "q", system="S", mode="max")
    assert got == [tok.bos_id] + enc(THINK_MAX_PREFIX) + enc("S") + [tok.user_id] + enc("q") + [
        tok.assistant_id, tok.think_id]
    # a prompt starting with the BOS string is rendered chat as written; system and mode ignored
    raw = BOS + USER + "x" + ASST
    assert cli_prompt_tokens(tok, raw, system="S", mode="max") == tok.encode_chat(raw)


def test_repl_tokens(tok):
    assert repl_prefix_tokens(tok, system="S", mode="high") == [tok.bos_id] + tok.encode("S")
    assert repl_prefix_tokens(tok, system="", mode="max") == [tok.bos_id] + tok.encode(THINK_MAX_PREFIX)
    assert repl_turn_tokens(tok, "hi", mode="none") == [tok.user_id] + tok.encode("hi") + [
        tok.assistant_id, tok.think_end_id]


def test_rendered_chat_tokenizes_specials(tok):
    text = render_chat([Message("user", "hello")], mode="high")
    ids = tok.encode_chat(text)
    assert ids[:2] == [tok.bos_id, tok.user_id] and ids[-2:] == [tok.assistant_id, tok.think_id]
    assert tok.decode(ids) == text
