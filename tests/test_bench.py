"""ds4-mlx bench: frontier arithmetic, the CSV format, snapshot/restore neutrality, memory refusal, plotting."""

from __future__ import annotations

import csv
import io
import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from ds4_mlx import bench as B
from ds4_mlx.bench_cli import bench_app
from ds4_mlx.random_model import random_model, random_weights_bytes, shape_config
from ds4_mlx.session import Session

REF = Path(__file__).resolve().parents[1] / "benchmarks" / "reference"  # ds4.c curves (copied from shared/)


def _app() -> typer.Typer:
    """The main app's registration, as the lead writes it."""
    app = typer.Typer()

    @app.command()
    def version() -> None:  # a second command, so "bench" is a real subcommand group
        pass

    app.add_typer(bench_app, name="bench")
    return app


@pytest.fixture(scope="module")
def tiny():
    return random_model("tiny", "q2", seed=3)


# ---- frontiers -------------------------------------------------------------------------------------------


def test_frontiers_step_incr_and_mul():
    assert B.frontiers(2048, 32768, step_incr=2048) == list(range(2048, 32769, 2048))
    assert B.frontiers(32, 100, step_incr=32) == [32, 64, 96]  # 128 > ctx_max: not walked
    # --step-mul: next = ceil(cur * F)
    got = B.frontiers(100, 1000, step_mul=1.5)
    want, f = [], 100
    while f <= 1000:
        want.append(f)
        f = math.ceil(f * 1.5)
    assert got == want == [100, 150, 225, 338, 507, 761]
    for bad in [dict(step_incr=0), dict(step_mul=1.0), dict(), dict(step_incr=2, step_mul=2.0)]:
        with pytest.raises(B.BenchError):
            B.frontiers(10, 100, **bad)
    with pytest.raises(B.BenchError):
        B.frontiers(100, 10, step_incr=1)


# ---- the walk on the tiny model ----------------------------------------------------------------------------


def test_cli_csv_rows_and_columns(tmp_path):
    out, js = tmp_path / "run.csv", tmp_path / "run.json"
    r = CliRunner().invoke(_app(), ["bench", "--random-weights", "tiny", "--ctx-start", "32", "--ctx-max", "96",
                                    "--step-incr", "32", "--gen-tokens", "3", "--chunk", "24",
                                    "--csv", str(out), "--json", str(js)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    lines = text.splitlines()
    assert lines[0] == "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes"
    rows = list(csv.DictReader(io.StringIO(text)))
    assert [int(r["ctx_tokens"]) for r in rows] == [32, 64, 96]
    assert [int(r["prefill_tokens"]) for r in rows] == [32, 32, 32]  # only the newly added interval
    assert all(int(r["gen_tokens"]) == 3 for r in rows)
    assert all(float(r["prefill_tps"]) > 0 and float(r["gen_tps"]) > 0 for r in rows)
    for line in lines[1:]:  # ds4-bench's %d,%d,%.2f,%d,%.2f,%llu
        f = line.split(",")
        assert len(f) == 6 and len(f[2].split(".")[1]) == 2 and len(f[4].split(".")[1]) == 2
    kv = [int(r["kvcache_bytes"]) for r in rows]
    assert all(a <= b for a, b in zip(kv, kv[1:])) and kv[-1] > kv[0] > 0
    # the system line: sidecar and JSON; the CSV itself stays ds4-bench's bytes (ds4's csv.DictReader parses it)
    side = (tmp_path / "run.system.txt").read_text()
    assert side.startswith("ds4-mlx bench: ds4-mlx ") and "mlx " in side and "commit " in side and "quant q2" in side
    summary = json.loads(js.read_text())
    assert summary["columns"] == list(B.CSV_COLUMNS)
    assert [row["ctx_tokens"] for row in summary["rows"]] == [32, 64, 96]
    assert all(row["peak_memory_bytes"] > 0 for row in summary["rows"])
    assert summary["system"]["mlx"] == mx.__version__ and summary["params"]["frontiers"] == [32, 64, 96]
    assert "ds4-mlx bench: ds4-mlx" in r.output  # the human table's system line (stderr)


def test_kv_bytes_match_a_fresh_session(tiny):
    """kvcache_bytes at each frontier is the KV state of a session that just prefilled that many tokens."""
    model, tok = tiny
    ids = B.generated_tokens(80, model.cfg.n_vocab, B.special_ids(tok), seed=1)
    res = B.run_bench(model, ids, [40, 80], 2, eos_id=tok.eos_id, chunk=16, warmup=False)
    for row in res.rows:
        s = Session(model, chunk_size=16)
        s.prefill(ids[: row.ctx_tokens])
        assert row.kvcache_bytes == s.kv_bytes


def test_decode_runs_the_generation_loop(tiny, monkeypatch):
    """The generation probe runs generate's own loop (decode_tokens: device draws, steps queued ahead), G steps a
    frontier, greedy with EOS banned: its ids are those of decode_tokens on a session at the same frontier."""
    model, tok = tiny
    ids = B.generated_tokens(48, model.cfg.n_vocab, B.special_ids(tok), seed=4)
    calls, taken = [], []

    def spy(session, sampler, max_tokens, **kw):
        calls.append((session.pos, max_tokens, sampler.params, sampler.banned))
        for t in B_decode(session, sampler, max_tokens, **kw):
            taken.append(t[0])
            yield t

    B_decode = B.decode_tokens
    monkeypatch.setattr(B, "decode_tokens", spy)
    B.run_bench(model, ids, [24, 48], 5, eos_id=tok.eos_id, chunk=16, warmup=False)
    assert [(c[0], c[1]) for c in calls] == [(24, 6), (48, 6)]  # 5 timed steps: 6 ids, the last not evaluated
    assert all(c[2].temperature <= 0 and c[3] == (tok.eos_id,) for c in calls)
    s = Session(model, chunk_size=16)
    s.prefill(ids[:48])
    want = [t for t, _ in B_decode(s, B.Sampler(B.GREEDY_PARAMS, banned=(tok.eos_id,)), 6)]
    assert taken[6:] == want and tok.eos_id not in taken


def test_generation_probe_leaves_the_walk_unchanged(tiny):
    """Snapshot, G greedy steps, restore: the next frontier's logits equal those of a walk without probes."""
    model, tok = tiny
    ids = B.generated_tokens(72, model.cfg.n_vocab, B.special_ids(tok), seed=2)
    points = [24, 48, 72]

    def walk(gen: int):
        seen = {}

        def grab(f, sess):
            seen[f] = np.array(sess.logits)

        res = B.run_bench(model, ids, points, gen, eos_id=tok.eos_id, chunk=20, warmup=False, on_frontier=grab)
        return seen, res

    with_probe, res = walk(6)
    without, _ = walk(0)
    assert all(r.gen_tokens == 6 and r.gen_tps > 0 for r in res.rows)
    for f in points:
        np.testing.assert_array_equal(with_probe[f], without[f])
    # and the probe really moved the session: a session that kept its 6 generated tokens differs
    s = Session(model, chunk_size=20)
    s.prefill(ids[:24])
    for _ in range(6):
        s.step(int(mx.argmax(s.logits).item()))
    s.prefill(ids[24:48])
    assert not np.array_equal(np.array(s.logits), with_probe[48])


def test_greedy_probe_excludes_eos(tiny):
    """With EOS forced to be the argmax, the probe still never picks it (and never stops)."""
    model, tok = tiny
    picked = []
    orig = Session.step

    def spy(self, token):
        picked.append(int(token.item()) if isinstance(token, mx.array) else int(token))
        return orig(self, token)

    # an EOS-loving head: bias the output head's logits by wrapping the model call
    class EosModel:
        cfg = model.cfg

        def make_cache(self, reserve=0):
            return model.make_cache(reserve)

        def __call__(self, tokens, pos, caches):
            logits = model(tokens, pos, caches)
            return logits + mx.where(mx.arange(model.cfg.n_vocab) == tok.eos_id, 1e4, 0.0)

    ids = B.generated_tokens(16, model.cfg.n_vocab, B.special_ids(tok), seed=4)
    Session.step = spy
    try:
        res = B.run_bench(EosModel(), ids, [16], 5, eos_id=tok.eos_id, chunk=16, warmup=False)
    finally:
        Session.step = orig
    assert len(picked) == 5 and tok.eos_id not in picked and res.rows[0].gen_tokens == 5


def test_step_mul_cli_rows(tmp_path):
    out = tmp_path / "mul.csv"
    r = CliRunner().invoke(_app(), ["bench", "--random-weights", "tiny", "--ctx-start", "16", "--ctx-max", "60",
                                    "--step-mul", "1.7", "--gen-tokens", "1", "--csv", str(out), "--no-warmup"])
    assert r.exit_code == 0, r.output
    rows = B.read_csv(out)
    assert [x["ctx_tokens"] for x in rows] == [16, 28, 48]  # ceil(16*1.7)=28, ceil(28*1.7)=48, 82 > 60
    assert [x["prefill_tokens"] for x in rows] == [16, 12, 20]


# ---- refusals --------------------------------------------------------------------------------------------------


def test_refuses_a_context_that_cannot_fit(tmp_path):
    r = CliRunner().invoke(_app(), ["bench", "--random-weights", "full", "--ctx-max", "100000000", "--ctx-start",
                                    "2048", "--step-incr", "100000000"])
    assert r.exit_code == 2
    assert "cannot fit" in r.output and "available" in r.output
    plan = B.memory_plan(shape_config("full"), random_weights_bytes(shape_config("full")), 100_000_000, 512)
    with pytest.raises(B.BenchError):
        plan.check(100_000_000)


def test_bad_input_is_one_error_line(tmp_path):
    for args in (["bench"], ["bench", "--random-weights", "huge"], ["bench", "--random-weights", "tiny",
                 "--step-mul", "0.5"], ["bench", "--random-weights", "tiny", "--ctx-start", "64", "--ctx-max", "32"],
                 ["bench", "--random-weights", "tiny", "--prompt-file", str(tmp_path / "missing.txt")]):
        r = CliRunner().invoke(_app(), args)
        assert r.exit_code == 2 and "error:" in r.output, (args, r.output)


def test_prompt_file_too_short(tmp_path):
    p = tmp_path / "p.txt"
    p.write_text("a short prompt")
    r = CliRunner().invoke(_app(), ["bench", "--random-weights", "tiny", "--prompt-file", str(p),
                                    "--ctx-start", "32", "--ctx-max", "64", "--step-incr", "32"])
    assert r.exit_code == 2 and "tokens" in r.output


def test_full_shape_plan_fits_an_h200():
    """The measurement the H200 session runs: 2048 -> 32768 at the full q2 shape stays under 120 GB."""
    cfg = shape_config("full")
    w = random_weights_bytes(cfg, "q2")
    plan = B.MemoryPlan(w, B.kv_bytes_estimate(cfg, 32768 + 65), B.scratch_bytes_estimate(cfg, 512), 0, "")
    assert 80e9 < w < 90e9  # the published q2 layout is ~87 GB
    assert plan.needed < 120e9


@pytest.mark.parametrize("chunk, measured_gb", [(2048, 5.56), (4096, 8.23), (8192, 15.52)])
def test_scratch_estimate_covers_the_measured_peaks(chunk, measured_gb):
    """MLX's peak past the weights and the KV state in a 32K prompt's prefill on the H200 (43 layers, q2,
    benchmarks/results/h200_bench_long.log and h200_walk32k_chunk*.log): the estimate covers it, within 1.3x."""
    est = B.scratch_bytes_estimate(shape_config("full"), chunk) / 1e9
    assert measured_gb <= est <= 1.3 * measured_gb


# ---- CSV reading and plots --------------------------------------------------------------------------------------


def _write(path: Path, ctx: list[int], prefill: list[float], gen: list[float], bom_crlf: bool = False) -> Path:
    lines = [",".join(B.CSV_COLUMNS)] + [f"{c},{c if i == 0 else c - ctx[i - 1]},{p:.2f},64,{g:.2f},{1000 * c}"
                                        for i, (c, p, g) in enumerate(zip(ctx, prefill, gen))]
    sep = "\r\n" if bom_crlf else "\n"
    path.write_bytes(("\ufeff" if bom_crlf else "").encode() + (sep.join(lines) + sep).encode())
    return path


def test_read_csv_handles_ds4_files():
    for name in ("m2_ultra.csv", "m4_max.csv", "h200_ds4c_cuda.csv"):  # m4_max has a BOM and CRLF
        rows = B.read_csv(REF / name)
        assert rows[0]["ctx_tokens"] == 2048 and rows[0]["prefill_tps"] > 0 and rows[-1]["gen_tps"] > 0


def test_plot_svg_has_one_line_per_input_and_ratios(tmp_path):
    pytest.importorskip("matplotlib")
    a = _write(tmp_path / "a.csv", [32, 64, 96], [100.0, 90.0, 80.0], [20.0, 19.0, 18.0])
    b = _write(tmp_path / "b.csv", [32, 64], [50.0, 45.0], [10.0, 9.5], bom_crlf=True)
    base = _write(tmp_path / "base.csv", [32, 64, 128], [25.0, 30.0, 10.0], [5.0, 4.0, 1.0])
    out = tmp_path / "speed.svg"
    r = CliRunner().invoke(_app(), ["bench", "plot", str(a), str(b), "-o", str(out), "--vs", str(base)])
    assert r.exit_code == 0, r.output
    root = ET.parse(out).getroot()
    assert root.tag.endswith("svg")
    ids = {el.get("id") for el in root.iter() if el.get("id", "").startswith("run-")}
    assert ids == {f"run-{i}-{k}" for i in range(3) for k in ("prefill", "gen")}  # a, b and the baseline
    # each line has one vertex per row: count the path's vertices of run-0's prefill line
    g = next(el for el in root.iter() if el.get("id") == "run-0-prefill")
    d = next(el for el in g.iter() if el.tag.endswith("path")).get("d")
    assert d.count("L") == 2  # M + 2 L = three points
    # ratios at the common frontiers: a/base at 32 = 100/25 = 4.00 and 20/5; at 64 = 3.00 and 4.75
    assert "4.00" in r.output and "3.00" in r.output and "4.75" in r.output
    assert B.ratios(B.read_csv(a), B.read_csv(base)) == [
        {"ctx_tokens": 32, "prefill_ratio": 4.0, "gen_ratio": 4.0},
        {"ctx_tokens": 64, "prefill_ratio": 3.0, "gen_ratio": 4.75}]


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    import builtins

    real = builtins.__import__

    def no_mpl(name, *a, **k):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_mpl)
    a = _write(tmp_path / "a.csv", [32, 64], [1.0, 2.0], [1.0, 2.0])
    r = CliRunner().invoke(_app(), ["bench", "plot", str(a), "-o", str(tmp_path / "x.svg")])
    assert r.exit_code == 2 and "pip install 'ds4-mlx[plot]'" in r.output


def test_cli_model_file_and_prompt_file(tmp_path):
    """-m FILE with --prompt-file: the prompt is plain-BPE encoded by the file's tokenizer, rows as asked."""
    from importlib import resources

    from ds4_mlx.testing import make_tiny_gguf

    gguf = make_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(resources.files("ds4_mlx").joinpath("data/tiny_corpus.txt").read_text(encoding="utf-8"))
    js = tmp_path / "r.json"
    r = CliRunner().invoke(_app(), ["bench", "-m", str(gguf), "--prompt-file", str(prompt), "--ctx-start", "40",
                                    "--ctx-max", "80", "--step-incr", "40", "-n", "2", "--json", str(js),
                                    "--no-warmup"])
    assert r.exit_code == 0, r.output
    s = json.loads(js.read_text())
    assert [x["ctx_tokens"] for x in s["rows"]] == [40, 80] and s["params"]["prompt"].startswith("prompt.txt (")
    assert "tiny.gguf" in s["system"]["model"]
    # without --csv the CSV goes to stdout, after the human table on stderr
    assert "ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes\n40,40," in r.output
