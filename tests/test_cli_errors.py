"""Bad input on the command line: every wrong path, flag or model file ends in exactly one ``error:`` line on
stderr and exit status 2, with no traceback, from every subcommand; nothing is computed before an output path
is known to be writable; help reads at 80 columns. Run in-process (typer's runner) except for a few subprocess
runs of the real entry point."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from ds4_mlx.cli import app

runner = CliRunner()


def one_error(r, needle: str) -> str:
    """The single ``error:`` line of a failed run (exit 2, no traceback), which must contain ``needle``."""
    assert r.exit_code == 2, (r.exit_code, r.output, r.stderr, r.exception)
    assert "Traceback" not in r.output + r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, r.stderr
    assert "\n" not in errors[0] and needle in errors[0], (needle, errors[0])
    return errors[0]


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_gguf):
    """A folder with a tiny model, a converted directory, a CSV, a plain file and a disk KV cache file."""
    from ds4_mlx.convert.gguf_to_mlx import convert
    from ds4_mlx.kvstore import KVHeader, cache_name

    root = tmp_path_factory.mktemp("cli-errors")
    convert(tiny_gguf(), root / "mlx", progress=False, log=lambda *a: None)
    (root / "run.csv").write_text("ctx_tokens,prefill_tokens,prefill_tps,gen_tokens,gen_tps,kvcache_bytes\n"
                                  "2048,2048,100.0,128,20.0,1000\n")
    (root / "plain.txt").write_text("not a model\n")
    (root / "kv").mkdir()
    text = b"a cached prompt"
    h = KVHeader(2, 1, 0, 40, 0, 4096, 0, int(time.time()), int(time.time()), 256, len(text))
    (root / "kv" / cache_name(text)).write_bytes(h.pack() + text + bytes(256))
    return {"root": root, "gguf": tiny_gguf(), "dir": root / "mlx", "csv": root / "run.csv",
            "plain": root / "plain.txt", "kv": root / "kv"}


@pytest.fixture
def demo_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DS4_MLX_CACHE", str(tmp_path / "cache"))


# ---- flags and paths -------------------------------------------------------------------------------------

def _argument_cases(f: dict) -> list[tuple[list[str], str]]:
    r, gguf, csv = f["root"], str(f["gguf"]), str(f["csv"])
    nowhere = str(r / "no-such-folder" / "out")
    return [
        # output paths: a folder that does not exist, a directory
        (["make-tiny", nowhere + ".gguf"], "does not exist"),
        (["make-tiny", str(r)], "is a directory"),
        (["generate", "-m", gguf, "-p", "x", "--dump-logprobs", nowhere + ".json"], "does not exist"),
        (["generate", "-m", gguf, "-p", "x", "--dump-logprobs", str(r)], "is a directory"),
        (["bench", "plot", csv, "-o", nowhere + ".svg"], "does not exist"),
        (["bench", "plot", csv, "-o", str(r)], "is a directory"),
        (["bench", "--random-weights", "tiny", "--csv", nowhere + ".csv"], "does not exist"),
        (["convert", gguf, str(f["plain"])], "exists and is not a directory"),
        (["convert", gguf, nowhere], "does not exist"),
        # input paths
        (["inspect", str(r / "none.gguf")], "no such file"),
        (["inspect", str(r)], "missing config.json"),
        (["generate", "-m", str(r / "none.gguf"), "-p", "x"], "no model at"),
        (["generate", "-m", gguf, "--prompt-file", str(r / "none.txt")], "no such prompt file"),
        (["bench", "plot", str(r / "none.csv")], "no such file"),
        (["convert", "--verify", str(f["plain"])], "not a directory"),
        (["convert", "--verify", str(r)], "missing config.json"),
        (["kv", "ls", str(f["plain"])], "is not a directory"),
        (["kv", "show", "ffffff", "--dir", str(f["kv"])], "no file"),
        (["kv", "show", str(f["plain"])], "not a .kv file"),
        (["kv", "rm", "ffffff", "--dir", str(f["kv"])], "no file"),
        # numbers out of range
        (["inspect", gguf, "--ctx", "0"], "'--ctx'"),
        (["convert", gguf, str(r / "x"), "--shard-gb", "0"], "--shard-gb must be at least"),
        (["convert", gguf], "missing OUT_DIR"),
        (["kv", "prune", str(f["kv"]), "--max-mb", "-1"], "--max-mb must be >= 0"),
        (["kv", "prune", str(f["kv"]), "--max-mb", "nan"], "--max-mb must be >= 0"),
        (["serve", "--port", "99999"], "'--port': 99999 is not a TCP port"),
        (["serve", "--ctx", "8"], "'--ctx': 8 is below 16"),
        (["serve", "-n", "0"], "'--tokens'"),
        (["serve", "--temp", "nan"], "--temp must be a finite number"),
        (["serve", "--batched-session", "-1"], "'--batched-session': -1 is not a session count"),
        (["serve", "--mixed-prefill-quantum", "0"], "'--mixed-prefill-quantum': 0 is not a positive token count"),
        (["serve", "-m", gguf, "--batched-session", "4", "--ctx", "4000000000"], "4 session(s) of --ctx 4000000000 do not fit"),
        (["generate", "-m", gguf, "-p", "x", "--temp", "nan"], "--temp must be a finite number"),
        (["generate", "-m", gguf, "-p", "x", "--top-p", "inf"], "--top-p must be a finite number"),
        (["chat", "-m", gguf, "--min-p", "nan"], "--min-p must be a finite number"),
        (["generate", "-m", gguf, "-p", "x", "-n", "0"], "--tokens must be > 0"),
        (["generate", "-m", gguf, "-p", "x", "--logprobs-top-k", "500"], "--logprobs-top-k must be <= 128"),
        (["make-tiny", str(r / "t.gguf"), "--experts", "q3"], "--experts must be q2, q4 or f16"),
        (["make-tiny", str(r / "t.gguf"), "--hca-ratio", "100000000"], "--hca-ratio must be 8..1024"),
        (["make-tiny", str(r / "t.gguf"), "--layers", "1000"], "--layers must be 3..64"),
        (["bench", "--random-weights", "huge"], "--random-weights must be tiny or full"),
        # what click itself parses
        (["generate", "--ctx", "abc"], "'--ctx'"),
        (["generate", "--no-such-flag"], "No such option: --no-such-flag"),
        (["inspect"], "Missing argument"),
        (["kv", "prune", str(f["kv"])], "--max-mb"),
    ]


def test_bad_flags_and_paths(files):
    """One ``error:`` line naming the flag or path, exit 2, for every subcommand; nothing written."""
    cases = _argument_cases(files)
    assert len(cases) == 45
    before = sorted(p.name for p in files["root"].iterdir())
    for args, needle in cases:
        r = runner.invoke(app, args)
        line = one_error(r, needle)
        assert "loading" not in r.stderr, (args, r.stderr)  # rejected before any model was read
        assert len(line) < 300, line
    assert sorted(p.name for p in files["root"].iterdir()) == before
    assert len(list(files["kv"].iterdir())) == 1  # prune -1 deleted nothing


def test_dump_logprobs_checks_its_path_before_computing(files, monkeypatch):
    """The finished computation is never thrown away: the path is checked before the model is loaded."""
    import ds4_mlx.cli as cli

    monkeypatch.setattr(cli, "_load", lambda *a: pytest.fail("loaded the model before checking the output path"))
    out = files["root"] / "missing" / "lp.json"
    one_error(runner.invoke(app, ["generate", "-m", str(files["gguf"]), "-p", "x", "--dump-logprobs", str(out)]),
              str(out))


def test_sampling_flags_ds4_clamps_get_a_warning(demo_cache):
    r = runner.invoke(app, ["generate", "--demo", "-p", "hi", "-n", "2", "--seed", "1", "--top-p", "2", "--top-k", "-3",
                            "--min-p", "-0.5"])
    assert r.exit_code == 0, r.stderr
    warnings = [line for line in r.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 3, r.stderr
    assert "--top-p 2 is outside (0, 1]: using 1 (off)" in warnings[0]
    assert "--min-p -0.5 is negative: using 0" in warnings[1] and "--top-k -3 is negative" in warnings[2]
    assert "Generation: 2 tokens" in r.stderr


def test_kv_show_and_rm_accept_the_names_ls_prints(files, tmp_path):
    kv = tmp_path / "kv"
    shutil.copytree(files["kv"], kv)
    r = runner.invoke(app, ["kv", "ls", str(kv)])
    assert r.exit_code == 0, r.output
    short = r.stdout.splitlines()[1].split()[0]
    full = next(kv.glob("*.kv")).name
    assert len(short) == 12 and full.startswith(short)
    r = runner.invoke(app, ["kv", "show", short, "--dir", str(kv)])
    assert r.exit_code == 0 and "tokens      40" in r.stdout, r.output
    r = runner.invoke(app, ["kv", "show", str(kv / short)])  # DIR/NAME as well
    assert r.exit_code == 0 and "a cached prompt" in r.stdout, r.output
    r = runner.invoke(app, ["kv", "rm", short, "--dir", str(kv)])
    assert r.exit_code == 0 and not list(kv.glob("*.kv"))


# ---- model files that do not load -----------------------------------------------------------------------

def _shard(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def _copy_dir(src: Path, dst: Path) -> Path:
    """A converted directory: JSON files copied, the shard linked (cases that change it write a copy)."""
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix == ".safetensors":
            os.symlink(p, dst / p.name)
        else:
            shutil.copy(p, dst / p.name)
    return dst


def _edit_json(path: Path, edit) -> None:
    doc = json.loads(path.read_text(encoding="utf-8"))
    doc = edit(doc) or doc
    path.write_text(json.dumps(doc), encoding="utf-8")


def _edit_shard(d: Path, edit) -> None:
    shard = _shard(d)
    data = bytearray(shard.read_bytes())
    shard.unlink()
    edit(data)
    shard.write_bytes(bytes(data))


def _set(key, value):
    def edit(doc):
        doc[key] = value
    return edit


def _del(*path):
    def edit(doc):
        for k in path[:-1]:
            doc = doc[k] if k is not iter else doc[next(iter(doc))]
        del doc[path[-1]]
    return edit


def _nan_in(name: str):
    def edit(data: bytearray) -> None:
        n = int.from_bytes(data[:8], "little")
        start = json.loads(data[8 : 8 + n])[name]["data_offsets"][0]
        data[8 + n + start + 12 : 8 + n + start + 16] = struct.pack("<f", float("nan"))
    return edit


def _header_entry(name: str, key: str, value):
    def edit(data: bytearray) -> None:
        n = int.from_bytes(data[:8], "little")
        header = json.loads(data[8 : 8 + n])
        header[name][key] = value
        js = json.dumps(header, separators=(",", ":")).encode()
        js += b" " * (n - len(js))
        assert len(js) == n  # same length: only the header's meaning changes
        data[8 : 8 + n] = js
    return edit


DIR_CASES = [  # (label, file, edit, needle)
    ("string for an int", "config.json", _set("n_layer", "6"), "n_layer = '6', expected an integer"),
    ("short ratio list", "config.json", _set("compress_ratios", [0, 0, 4]), "compress_ratios has 3 entries"),
    ("list instead of an object", "config.json", lambda d: [d], "expected a JSON object"),
    ("object instead of a list", "config.json", _set("swiglu_clamp", {"0": 10.0}), "swiglu_clamp"),
    ("rms_eps null", "config.json", _set("rms_eps", None), "rms_eps = None, expected a finite number"),
    ("rms_eps -1", "config.json", _set("rms_eps", -1.0), "rms_eps = -1.0, expected > 0"),
    ("rope base 0", "config.json", _set("rope_freq_base", 0), "rope_freq_base = 0, expected > 1"),
    ("window 0", "config.json", _set("n_swa", 0), "n_swa = 0, expected > 0"),
    ("sinkhorn 4e9", "config.json", _set("n_sinkhorn_iter", 4_000_000_000), "at most 100"),
    ("top-k > experts", "config.json", _set("n_expert_used", 99), "n_expert_used 99 > n_expert 16"),
    ("expert types", "config.json", _set("expert_types", ["Q4_K", "Q4_K", "Q4_K"]), "config.json says Q4_K"),
    ("shard without size", "model.safetensors.index.json",
     _del("shards", iter, "size"), "expected {\"size\""),
    ("tensor without shape", "model.safetensors.index.json",
     _del("tensors", "output_norm.weight", "shape"), "tensor output_norm.weight"),
    ("shard outside the folder", "model.safetensors.index.json",
     lambda d: d["shards"].update({"../x.safetensors": {"size": 8, "sha256": ""}}), "not a .safetensors file name"),
    ("tokenizer without a model", "tokenizer.json", lambda d: {"version": "1.0"}, "expected a BPE model"),
    ("merge of unknown tokens", "tokenizer.json",
     lambda d: d["model"]["merges"].insert(0, ["q\u4e00", "z"]), "merge #0"),
    ("merge not 'A B'", "tokenizer.json", lambda d: d["model"]["merges"].insert(3, "abc"), "merge #3 is not 'A B'"),
    ("corrupt header length", "shard", lambda b: b.__setitem__(slice(0, 8), (1 << 40).to_bytes(8, "little")),
     "corrupt safetensors header"),
    ("header not JSON", "shard", lambda b: b.__setitem__(slice(8, 12), b"\xff\xfe{["), "corrupt safetensors header"),
    ("header dtype", "shard", _header_entry("output_norm.weight", "dtype", "F16"), "tensor output_norm.weight"),
    ("header offsets", "shard", _header_entry("blk.0.attn_norm.weight", "data_offsets", [0, 4]),
     "tensor blk.0.attn_norm.weight"),
    ("nan norm", "shard", _nan_in("blk.1.ffn_norm.weight"), "blk.1.ffn_norm.weight holds nan at index 3"),
]


@pytest.mark.parametrize("label,file,edit,needle", DIR_CASES, ids=[c[0] for c in DIR_CASES])
def test_bad_converted_directory(files, tmp_path, label, file, edit, needle):
    """``inspect`` rejects what ``generate`` rejects, with the same one-line message."""
    d = _copy_dir(files["dir"], tmp_path / "bad")
    if file == "shard":
        _edit_shard(d, edit)
    else:
        _edit_json(d / file, edit)
    a = one_error(runner.invoke(app, ["inspect", str(d)]), needle)
    b = one_error(runner.invoke(app, ["generate", "-m", str(d), "-p", "hi", "-n", "1"]), needle)
    assert a == b and str(d) in a


def test_good_converted_directory_still_loads(files):
    r = runner.invoke(app, ["inspect", str(files["dir"])])
    assert r.exit_code == 0, r.stderr


def test_bad_gguf_merges_fail_in_generate_like_in_inspect(tmp_path):
    """A malformed merge list: ``inspect`` and ``generate`` both refuse it (it once passed ``inspect``)."""
    from ds4_mlx.testing import random_tensors, tiny_config, tiny_tokenizer, write_gguf

    cfg = tiny_config()
    tok = tiny_tokenizer(cfg.n_vocab)
    a, b = tok.merges[0].split(" ")
    bad = type(tok)(tok.tokens, [f"{a}{b} {a}{b}{a}{b}{a}"] + tok.merges[1:], None)  # AB absent from the vocab
    path = write_gguf(tmp_path / "m.gguf", cfg, random_tensors(cfg, np.random.default_rng(0), "q2"), bad)
    x = one_error(runner.invoke(app, ["inspect", str(path)]), "tokenizer.ggml.merges: merge #0")
    y = one_error(runner.invoke(app, ["generate", "-m", str(path), "-p", "hi"]), "tokenizer.ggml.merges: merge #0")
    assert x == y and "not in the vocabulary" in x


def test_check_merges_names_a_missing_pair_instead_of_aborting():
    """``tokenizers`` aborts the process on a merge whose result is not in the vocabulary; the check names it."""
    from ds4_mlx.tokenizer import check_merges

    assert check_merges({"a", "b", "ab"}, ["a b"]) == [("a", "b")]
    for merges, needle in ((["a b"], "'ab' is not in the vocabulary"), (["a c"], "'c' is not"), (["ab"], "not 'A B'"),
                           (["a b c"], "not 'A B'"), ([None], "not 'A B'")):
        with pytest.raises(ValueError, match=needle):
            check_merges({"a", "b"}, merges)


# ---- the real entry point --------------------------------------------------------------------------------

def test_subprocess_errors_are_one_line(files):
    for args, needle in ((["serve", "--port", "99999"], "'--port'"),
                         (["make-tiny", str(files["root"] / "no" / "t.gguf")], "does not exist")):
        r = subprocess.run([sys.executable, "-m", "ds4_mlx", *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.count("error:") == 1 and r.stderr.startswith("error:") and needle in r.stderr, r.stderr


# ---- help -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cmd", [[], ["generate"], ["chat"], ["serve"], ["inspect"], ["make-tiny"], ["convert"],
                                 ["bench"], ["bench", "plot"], ["kv"], ["kv", "show"], ["kv", "prune"]])
def test_help_reads_at_80_columns(cmd):
    r = runner.invoke(app, [*cmd, "--help"], terminal_width=80)
    assert r.exit_code == 0, r.output
    assert "<bool>" not in r.output and "``" not in r.output and "…" not in r.output
    assert max(len(line) for line in r.output.splitlines()) <= 80
    if cmd == ["serve"]:
        assert "--kv-cache-continued-interval-tokens" in r.output and "--disable-exact-dsml-tool-replay" in r.output
    if cmd == ["convert"]:
        assert "--verify" in r.output and "-m OUT_DIR" in r.output


def test_readme_commands_and_ci():
    """The README's first command is the light install plus the demo, the second the dev install plus the
    tests, and CI runs that second line."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text(encoding="utf-8")
    setup = readme[readme.index("## Set-up") : readme.index("## Command line")]
    blocks = [b.split("```", 1)[0].strip() for b in setup.split("```bash\n")[1:]]
    assert len(blocks) == 2
    assert "pip install -e . &&" in blocks[0] and "[dev]" not in blocks[0] and "ds4-mlx generate --demo" in blocks[0]
    assert blocks[1] == 'pip install -e ".[dev]" && python -m pytest -q'
    assert blocks[1] in (root / ".ci" / "run").read_text().splitlines()
