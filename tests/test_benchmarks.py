"""The benchmark scripts that benchmarks/RESULTS.md's commands run, each run as its own process (benchmarks/ is
no package, and nothing of it is imported here): end to end at the tiny shape where that is cheap, and the readers
of the GPU profilers' logs (Nsight Compute CSV, an Nsight Systems export) on made-up logs."""

from __future__ import annotations

import csv
import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from ds4_mlx.random_model import shape_config

ROOT = Path(__file__).resolve().parents[1]


def run_script(name: str, *args, ok: bool = True) -> subprocess.CompletedProcess:
    """``python benchmarks/<name>.py ARGS`` from the repository root; ``ok``: it must exit 0 (else must not)."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *map(str, args)], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert (r.returncode == 0) == ok, (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    return r


def test_model_benchmark_runs_at_tiny_shape(tmp_path):
    """benchmarks/model.py end to end at the tiny shape (the full shape runs on the GPU)."""
    out = tmp_path / "res.json"
    run_script("model", "--shape", "tiny", "--prefill", 23, "--chunk", 10, "--decode", 2, "--reps", 1, "--json", out)
    res = json.loads(out.read_text())
    # the decode ran after the prompt, the warm-up (a step past the longest window, then as many generated
    # tokens), the synchronous and the pipelined steps: each timed run over positions new to it
    assert res["decode_ctx"] == 23 + 2 * (max(shape_config("tiny").compress_ratios) + 1) + 2 + 2
    split = res["decode_host_split_ms"]
    assert set(split) == {"build", "encode", "wait"} and split["encode"] > 0 and split["build"] > 0
    assert res["decode_ms"] > 0 and res["decode_uncompiled_ms"] > 0 and res["prefill_tok_s"] > 0
    assert 0 < res["floor_ratio"] and 0 < res["floor_ratio_generate"] and res["peak_memory_GB"] > 0
    assert set(res["components_ms"]) == {"attention", "moe", "hc", "output head"}
    assert all(v > 0 for v in res["components_ms"].values())
    assert res["decode_lag2_ms"] > 0 and res["decode_lag2_host_split_ms"]["encode"] > 0

    run_script("model", "--shape", "tiny", "--prefill", 9, "--decode", 2, "--quick", "--json", out)
    quick = json.loads(out.read_text())
    assert quick["decode_ms"] > 0 and quick["decode_uncompiled_ms"] is None and quick["components_ms"] == {}


def test_ab_in_process_runs_both_versions(tmp_path):
    """benchmarks/ab_in_process.py: another tree's package, imported under another name, timed round by round
    against this one in the same process; a folder without the package fails before any set-up."""
    other = tmp_path / "other"
    for d in ("ds4_mlx", "custom_kernels"):
        shutil.copytree(ROOT / d, other / d, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "ab.json"
    r = run_script("ab_in_process", other, "--shape", "tiny", "--prefill", 9, "--decode", 2, "--rounds", 2,
                   "--json", out)  # fmt: skip
    res = json.loads(out.read_text())
    assert len(res["this"]) == len(res["other"]) == len(res["ratios"]) == 2 and min(res["this"] + res["other"]) > 0
    assert res["rounds_this_faster"] == sum(t < o for t, o in zip(res["this"], res["other"]))
    assert "round 1: this" in r.stdout
    out = tmp_path / "ab_prefill.json"  # the prefill mode: a fresh session's prefill a round
    run_script("ab_in_process", other, "--shape", "tiny", "--measure", "prefill", "--prefill", 9, "--rounds", 2,
               "--json", out)  # fmt: skip
    res = json.loads(out.read_text())
    assert len(res["this"]) == len(res["other"]) == 2 and min(res["this"] + res["other"]) > 0
    r = run_script("ab_in_process", other, "--shape", "tiny", "--batch", 3, "--prefill", 9, "--decode", 2,
                   "--rounds", 1)  # fmt: skip
    assert "ms/step" in r.stdout
    r = run_script("ab_in_process", tmp_path / "nowhere", "--shape", "tiny", ok=False)
    assert "has no ds4_mlx/ folder" in r.stderr and "Traceback" not in r.stderr


def test_decode_step_launch_budget(tmp_path):
    """The decode step's launch count on the GPU code path (benchmarks/graph_cost.py, kernels stood in for).

    On MLX-CUDA the host pays ~10 µs to encode a launch and ~5 µs for each array it writes, and the device
    a few µs a small launch (benchmarks/RESULTS.md): 6 layers of the real pattern at 64 tokens of context take
    21.3 launches a layer, 15 views and 18 output arrays a layer. Raise the budget only for a change that
    needs the ops."""

    def graph_cost(*args) -> dict:
        out = tmp_path / "gc.json"
        run_script("graph_cost", "--layers", 6, *args, "--json", out)
        return json.loads(out.read_text())

    res = graph_cost("--ctx", 64, "--reps", 2)
    assert res["compiled"] and res["kernel_launches"] >= 6 * 16  # the custom kernels were on the path
    # every launch writes at least one array and reads several (weights, activations, parameter blocks)
    assert res["kernel_launches"] < res["kernel_outputs"] < 2 * res["kernel_launches"] < res["kernel_inputs"], res
    assert res["launches_per_layer"] <= 22.5, res
    assert res["view_ops"] <= 3 * 6, res
    assert res["kernel_outputs"] <= 19 * 6, res
    for kernel in ("hc_mix", "hc_pre", "hc_pre_xq", "moe_route", "comp_write"):  # one output array a launch
        launches, outputs = res["by_kernel"][kernel]
        assert outputs == launches > 0, (kernel, res["by_kernel"])
    # the per-kernel counts of the stand-ins add up to what the graph holds
    assert [sum(v[i] for v in res["by_kernel"].values()) for i in (0, 1)] == [res["kernel_launches"],
                                                                              res["kernel_outputs"]], res
    res = graph_cost("--ctx", 67, "--reps", 2)  # this step completes the ratio-4 windows
    assert res["launches_per_layer"] <= 24, res
    assert res["view_ops"] <= 5 * 6, res
    # 40 steps onward: one graph shape per kind of step (which windows complete, a row buffer's growth), as
    # MLX-CUDA caches CUDA graphs by topology: no state left for a later step, no new input made inside a step
    res = graph_cost("--ctx", 64, "--reps", 1, "--steps", 40)
    assert res["steps"] == 40 and set(res["kind_shapes"].values()) == {1}, res
    assert {"complete -", "complete 4", "complete 4/16"} <= set(res["kind_shapes"]), res


NCU_HEAD = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'


def write_ncu(path: Path, rows: list[tuple[str, str, str]]) -> Path:
    """A ``ncu --csv`` log of ``gpu__time_duration.sum`` rows (kernel name, unit, value) behind profiler noise."""
    lines = ["==PROF== noise", NCU_HEAD] + [f'"{i}","{k}","gpu__time_duration.sum","{u}","{v}"'
                                           for i, (k, u, v) in enumerate(rows)]
    path.write_text("\n".join(lines))
    return path


def test_kernel_profile_reads_ncu_csv(tmp_path):
    """benchmarks/kernel_profile.py's readers (its ncu runs need a GPU): units, markers, per-shape A/B."""
    step = write_ncu(tmp_path / "step.csv", [("warm", "ns", "9,000"), ("ds4_marker", "ns", "1"),
                                             ("mv_a(x)", "ns", "2,000"), ("mv_a(y)", "us", "3"), ("gemm", "ms", "0.5"),
                                             ("ds4_marker", "ns", "1")])  # fmt: skip
    out = run_script("kernel_profile", "--summarize", step).stdout
    assert "3 kernels, 505 us" in out and "mv_a" in out and "warm" not in out  # between the last two markers
    assert "step 0" not in out  # one marked step: no per-step lines
    two = write_ncu(tmp_path / "two.csv", [("ds4_marker", "ns", "1"), ("gather(a)", "us", "98"), ("mv_a(x)", "us", "2"),
                                           ("ds4_marker", "ns", "1"), ("gather(a)", "us", "1"), ("mv_a(x)", "us", "2"),
                                           ("ds4_marker", "ns", "1")])  # fmt: skip
    out = run_script("kernel_profile", "--summarize", two).stdout
    assert "step 0: 2 kernels, 100 us; slowest: #0 gather 98 us" in out and "step 1: 2 kernels, 3 us" in out
    err = run_script("kernel_profile", "--summarize", write_ncu(tmp_path / "none.csv", []), ok=False).stderr
    assert "fewer than two ds4_marker kernels" in err

    # --compare-mv: one measured launch after each marker, per decode matvec shape; a log of another length fails
    err = run_script("kernel_profile", "--compare-mv", step, step, ok=False).stderr
    n = int(err.split("expected ")[1].split()[0])
    new = write_ncu(tmp_path / "new.csv", [r for i in range(n) for r in (("ds4_marker", "ns", "1"), (f"mv{i}", "us", "10"))])
    old = write_ncu(tmp_path / "old.csv", [r for i in range(n) for r in (("ds4_marker", "ns", "1"), (f"mv{i}", "us", "15"))])
    out = run_script("kernel_profile", "--compare-mv", new, old).stdout
    assert out.count("1.50") == n + 1  # every shape and the sum: 15 us old / 10 us new


def test_mv_sweep_summary_and_occupancy(tmp_path):
    """benchmarks/mv_sweep.py's readers (its ncu runs need a GPU): the median of each config's three measured
    launches out of five, and the occupancy metrics of the third."""
    times = [9, 9, 5, 4, 6, 9, 9, 3, 2, 1]  # two configs: medians 5 and 2
    rows = [f'"{i}","ds_mv_x","gpu__time_duration.sum","us","{t}"' for i, t in enumerate(times)]
    (tmp_path / "ncu.csv").write_text("\n".join([NCU_HEAD] + rows))
    labels = tmp_path / "labels.json"
    labels.write_text(json.dumps([["q_b", [4, 4, 1]], ["q_b", None]]))
    out = run_script("mv_sweep", labels, "--summarize", tmp_path / "ncu.csv").stdout
    assert "default: 2.0  (4, 4, 1): 5.0" in out
    labels.write_text(json.dumps([["q_b", None]]))
    err = run_script("mv_sweep", labels, "--summarize", tmp_path / "ncu.csv", ok=False).stderr
    assert "10 launches, expected 5 per config" in err

    regs = [90, 91, 96, 92, 93, 80, 81, 72, 83, 84]
    rows = [f'"{i}","ds_mv_x","{m}","","{v:,}"' for i, r in enumerate(regs)
            for m, v in (("launch__registers_per_thread", r), ("gpu__time_duration.sum", 1000 * r))]
    (tmp_path / "occ.csv").write_text("\n".join([NCU_HEAD] + rows))
    labels.write_text(json.dumps([["q_b", [4, 4, 1]], ["down", None]]))
    out = run_script("mv_sweep", labels, "--occupancy", tmp_path / "occ.csv").stdout
    assert "q_b (4, 4, 1) | 96000 | 96 | None" in out and "down default | 72000 | 72 | None" in out


def test_timeline_reads_nsys_sqlite(tmp_path):
    """benchmarks/timeline.py's analysis of an Nsight Systems export (its captures need a GPU): busy time as the
    union of overlapping activity, and an idle gap counted as the host's when the next work was queued late."""
    db = sqlite3.connect(tmp_path / "t.sqlite")
    db.execute("CREATE TABLE StringIds(id INTEGER, value TEXT)")
    db.executemany("INSERT INTO StringIds VALUES(?, ?)", enumerate(["kA", "kB", "cudaGraphLaunch", "gpu::eval",
                                                                   "cudaGraphInstantiate_v12000",
                                                                   "cudaGraphExecUpdate_v10020"]))
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL(start INT, end INT, shortName INT, correlationId INT)")
    db.execute("CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME(start INT, end INT, nameId INT, correlationId INT)")
    db.execute("CREATE TABLE NVTX_EVENTS(start INT, end INT, text TEXT, textId INT)")
    # ns: kernels at [0, 10] us, [15, 20] and [18, 30] (overlapping), [100, 110]; the last one's graph launch
    # call starts at 60 us, after the device went idle at 30 us: that 70 us gap is the host's
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES(?, ?, ?, ?)",
                   [(0, 10_000, 0, 1), (15_000, 20_000, 1, 1), (18_000, 30_000, 0, 2), (100_000, 110_000, 1, 3)])
    db.executemany("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES(?, ?, ?, ?)",
                   [(-5_000, -4_000, 2, 1), (5_000, 6_000, 2, 2), (60_000, 61_000, 2, 3),
                    (-9_000, -6_000, 4, 0), (55_000, 59_000, 4, 0), (2_000, 2_500, 5, 0)])
    db.execute("INSERT INTO NVTX_EVENTS VALUES(0, 5, 'gpu::eval', NULL)")
    db.commit()
    db.close()
    out = run_script("timeline", "analyze", tmp_path / "t.sqlite", "--steps", 2, "--top", 5).stdout
    assert "0.11 ms wall (0.06 ms a step), 4 device activities" in out
    assert "device busy 0.04 ms (31.8 %), idle 0.07 ms in 2 gaps" in out  # busy 10 + 15 + 10 of 110 us
    assert "0.07 ms in 1 gaps; device-side: 0.01 ms" in out  # the 70 us gap was the host's, the 5 us one not
    assert "70.0  kA -> kB  late  cudaGraphLaunch" in out
    assert ("CUDA graphs: Launch 3x 0.00 ms, Instantiate 2x 0.01 ms, ExecUpdate 1x 0.00 ms "
            "(1.00 instantiations a step)") in out


def test_first_use_benchmark_times_every_stage(tmp_path):
    """benchmarks/first_use.py at the tiny shape: load, three prefill chunks and two decode rounds, each timed."""
    out = tmp_path / "first_use.json"
    text = run_script("first_use", "--steps", 2, "--json", out).stdout
    stages = json.loads(out.read_text())["stages"]
    assert [st["stage"].split(" (")[0] for st in stages] == [
        "build the random model", "prefill chunk 1", "prefill chunk 2", "prefill chunk 3", "decode round 1",
        "decode round 2"]
    assert all(st["seconds"] > 0 for st in stages) and "total" in text


def test_expert_cache_hits_follow_the_cache_share(tmp_path):
    """benchmarks/expert_cache_hits.py drives the real cache: uniform routing hits about as often as the cache's
    share of the experts, a cache of all of them (nearly) always once warm, and skewed routing more than uniform."""
    out = tmp_path / "hits.json"
    run_script("expert_cache_hits", "--layers", 2, "--experts", 32, "-k", 4, "--shares", "0.5,1.0", "--zipf",
               "0,1.4", "--steps", 150, "--warm", 150, "--json", out)  # fmt: skip
    rows = {(r["zipf_s"], r["cache_share"]): r for r in json.loads(out.read_text())["rows"]}
    assert abs(rows[0.0, 0.5]["hit_rate"] - 0.5) < 0.1
    assert rows[0.0, 1.0]["hit_rate"] == 1.0 and rows[1.4, 1.0]["hit_rate"] > 0.99  # the rarest may not come yet
    assert rows[1.4, 0.5]["hit_rate"] > rows[0.0, 0.5]["hit_rate"] + 0.2
    assert rows[0.0, 0.5]["experts_read_per_layer"] == pytest.approx(4 * (1 - rows[0.0, 0.5]["hit_rate"]), abs=0.01)
    # tokens that repeat their neighbours' experts hit more; decayed use beats least-recently-used on skewed routing
    run_script("expert_cache_hits", "--layers", 2, "--experts", 32, "-k", 4, "--shares", "0.25", "--zipf", "1.4",
               "--repeats", "0,0.5", "--half-lives", "0,256", "--steps", 150, "--warm", 150, "--first", 20, "--json",
               out)  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert all(r["first_preloaded"] > r["first_cold"] for r in rows)  # a start from the use profile hits more
    rate = {(r["repeat"], r["half_life"]): r["hit_rate"] for r in rows}
    assert rate[0.5, 0.0] > rate[0.0, 0.0] + 0.1 and rate[0.5, 256.0] > rate[0.0, 256.0] + 0.1
    assert rate[0.0, 256.0] > rate[0.0, 0.0] + 0.02 and rate[0.5, 256.0] > rate[0.5, 0.0] + 0.02


def test_parallel_bytes_split_what_each_mode_splits(tmp_path):
    """benchmarks/parallel_bytes.py (the layout alone): the modes hold about 1/N of the model, and each split mode
    reads less a token than one rank, heads and experts split least of all."""
    out = tmp_path / "bytes.json"
    run_script("parallel_bytes", "--ranks", 2, 8, "--json", out)
    rows = {(r["mode"], r["ranks"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [(m, n) for m in ("expert", "pipeline", "tensor") for n in (2, 8)]
    for n in (2, 8):
        assert rows["pipeline", n]["speedup"] == 1.0
        assert 1 < rows["expert", n]["speedup"] < rows["tensor", n]["speedup"] < n
        assert 86 / n < rows["tensor", n]["held_gb"] < 86 / n + 4  # the replicated part: ~3 GB
    assert rows["tensor", 2]["messages"] == 2 * rows["expert", 2]["messages"] == 86
    assert rows["tensor", 2]["sent_mb_chunk"] == pytest.approx(2 * rows["expert", 2]["sent_mb_chunk"])
    assert rows["pipeline", 2]["sent_mb_chunk"] == pytest.approx(2048 * 4 * 4096 * 4 / 1e6)  # the chunk's state


@pytest.mark.parametrize("script", ["collectives", "kernel_speed", "kvcache", "load", "moe_prefill",
                                    "pipeline_prefill", "prefill_precision", "prefill_profile"])
def test_scripts_parse_their_arguments(script):
    """The other scripts RESULTS.md runs at least import and parse ``--help`` (their runs need a GPU or minutes)."""
    assert "usage" in run_script(script, "--help").stdout.lower()


def test_batched_benchmark_reports_every_batch_and_the_ttft(tmp_path):
    """benchmarks/batched.py at the tiny shape: a row per B with its speed against B = 1, then the TTFT run."""
    out = tmp_path / "batched.csv"
    text = run_script("batched", "--ctx", 40, "--batches", "1,2", "--steps", 2, "--ttft-prompt", 24,
                      "--ttft-decoders", 2, "--quantum", 8, "--sweeps", 2, "--csv", out).stdout
    assert "sweep 1 of 2" in text and "sweep 2 of 2" in text  # the csv holds the last sweep
    decode, ttft = out.read_text().strip().split("\n\n")
    rows = list(csv.DictReader(decode.splitlines()))
    assert [r["batch"] for r in rows] == ["1", "2"] and rows[0]["aggregate_x"] == "1.0"
    assert all(float(r["aggregate_tps"]) > 0 and float(r["session_tps"]) > 0 for r in rows)
    (t,) = csv.DictReader(ttft.splitlines())
    assert float(t["ttft_s"]) > 0 and float(t["prefill_alone_s"]) > 0 and float(t["itl_mean_s"]) > 0
    assert "TTFT of a 24-token prompt beside 2 decoding sessions" in text
    assert "x B=1" in run_script("batched", "--ctx", 16, "--batches", "2", "--steps", 2, "--ttft-prompt", 0,
                                 "--wait").stdout  # the loop that awaits every step
    run_script("batched", "--batches", "0", ok=False)
