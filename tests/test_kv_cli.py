"""``ds4-mlx kv`` (ls / show / rm / prune), run through its own Typer app."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from ds4_mlx.kv_cli import kv_app
from ds4_mlx.kvstore import KVHeader, cache_name, read_kv_file, session_to_file
from ds4_mlx.loader import load
from ds4_mlx.session import Session

runner = CliRunner()


@pytest.fixture(scope="module")
def kv_dir(tiny_gguf, tmp_path_factory):
    """One real file (a 12-token session) and three synthetic ones with known hits/ages/sizes."""
    d = tmp_path_factory.mktemp("kvcli")
    model, tok = load(tiny_gguf())
    s = Session(model)
    s.prefill([int(t) for t in np.random.default_rng(3).integers(0, 512, 12)])
    text = b"<real prefix>\nline two"
    session_to_file(s, d / cache_name(text), text=text, reason="cold")
    now = int(time.time())
    for i, (hits, tokens, age, n) in enumerate([(9, 500, 0, 3000), (0, 100, 3600, 6000), (1, 200, 86400, 4000)]):
        t = f"synthetic file {i} " .encode() + b"x" * 100
        h = KVHeader(2, 2 + i % 3, 0, tokens, hits, 4096, 0, now - age, now - age, n, len(t))
        (d / cache_name(t)).write_bytes(h.pack() + t + bytes(n))
    (d / ("0" * 40 + ".kv")).write_bytes(b"KVC\x01garbage")  # unreadable: listed as such
    return d


def test_ls_lists_files_best_first(kv_dir):
    r = runner.invoke(kv_app, ["ls", str(kv_dir)])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].split()[:3] == ["file", "tokens", "size"]
    rows = lines[1:5]
    # (hits+1)*tokens/size: 9 hits x 500 tokens first, then 200 (1 hit a day ago), 100, the real 12-token file
    assert [row.split()[1] for row in rows] == ["500", "200", "100", "12"]
    assert "continued" in rows[0] and "<real prefix>\\nline two" in r.output
    assert "4 files" in r.output and "1 unreadable" in r.output and "shorter than" in r.output
    r = runner.invoke(kv_app, ["ls", str(kv_dir), "--json"])
    objs = [json.loads(x) for x in r.output.splitlines()]
    assert {o["tokens"] for o in objs} == {12, 500, 100, 200} and all(o["bytes"] > 0 for o in objs)


def test_show(kv_dir):
    real = kv_dir / cache_name(b"<real prefix>\nline two")
    r = runner.invoke(kv_app, ["show", str(real)])
    assert r.exit_code == 0, r.output
    assert "tokens      12" in r.output and "cold" in r.output and "magic 0x34565344" in r.output
    assert "6 layers" in r.output and "'<real prefix>\\nline two'" in r.output
    bad = kv_dir / ("0" * 40 + ".kv")
    r = runner.invoke(kv_app, ["show", str(bad)])
    assert r.exit_code == 2 and "shorter than" in r.output


def test_prune_and_rm(kv_dir, tmp_path):
    d = tmp_path / "copy"
    d.mkdir()
    for p in kv_dir.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    name = cache_name(b"<real prefix>\nline two")
    sizes = {p.name: p.stat().st_size for p in d.glob("*.kv")}
    keep_mb = (sum(sizes.values()) - sizes[name] + 100) / (1 << 20)  # room for all but the real file
    r = runner.invoke(kv_app, ["prune", str(d), "--max-mb", f"{keep_mb:.6f}"])
    assert r.exit_code == 0, r.output
    assert r.output.count("removed ") == 1 and "12 tokens" in r.output  # the least useful one
    left = sorted(read_kv_file(p, with_payload=False).header.tokens for p in d.glob("*.kv")
                  if p.name != "0" * 40 + ".kv")
    assert left == [100, 200, 500]
    r = runner.invoke(kv_app, ["prune", str(d), "--max-mb", f"{3300 / (1 << 20):.6f}"])
    assert "2 removed" in r.output  # 100 then 200 tokens go; the 9-hit file stays
    name = next(p.name for p in d.glob("*.kv") if p.name != "0" * 40 + ".kv")
    r = runner.invoke(kv_app, ["rm", name[:8], "--dir", str(d)])
    assert r.exit_code == 0 and not (d / name).exists()
    r = runner.invoke(kv_app, ["rm", "nope", "--dir", str(d)])
    assert r.exit_code == 2
