"""Pipeline parallel (ds4_mlx.distributed) on localhost with MLX's ring backend: 2 ranks and 3 with an uneven split
give the logits and greedy ids of one rank; a rank that dies ends the others with an error, not a hang."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.distributed import split_layers
from ds4_mlx.loader import load

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import pipeline_rank  # noqa: E402

LAUNCH = shutil.which("mlx.launch") or (shutil.which("mlx.launch", path=str(Path(sys.executable).parent)))
needs_launch = pytest.mark.skipif(LAUNCH is None, reason="mlx.launch is not installed")
TOL = 1e-5  # the numerics tests' bound on logits (relative to the largest)


def test_split_layers():
    assert split_layers(6, 2) == [range(0, 3), range(3, 6)]
    assert split_layers(7, 3) == [range(0, 2), range(2, 4), range(4, 7)]
    assert split_layers(6, 3, "0:1, 1:4,4:6") == [range(0, 1), range(1, 4), range(4, 6)]
    for spec, why in [("0:3,3:5", "ends at layer 5"), ("0:3", "1 ranges for 2 ranks"), ("0:3,4:6", "start at layer 3"),
                      ("0:3,3:3", "at least one layer"), ("0-3,3:6", "not a range")]:
        with pytest.raises(ValueError, match=why):
            split_layers(6, 2, spec)
    with pytest.raises(ValueError, match="7 ranks for 6 layers"):
        split_layers(6, 7)


@pytest.fixture(scope="module")
def reference(tiny_gguf):
    """One rank's results for tests/pipeline_rank.py's checks."""
    path = tiny_gguf()
    out = {}
    for profile in ("hf", "ds4"):
        model, tok = load(path, numerics=profile)
        out.update({f"{profile}.{k}": v for k, v in pipeline_rank.run(model, tok).items()})
    return path, out


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


@needs_launch
@pytest.mark.parametrize("ranks,layers,profiles", [(2, "-", "hf,ds4"), (3, "0:1,1:4,4:6", "ds4")])
def test_pipeline_matches_one_rank(reference, tmp_path, ranks, layers, profiles):
    path, ref = reference
    out = tmp_path / "out.npz"
    cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--python", sys.executable,
           str(HERE / "pipeline_rank.py"), str(path), layers, profiles, str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.exists(), proc.stdout + proc.stderr
    got = dict(np.load(out))
    ref = {k: v for k, v in ref.items() if k.split(".")[0] in profiles.split(",")}
    assert sorted(got) == sorted(ref)
    for key, want in ref.items():
        if key.endswith(".ids"):
            assert len(want) > 0 and got[key].tolist() == want.tolist(), key
        else:
            assert got[key].shape == want.shape and _rel(got[key], want) <= TOL, key
    for profile in profiles.split(","):  # a restored snapshot replays its steps exactly
        np.testing.assert_array_equal(got[f"{profile}.replay"], got[f"{profile}.steps"])


def _rank_processes(launcher: int, n: int, timeout: float = 60) -> dict[int, int]:
    """{rank: pid} of the processes mlx.launch started (its children, each with MLX_RANK in its environment)."""
    deadline, found = time.monotonic() + timeout, {}
    while len(found) < n and time.monotonic() < deadline:
        # mlx.launch starts each rank from a thread of its own: every task's children
        children = [c for task in Path(f"/proc/{launcher}/task").iterdir() for c in (task / "children").read_text().split()]
        for pid in map(int, children):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            ranks = [int(e[9:]) for e in env if e.startswith(b"MLX_RANK=")]
            if ranks:
                found[ranks[0]] = pid
        time.sleep(0.05)
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


@needs_launch
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("victim", [1, 0])
def test_lost_rank_ends_the_others(tiny_gguf, tmp_path, victim):
    """A rank killed mid-generation: mlx.launch ends the other rank and returns within seconds (MLX's ring
    backend reports the lost peer, but a send queued behind the failed ones can wait forever)."""
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", "generate", "-m",
           str(tiny_gguf()), "-p", "hello", "-n", "100000", "--ctx", "200000", "--temp", "0", "--nothink",
           "--parallel", "pipeline"]
    out, err = tmp_path / "out", tmp_path / "err"
    launcher = subprocess.Popen(cmd, stdout=out.open("wb"), stderr=err.open("wb"))
    try:
        ranks = _rank_processes(launcher.pid, 2)
        assert sorted(ranks) == [0, 1], err.read_text(errors="replace")
        deadline = time.monotonic() + 60
        while out.stat().st_size == 0 and time.monotonic() < deadline:
            time.sleep(0.05)  # until rank 0 prints: the pipeline is generating
        assert out.stat().st_size > 0, err.read_text(errors="replace")
        os.kill(ranks[victim], signal.SIGKILL)
        t = time.monotonic()
        launcher.wait(timeout=30)
        took = time.monotonic() - t
    finally:
        if launcher.poll() is None:
            launcher.kill()
    survivor = ranks[1 - victim]
    assert not _alive(survivor) and took < 10, (took, err.read_text(errors="replace")[-2000:])
    assert f"rank {victim} exited with code -9" in err.read_text(errors="replace")


class _Group:
    """A stand-in for an ``mx.distributed`` group: loading a stage only asks its rank and size."""

    def __init__(self, rank: int, size: int):
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


def test_each_rank_reads_only_its_tensors(tiny_gguf):
    from ds4_mlx.distributed import PipelineFollower, PipelineModel

    path = tiny_gguf()
    whole, _ = load(path)
    stages = [load(path, group=_Group(r, 3), layers="0:1,1:4,4:6")[0] for r in range(3)]
    assert isinstance(stages[0], PipelineModel) and all(isinstance(s, PipelineFollower) for s in stages[1:])
    assert [[b.il for b in s.stage.layers] for s in stages] == [[0], [1, 2, 3], [4, 5]]
    assert sum(s.weights_bytes for s in stages) == whole.weights_bytes
    assert stages[0].stage.token_embd is not None and stages[1].stage.token_embd is None
    assert hasattr(stages[2].stage, "output") and not hasattr(stages[0].stage, "output")
    with pytest.raises(ValueError, match="one rank"):
        load(path, layers="0:6")
