"""End-to-end sanity of the assembled model on the tiny GGUFs: finite, non-degenerate activations."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from ds4_mlx.loader import load
from kernel_util import load_benchmark


@pytest.mark.parametrize("experts", ["q2", "q4", "f16"])
@pytest.mark.parametrize("numerics", ["ds4", "hf"])
def test_activations_finite_and_logits_not_degenerate(tiny_gguf, experts, numerics):
    model, tok = load(tiny_gguf(experts=experts, hca_ratio=16), numerics=numerics)
    cfg = model.cfg
    rng = np.random.default_rng(3)
    tokens = mx.array([0] + rng.integers(2, cfg.n_vocab, 39).tolist(), dtype=mx.int32)
    caches = model.make_cache()
    S = model.embed(tokens)
    for il, (layer, cache) in enumerate(zip(model.layers, caches)):
        S = layer(S, tokens, 0, cache)
        s = np.array(S)
        assert np.isfinite(s).all(), f"layer {il}"
        rms = np.sqrt((s**2).mean(axis=-1))  # [T, n_hc] per-stream RMS
        assert rms.min() > 1e-2 and rms.max() < 1e3, (il, rms.min(), rms.max())
        # the streams differ from each other (HC mixing is doing something)
        assert np.abs(s[:, 0] - s[:, 1]).max() > 1e-3
    logits = np.array(model.head(S))  # [T, V]
    assert np.isfinite(logits).all()
    assert logits.std(axis=-1).min() > 0.1  # std across the vocab, at every position
    assert len(set(logits.argmax(-1).tolist())) > 1  # not the same prediction everywhere
    # default call returns the last position's logits
    last = np.array(model(tokens, 0, model.make_cache()))
    assert last.shape == (cfg.n_vocab,)
    np.testing.assert_allclose(last, logits[-1], rtol=1e-5, atol=1e-5 * np.abs(logits).max())


def test_load_returns_tokenizer(tiny_gguf):
    model, tok = load(tiny_gguf())
    assert model.numerics.fp8_kv  # ds4 profile is the default
    if tok is not None:
        ids = tok.encode("hello world")
        assert ids and max(ids) < model.cfg.n_vocab


def test_benchmark_runs_at_tiny_shape(tmp_path):
    """benchmarks/model.py end to end at the tiny shape (the full shape runs on the GPU)."""
    import json

    bench = load_benchmark("model")
    out = tmp_path / "res.json"
    res = bench.main(["--shape", "tiny", "--prefill", "23", "--chunk", "10", "--decode", "2", "--reps", "1",
                      "--json", str(out)])
    # the pipelined decode ran after the prompt, the warm-up (a step past the longest window, then as many
    # generated tokens), the synchronous and the pipelined steps: each timed run over positions new to it
    warm = 2 * (max(bench.shape_config("tiny").compress_ratios) + 1)
    assert json.loads(out.read_text())["decode_ctx"] == 23 + warm + 2 + 2
    split = res["decode_host_split_ms"]
    assert set(split) == {"build", "encode", "wait"} and split["encode"] > 0 and split["build"] > 0
    assert res["decode_ms"] > 0 and res["decode_uncompiled_ms"] > 0 and res["prefill_tok_s"] > 0 and 0 < res["floor_ratio"]
    assert set(res["components_ms"]) == {"attention", "moe", "hc", "output head"}
    assert all(v > 0 for v in res["components_ms"].values())
    assert res["decode_lag2_ms"] > 0 and res["decode_lag2_host_split_ms"]["encode"] > 0 and 0 < res["floor_ratio_lag2"]
    quick = bench.main(["--shape", "tiny", "--prefill", "9", "--decode", "2", "--quick"])  # what mlx_cuda_env.py runs
    assert quick["decode_ms"] > 0 and quick["decode_uncompiled_ms"] is None and quick["components_ms"] == {}


def test_pipeline_depth_runs_at_tiny_shape():
    """benchmarks/pipeline_depth.py: every variant, from the same snapshot (so the same tokens each time), at
    ``--shape narrow`` (the real layer pattern at the tiny widths)."""
    pd = load_benchmark("pipeline_depth")
    res = pd.main(["--shape", "narrow", "--layers", "6", "--prefill", "24", "--decode", "3", "--rounds", "1"])
    assert set(res) == set(pd.VARIANTS)
    for name, [(ms, wait, cpu, enc_cpu)] in res.items():
        if name == "decode_tokens":  # timed as a whole: its wait and CPU split are inside it
            assert ms > 0 and math.isnan(wait) and math.isnan(cpu) and math.isnan(enc_cpu)
            continue
        assert ms > 0 and wait >= 0 and cpu > 0, name
        assert (enc_cpu > 0) == ("thread" in name), name  # the encoder thread's CPU: only where there is one
    assert res["lag1+6ms"][0][0] >= 6.0  # the sleep is inside the timed step
    assert res["lag1+6ms"][0][2] < res["lag1+6ms"][0][0] - 5.0  # ... but not in the thread's CPU time

    # --onward: each run starts where the last one stopped (new positions), the package's loop included
    starts, run = [], pd.run
    pd.run = lambda sess, start, n, **kw: starts.append(sess.pos) or run(sess, start, n, **kw)
    pd.main(["--shape", "tiny", "--prefill", "24", "--decode", "3", "--rounds", "2", "--onward",
             "--only", "lag2", "decode_tokens"])
    assert len(starts) == 4 and all(b == a + 3 for a, b in zip(starts, starts[1:])), starts


def test_ab_decode_runs_both_trees(tmp_path):
    """benchmarks/ab_decode.py: model.py --quick from this tree and from another (here a copy), in rounds."""
    import json
    import shutil
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    other = tmp_path / "other"
    for d in ("ds4_mlx", "custom_kernels", "convert", "benchmarks"):
        shutil.copytree(root / d, other / d, ignore=shutil.ignore_patterns("__pycache__", "results"))
    ab = load_benchmark("ab_decode")
    out = tmp_path / "ab.json"
    res = ab.main([str(other), "--shape", "tiny", "--prefill", "9", "--decode", "2", "--rounds", "1", "--json", str(out)])
    assert set(res) == {"this tree", "other: other"} and json.loads(out.read_text()).keys() == res.keys()
    assert all(v["decode_ms"] > 0 and "error" not in v["runs"][0] for v in res.values()), res
    with pytest.raises(SystemExit, match="not a ds4-mlx tree"):
        ab.main([str(tmp_path), "--shape", "tiny"])


def test_ab_in_process_runs_both_versions(tmp_path):
    """benchmarks/ab_in_process.py: another tree's package imported under another name, both timed in one process
    over the same weight arrays."""
    import json
    import shutil
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    other = tmp_path / "other"
    for d in ("ds4_mlx", "custom_kernels"):
        shutil.copytree(root / d, other / d, ignore=shutil.ignore_patterns("__pycache__"))
    ab = load_benchmark("ab_in_process")
    out = tmp_path / "ab.json"
    res = ab.main([str(other), "--shape", "tiny", "--prefill", "9", "--decode", "2", "--rounds", "2",
                   "--json", str(out)])  # fmt: skip
    assert len(res["this"]) == len(res["other"]) == len(res["ratios"]) == 2 and min(res["this"] + res["other"]) > 0
    assert json.loads(out.read_text()) == res
    import ds4_mlx.session

    copy = sys.modules["ds4_mlx_ab.session"]  # the other version ran from its renamed copy, not from this tree
    assert copy is not ds4_mlx.session and not Path(copy.__file__).resolve().is_relative_to(root)
    assert copy.Session is not ds4_mlx.session.Session
    # both versions' models wrap the same weight arrays, each in its own weight class
    from ds4_mlx.random_model import random_weights, shape_config

    cfg = shape_config("tiny")
    weights = random_weights(cfg)
    a, b = (ab.version(pkg, cfg, weights, 9, 64) for pkg in ("ds4_mlx", "ds4_mlx_ab"))
    assert a.sess.reserve == b.sess.reserve == 64  # sized up front: no buffer grows while timed
    ea, eb = a.sess.model.token_embd, b.sess.model.token_embd
    assert ea.data is eb.data is weights["token_embd.weight"].data and type(ea) is not type(eb)
    with pytest.raises(SystemExit, match="no ds4_mlx"):
        ab.import_other(tmp_path / "nowhere", tmp_path / "x")


def test_decode_step_launch_budget():
    """The decode step's launch count on the GPU code path (benchmarks/graph_cost.py, kernels stood in for).

    Each launch costs the host several µs to encode on MLX-CUDA (benchmarks/RESULTS.md). 6 layers of the real
    pattern (64 tokens of context) took 78-79 launches per layer (compiled step) before the fused
    attention/QKV/top-k/router kernels, 47 after, 38.8 once projections of one input share a matvec (stacked
    rows), 33.8 with the MoE matvec epilogues, 25.8 with the input norms in HC pre, HC post in the next mix,
    the compressor write, the indexer scores and the raw window as kernels; raise the budget only for a change
    that needs the ops. View ops (reshapes, slices, dtype views) cost the host too (MLX replays and encodes every
    node): 43 layers at ctx 600 had 868 before the launch wrappers passed arrays as they are shaped and the
    cached weight views were materialized, 332 after (8.8 a layer here). 24.8 launches a layer with the q_a
    norm as the q_b matvec's prologue. A step that completes the ratio-4 windows (ctx 67) had ~33 before their
    rows' FP8/QAT/f16 rounding moved into the emit launch, 26.2 after. 24.0 (25.3 completing) with each
    layer's last HC post inside the next layer's first mix. 22.0 (23.3) with the shared expert inside the
    routed experts' two launches. Views: 53 (63 completing) here until decode's kernels read their columns of a
    stacked projection in place (``Cols``) and the grouped output projection took the attention output as it is
    shaped; 15 (25) after (43 layers at ctx 600: 332 -> 15). Output arrays cost the host ~5 µs each (RESULTS.md,
    twenty-fourth session): 26.5 a layer here until HC pre wrote its decode outputs as one row, 21.5 after,
    18 once hc_mix, moe_route and the compressor frontier write wrote one array each (twenty-fifth session).
    """
    gc = load_benchmark("graph_cost")
    res = gc.main(["--layers", "6", "--ctx", "64", "--reps", "2"])
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
    res = gc.main(["--layers", "6", "--ctx", "67", "--reps", "2"])  # this step completes the ratio-4 windows
    assert res["launches_per_layer"] <= 24, res
    assert res["view_ops"] <= 5 * 6, res
    # 40 steps onward: one graph shape per kind of step (which windows complete, a row buffer's growth), as
    # MLX-CUDA caches CUDA graphs by topology: no state left for a later step, no new input made inside a step
    res = gc.main(["--layers", "6", "--ctx", "64", "--reps", "1", "--steps", "40"])
    assert res["steps"] == 40 and set(res["kind_shapes"].values()) == {1}, res
    assert {"complete -", "complete 4", "complete 4/16"} <= set(res["kind_shapes"]), res


def test_kernel_profile_reads_ncu_csv(tmp_path, capsys):
    """benchmarks/kernel_profile.py's readers (its ncu runs need a GPU): units, markers, per-shape A/B."""
    kp = load_benchmark("kernel_profile")

    def write(name, rows):
        head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
        lines = ["==PROF== noise", head] + [f'"{i}","{k}","gpu__time_duration.sum","{u}","{v}"'
                                             for i, (k, u, v) in enumerate(rows)]
        (tmp_path / name).write_text("\n".join(lines))
        return tmp_path / name

    step = write("step.csv", [("warm", "ns", "9,000"), ("ds4_marker", "ns", "1"), ("mv_a(x)", "ns", "2,000"),
                              ("mv_a(y)", "us", "3"), ("gemm", "ms", "0.5"), ("ds4_marker", "ns", "1")])
    assert kp.kernel_times(step)[0] == ("warm", 9.0)
    kp.summarize(step)
    out = capsys.readouterr().out
    assert "3 kernels, 505 us" in out and "mv_a" in out  # the kernels between the last two markers
    assert "step 0" not in out  # one marked step: no per-step lines
    two = write("two.csv", [("ds4_marker", "ns", "1"), ("gather(a)", "us", "98"), ("mv_a(x)", "us", "2"),
                            ("ds4_marker", "ns", "1"), ("gather(a)", "us", "1"), ("mv_a(x)", "us", "2"),
                            ("ds4_marker", "ns", "1")])  # fmt: skip
    kp.summarize(two)
    out = capsys.readouterr().out
    assert "step 0: 2 kernels, 100 us; slowest: #0 gather 98 us" in out and "step 1: 2 kernels, 3 us" in out

    n = len(kp.mv_shapes())
    new = write("new.csv", [r for i in range(n) for r in (("ds4_marker", "ns", "1"), (f"mv{i}", "us", "10"))])
    old = write("old.csv", [r for i in range(n) for r in (("ds4_marker", "ns", "1"), (f"mv{i}", "us", "15"))])
    kp.compare_mv(new, old)
    out = capsys.readouterr().out
    assert out.count("1.50") == n + 1  # every shape and the sum: 15 us old / 10 us new
    with pytest.raises(SystemExit):
        kp.compare_mv(new, step)


def test_mv_sweep_configs_and_summary(tmp_path, capsys):
    """benchmarks/mv_sweep.py (its ncu run needs a GPU): the shared-memory bound on its configs, and the
    median of each config's three measured launches out of five."""
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    sys.path.insert(0, str(bench))  # mv_sweep reads ncu logs with kernel_profile's reader
    try:
        ms = load_benchmark("mv_sweep")
        assert (8, 2, 1) in ms.configs("Q8_0", nrs=(8,)) and (8, 4, 1) not in ms.configs("Q8_0", nrs=(8,))  # 69 KB
        assert ms.configs("Q8_0", nrs=(4,), nsgs=(4,)) == [(4, 4, 1), (4, 4, 2), (4, 4, 4)]
        assert (4, 4, 2) not in ms.configs("IQ2_XXS", 2, "Q8_0", nsgs=(4,))  # the shared Q8_0 rows widen the stage
        head = '"ID","Kernel Name","Metric Name","Metric Unit","Metric Value"'
        times = [9, 9, 5, 4, 6, 9, 9, 3, 2, 1]  # two configs: medians 5 and 2
        rows = [f'"{i}","ds_mv_x","gpu__time_duration.sum","us","{t}"' for i, t in enumerate(times)]
        (tmp_path / "ncu.csv").write_text("\n".join([head] + rows))
        (tmp_path / "labels.json").write_text(json.dumps([["q_b", [4, 4, 1]], ["q_b", None]]))
        res = ms.summarize(tmp_path / "ncu.csv", tmp_path / "labels.json")
        assert res == {"q_b": [("default", 2.0), ((4, 4, 1), 5.0)]}
        assert "default: 2.0" in capsys.readouterr().out
        (tmp_path / "labels.json").write_text(json.dumps([["q_b", None]]))
        with pytest.raises(SystemExit):
            ms.summarize(tmp_path / "ncu.csv", tmp_path / "labels.json")  # 10 launches for one config
        # --occupancy: several metrics a launch, the third launch of each config read
        regs = [90, 91, 96, 92, 93, 80, 81, 72, 83, 84]
        rows = [f'"{i}","ds_mv_x","{m}","","{v:,}"' for i, r in enumerate(regs)
                for m, v in (("launch__registers_per_thread", r), ("gpu__time_duration.sum", 1000 * r))]
        (tmp_path / "occ.csv").write_text("\n".join([head] + rows))
        (tmp_path / "labels.json").write_text(json.dumps([["q_b", [4, 4, 1]], ["down", None]]))
        occ = ms.occupancy(tmp_path / "occ.csv", tmp_path / "labels.json")
        assert occ["q_b (4, 4, 1)"]["registers"] == "96" and occ["down default"]["registers"] == "72"
        assert occ["down default"]["ns"] == "72000" and occ["down default"]["DRAM %"] is None
    finally:
        sys.path.remove(str(bench))


def test_timeline_reads_nsys_sqlite(tmp_path, capsys):
    """benchmarks/timeline.py's analysis of an Nsight Systems export (its captures need a GPU): busy time as the
    union of overlapping activity, and an idle gap counted as the host's when the next work was queued late."""
    import sqlite3

    tl = load_benchmark("timeline")

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
    tl.analyze(tmp_path / "t.sqlite", steps=2, top=5)
    out = capsys.readouterr().out
    assert "0.11 ms wall (0.06 ms a step), 4 device activities" in out
    assert "device busy 0.04 ms (31.8 %), idle 0.07 ms in 2 gaps" in out  # busy 10 + 15 + 10 of 110 us
    assert "0.07 ms in 1 gaps; device-side: 0.01 ms" in out  # the 70 us gap was the host's, the 5 us one not
    assert "70.0  kA -> kB  late  cudaGraphLaunch" in out
    assert ("CUDA graphs: Launch 3x 0.00 ms, Instantiate 2x 0.01 ms, ExecUpdate 1x 0.00 ms "
            "(1.00 instantiations a step)") in out
