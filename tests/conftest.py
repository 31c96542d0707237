"""Shared fixtures: tiny DS4 GGUFs written once per test session."""

from __future__ import annotations

import importlib
import threading
from pathlib import Path

import pytest

from ds4_mlx.testing import make_tiny_gguf


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """``tiny_gguf(experts="q2", hca_ratio=16, seed=0, layers=6) -> Path``; each variant is written once."""
    root = tmp_path_factory.mktemp("tiny")
    cache: dict[tuple, Path] = {}

    def make(experts: str = "q2", hca_ratio: int = 16, seed: int = 0, layers: int = 6) -> Path:
        key = (experts, hca_ratio, seed, layers)
        if key not in cache:
            path = root / f"tiny-{experts}-r{hca_ratio}-s{seed}-l{layers}.gguf"
            cache[key] = make_tiny_gguf(path, experts=experts, hca_ratio=hca_ratio, seed=seed, layers=layers)
        return cache[key]

    return make


@pytest.fixture(params=[False, True], ids=["one-thread", "encode-thread"])
def encode_thread(request, monkeypatch):
    """Both ways ``decode_tokens`` queues its pipelined steps: from the caller's thread, and from a
    ``StepEncoder`` thread (its default on CUDA only, so forced on here)."""
    generate = importlib.import_module("ds4_mlx.generate")  # the package's ``generate`` is the function
    monkeypatch.setattr(generate, "kernel_backend", lambda: "cuda" if request.param else "fallback")
    return request.param


@pytest.fixture
def in_other_thread():
    """``in_other_thread(fn)``: ``fn()`` run in a new thread (MLX streams are per thread), its result returned
    and its exception raised here."""

    def run(fn):
        out = {}

        def target():
            try:
                out["value"] = fn()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                out["error"] = e

        t = threading.Thread(target=target)
        t.start()
        t.join()
        if "error" in out:
            raise out["error"]
        return out["value"]

    return run
