"""CI compile checks of every kernel instantiation without a GPU (docs/quants.md §3.4).

1. Metal: the exact text MLX generates (printed by ``verbose=True`` under ``mx.export_function`` tracing),
   type-checked with ``g++ -fsyntax-only`` against ``custom_kernels/metal_shim.h``.
2. CUDA: the text MLX's cuda_kernel generates (rendered by the builder), compiled with ``nvcc -arch=sm_90``.
The instantiations go into one translation unit for Metal and one per core for CUDA (compiled side by side) to keep
the checks fast.
"""

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as QT

from ds4_mlx.weights import _kernels

from kernel_util import gxx_metal_check, nvcc_compile, render_metal_sources  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
kernels = _kernels()

RENDER_METAL = r"""
import os, sys, tempfile
import mlx.core as mx
sys.path.insert(0, sys.argv[1])
from ds4_mlx.weights import _kernels
k = _kernels()
def arrays(kind):
    x = mx.zeros((64,), dtype=mx.float16 if kind == "mm" else mx.float32)  # mm reads x as f16
    common = dict(w=mx.zeros((64,), dtype=mx.uint8), x=x, ids=mx.zeros((8,), dtype=mx.int32),
                  tiles=mx.zeros((8,), dtype=mx.int32), params=mx.zeros((8,), dtype=mx.int32),
                  w2=mx.zeros((64,), dtype=mx.uint8), aux=mx.zeros((8,)), ws=mx.zeros((64,), dtype=mx.uint8),
                  iq=mx.zeros((64,), dtype=mx.bfloat16), hw=mx.zeros((8,)), keys=mx.zeros((64,), dtype=mx.bfloat16),
                  q=mx.zeros((64,)),
                  raw=mx.zeros((64,), dtype=mx.float16), comp=mx.zeros((64,), dtype=mx.float16),
                  idx=mx.zeros((8,), dtype=mx.int32), sinks=mx.zeros((8,)), rc=mx.zeros((8,)), rs=mx.zeros((8,)),
                  oparams=mx.zeros((8,), dtype=mx.int32))
    return [common[n] for n in k.INPUTS[kind]]
def out_dtype(inst):  # mm's SwiGLU, deq's H and attn_chunk write f16
    t = dict(inst.template)
    f16 = ((inst.kind == "mm" and t["EPI"] == k.MM_SWIGLU) or (inst.kind == "deq" and t["H"])
           or inst.kind == "attn_chunk")
    return mx.float16 if f16 else mx.float32
d = tempfile.mkdtemp()
for i, inst in enumerate(k.instantiations()):
    kern = k.get_kernel(inst.kind, "metal", inst.iq2_grid)
    def f(*a):
        return kern(inputs=list(a), template=list(inst.template), grid=(128, 1, 1), threadgroup=(128, 1, 1),
                    output_shapes=[(8,)], output_dtypes=[out_dtype(inst)], verbose=True)[0]
    print(f"@@@ {inst.tag}", flush=True)
    mx.export_function(os.path.join(d, f"{i}.mlxfn"), f, *arrays(inst.kind))
"""


@pytest.mark.slow
def test_metal_instantiations_typecheck(tmp_path):
    sources = render_metal_sources(RENDER_METAL)
    insts = kernels.instantiations()
    assert sorted(sources) == sorted(i.tag for i in insts)
    kind_of = {i.tag: i.kind for i in insts}
    for tag, src in sources.items():  # MLX's own text: our header, prologue and template are in it
        assert "#define DS_METAL" in src and "ds_lane = thread_index_in_simdgroup" in src
        assert "[[kernel]]" in src and "template [[host_name(" in src
        if kernels.INPUTS[kind_of[tag]][0] == "w":  # the weight kernels read the weight bytes first
            assert "const device uint8_t* w [[buffer(0)]]" in src
    r = gxx_metal_check(sources.values(), tmp_path, "metal_all")
    assert r.returncode == 0, r.stderr[-6000:]


def test_metal_shim_catches_errors(tmp_path):
    """The g++ check is not vacuous: a body error (unknown identifier) fails it."""
    src = kernels.render_header("mv", "metal") + "\ntemplate <int QT> [[kernel]] void k(const device uint8_t* w, device float* y) {\n"
    src += "y[0] = ds_dot32(QT, w, 0u, nullptr, no_such_variable);\n}\n"
    r = gxx_metal_check([src], tmp_path, "bad")
    assert r.returncode != 0 and "no_such_variable" in r.stderr


@pytest.mark.slow
def test_cuda_instantiations_compile(tmp_path):
    insts = kernels.instantiations()
    parts = max(2, os.cpu_count() or 1)  # side by side: one nvcc of all of them is the suite's longest test
    r = nvcc_compile([kernels.render_cuda_translation_unit(insts[i::parts]) for i in range(parts)], tmp_path, "cuda")
    assert r.returncode == 0, r.stderr[-6000:]
    for inst in insts:
        assert f"custom_kernel_ds_{inst.tag}" in r.stderr  # ptxas compiled every entry point
    assert "error" not in r.stderr.lower()


def test_instantiation_matrix_covers_every_type_and_kind():
    tags = {i.tag for i in kernels.instantiations()}
    for qt in kernels.KERNEL_TYPES:
        for g in (0, 1):
            # every launch shape the dispatcher picks (kernels.mv_config), short rows and K splits included
            for nr, nsg, ks in kernels.mv_launch_shapes(qt, kernels.MV_PLAIN):
                assert f"mv_QT{int(qt)}_NR{nr}_NSG{nsg}_GATHER{g}_KS{ks}_EPI0_SH0_SQT{int(qt)}_XQ0" in tags
        for bn in kernels.MM_BN_CHOICES:
            for epi in (kernels.MM_PLAIN, kernels.MM_SWIGLU):
                assert f"mm_QT{int(qt)}_BN{bn}_EPI{epi}" in tags
        assert {f"deq_QT{int(qt)}_H0", f"deq_QT{int(qt)}_H1"} <= tags
    for qt, n_out, rows, epi, n_in in _MODEL_LAUNCHES:
        nr, nsg, ks = kernels.mv_config(qt, n_out, rows, epi, n_in)
        assert any(f"_NR{nr}_NSG{nsg}_" in t and f"_KS{ks}_EPI{epi}_" in t and t.startswith(f"mv_QT{int(qt)}_")
                   for t in tags), (qt, n_out, epi)
    # the routed experts' gate+up launch with the shared expert and quantized x (fused.experts_with_shared)
    for qt in set(kernels.MV_XQ_TYPES) & set(kernels.MV_SHARED_ROUTED):
        for nr, nsg, ks in kernels.mv_launch_shapes(qt, kernels.MV_SWIGLU):
            assert (f"mv_QT{int(qt)}_NR{nr}_NSG{nsg}_GATHER1_KS{ks}_EPI{kernels.MV_SWIGLU}_SH1_"
                    f"SQT{int(kernels.MV_SHARED_TYPE)}_XQ1") in tags, (qt, nr, nsg, ks)  # fmt: skip


def test_rendered_sources_share_one_body():
    """Metal and CUDA sources are the same files, each without the other backend's branches."""
    for kind in kernels.INPUTS:
        for backend, prologue in (("metal", kernels.METAL_PROLOGUE), ("cuda", kernels.CUDA_PROLOGUE)):
            body = kernels.keep_backend(kernels._read(f"{kind}.body"), backend)
            assert kernels.render_source(kind, backend) == kernels.minify(prologue) + body
            own = kernels.keep_backend(kernels._read(f"{kernels.HEADER_OF.get(kind, kind)}.h"), backend)
            for grid in (True, False):
                assert kernels.render_header(kind, backend, grid).endswith(own)
        assert "DS_METAL" not in kernels.render_source(kind, "cuda") + kernels.render_source(kind, "metal")
    assert "simdgroup" not in kernels.render_source("mm", "cuda")
    assert "ds_h2_fma" not in kernels.render_header("mm", "metal")
    assert kernels.iq2_grid_words().count("0x") == 512


def test_keep_backend_keeps_the_backends_branches():
    text = "\n".join(["a", "#if defined(DS_METAL)", "m1", "#if defined(X)", "mx", "#else", "my", "#endif",
                       "#else", "c1", "#if !defined(DS_METAL)", "c2", "#endif", "#endif", "#if defined(Y)", "y",
                       "#endif", "z"])  # fmt: skip
    assert kernels.keep_backend(text, "metal").split() == ["a", "m1", "#if", "defined(X)", "mx", "#else", "my",
                                                            "#endif", "#if", "defined(Y)", "y", "#endif", "z"]
    assert kernels.keep_backend(text, "cuda").split() == ["a", "c1", "c2", "#if", "defined(Y)", "y", "#endif", "z"]
    assert kernels.keep_backend(text, "sim") == kernels.keep_backend(text, "cuda")
    for bad in ("#if defined(DS_METAL)\na", "#endif", "#if defined(DS_METAL)\n#elif defined(X)\n#endif"):
        with pytest.raises(ValueError, match="keep_backend"):
            kernels.keep_backend(bad, "metal")


# (type, rows of the weight, rows of output, epilogue, K) of the full-shape model's decode matvecs
_MODEL_LAUNCHES = [
    (QT.Q8_0, 1536, 1, kernels.MV_RMS, 4096),  # q_a + kv
    (QT.Q8_0, 32768, 1, kernels.MV_RMS, 1024),  # q_b
    (QT.Q8_0, 4096, 1, kernels.MV_PLAIN, 8192),  # out_b
    (QT.Q8_0, 1024, 8, kernels.MV_PLAIN, 4096),  # out_a, 8 groups
    (QT.Q8_0, 129280, 1, kernels.MV_PLAIN, 4096),  # LM head
    (QT.IQ2_XXS, 2048, 7, kernels.MV_SWIGLU, 4096),  # 6 routed experts + the shared one
    (QT.Q2_K, 4096, 1, kernels.MV_SUM, 2048),  # their down products, summed
    (QT.F16, 256, 1, kernels.MV_PLAIN, 4096),  # router
    (QT.F16, 8192, 1, kernels.MV_PLAIN, 1024),  # indexer q_b
]


def test_mv_config_follows_the_measured_rules():
    """K split in all simdgroups for few threadgroups, in two for a middling count, never for many (the LM head,
    the routed SwiGLU); short rows (K <= MV_SHORT_K) get twice the rows per simdgroup (benchmarks/RESULTS.md)."""
    cfg = {(qt, n, e): kernels.mv_config(qt, n, r, e, k) for qt, n, r, e, k in _MODEL_LAUNCHES}
    nr, nsg = kernels.MV_CONFIG[QT.Q8_0]
    assert cfg[QT.Q8_0, 1536, kernels.MV_RMS] == (nr, nsg, nsg)  # 96 threadgroups
    assert cfg[QT.Q8_0, 4096, kernels.MV_PLAIN] == (nr, nsg, 2)  # 256
    assert cfg[QT.Q8_0, 129280, kernels.MV_PLAIN] == (nr, nsg, 1)  # 8080
    assert cfg[QT.Q8_0, 32768, kernels.MV_RMS] == (2 * nr, nsg // 2, 1)  # short rows
    nr, nsg = kernels.MV_CONFIG[QT.IQ2_XXS]
    assert cfg[QT.IQ2_XXS, 2048, kernels.MV_SWIGLU] == (nr // 2, nsg, 1)  # 3584 threadgroups
    assert cfg[QT.Q2_K, 4096, kernels.MV_SUM][2] == 2  # one token's sum: 512 threadgroups, not 6 x 512
    assert kernels.mv_config(QT.Q2_K, 4096, 6, kernels.MV_PLAIN, 2048)[2] == 1  # six unsummed rows
    nr, nsg = kernels.MV_CONFIG[QT.F16]
    assert cfg[QT.F16, 256, kernels.MV_PLAIN] == (nr, nsg, nsg)
    assert cfg[QT.F16, 8192, kernels.MV_PLAIN] == (nr, nsg, 1)  # NSG < 4: no short-row change


def test_mv_launch_plan():
    """The matvec launch arithmetic (grid, threadgroup, template, scalar block) for a K-split and an unsplit
    launch; plans are per weight and call shape."""
    import numpy as np
    from ds4_mlx.quants import random_blocks
    from ds4_mlx.weights import QuantWeight

    rng = np.random.default_rng(0)
    w = QuantWeight.from_numpy(random_blocks(rng, QT.Q8_0, (1024, 4096)), QT.Q8_0, (1024, 4096))
    kind, wb, params, template, grid, tg, out = kernels._mv_plan(w, "cuda", 1, 1, 1, False, None, direct=False)
    assert kind == "mv"
    assert dict(template)["KS"] == 4 and tg == (128, 1, 1) and out == (1, 1024)
    assert grid == (1024 // 4 * 128, 1, 1)  # NR=4 rows per group of KS=4 simdgroups: 256 threadgroups
    assert np.array(params).tolist() == [4096, 1024, 4096 // 32 * 34, 1, 0, 1, 0, 0, 0, 1]
    e = QuantWeight.from_numpy(random_blocks(rng, QT.IQ2_XXS, (8, 64, 256)), QT.IQ2_XXS, (8, 64, 256))
    nr, nsg = kernels.MV_CONFIG[QT.IQ2_XXS]
    _, _, params, template, grid, tg, out = kernels._mv_plan(e, "cuda", 6, 1, 6, True, None)
    assert dict(template)["KS"] == nsg and dict(template)["GATHER"] is True  # 6 pairs x 8 groups: split
    assert grid == (-(-64 // nr) * 32 * nsg, 1, 6) and out == (6, 64)  # NR rows per threadgroup when split
    assert np.array(params).tolist()[3:6] == [6, 0, 6]
    _, _, _, template, grid, _, _ = kernels._mv_plan(e, "cuda", 6, 1, 6, True, (nr, nsg, 1))  # forced unsplit
    assert dict(template)["KS"] == 1 and grid == (-(-64 // (nr * nsg)) * 32 * nsg, 1, 6)
    # SwiGLU epilogue: NR/2 rows of each of the two weights, the clamp's f32 bits and the route-weight flag
    _, _, params, template, grid, _, out = kernels._mv_plan(e, "cuda", 6, 1, 6, True, None, kernels.MV_SWIGLU, True, 10.0)
    assert dict(template)["NR"] == nr // 2 and dict(template)["EPI"] == kernels.MV_SWIGLU and out == (6, 64)
    assert np.array(params).tolist()[6:] == [int(np.float32(10.0).view(np.int32)), 1, 0, 6]
    # sum epilogue: one output row (and grid z) per token, not per pair
    _, _, _, template, grid, _, out = kernels._mv_plan(e, "cuda", 12, 12, 6, True, None, kernels.MV_SUM, False, 0.0)
    assert dict(template)["EPI"] == kernels.MV_SUM and grid[2] == 2 and out == (2, 64)
    # the quantized-x SwiGLU launch as mv_reg.body, with the shared expert: NR rows a threadgroup, all NSG
    # simdgroups on them, the T shared pairs after the routed ones (both in one threadgroup's z), a packed route
    # (ids' pitch 2k)
    kind, _, params, template, grid, tg, out = kernels._mv_plan(
        e, "cuda", 12, 2, 6, True, None, kernels.MV_SWIGLU, 2, 10.0, QT.Q8_0, True, 0, True, True)
    nr, nsg, rg = kernels.reg_config(kernels.MV_SWIGLU, 256)
    want = kernels.mv_reg_template(QT.IQ2_XXS, nr, nsg, rg, True, kernels.MV_SWIGLU, QT.Q8_0, xb=2)
    assert kind == "mv_reg" and template == list(want)
    assert grid == (-(-64 // (nr * rg)) * 32 * nsg, 1, 12 + 1) and tg == (32 * nsg, 1, 1) and out == (14, 64)
    assert np.array(params).tolist()[3:] == [6, 0, 12, int(np.float32(10.0).view(np.int32)), 2, 0, 12]


def test_mv_dispatches_f16_and_q8_0_matvecs_to_mv_reg_on_cuda(monkeypatch):
    """On CUDA, dense F16 and Q8_0 matvecs (plain and with the RMSNorm prologue) run mv_reg.body at their
    epilogue's config, with one simdgroup a row group for rows of at most MV_REG_SHORT_K weights; Q4_K stays on
    mv.body; Metal keeps mv.body."""
    import mlx.core as mx
    import numpy as np

    from ds4_mlx.random_model import random_quant_weight

    launched = []

    def fake_kernel(kind, backend, iq2):  # records what mv would launch
        def launch(**kw):
            launched.append((kind, dict(kw["template"]), kw["threadgroup"]))
            return [mx.zeros(kw["output_shapes"][0])]
        return launch

    monkeypatch.setattr(kernels, "get_kernel", fake_kernel)
    rng = np.random.default_rng(4)
    for n_in in (1024, 4096):
        x, nw = mx.array(rng.standard_normal((1, n_in)).astype(np.float32)), mx.ones((n_in,))
        for qt, kind in ((QT.F16, "mv_reg"), (QT.Q8_0, "mv_reg"), (QT.Q4_K, "mv")):
            w = random_quant_weight(qt, (96, n_in), 0.02)
            for backend, want in (("cuda", kind), ("metal", "mv")):
                for epi, kw in ((kernels.MV_PLAIN, dict()), (kernels.MV_RMS, dict(aux=nw, clamp=1e-6))):
                    if qt == QT.Q4_K and epi == kernels.MV_RMS:
                        continue  # no RMS prologue for Q4_K
                    launched.clear()
                    kernels.mv(w, x, backend, epi=epi, **kw)
                    got, template, tg = launched[0]
                    assert got == want, (n_in, qt, backend, epi)
                    if want == "mv_reg":
                        nsg = 1 if n_in <= kernels.MV_REG_SHORT_K else kernels.MV_REG[epi].config[1]
                        assert template["NSG"] == nsg and tg == (32 * nsg, 1, 1)


# --- source size: MLX hashes each custom kernel's whole source at every launch ---------------------------


def test_minify_drops_comments_and_blanks_only():
    src = (
        "// file comment\n"
        "#define A(x) \\\n"
        "    ((x) + 1)   // trailing\n"
        "\n"
        "  /* block */ int f() {   return A(2); }\n"
        'const char* s = "a // b  /* c */";  char q = \'"\';\n'
        "asm volatile(\"cp.async.commit_group;\\n\" ::);\n"
    )
    assert kernels.minify(src) == (
        "#define A(x) \\\n"
        "((x) + 1)\n"
        "int f() { return A(2); }\n"
        'const char* s = "a // b  /* c */"; char q = \'"\';\n'
        "asm volatile(\"cp.async.commit_group;\\n\" ::);\n"
    )


def _tokens(text: str, tmp_path: Path) -> str:
    """The text's tokens as g++ sees them without expanding anything (comments dropped, directives kept)."""
    f = tmp_path / "t.h"
    f.write_text(text)
    r = subprocess.run(["g++", "-x", "c++", "-fpreprocessed", "-dD", "-E", "-P", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return " ".join(r.stdout.replace("\\\n", " ").split())


def test_minified_kernel_files_keep_every_token(tmp_path):
    """g++'s own comment stripping of each kernel file and of its minified text yield the same tokens."""
    if shutil.which("g++") is None:
        pytest.skip("g++ not found")
    files = sorted(p for p in kernels.SOURCE_DIR.iterdir() if p.suffix in (".h", ".body") and p.name != "metal_shim.h")
    assert len(files) >= 15
    for p in files:
        raw = p.read_text()
        small = kernels._read(p.name)
        assert len(small) < len(raw), p.name
        assert _tokens(small, tmp_path) == _tokens(raw, tmp_path), p.name


def test_kernel_sources_stay_small():
    """Every Metal launch carries its rendered source (header + body, which MLX keys its kernels by) within a
    budget: the IQ2 grid only where IQ2_XXS weights are read, block decoding only in the quant kernels. The
    decode kernels, launched hundreds of times a token, keep the tight budget; the prefill kernels (a few
    launches a layer per chunk) carry mm.h's CUDA-only tile paths too."""
    prefill = {"mm", "deq", "index_mm", "attn_chunk"}
    for inst in kernels.instantiations():
        size = len(kernels.render_header(inst.kind, "metal", inst.iq2_grid)) + len(kernels.render_source(inst.kind, "metal"))
        budget = 22_500 if inst.kind in prefill else 20_800  # the largest today: mv 20.8 KB, attn_chunk 22.1 KB
        assert size <= budget + (6_700 if inst.iq2_grid else 0), (inst.tag, size)  # the grid: 6.6 KB
    from ds4_mlx.kernels import fused  # noqa: F401  (run alone, nothing else has imported it)
    assert "0x" not in kernels.render_header("mv", "cuda", False).split("DS_IQ2_GRID_WORDS", 1)[1].split("\n", 1)[0]
    for kind in kernels.fused.SPECS:
        size = len(kernels.fused.render_fused_header("metal", kind)) + len(kernels.fused.render_body(kind, "metal"))
        assert size <= 11_400, (kind, size)  # hc_pre: 5.3 KB header + 6.0 KB body (its split and quantized output)
        assert "ds_dot32" not in kernels.fused.render_fused_header("cuda")


def test_cuda_launches_carry_one_include_line_per_part(tmp_path, monkeypatch):
    """MLX-CUDA hashes the whole source at every launch: CUDA launches name content-hashed files instead."""
    import mlx.core as mx

    monkeypatch.delenv("DS4_MLX_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    made = {}
    for b in ("metal", "cuda"):  # what kernels.build hands MLX's kernel makers
        monkeypatch.setattr(mx.fast, f"{b}_kernel", lambda b=b, **kw: made.setdefault(b, kw))

    def launch_text(h, s, backend):
        made.pop(backend, None)
        kernels.build("k", ["x"], ["y"], h, s, backend)
        return made[backend]["header"], made[backend]["source"]

    h, s = kernels.render_header("mv", "cuda", True), kernels.render_source("mv", "cuda")
    lh, ls = launch_text(h, s, "cuda")
    for line, text in ((lh, h), (ls, s)):
        assert line.startswith('#include "') and line.count("\n") == 1 and len(line) < 200, line
        path = Path(line.split('"')[1])
        assert path.is_absolute() and path.parent == tmp_path / "ds4-mlx" / "kernels"
        assert path.read_text() == text
    assert launch_text(h + "\n", s, "cuda")[0] != lh  # new content, new name: no stale PTX cache hit
    Path(lh.split('"')[1]).write_text("tampered")
    assert launch_text(h, s, "cuda")[0] == lh and Path(lh.split('"')[1]).read_text() == h  # rewritten
    assert launch_text(h, s, "metal") == (h, s)  # Metal's runtime compiler reads no files
    (tmp_path / "not_a_dir").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "not_a_dir"))
    assert launch_text(h, s, "cuda") == (h, s)  # unwritable cache: the text itself
    with pytest.raises(ValueError, match="no kernels for backend"):
        kernels.build("k", ["x"], ["y"], h, s, "fallback")
