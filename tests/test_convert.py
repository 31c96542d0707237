"""GGUF → MLX directory conversion (convert/): lossless round trip, tokenizer.json, resume, corruption, memory."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.convert import gguf_to_mlx
from ds4_mlx.convert.gguf_to_mlx import convert
from ds4_mlx.gguf_file import DS4FormatError, load_weights, open_gguf
from ds4_mlx.loader import load
from ds4_mlx.mlx_dir import INDEX, open_mlx_dir, verify_dir
from ds4_mlx.tokenizer import SPECIAL_TOKENS, Tokenizer
from ds4_mlx.weights import QuantWeight

SHARD = 3e6  # the tiny models are ~10 MB: several shards


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory):
    """``converted(experts) -> (gguf_path, dir)``, each converted once."""
    cache: dict[str, tuple[Path, Path]] = {}

    def make(experts: str = "q2"):
        if experts not in cache:
            src = tiny_gguf(experts=experts)
            out = tmp_path_factory.mktemp(f"mlx-{experts}")
            convert(src, out, shard_bytes=SHARD, progress=False, log=lambda *a: None)
            cache[experts] = (src, out)
        return cache[experts]

    return make


def _bits(a: mx.array) -> np.ndarray:
    a = np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    return a.view(np.uint8)


@pytest.mark.parametrize("experts", ["q2", "q4", "f16"])
def test_round_trip_weights_and_logits_bit_identical(converted, experts):
    src, out = converted(experts)
    g = open_gguf(src)
    ref = load_weights(g)
    cfg, weights, tok = open_mlx_dir(out, verify=True)
    assert cfg == g.config
    assert tok.tokens == g.tokenizer.tokens and tok.merges == g.tokenizer.merges
    assert tok.token_types == g.tokenizer.token_types
    assert weights.keys() == ref.keys()
    for name, r in ref.items():
        w = weights[name]
        assert type(w) is type(r), name
        if isinstance(r, QuantWeight):
            assert (w.qtype, w.shape) == (r.qtype, r.shape), name
            w, r = w.data, r.data
        assert (w.dtype, w.shape) == (r.dtype, r.shape), name
        assert np.array_equal(_bits(w), _bits(r)), name

    rng = np.random.default_rng(7)
    tokens = mx.array([0] + rng.integers(2, cfg.n_vocab, 21).tolist(), dtype=mx.int32)
    logits = []
    for path in (src, out):
        model, tokenizer = load(path)
        logits.append(np.array(model(tokens, 0, model.make_cache(), all_logits=True)))
        assert tokenizer is not None and tokenizer.encode("hello") == Tokenizer.from_gguf(g.tokenizer).encode("hello")
    assert logits[0].shape == (len(tokens), cfg.n_vocab) and logits[0].std() > 0.1
    assert np.array_equal(logits[0].view(np.uint32), logits[1].view(np.uint32))


def test_shards_are_standard_safetensors(converted):
    """The official ``safetensors`` reader accepts every shard; bytes equal the GGUF's raw tensor data."""
    from safetensors.numpy import load_file

    src, out = converted("q2")
    g = open_gguf(src)
    index = json.loads((out / INDEX).read_text())
    assert len(index["shards"]) > 1
    seen = 0
    for shard, info in index["shards"].items():
        assert (out / shard).stat().st_size == info["size"] <= SHARD
        for name, arr in load_file(out / shard).items():
            assert index["weight_map"][name] == shard
            assert arr.tobytes() == np.ascontiguousarray(g.tensors[name].data).tobytes(), name
            assert index["tensors"][name] == {"qtype": g.tensors[name].qtype.name, "shape": list(g.tensors[name].shape)}
            seen += 1
    assert seen == len(g.tensors)
    cfg = json.loads((out / "config.json").read_text())
    import hashlib

    assert cfg["ds4_mlx"]["source"]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()
    assert cfg["n_expert"] == g.config.n_expert and cfg["compress_ratios"] == list(g.config.compress_ratios)
    chat = json.loads((out / "tokenizer_config.json").read_text())["ds4_chat"]
    assert set(chat["special_tokens"]) == set(SPECIAL_TOKENS) and chat["default_system"]


def _random_unicode(rng: random.Random, n: int) -> str:
    pick = [
        lambda: chr(rng.randint(0x20, 0x7E)),
        lambda: rng.choice(" \n\t  \r\n"),
        lambda: chr(rng.randint(0x4E00, 0x9FFF)),
        lambda: chr(rng.randint(0x1F300, 0x1FAFF)),
        lambda: chr(rng.randint(0x0300, 0x036F)),
        lambda: chr(rng.randint(0x80, 0x7FF)),
        lambda: chr(rng.choice([rng.randint(0x800, 0xD7FF), rng.randint(0xE000, 0xFFFF)])),
        lambda: chr(rng.randint(0x10000, 0x10FFFF)),
        lambda: rng.choice(["the ", "def ", "  return", "123", "4567", "'s", "...", "DSML"]),
        lambda: rng.choice(SPECIAL_TOKENS),
    ]
    return "".join(rng.choice(pick)() for _ in range(n))


def test_tokenizer_json_matches_gguf_tokenizer(converted):
    from tokenizers import Tokenizer as HFTokenizer

    src, out = converted("q2")
    ours = Tokenizer.from_gguf(open_gguf(src).tokenizer)
    hf = HFTokenizer.from_file(str(out / "tokenizer.json"))
    rng = random.Random(11)
    for i in range(300):
        text = _random_unicode(rng, rng.randint(1, 80))
        assert hf.encode(text, add_special_tokens=False).ids == ours.encode_chat(text), repr(text)
    assert hf.decode(ours.encode("héllo wörld 你好"), skip_special_tokens=False) == "héllo wörld 你好"


def test_interrupted_conversion_resumes(tiny_gguf, tmp_path, monkeypatch):
    src = tiny_gguf(experts="q4")
    fresh = tmp_path / "fresh"
    convert(src, fresh, shard_bytes=SHARD, progress=False, log=lambda *a: None)

    out = tmp_path / "resumed"
    real = gguf_to_mlx._write_shard
    calls = []

    def dies_on_third(fd, shard, path, buf, advance):
        calls.append(shard.filename)
        if len(calls) == 3:  # die half-way through the shard: a .partial file is left behind
            path.with_name(path.name + ".partial").write_bytes(b"half a shard")
            raise KeyboardInterrupt
        return real(fd, shard, path, buf, advance)

    monkeypatch.setattr(gguf_to_mlx, "_write_shard", dies_on_third)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, shard_bytes=SHARD, progress=False, log=lambda *a: None)
    assert not (out / INDEX).exists()
    with pytest.raises(DS4FormatError, match="missing"):
        open_mlx_dir(out)

    monkeypatch.setattr(gguf_to_mlx, "_write_shard", real)
    # damage one of the finished shards: it must be rewritten, the other kept
    first, second = calls[0], calls[1]
    data = bytearray((out / second).read_bytes())
    data[-5] ^= 0xFF
    (out / second).write_bytes(data)
    report = convert(src, out, shard_bytes=SHARD, progress=False, log=lambda *a: None)
    assert report["skipped"] == [first]
    assert second in report["written"] and len(report["written"]) == len(report["shards"]) - 1
    for f in sorted(os.listdir(fresh)):
        assert (out / f).read_bytes() == (fresh / f).read_bytes(), f
    assert not list(out.glob("*.partial"))
    verify_dir(out)


def test_corrupt_missing_and_wrong_version_fail_clearly(converted, tmp_path):
    import shutil

    _, good = converted("q2")
    d = tmp_path / "bad"
    shutil.copytree(good, d)
    shard = sorted(d.glob("*.safetensors"))[1]
    # flipped byte, same size: the load-time size check passes, verify catches it
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(data)
    open_mlx_dir(d)  # sizes only: loads
    with pytest.raises(DS4FormatError, match=f"{shard.name}.*sha256.*corrupt"):
        open_mlx_dir(d, verify=True)
    # truncated shard: caught on every load
    shard.write_bytes(data[:-100])
    with pytest.raises(DS4FormatError, match=f"{shard.name}.*bytes.*index records"):
        load(d)
    shard.unlink()
    with pytest.raises(DS4FormatError, match=f"{shard.name}: missing shard"):
        load(d)
    shutil.copy(good / shard.name, shard)
    cfg = json.loads((d / "config.json").read_text())
    cfg["ds4_mlx"]["format_version"] = 99
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DS4FormatError, match="format version 99"):
        load(d)


def test_dry_run_writes_nothing(tiny_gguf, tmp_path):
    lines = []
    report = convert(tiny_gguf(), tmp_path / "x", dry_run=True, shard_bytes=SHARD, log=lines.append)
    assert not (tmp_path / "x").exists()
    assert len(report["shards"]) > 1 and all(s in lines[0] for s in report["shards"])


_RSS_SCRIPT = textwrap.dedent(
    """
    import json, resource, sys
    from ds4_mlx.convert.gguf_to_mlx import convert
    dry = sys.argv[3] == "dry"
    convert(sys.argv[1], sys.argv[2], dry_run=dry, progress=False, shard_bytes=2e8, log=lambda *a: None)
    # Linux: VmHWM is this process's own peak (ru_maxrss also counts the parent's RSS at fork time)
    try:
        hwm = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
        peak = int(hwm.split()[1]) * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    print(json.dumps({"peak_rss": peak}))
    """
)


@pytest.mark.slow
def test_conversion_memory_stays_far_below_model_size(tmp_path):
    """A ~1 GB GGUF (f16 experts, 416 of them) converts with peak RSS a small fraction of its size."""
    from ds4_mlx.testing import make_tiny_gguf

    src = make_tiny_gguf(tmp_path / "big.gguf", experts="f16", n_expert=416, layers=6)
    size = src.stat().st_size
    assert size > 0.95e9

    def maxrss(mode: str) -> int:
        r = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(src), str(tmp_path / "out"), mode],
                           capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
        return json.loads(r.stdout.strip().splitlines()[-1])["peak_rss"]

    base = maxrss("dry")  # imports + parsing the GGUF header, nothing copied
    peak = maxrss("run")
    print(f"GGUF {size / 1e9:.2f} GB; peak RSS dry run {base / 1e6:.0f} MB, conversion {peak / 1e6:.0f} MB")
    assert peak < size / 5
    assert peak - base < 200e6  # the copy buffer plus bookkeeping, not the model
    verify_dir(tmp_path / "out")


def test_cli_command_convert_dry_run_and_verify(tiny_gguf, tmp_path):
    import typer
    from typer.testing import CliRunner

    from ds4_mlx.convert.cli import convert_cmd

    app = typer.Typer()
    app.command("convert")(convert_cmd)
    app.command("other")(lambda: None)  # two commands, so "convert" is a subcommand as in ds4-mlx
    run = CliRunner().invoke
    src, out = tiny_gguf(), tmp_path / "d"
    r = run(app, ["convert", str(src), str(out), "--dry-run", "--shard-gb", "0.003"])
    assert r.exit_code == 0, r.output
    assert "model-00001-of-0000" in r.output and not out.exists()
    r = run(app, ["convert", str(src), str(out), "--shard-gb", "0.003"])
    assert r.exit_code == 0, r.output
    assert "GGUF/dir" in r.output  # the load-time comparison is reported
    r = run(app, ["convert", str(src), str(out), "--verify"])
    assert r.exit_code == 0 and "OK" in r.output
    shard = sorted(out.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-1] + b"\0" if shard.read_bytes()[-1:] != b"\0" else shard.read_bytes()[:-1] + b"\1")
    r = run(app, ["convert", str(src), str(out), "--verify"])
    assert r.exit_code == 2 and "corrupt shard" in r.output


def test_check_model_and_tokenizer_data_accept_either(converted):
    from ds4_mlx.mlx_dir import check_model, open_tokenizer_data

    src, out = converted("q2")
    assert check_model(src) == check_model(out)
    a, b = open_tokenizer_data(src), open_tokenizer_data(out)
    assert (a.tokens, a.merges, a.token_types) == (b.tokens, b.merges, b.token_types)
    with pytest.raises(DS4FormatError, match="missing config.json"):
        check_model(out.parent)
