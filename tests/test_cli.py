"""The ``ds4-mlx`` command line: make-tiny and inspect, through typer's runner and as a real subprocess."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time

import pytest
from typer.testing import CliRunner

from ds4_mlx.cli import app

runner = CliRunner()


@pytest.mark.parametrize("experts", ["q2", "q4", "f16"])
@pytest.mark.parametrize("ratio", ["16", "128"])
def test_make_tiny_then_inspect(tmp_path, experts, ratio):
    out = tmp_path / "t.gguf"
    r = runner.invoke(app, ["make-tiny", str(out), "--experts", experts, "--hca-ratio", ratio, "--seed", "3"])
    assert r.exit_code == 0, r.output
    assert out.stat().st_size > 1_000_000
    r = runner.invoke(app, ["inspect", str(out)])
    assert r.exit_code == 0, r.output
    assert "bytes read per decoded token" in r.output and "routed experts" in r.output
    assert f"compress ratios [0, 4, {ratio}]" in r.output
    assert {"q2": "IQ2_XXS/IQ2_XXS/Q2_K", "q4": "Q4_K/Q4_K/Q4_K", "f16": "F16/F16/F16"}[experts] in r.output
    assert "178" in r.output  # tensor count of the 6-layer tiny model


def test_make_tiny_rejects_bad_options(tmp_path):
    r = runner.invoke(app, ["make-tiny", str(tmp_path / "x.gguf"), "--experts", "q3"])
    assert r.exit_code == 2 and "--experts must be q2, q4 or f16" in r.stderr
    assert not (tmp_path / "x.gguf").exists()
    r = runner.invoke(app, ["make-tiny", str(tmp_path / "x.gguf"), "--hca-ratio", "4"])
    assert r.exit_code == 2 and "--hca-ratio" in r.stderr
    for skew in ("-1", "nan"):
        r = runner.invoke(app, ["make-tiny", str(tmp_path / "x.gguf"), "--router-skew", skew])
        assert r.exit_code == 2 and "--router-skew must be 0..4" in r.stderr
    assert not (tmp_path / "x.gguf").exists()


def test_help_explains_commands():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "make-tiny" in r.output and "inspect" in r.output
    r = runner.invoke(app, ["make-tiny", "--help"])
    assert "--experts" in r.output and "--hca-ratio" in r.output


def test_console_script_subprocess(tmp_path):
    exe = shutil.which("ds4-mlx", path=os.path.dirname(sys.executable)) or shutil.which("ds4-mlx")
    cmd = [exe] if exe else [sys.executable, "-m", "ds4_mlx"]
    out = tmp_path / "s.gguf"
    r = subprocess.run(cmd + ["make-tiny", str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    r = subprocess.run(cmd + ["inspect", str(out), "--ctx", "64"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "ctx 64" in r.stdout


# ---- generate / chat ---------------------------------------------------------------------------------

@pytest.fixture
def demo_env(tmp_path, monkeypatch):
    """Point the demo-model cache at a temp dir (a fresh machine has none)."""
    monkeypatch.setenv("DS4_MLX_CACHE", str(tmp_path / "cache"))
    return {**os.environ, "DS4_MLX_CACHE": str(tmp_path / "cache")}


def test_generate_demo_prints_text_and_stats(demo_env):
    r = runner.invoke(app, ["generate", "--demo", "-p", "Hello", "-n", "6", "--seed", "1"])
    assert r.exit_code == 0, r.output + r.stderr
    assert r.stdout.strip()  # a continuation
    assert "Generation: 6 tokens" in r.stderr and "Prompt:" in r.stderr and "Peak memory" in r.stderr
    # it says what it is doing, on stderr: the first run builds the demo model, every run loads it
    status = r.stderr.splitlines()
    assert status[0].startswith("building the demo model (once") and status[1].startswith("built the demo model in")
    assert status[2].startswith("loading ") and "demo-tiny" in status[2]
    again = runner.invoke(app, ["generate", "--demo", "-p", "Hello", "-n", "6", "--seed", "1"])
    assert again.stdout == r.stdout  # same seed, same text
    assert "building" not in again.stderr and again.stderr.startswith("loading ")


def test_progress_bars_show_only_after_their_delay():
    """A bar appears once a prefill (or a load) has run ``delay`` seconds (a timer, so even inside one long
    chunk) and is gone when the work ends; quick work never shows it."""
    import io

    from rich.console import Console

    from ds4_mlx.cli import _DelayedBar

    def bar_on_a_terminal(delay, bytes_=False):
        bar = _DelayedBar("prefill", delay, bytes_)
        bar.console = Console(file=io.StringIO(), force_terminal=True, width=80)
        return bar

    quick = bar_on_a_terminal(0.5)
    quick(0, 100)
    quick(100, 100)
    quick.close()
    time.sleep(0.7)
    assert quick.console.file.getvalue() == ""
    slow = bar_on_a_terminal(0.05)
    slow(0, 1024)
    time.sleep(0.3)  # the timer fired while "the first chunk ran"
    slow(512, 1024)
    shown = slow.console.file.getvalue()
    slow.close()
    assert "prefill" in shown and "1024 tokens" in shown
    assert slow.bar is None and not slow.timer.is_alive()
    load = bar_on_a_terminal(0.05, bytes_=True)  # the loader's stages, in bytes
    load(0, 4_000_000, "reading")
    time.sleep(0.3)
    load(3_000_000, 4_000_000, "to device")
    time.sleep(0.2)
    shown = load.console.file.getvalue()
    load.close()
    assert "to device" in shown and "3.0/4.0 MB" in shown


def test_stream_generate_reports_prefill_progress(tiny_gguf):
    """``progress(done, total)``: ``(0, total)`` before the prefill, then after every chunk."""
    from ds4_mlx import load, stream_generate

    model, tok = load(tiny_gguf())
    calls = []
    ids = list(range(2, 42))
    for _ in stream_generate(model, tok, ids, max_tokens=1, prefill_chunk=16, progress=lambda *a: calls.append(a)):
        pass
    assert calls == [(0, 40), (16, 40), (32, 40), (40, 40)]


def test_generate_greedy_nothink_and_prompt_file(demo_env, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("Write a haiku about the sea.")
    r = runner.invoke(app, ["generate", "--demo", "--prompt-file", str(f), "-n", "4", "--temp", "0", "--nothink"])
    assert r.exit_code == 0, r.stderr
    assert "Generation: " in r.stderr


def test_generate_bad_input_exits_2(demo_env, tmp_path):
    cases = [
        (["generate", "-p", "hi", "-m", str(tmp_path / "none.gguf")], "no model at"),
        (["generate", "--demo"], "exactly one of"),
        (["generate", "--demo", "-p", "x", "--prompt-file", "y"], "exactly one of"),
        (["generate", "--demo", "-p", "x", "-n", "0"], "--tokens must be > 0"),
        (["generate", "--demo", "-p", "x", "--think", "--nothink"], "choose one of"),
        (["generate", "--demo", "-p", "x" * 200, "--ctx", "16"], "does not fit --ctx 16"),
        (["generate", "--demo", "--prompt-file", str(tmp_path / "missing.txt")], "no such prompt file"),
    ]
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    cases.append((["generate", "-m", str(bad), "-p", "x"], "not a GGUF file"))
    for args, needle in cases:
        r = runner.invoke(app, args)
        assert r.exit_code == 2, (args, r.output, r.stderr)
        errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and needle in errors[0] and "Traceback" not in r.stderr, (args, r.stderr)


def test_dump_tokens_and_logprobs(demo_env, tmp_path):
    from ds4_mlx.demo import demo_model_path
    from ds4_mlx.gguf_file import open_gguf
    from ds4_mlx.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(open_gguf(demo_model_path()).tokenizer)
    r = runner.invoke(app, ["generate", "--demo", "--dump-tokens", "-p", "<｜User｜>hi there"])
    assert r.exit_code == 0, r.stderr
    lines = r.stdout.splitlines()
    ids = tok.encode_chat("<｜User｜>hi there")
    assert lines[0] == "[" + ", ".join(map(str, ids)) + "]" and ids[0] == tok.user_id
    assert len(lines) == 1 + len(ids) and lines[1].split() == [str(ids[0]), "<｜User｜>"]

    import json

    out = tmp_path / "lp.json"
    r = runner.invoke(app, ["generate", "--demo", "-p", "Hello", "-n", "3", "--dump-logprobs", str(out), "--logprobs-top-k", "5"])
    assert r.exit_code == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["top_k"] == 5 and doc["prompt_tokens"] > 3 and 1 <= len(doc["steps"]) <= 3
    for step in doc["steps"]:
        top = step["top_logprobs"]
        assert len(top) == 5 and step["selected"] == top[0]["token"]  # greedy
        lps = [t["logprob"] for t in top]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        assert bytes(top[0]["token"]["bytes"]) == tok.token_bytes(top[0]["token"]["id"])


def test_chat_repl_over_stdin(demo_env, tmp_path):
    f = tmp_path / "q.txt"
    f.write_text("What is in this file?")
    script = f"Hello there\n/nothink\n/read {f}\n/ctx 0\n/bogus\n/ctx 4096\nBye\n/quit\n"
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "chat", "--demo", "-n", "4", "--seed", "1"], input=script,
                       capture_output=True, text=True, timeout=300, env=demo_env)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.count("ds4> ") >= 8
    assert "mode: none" in out and "usage: /ctx N" in out and "unknown command /bogus" in out
    assert "new session, ctx 4096" in out
    # three generations ran (Hello there, the /read file, Bye), one stats line each; the second turn reused
    # the live KV of the first (cached > 0), /ctx started a fresh session for the third
    stats = re.findall(r"prompt (\d+) tokens \((\d+) cached\)", r.stderr)
    assert len(stats) == 3, r.stderr
    (p1, c1), (p2, c2), (p3, c3) = [(int(a), int(b)) for a, b in stats]
    assert c1 == 0 and c2 > p1 - 2 and c3 == 0


def test_generate_subprocess(demo_env):
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "generate", "--demo", "-p", "Hello", "-n", "3", "--seed", "4"],
                       capture_output=True, text=True, timeout=300, env=demo_env)
    assert r.returncode == 0, r.stderr
    assert "Generation: 3 tokens" in r.stderr and r.stdout.strip()


def test_serve_rejects_a_bad_model_before_binding(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(10))
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "serve", "-m", str(bad), "--port", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error:") and "truncated or corrupt" in r.stderr
    r = runner.invoke(app, ["serve", "--help"])
    assert r.exit_code == 0 and "--api-key" in r.output and "--demo" in r.output


def test_convert_then_inspect_and_generate_from_the_directory(tmp_path, tiny_gguf):
    out = tmp_path / "mlx"
    r = runner.invoke(app, ["convert", str(tiny_gguf()), str(out), "--no-load-check"])
    assert r.exit_code == 0, r.output + r.stderr
    a = runner.invoke(app, ["inspect", str(out)])
    b = runner.invoke(app, ["inspect", str(tiny_gguf())])
    assert a.exit_code == 0 and b.exit_code == 0, a.stderr
    assert a.output[a.output.index("layers"):] == b.output[b.output.index("layers"):]  # same tables; paths differ
    g1 = runner.invoke(app, ["generate", "-m", str(out), "-p", "hi", "-n", "4", "--seed", "2"])
    g2 = runner.invoke(app, ["generate", "-m", str(tiny_gguf()), "-p", "hi", "-n", "4", "--seed", "2"])
    assert g1.exit_code == 0 and g1.stdout == g2.stdout


def test_every_subcommand_is_registered():
    r = runner.invoke(app, ["--help"])
    for cmd in ("make-tiny", "inspect", "generate", "chat", "serve", "convert", "bench", "kv"):
        assert cmd in r.output, cmd
    assert runner.invoke(app, ["kv", "--help"]).exit_code == 0
    assert "plot" in runner.invoke(app, ["bench", "--help"]).output


def test_cuda_graph_batching_default(monkeypatch):
    """On a CUDA machine the package sets MLX-CUDA's graph batching unless the user set either variable;
    elsewhere (Metal, CPU) it leaves MLX's defaults."""
    import mlx.core as mx

    import ds4_mlx

    keys = ds4_mlx.CUDA_GRAPH_BATCHING
    for k in keys:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    ds4_mlx._batch_cuda_graphs()
    assert not any(k in os.environ for k in keys)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MLX_MAX_OPS_PER_BUFFER", "20")
    ds4_mlx._batch_cuda_graphs()
    assert os.environ["MLX_MAX_OPS_PER_BUFFER"] == "20" and "MLX_MAX_MB_PER_BUFFER" not in os.environ
    monkeypatch.delenv("MLX_MAX_OPS_PER_BUFFER")
    ds4_mlx._batch_cuda_graphs()
    assert {k: os.environ[k] for k in keys} == keys
