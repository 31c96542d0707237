"""The ``ds4-mlx`` command line: make-tiny and inspect, through typer's runner and as a real subprocess."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
