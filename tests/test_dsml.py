"""DSML tests: canonical rendering (docs/serving.md §2.5), final parse and repair rules (§6.3), finish reasons, and
the generation-time trackers (§6.2)."""

from __future__ import annotations

import json
import random

import pytest

from ds4_mlx.chat import Message, ToolCall, render_chat
from ds4_mlx.dsml import (
    DecodeState,
    DSMLTracker,
    ToolCallDetector,
    final_finish_reason,
    json_object_items,
    minify_json,
    parse_output,
    partial_marker_len,
    render_tool_calls,
)

P_END = "</｜DSML｜parameter>"


def block(*invokes: str) -> str:
    return "\n\n<｜DSML｜tool_calls>\n" + "".join(invokes) + "</｜DSML｜tool_calls>"


def invoke(name: str, *params: str) -> str:
    return f'<｜DSML｜invoke name="{name}">\n' + "".join(params) + "</｜DSML｜invoke>\n"


def param(name: str, string: str | None, value: str) -> str:
    s = "" if string is None else f' string="{string}"'
    return f'<｜DSML｜parameter name="{name}"{s}>{value}{P_END}\n'


def pairs(raw: str):
    return json.loads(raw, object_pairs_hook=list)


# -- canonical rendering --------------------------------------------------------------------------------------
def test_render_canonical_rules():
    args = '{ "b": "x </｜DSML｜parameter> <&>\\"q\\"", "a" : [1, 2.50e3, {"k": "</｜DSML｜parameter>"}],' \
           ' "n": null, "t": true, "b": -0.0 }'
    got = render_tool_calls([ToolCall("1", 'we<ird>&"name', args)])
    assert got == block(invoke(
        "we&lt;ird&gt;&amp;&quot;name",
        param("b", "true", 'x &lt;/｜DSML｜parameter> <&>"q"'),
        param("a", "false", '[1,2.50e3,{"k":"\\u003c/｜DSML｜parameter>"}]'),
        param("n", "false", "null"),
        param("t", "false", "true"),
        param("b", "false", "-0.0"),  # duplicate keys all rendered, in order
    ))


@pytest.mark.parametrize("raw", ["not json", "[1, 2]", '"str"', "{bad}", '{"a": NaN}', ""])
def test_render_non_object_arguments(raw):
    got = render_tool_calls([{"name": "f", "arguments": raw + P_END}])
    assert got == block(invoke("f", param("arguments", "true", raw + "&lt;/｜DSML｜parameter>")))


def test_render_zero_params_and_many_calls():
    got = render_tool_calls([ToolCall("1", "x", "{}"), ToolCall("2", "y", " { } ")])
    assert got == "\n\n<｜DSML｜tool_calls>\n" + invoke("x") + invoke("y") + "</｜DSML｜tool_calls>"
    assert invoke("x") == '<｜DSML｜invoke name="x">\n</｜DSML｜invoke>\n'


def test_json_helpers():
    raw = ' {"a" : "s p\\"a}ce" , "b":{ "c" :[ 1 , "]" ]} , "a": 1E5 } '
    assert json_object_items(raw) == [("a", '"s p\\"a}ce"'), ("b", '{ "c" :[ 1 , "]" ]}'), ("a", "1E5")]
    assert minify_json(raw) == '{"a":"s p\\"a}ce","b":{"c":[1,"]"]},"a":1E5}'
    assert json_object_items("[1]") is None and json_object_items("{") is None


# -- parse ----------------------------------------------------------------------------------------------------
def _rand_string(rng: random.Random) -> str:
    pool = ["a", "Z", " ", "\n", "\t", "<", ">", '"', "'", "\\", "/", "日本", "😀", "{", "}", "[", "]", ",", ":",
            P_END, "</tool_calls>", "<｜DSML｜invoke", "\u0001"]
    return "".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))


def _rand_value(rng: random.Random, depth: int = 0):
    r = rng.random()
    if r < 0.4:
        return _rand_string(rng)
    if r < 0.55:
        return rng.choice([0, -1, 3.25, 1e21, 12345678901234567890])
    if r < 0.65:
        return rng.choice([True, False, None])
    if depth < 2 and r < 0.8:
        return [_rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if depth < 2:
        return {_rand_string(rng): _rand_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return "leaf"


def test_render_parse_round_trip():
    rng = random.Random(0)
    for _ in range(300):
        calls = []
        for k in range(rng.randint(1, 3)):
            obj = {_rand_string(rng) or f"k{j}": _rand_value(rng) for j in range(rng.randint(0, 4))}
            indent = rng.choice([None, 2])
            calls.append(ToolCall(f"id{k}", rng.choice(["bash", "read_file", "日本"]),
                                  json.dumps(obj, ensure_ascii=rng.random() < 0.5, indent=indent)))
        visible = rng.choice(["", "Sure.", "Let me check  \n"])
        text = visible + render_tool_calls(calls)
        out = parse_output(text, thinking=False)
        assert out.valid and out.start_seen and out.terminated
        assert out.content == visible.rstrip()
        assert out.raw_dsml == render_tool_calls(calls)
        assert [c.name for c in out.calls] == [c.name for c in calls]
        for got, want in zip(out.calls, calls):
            assert pairs(got.arguments_json) == pairs(want.arguments)
            # string values come back decoded (JSON-escaped the usual way), other values keep their raw spelling
            want_json = "{" + ",".join(
                json.dumps(k, ensure_ascii=False) + ":"
                + (json.dumps(json.loads(v), ensure_ascii=False) if v.startswith('"')
                   else minify_json(v).replace(P_END, "\\u003c/｜DSML｜parameter>"))
                for k, v in json_object_items(want.arguments)) + "}"
            assert got.arguments_json == want_json


def test_parse_builds_ds4_argument_text():
    text = "Hi" + block(invoke("f", param("k", "true", "v"), param("k2", "false", " 10 "),
                                 param("o", "false", '{"a": [1, 2]}'), param("e", "false", "  ")))
    (call,) = parse_output(text, thinking=False).calls
    assert call.arguments == '{"k": "v", "k2": 10, "o": {"a":[1,2]}, "e": null}'
    assert call.arguments_json == '{"k":"v","k2":10,"o":{"a":[1,2]},"e":null}'
    assert call.arguments_object() == {"k": "v", "k2": 10, "o": {"a": [1, 2]}, "e": None}


def test_entity_decoding_is_lossy_like_ds4():
    # the renderer leaves "&amp;" raw, the parser decodes it: a ds4 quirk, not a round trip
    out = parse_output(block(invoke("f&amp;g", param("a&lt;b", "true", "x &amp; y &lt;z&gt; &quot;&apos; &foo;"))),
                       thinking=False)
    assert out.calls[0].name == "f&g"
    assert out.calls[0].arguments_object() == {"a<b": "x & y <z> \"' &foo;"}


def test_thinking_split_and_search_after_last_think_end():
    calls_block = block(invoke("f", param("a", "true", "1")))
    out = parse_output("reasoning</think>answer  " + calls_block, thinking=True)
    assert (out.reasoning, out.content, len(out.calls)) == ("reasoning", "answer", 1)
    out = parse_output("<think>r</think>just text", thinking=True)
    assert (out.reasoning, out.content, out.calls, out.start_seen) == ("r", "just text", [], False)
    # a block inside the reasoning is not executable
    out = parse_output("r " + calls_block + "</think>done", thinking=True)
    assert out.calls == [] and out.reasoning == "r " + calls_block and out.content == "done"
    # no </think> at all: everything is content, no reasoning
    out = parse_output("still thinking " + calls_block, thinking=True)
    assert out.reasoning is None and out.content == "still thinking " + calls_block and out.calls == []
    # non-thinking mode never splits
    out = parse_output("a</think>b", thinking=False)
    assert out.reasoning is None and out.content == "a</think>b"


def test_start_marker_precedence_and_variants():
    dsml = block(invoke("dsml"))
    plain = '<tool_calls>\n<invoke name="plain">\n</invoke>\n</tool_calls>'
    out = parse_output("x " + plain + " y" + dsml, thinking=False)  # precedence, not position
    assert [c.name for c in out.calls] == ["dsml"] and out.content == "x " + plain + " y"
    out = parse_output("x\n\n" + plain, thinking=False)
    assert [c.name for c in out.calls] == ["plain"] and out.raw_dsml == "\n\n" + plain and out.content == "x"
    short = ('<DSML｜tool_calls>\n<DSML｜invoke name="s">\n<DSML｜parameter name="p" string="false">[1]'
             '</DSML｜parameter>\n</DSML｜invoke>\n</DSML｜tool_calls>')
    out = parse_output("t " + short, thinking=False)
    assert out.calls[0].name == "s" and out.calls[0].arguments_json == '{"p":[1]}'
    assert out.raw_dsml == short and out.content == "t"


def test_repair_rules():
    # string attribute absent -> string
    out = parse_output(block(invoke("f", param("a", None, " raw 1 "))), thinking=False)
    assert out.calls[0].arguments_object() == {"a": " raw 1 "}
    # nested parameters (loose XML) -> object; the outer closing tag is optional
    nested = ('<｜DSML｜parameter name="outer">\n' + param("x", "false", "1") + param("y", "true", "s")
              + P_END + "\n")
    out = parse_output(block(invoke("f", nested)), thinking=False)
    assert out.calls[0].arguments_object() == {"outer": {"x": 1, "y": "s"}}
    nested_open = '<｜DSML｜parameter name="outer">' + param("x", "false", "2")
    out = parse_output(block(invoke("f", nested_open, param("z", "true", "3"))), thinking=False)
    assert out.calls[0].arguments_object() == {"outer": {"x": 2, "z": "3"}}
    # non-JSON string="false" value -> clients get {}
    out = parse_output(block(invoke("f", param("a", "false", "not json"))), thinking=False)
    assert out.calls[0].arguments == '{"a": notjson}' and out.calls[0].arguments_json == "{}"


@pytest.mark.parametrize(
    "bad,terminated",
    [
        (block('<｜DSML｜invoke>\n</｜DSML｜invoke>\n'), True),  # missing name
        (block(invoke("f", '<｜DSML｜parameter string="true">v' + P_END)), True),  # parameter without name
        (block("stray text\n" + invoke("f")), True),
        (block(invoke("f", "junk")), True),
        ('\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f"', False),  # missing '>' / no end
        ("\n\n<｜DSML｜tool_calls>\n" + invoke("f"), False),  # no end marker
        ("\n\n<｜DSML｜tool_calls>\n" + invoke("f", '<｜DSML｜parameter name="a" string="true">v'), False),
    ],
)
def test_grammar_failures_return_raw_text(bad, terminated):
    text = "<think>r</think>visible" + bad
    out = parse_output(text, thinking=False)
    assert out.calls == [] and out.content == text and not out.valid and out.start_seen
    assert out.terminated is terminated
    want = "stop" if terminated else "error"
    assert final_finish_reason(out, "stop", tools_active=True) == want
    assert final_finish_reason(out, "length", tools_active=True) == ("length" if terminated else "error")
    assert final_finish_reason(out, "stop", tools_active=False) == "stop"


def test_finish_reason_with_calls_even_without_tools():
    out = parse_output("ok" + block(invoke("f")), thinking=False)
    assert final_finish_reason(out, "stop", tools_active=False) == "tool_calls"
    assert final_finish_reason(parse_output("plain", thinking=False), "length", tools_active=True) == "length"


def test_history_replay_of_parsed_turn_is_exact():
    """A parsed tool turn replayed through raw_dsml renders the exact generated bytes (§6.5)."""
    generated = 'Checking.\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">\n<｜DSML｜parameter name="n" string="false">1.50</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>'
    out = parse_output(generated, thinking=False)
    calls = [ToolCall("c1", c.name, c.arguments_json) for c in out.calls]
    m = Message("assistant", out.content, calls=calls, raw_dsml=out.raw_dsml)
    rendered = render_chat([Message("user", "u"), m], mode="none")
    assert rendered.endswith("</think>" + generated + "<｜end▁of▁sentence｜>")
    # the canonical rendering (no replay map entry) is also the same bytes here
    m.raw_dsml = None
    assert render_chat([Message("user", "u"), m], mode="none").endswith(
        generated + "<｜end▁of▁sentence｜>")


# -- generation-time state machines ---------------------------------------------------------------------------
def _states(pieces: list[str]) -> list[tuple[str, DecodeState, bool]]:
    t, out = DSMLTracker(), []
    for p in pieces:
        t.feed(p)
        out.append((p, t.state, t.greedy))
    return out


def test_tracker_states_on_canonical_block():
    pieces = ["Hi", "\n\n", "<", "｜DSML｜", "tool_calls>", "\n", "<", "｜DSML｜", 'invoke name="f">', "\n",
              "<", "｜DSML｜", 'parameter name="s" string="true">', "ab", "c<", "/", "｜DSML｜", "parameter>", "\n",
              "<", "｜DSML｜", 'parameter name="j" string="false">', "{", '"k', '\\"', 'x"', ":", " [1", "]}",
              "</", "｜DSML｜", "parameter>", "\n</", "｜DSML｜", "invoke>\n</", "｜DSML｜", "tool_calls>", "more"]
    got = _states(pieces)
    S, D = DecodeState, {p: (st, g) for p, st, g in got}
    seq = [(st, g) for _, st, g in got]
    assert seq[0] == (S.OUTSIDE, False)
    assert seq[4] == (S.STRUCTURAL, True)  # after <｜DSML｜tool_calls>
    i = pieces.index('parameter name="s" string="true">')
    assert seq[i] == (S.STRING_BODY, False) and seq[i + 1] == (S.STRING_BODY, False)  # payload sampled
    assert seq[i + 2] == (S.STRING_BODY, False)  # 'c<': 1 byte of a closing tag pending -> still payload
    assert seq[i + 3] == (S.STRING_BODY, True)  # '</' pending: structure, greedy
    assert seq[i + 5] == (S.STRUCTURAL, True)
    j = pieces.index('parameter name="j" string="false">')
    assert seq[j] == (S.JSON_STRUCTURAL, True)
    assert seq[j + 2] == (S.JSON_STRING, False)  # inside "k
    assert seq[j + 3] == (S.JSON_STRING, False)  # escaped quote keeps the string open
    assert seq[j + 4] == (S.JSON_STRUCTURAL, True)
    assert seq[j + 7] == (S.JSON_STRUCTURAL, True)
    assert seq[j + 10] == (S.STRUCTURAL, True)  # closing parameter tag
    assert seq[-2] == (S.DONE, False) and seq[-1] == (S.DONE, False)
    assert D["more"][0] is S.DONE


def test_tracker_string_attr_absent_is_string_body():
    t = DSMLTracker()
    t.feed('<tool_calls>\n<invoke name="f">\n<parameter name="a">')
    assert t.state is DecodeState.STRING_BODY and not t.greedy
    t.feed("x</parameter>")
    assert t.state is DecodeState.STRUCTURAL and t.greedy


def test_tool_call_detector_ignores_think():
    d = ToolCallDetector(in_think=True)  # prompt ended with <think>
    d.feed("plan: <｜DSML｜tool_calls> ... </｜DSML｜tool_calls>")
    assert not d.tool_mode and not d.done and not d.stray_end
    d.feed("</think>answer</｜DSML｜tool_calls>")
    assert d.stray_end and not d.tool_mode
    d.feed("\n\n<｜DSML｜tool_")
    assert not d.tool_mode
    d.feed("calls>\n" + invoke("f"))
    assert d.tool_mode and not d.done
    d.feed("</｜DSML｜tool_calls>")
    assert d.done


def test_partial_marker_len():
    markers = ["\n\n<｜DSML｜tool_calls>", "<tool_calls>"]
    assert partial_marker_len("abc\n\n<｜DS", markers) == len("\n\n<｜DS")
    assert partial_marker_len("abc<tool", markers) == len("<tool")
    assert partial_marker_len("abc", markers) == 0
    assert partial_marker_len("x<tool_calls>", markers) == 0  # complete marker is not partial


def test_content_trim_is_ascii_whitespace_only():
    out = parse_output("answer\u00a0 \t\n" + block(invoke("f")), thinking=False)
    assert out.content == "answer\u00a0" and len(out.calls) == 1
