"""The disk KV cache through the real server: a prompt saved on one run is resumed from disk after a restart.

Run A prefills a long prompt (cold save) and exits (shutdown save); run B, a fresh process on the same
directory, serves the prompt + a new turn from the cold file (usage and /v1/stats show it, a corrupt file keyed
on a longer prefix is skipped with a reason, a continued save and an evict save happen); run C, without a cache,
computes the same request from scratch: greedy output is identical token for token.
"""

from __future__ import annotations

import json
import signal
import time

import httpx
import numpy as np
import pytest

from ds4_mlx.chat import render_chat
from ds4_mlx.kvstore import KVHeader, cache_name, read_kv_file
from ds4_mlx.server.app import ServerConfig
from ds4_mlx.server.openai import parse_chat
from server_util import running_server, start_server

WORDS = " ".join(f"w{i}" for i in range(30))
P1 = [{"role": "system", "content": "You are terse. " + WORDS}, {"role": "user", "content": "hello there"}]
P2 = P1 + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "more please"}]
KV = ["--kv-cache-min-tokens", "16", "--kv-cache-boundary-align-tokens", "16"]


def chat(base: str, messages: list, max_tokens: int) -> dict:
    body = {"model": "deepseek-v4-flash", "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "thinking": {"type": "disabled"}}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def rendered(messages: list) -> bytes:
    req = parse_chat({"model": "deepseek-v4-flash", "messages": messages, "thinking": {"type": "disabled"}},
                     ServerConfig())
    return render_chat(req.messages, mode=req.mode, tools=req.tools, tool_choice=req.tool_choice).encode()


def reasons(d) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for p in sorted(d.glob("*.kv")):
        h = read_kv_file(p, with_payload=False).header
        out.setdefault(h.reason_name, []).append(h.tokens)
    return out


@pytest.mark.slow
def test_restart_resumes_from_disk(tiny_gguf, tmp_path):
    model = tiny_gguf()
    d = tmp_path / "kv"
    trace = tmp_path / "trace.log"

    # --- run A: cold prompt -> cold save at the stable prefix; exit -> shutdown save of the live session
    with running_server(model, "--kv-disk-dir", str(d), *KV, "--kv-cache-continued-interval-tokens", "0") as base:
        r1 = chat(base, P1, 4)
        assert r1["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        st = httpx.get(base + "/v1/stats").json()
        assert st["misses"] == {"no file": 1} and st["disk"]["saves"] == {"cold": 1}
        cold_at = st["last_decisions"][-1]["cold_save_at"]
        assert 16 <= cold_at < r1["usage"]["prompt_tokens"]
        assert st["disk"]["bytes_written"] == st["disk"]["bytes"] > 0
    live = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"]
    assert reasons(d) == {"cold": [cold_at], "shutdown": [live]}

    # a corrupt file (valid-looking header, random payload) keyed on a longer prefix of the next prompt
    text2 = rendered(P2)
    bad_text = text2[:-3]
    payload = np.random.default_rng(0).bytes(4096)
    now = int(time.time())
    (d / cache_name(bad_text)).write_bytes(
        KVHeader(2, 1, 0, 100, 0, 32768, 0, now, now, len(payload), len(bad_text)).pack() + bad_text + payload)

    # --- run B: restart; the same prompt + a new turn is served from the cold file
    with running_server(model, "--kv-disk-dir", str(d), *KV, "--kv-cache-continued-interval-tokens", "32",
                        "--trace", str(trace)) as base:
        r2 = chat(base, P2, 6)
        assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == cold_at
        st = httpx.get(base + "/v1/stats").json()
        assert st["hits"] == {"disk-text": 1} and st["misses"] == {}
        assert st["tokens_reused"] == cold_at
        assert st["prefill_tokens_computed"] == r2["usage"]["prompt_tokens"] - cold_at
        assert st["last_decisions"][-1]["reason"].startswith(f"disk hit at {cold_at} tokens")
        assert st["disk"]["bytes_read"] > 0 and st["disk"]["skipped"]
        assert {"file": cache_name(bad_text), "reason": st["disk"]["last_skips"][0]["reason"]} in st["disk"]["last_skips"]
        assert "payload magic" in st["disk"]["last_skips"][0]["reason"]
        assert st["disk"]["saves"].get("continued") == 1  # at 96 = 3 x 32 live tokens
        # Anthropic usage reports the reused tokens as cache reads
        a = httpx.post(base + "/v1/messages", timeout=120, json={
            "model": "deepseek-v4-flash", "max_tokens": 2, "system": P1[0]["content"], "messages": P2[1:],
            "thinking": {"type": "disabled"}}).json()
        assert a["usage"]["cache_read_input_tokens"] == httpx.get(base + "/v1/stats").json()[
            "last_decisions"][-1]["cached_tokens"] > 0
        # an unrelated prompt: the live session is saved (evict) and the miss says where the text diverged
        evicts = httpx.get(base + "/v1/stats").json()["disk"]["saves"].get("evict", 0)
        chat(base, [{"role": "system", "content": "Another agent entirely. " + WORDS}, {"role": "user",
                                                                                           "content": "hi"}], 1)
        st = httpx.get(base + "/v1/stats").json()
        assert st["disk"]["saves"].get("evict") == evicts + 1
        assert st["last_decisions"][-1]["reason"].startswith("miss: text diverged at byte")
        assert st["misses"].get("text diverged", 0) >= 1
    log = trace.read_text()
    assert f"cache: disk hit at {cold_at} tokens" in log and "payload magic" in log
    assert {"cold", "shutdown", "continued", "evict"} <= set(reasons(d))
    assert (d / cache_name(bad_text)).exists()  # skipped, not used (and kept: §5.6 deletes only on a token mismatch)

    # --- run C: no cache, the same request from scratch gives the same greedy tokens
    with running_server(model) as base:
        r3 = chat(base, P2, 6)
    assert r3["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert r3["usage"]["prompt_tokens"] == r2["usage"]["prompt_tokens"]
    assert r3["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]
    assert r2["usage"]["completion_tokens"] == 6


@pytest.mark.slow
def test_tool_id_map_survives_restart(tiny_gguf, tmp_path):
    """A tool call's exact DSML block is saved in the KV file's tool-id map; after a restart the client's replay of
    the call (by id) renders byte-exact again, so the whole saved session is a disk hit."""
    model = tiny_gguf()
    d = tmp_path / "kv"
    D = "｜DSML｜"
    block = (f'\n\n<{D}tool_calls>\n<{D}invoke name="ls">\n\n<{D}parameter name="n" string="false">[1,2]'
             f"</{D}parameter>\n</{D}invoke>\n</{D}tool_calls>")  # not canonical: a blank line before the parameter
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "files?"}]
    body = {"model": "deepseek-v4-flash", "messages": msgs, "tools": tools, "max_tokens": 300,
            "thinking": {"type": "disabled"}}
    with running_server(model, "--kv-disk-dir", str(d), *KV) as base:
        r1 = httpx.post(base + "/v1/chat/completions", json=body, timeout=120,
                        headers={"X-DS4-Test-Output": json.dumps(block)}).json()
    (call,) = r1["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"n": [1, 2]}
    shutdown = [p for p in d.glob("*.kv") if read_kv_file(p).header.reason_name == "shutdown"]
    assert len(shutdown) == 1 and read_kv_file(shutdown[0]).tool_map == {call["id"]: block}

    msgs2 = msgs + [{"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]
    req = parse_chat({**body, "messages": msgs2}, ServerConfig())
    canonical = render_chat(req.messages, mode=req.mode, tools=req.tools, tool_choice=req.tool_choice)
    assert block not in canonical  # without the map the replay would not match the saved text
    with running_server(model, "--kv-disk-dir", str(d), *KV) as base:
        r2 = httpx.post(base + "/v1/chat/completions", json={**body, "messages": msgs2, "max_tokens": 1},
                        timeout=120).json()
        st = httpx.get(base + "/v1/stats").json()
    live = r1["usage"]["prompt_tokens"] + r1["usage"]["completion_tokens"]
    assert r2["usage"]["prompt_tokens_details"]["cached_tokens"] == live
    assert st["hits"] == {"disk-text": 1}


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signal_after_a_request_exits_cleanly_with_the_shutdown_save(tiny_gguf, tmp_path, sig):
    """Ctrl+C (or SIGTERM) after serving a request on the real model: exit status 0, no C++ abort ("terminate
    called without an active exception", status 134, when MLX finalized the worker thread's arrays at exit), and
    the live session saved on the way out."""
    d = tmp_path / "kv"
    proc, base = start_server(tiny_gguf(), "--kv-disk-dir", str(d), *KV, "--kv-cache-cold-max-tokens", "0")
    try:
        r = chat(base, P1, 3)
        proc.send_signal(sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode(errors="replace")[-2000:]
    assert b"terminate called" not in out
    live = r["usage"]["prompt_tokens"] + r["usage"]["completion_tokens"]
    assert reasons(d) == {"shutdown": [live]}
