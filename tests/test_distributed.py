"""Model parallel (ds4_mlx.distributed) on localhost with MLX's ring backend: a layer pipeline, the experts split
(expert parallel) and the attention heads split as well (tensor parallel), over 2 ranks and 3 with an uneven split,
give the logits and greedy ids of one rank; a rank that dies ends the others with an error, not a hang."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from ds4_mlx.backend import on_cuda_gpu
from ds4_mlx.distributed import even_split, expert_range, messages_awaited, split_layers, tensor_share
from ds4_mlx.kvstore import snapshot_from_payload
from ds4_mlx.loader import load
from ds4_mlx.session import Session

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
def reference(tiny_gguf, tmp_path_factory):
    """One rank's results for tests/pipeline_rank.py's checks, its models, and its KV payloads as files (in
    ``kv``, one per profile) for the ranks to restore."""
    path, kv = tiny_gguf(), tmp_path_factory.mktemp("kv")
    out, models = {}, {}
    for profile in ("hf", "ds4"):
        models[profile], tok = load(path, numerics=profile)
        out.update({f"{profile}.{k}": v for k, v in pipeline_rank.run(models[profile], tok).items()})
        (kv / f"{profile}.kv").write_bytes(out[f"{profile}.payload"].tobytes())
    return path, out, models, kv


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def _matches_one_rank(reference, tmp_path, ranks: int, layers: str, profiles: str, mode: str, ds4_tol: float,
                      env: dict[str, str] | None = None):
    """tests/pipeline_rank.py over ``ranks`` ranks against one rank: greedy ids equal, logits within the profile's
    tolerance; a restored snapshot replays its steps exactly; one rank's KV payload restored on the ranks, and the
    ranks' payload restored on one rank, step as one rank does."""
    path, ref, models, kv = reference
    out = tmp_path / "out.npz"
    cmd = [LAUNCH, "-n", str(ranks), "--backend", "ring", "--python", sys.executable,
           str(HERE / "pipeline_rank.py"), str(path), layers, profiles, str(out), mode, str(kv)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ, **(env or {})})
    assert out.exists(), proc.stdout + proc.stderr
    got = dict(np.load(out))
    for profile in profiles.split(","):
        tol = TOL if profile == "hf" else ds4_tol
        want = {k.split(".", 1)[1]: v for k, v in ref.items() if k.startswith(profile + ".")}
        mine = {k.split(".", 1)[1]: v for k, v in got.items() if k.startswith(profile + ".")}
        assert sorted(mine) == sorted([*want, "restored"])
        assert len(want["ids"]) > 0 and mine["ids"].tolist() == want["ids"].tolist(), profile
        for key in ("full", "chunked", "steps", "replay", "restored"):
            assert mine[key].shape == want.get(key, want["steps"]).shape, (profile, key)
            assert _rel(mine[key], want.get(key, want["steps"])) <= tol, (profile, key)
        np.testing.assert_array_equal(mine["replay"], mine["steps"])
        assert len(mine["payload"]) == len(want["payload"])  # the same file format
        s = Session(models[profile])
        s.restore(snapshot_from_payload(models[profile], mine["payload"].tobytes()))
        steps = np.stack([np.array(s.step(t)) for t in pipeline_rank.PROMPT[pipeline_rank.PREFILL :]])
        assert _rel(steps, want["steps"]) <= tol, (profile, "the ranks' payload on one rank")


@needs_launch
@pytest.mark.parametrize("ranks,layers,profiles", [(2, "-", "hf,ds4"), (3, "0:1,1:4,4:6", "ds4")])
def test_pipeline_matches_one_rank(reference, tmp_path, ranks, layers, profiles):
    _matches_one_rank(reference, tmp_path, ranks, layers, profiles, "pipeline", TOL)


@needs_launch
def test_pipeline_with_awaited_messages_matches_one_rank(reference, tmp_path):
    """Every message awaited (as on MLX-CUDA): the same results, the chunks no longer overlapped."""
    _matches_one_rank(reference, tmp_path, 3, "0:1,1:4,4:6", "ds4", "pipeline", TOL, {"DS4_MLX_AWAIT_MESSAGES": "1"})


def test_awaited_messages_setting(monkeypatch):
    monkeypatch.setenv("DS4_MLX_AWAIT_MESSAGES", "1")
    assert messages_awaited()
    monkeypatch.setenv("DS4_MLX_AWAIT_MESSAGES", "0")
    assert not messages_awaited()
    monkeypatch.setenv("DS4_MLX_AWAIT_MESSAGES", "yes")
    with pytest.raises(ValueError, match="must be 0 or 1"):
        messages_awaited()
    monkeypatch.delenv("DS4_MLX_AWAIT_MESSAGES")
    assert messages_awaited() == on_cuda_gpu()


@needs_launch
@pytest.mark.parametrize("mode,ranks", [("expert", 2), ("expert", 3), ("tensor", 2)])
def test_split_tensors_match_one_rank(reference, tmp_path, mode, ranks):
    """The experts split over 2 and 3 ranks (3 an uneven split), and the heads too over 2: one rank's greedy ids,
    and its logits up to the order of the sums (the ranks' shares are added by all_sum). That order alone moves
    the `hf` profile's logits by ~1e-6; in the `ds4` profile it flips a last bit of some FP8/f16 cache roundings
    too, up to 7.5e-5 on this model (heads split), so that profile is held to 1e-4."""
    _matches_one_rank(reference, tmp_path, ranks, "-", "hf,ds4", mode, 1e-4)


def test_each_expert_parallel_rank_reads_only_its_experts(tiny_gguf):
    assert [expert_range(8, 3, r) for r in range(3)] == [range(0, 2), range(2, 5), range(5, 8)]
    with pytest.raises(ValueError, match="9 ranks for 8 experts"):
        expert_range(8, 9, 0)
    assert [even_split(256, 3, r, 32) for r in range(3)] == [range(0, 64), range(64, 160), range(160, 256)]
    path = tiny_gguf()
    whole, _ = load(path)
    ranks = [load(path, group=_Group(r, 3), parallel="expert")[0] for r in range(3)]
    E, F = whole.cfg.n_expert, whole.cfg.n_ff_exp
    for r, m in enumerate(ranks):
        mine, hidden = expert_range(E, 3, r), even_split(F, 3, r, 32)
        for b, ref in zip(m.layers, whole.layers, strict=True):
            assert b.ffn.expert_ids == mine and b.ffn.ffn_gate_exps.shape[0] == len(mine)
            want = ref.ffn.ffn_down_exps.data[mine.start : mine.stop]
            np.testing.assert_array_equal(np.array(b.ffn.ffn_down_exps.data), np.array(want))
            # the shared expert's hidden units: rows of up, columns of down
            up, down = ref.ffn.ffn_up_shexp.dequantize(), ref.ffn.ffn_down_shexp.dequantize()
            np.testing.assert_array_equal(np.array(b.ffn.ffn_up_shexp.dequantize()),
                                          np.array(up[hidden.start : hidden.stop]))
            np.testing.assert_array_equal(np.array(b.ffn.ffn_down_shexp.dequantize()),
                                          np.array(down[:, hidden.start : hidden.stop]))  # fmt: skip
    split = sum(w.data.nbytes for b in whole.layers
                for w in (b.ffn.ffn_gate_exps, b.ffn.ffn_up_exps, b.ffn.ffn_down_exps, b.ffn.ffn_gate_up_shexp,
                          b.ffn.ffn_down_shexp))  # fmt: skip
    assert sum(m.weights_bytes for m in ranks) == 3 * whole.weights_bytes - 2 * split  # the rest on every rank
    with pytest.raises(ValueError, match="the modes are 'pipeline', 'expert', 'tensor'"):
        load(path, parallel="heads")
    with pytest.raises(ValueError, match="this is expert parallel"):
        load(path, group=_Group(0, 2), parallel="expert", layers="0:3,3:6")


def test_each_tensor_parallel_rank_reads_only_its_heads(tiny_gguf):
    """With the heads split, a rank holds whole output groups: their query rows, sinks, output_a rows and
    output_b columns; the projections every head reads (q_a, the KV row, compressors, indexer) stay whole."""
    path = tiny_gguf()
    whole, _ = load(path)
    cfg = whole.cfg
    ranks = [load(path, group=_Group(r, 2), parallel="tensor")[0] for r in range(2)]
    per, D, L = cfg.heads_per_group, cfg.head_dim, cfg.o_lora_rank
    for r, m in enumerate(ranks):
        groups = even_split(cfg.n_out_group, 2, r)
        heads = range(groups.start * per, groups.stop * per)
        for b, ref in zip(m.layers, whole.layers, strict=True):
            a, w = b.attn, ref.attn
            assert (a.n_head, a.n_group) == (len(heads), len(groups)) and a.group is not None
            for got, want in [(a.attn_q_b.dequantize(), w.attn_q_b.dequantize()[heads.start * D : heads.stop * D]),
                              (a.attn_sinks, w.attn_sinks[heads.start : heads.stop]),
                              (a.attn_output_a.dequantize(),
                               w.attn_output_a.dequantize()[groups.start * L : groups.stop * L]),
                              (a.attn_output_b.dequantize(),
                               w.attn_output_b.dequantize()[:, groups.start * L : groups.stop * L]),
                              (a.attn_q_a_kv.dequantize(), w.attn_q_a_kv.dequantize())]:  # fmt: skip
                np.testing.assert_array_equal(np.array(got), np.array(want))
    with pytest.raises(ValueError, match="3 ranks for 2 attention output groups"):
        load(path, group=_Group(0, 3), parallel="tensor")
    cut = tensor_share(cfg, "tensor", 2, 1)
    assert cut("blk.0.indexer.attn_q_b.weight") is None and cut("output.weight") is None
    assert cut("blk.0.attn_output_b.weight") == (1, range(cfg.o_lora_rank, 2 * cfg.o_lora_rank))


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
@pytest.mark.parametrize("mode,victim", [("pipeline", 1), ("pipeline", 0), ("expert", 1), ("tensor", 0)])
def test_lost_rank_ends_the_others(tiny_gguf, tmp_path, mode, victim):
    """A rank killed mid-generation: mlx.launch ends the other rank and returns within seconds (MLX's ring
    backend reports the lost peer, but a send queued behind the failed ones can wait forever)."""
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", "generate", "-m",
           str(tiny_gguf()), "-p", "hello", "-n", "100000", "--ctx", "200000", "--temp", "0", "--nothink",
           "--parallel", mode]
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


@needs_launch
def test_generate_with_the_heads_split_prints_one_ranks_text(tiny_gguf):
    """`mlx.launch -n 2 -- ds4-mlx generate --parallel tensor`: rank 0 prints what one process prints; the other
    rank prints nothing."""
    args = ["generate", "-m", str(tiny_gguf()), "-p", "hello", "-n", "12", "--temp", "0", "--nothink"]
    one = subprocess.run([sys.executable, "-m", "ds4_mlx", *args], capture_output=True, text=True, timeout=120)
    two = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", *args,
                          "--parallel", "tensor"], capture_output=True, text=True, timeout=120)  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert one.stdout.strip() and two.stdout == one.stdout
    assert two.stderr.count("Generation:") == 1 and "tensor parallel over 2 ranks" in two.stderr


@needs_launch
def test_chat_over_a_pipeline_answers_as_one_process(tiny_gguf):
    """`mlx.launch -n 2 -- ds4-mlx chat --parallel pipeline` with two turns on its input: rank 0 prints the replies
    one process prints (the second turn reusing the first's cache on both ranks), and a /ctx reset in between
    starts the ranks' caches afresh."""
    args = ["chat", "-m", str(tiny_gguf()), "-n", "8", "--temp", "0", "--nothink"]
    turns = "hello\nwhat next\n/ctx 256\nhello\n/quit\n"
    one = subprocess.run([sys.executable, "-m", "ds4_mlx", *args], input=turns, capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    two = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", *args,
                          "--parallel", "pipeline"], input=turns, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    assert one.stdout.count("ds4> ") == 5 and "new session, ctx 256" in one.stdout
    assert two.stdout == one.stdout
    assert "pipeline parallel over 2 ranks" in two.stderr


@needs_launch
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_bench_over_two_ranks(tmp_path, mode):
    """`mlx.launch -n 2 -- ds4-mlx bench --random-weights tiny --parallel MODE`: the ranks measure together (in
    step, or rank 0 driving the pipeline) and rank 0 alone reports and writes the CSV, whose system line names the
    split."""
    out = tmp_path / "bench.csv"
    r = subprocess.run([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", "bench",
                        "--random-weights", "tiny", "--parallel", mode, "--ctx-start", "32", "--ctx-max", "64",
                        "--step-incr", "32", "-n", "2", "--no-warmup", "--csv", str(out)],
                       capture_output=True, text=True, timeout=180)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    rows = out.read_text().splitlines()
    assert rows[0].startswith("ctx_tokens,") and [x.split(",")[0] for x in rows[1:]] == ["32", "64"]
    assert f"{mode} parallel over 2 ranks" in out.with_suffix(".system.txt").read_text()
    assert r.stderr.count("memory plan:") == 1  # one rank reports


@pytest.mark.parametrize("flags,why", [
    (["--parallel", "heads"], "the modes are 'pipeline', 'expert', 'tensor'"),
    (["--parallel", "expert", "--layers", "0:3,3:6"], "--layers splits the model over the ranks of --parallel pipeline"),
    (["--parallel", "expert"], "--parallel expert needs several ranks: start it with mlx.launch"),
])  # fmt: skip
def test_parallel_flags_refused_clearly(tiny_gguf, flags, why):
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "generate", "-m", str(tiny_gguf()), "-p", "hi", *flags],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode != 0 and why in " ".join(r.stderr.split()) and "Traceback" not in r.stderr


def test_serve_refuses_what_several_ranks_do_not_do(tiny_gguf):
    r = subprocess.run([sys.executable, "-m", "ds4_mlx", "serve", "-m", str(tiny_gguf()), "--parallel", "tensor",
                        "--batched-session", "2"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "--batched-session is not available with --parallel" in r.stderr
    assert "Traceback" not in r.stderr


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
    assert [[b.il for b in s.local.layers] for s in stages] == [[0], [1, 2, 3], [4, 5]]
    assert sum(s.weights_bytes for s in stages) == whole.weights_bytes
    assert stages[0].local.token_embd is not None and stages[1].local.token_embd is None
    assert hasattr(stages[2].local, "output") and not hasattr(stages[0].local, "output")
    with pytest.raises(ValueError, match="one rank"):
        load(path, layers="0:6")


def _chat(base: str, messages: list[dict], n: int, forced: str | None = None) -> dict:
    import httpx

    body = {"model": "deepseek-chat", "messages": messages, "max_tokens": n, "temperature": 0}  # no thinking
    headers = {} if forced is None else {"X-DS4-Test-Output": json.dumps(forced)}  # the test hooks' forced answer
    r = httpx.post(base + "/v1/chat/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@needs_launch
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="finds the ranks through /proc")
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_serve_over_two_ranks_answers_as_one(tiny_gguf, tmp_path, mode):
    """`mlx.launch -n 2 -- ds4-mlx serve --parallel MODE --kv-disk-dir D`: rank 0 serves HTTP and drives the other
    rank; two turns (the second reusing the first's tokens) answer what one process answers, and stopping rank
    0's server saves the live state and releases the other rank, so the launcher exits 0. One process on D then
    resumes a third turn from that file, with one process's answer."""
    import httpx
    from server_util import free_port, running_server, start_server, stop_server

    # the answers forced to valid UTF-8 (the random model's own text often is not, and a client cannot replay bytes
    # it never received), so that each turn extends the live tokens; the third answer is the model's
    answers = ["Once upon a time.", "There was a fox."]
    first = [{"role": "user", "content": "Tell me a story"}]
    second = first + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "more"}]
    third = second + [{"role": "assistant", "content": answers[1]}, {"role": "user", "content": "go on"}]
    turns = [(first, 50, answers[0]), (second, 50, answers[1])]
    chunk = ["--prefill-chunk", "8"]  # prompts of several chunks: a pipeline queues those before the last
    proc, base = start_server(tiny_gguf(), *chunk)
    try:
        want = [_chat(base, *turn) for turn in [*turns, (third, 6)]]
    finally:
        stop_server(proc)
    port, kv, log = free_port(), tmp_path / "kv", tmp_path / "log"
    kv_flags = ["--kv-disk-dir", str(kv), "--kv-cache-min-tokens", "16", "--kv-cache-boundary-align-tokens", "16"]
    launcher = subprocess.Popen([LAUNCH, "-n", "2", "--backend", "ring", "--", sys.executable, "-m", "ds4_mlx", "serve",
                                 "-m", str(tiny_gguf()), "--port", str(port), "--parallel", mode, *kv_flags, *chunk],
                                stdout=log.open("wb"), stderr=subprocess.STDOUT,
                                env={**os.environ, "DS4_MLX_TEST_HOOKS": "1"})  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and launcher.poll() is None:
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
                if httpx.get(base + "/health", timeout=2).json()["status"] == "ok":
                    break
            time.sleep(0.2)
        got = [_chat(base, *turn) for turn in turns]
        ranks = _rank_processes(launcher.pid, 2)
        os.kill(ranks[0], signal.SIGTERM)
        launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    text = log.read_text(errors="replace")
    assert [g["choices"][0]["message"] for g in got] == [w["choices"][0]["message"] for w in want[:2]], text[-2000:]
    cached = [r[1]["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (want, got)]
    assert cached[0] > 0 and cached[1] == cached[0]  # the second turn reused the first's tokens
    assert launcher.returncode == 0 and f"{mode} parallel over 2 ranks" in text, text[-2000:]
    assert list(kv.glob("*.kv")), text[-2000:]  # the shutdown save, every layer's state in one file
    with running_server(tiny_gguf(), *kv_flags, *chunk) as base:
        resumed = _chat(base, third, 6)
        decision = httpx.get(base + "/v1/stats").json()["last_decisions"][-1]
    assert decision["source"] == "disk-text" and resumed["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert resumed["choices"][0]["message"] == want[2]["choices"][0]["message"]
