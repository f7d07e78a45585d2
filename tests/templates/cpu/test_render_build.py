"""compiler/codegen render_kernel / kernel_id / build_shared_library: identities, errors, cache."""

import ctypes
import os

import pytest

from llmc.compiler.codegen import build
from llmc.compiler.codegen.build import build_shared_library, default_cache_dir
from llmc.compiler.codegen.render import kernel_id, render_kernel
from llmc.errors import CompileError

GEMM = dict(n=1536, k=576, wdtype="bf16", has_bias=False)


def test_kernel_id_is_readable_and_canonical():
    assert kernel_id("cpu", "gemm", GEMM) == "cpu_gemm_n1536_k576_bf16_bias0"
    assert kernel_id("cpu", "gemm", dict(reversed(list(GEMM.items())), name="f")) == "cpu_gemm_n1536_k576_bf16_bias0"
    rms = dict(hidden=576, eps=1e-5, wdtype="f32", add_residual=True)
    assert kernel_id("cpu", "rmsnorm", rms) == "cpu_rmsnorm_h576_eps1em05_f32_res1"
    pa = dict(num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, scale=0.125, sliding_window=4096, kv_dtype="f32")
    assert kernel_id("cpu", "paged_attention", pa) == "cpu_paged_attention_qh9_kvh3_d64_bs16_sc0p125_sw4096_kvf32"
    assert kernel_id("cpu", "gemm", GEMM).isidentifier()


def test_render_names_the_function_and_fills_constants():
    src = render_kernel("cpu", "gemm", name="proj", **GEMM)
    assert "static void proj(const float* x, const uint16_t* w, const uint16_t* bias, float* y, int T)" in src
    assert "llmc::gemm<1536, 576, false, 16384, 32768>" in src  # the tunables at their defaults (gemm.tune.toml)
    tuned = render_kernel("cpu", "gemm", name="proj", **GEMM, prefetch_bytes=0, task_bytes=65536)
    assert "llmc::gemm<1536, 576, false, 0, 65536>" in tuned


def test_render_errors_name_op_and_template():
    with pytest.raises(CompileError, match=r"op 'gemm' \(template cpu/gemm.cc.j2.*missing has_bias"):
        render_kernel("cpu", "gemm", name="f", n=4, k=4, wdtype="f32")
    with pytest.raises(CompileError, match="unknown tile"):
        render_kernel("cpu", "gemm", name="f", tile=4, **GEMM)
    with pytest.raises(CompileError, match="wdtype must be one of"):
        render_kernel("cpu", "gemm", name="f", **dict(GEMM, wdtype="fp8"))
    with pytest.raises(CompileError, match="no kernel template for op 'conv2d'"):
        render_kernel("cpu", "conv2d", name="f")
    with pytest.raises(CompileError, match="C identifier"):
        render_kernel("cpu", "gemm", name="bad name", **GEMM)


def test_build_caches_by_content(tmp_path):
    src = 'extern "C" int answer() { return 42; }\n'
    lib = build_shared_library(src, cache_dir=tmp_path)
    assert ctypes.CDLL(str(lib)).answer() == 42
    mtime = lib.stat().st_mtime_ns
    assert build_shared_library(src, cache_dir=tmp_path) == lib and lib.stat().st_mtime_ns == mtime
    other = build_shared_library(src, cache_dir=tmp_path, flags=[*build.CPU_FLAGS, "-DX=1"])
    assert other != lib
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]  # no temporaries left behind


def test_build_failure_raises_with_compiler_output(tmp_path):
    with pytest.raises(CompileError, match="not_a_type"):
        build_shared_library({"bad.cc": "not_a_type x;\n"}, cache_dir=tmp_path)


def test_cache_dir_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c" / "build"
    monkeypatch.delenv("LLMC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x" / "llmc" / "build"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_cache_dir() == type(tmp_path).home() / ".cache" / "llmc" / "build"
    assert os.fspath(default_cache_dir()).endswith(os.path.join("llmc", "build"))
