"""The CUDA templates keep the CPU contract: the same parameters plus the activation element (adtype; the CPU's
activations are float32), and with float32 activations the same launcher signature plus a stream, so model.cu
calls the same functions with the same arguments as model.cc."""

import math
import re
import subprocess

import pytest

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import kernel_id, render_kernel, target_headers, template_params
from llmc.compiler.tuning.space import tune_space
from llmc.errors import CompileError
from tests.templates.kernel_harness import SIGNATURES, kernels_source

COMMON = {
    "embedding": dict(hidden=64, wdtype="bf16"),
    "rmsnorm": dict(hidden=64, eps=1e-5, wdtype="f32", add_residual=True),
    "gemm": dict(n=8, k=16, wdtype="bf16", has_bias=True),
    "rope": dict(num_heads=2, head_dim=8, inv_freq=[1.0, 0.1, 0.01, 0.001]),
    "paged_attention": dict(
        num_heads=4, num_kv_heads=2, head_dim=16, block_size=4, scale=0.25, sliding_window=0, kv_dtype="bf16"
    ),
    "silu_mul": dict(inter=32),
    "gather_rows": dict(cols=32),
    "qembedding": dict(hidden=64, bits=4, group_size=32, asymmetric=False, scale_bits=16),
}
# parameters of a CPU template that the CUDA one lacks: a CUDA build holds the IQ4 codebook in int8
# (compiler/quant_widen.py held_on_cuda), so its kernels take no codebook
CPU_ONLY = {"qembedding": {"codebook"}}


def _signature(src: str, name: str) -> str:
    m = re.search(r"static void " + name + r"\(([^)]*)\)", src)
    assert m, src
    return " ".join(m.group(1).split())


@pytest.mark.parametrize("op", sorted(COMMON))
def test_same_params_and_signature_as_cpu(op):
    def contract(target):  # the tunables (<op>.tune.toml) are each target's own
        space = tune_space(target, op)
        return template_params(target, op) - (space.names if space else set())

    assert contract("cuda") == contract("cpu") - CPU_ONLY.get(op, set()) | {"adtype"}
    cpu = _signature(render_kernel("cpu", op, name="f", **COMMON[op]), "f")
    cuda = _signature(render_kernel("cuda", op, name="f", adtype="f32", **COMMON[op]), "f")
    assert cuda == cpu + ", cudaStream_t stream"
    bf16 = _signature(render_kernel("cuda", op, name="f", adtype="bf16", **COMMON[op]), "f")
    types = {a.rsplit(" ", 1)[1]: a.rsplit(" ", 1)[0] for a in cuda.split(", ")}
    want = {
        n: t.replace("float*", "uint16_t*") if kind == "A*" else t for n, kind in SIGNATURES[op] for t in [types[n]]
    }
    assert bf16 == ", ".join(f"{t} {n}" for n, t in want.items()) + ", cudaStream_t stream"  # activations: bf16 bits


def test_weight_types():
    sig = {
        wd: _signature(render_kernel("cuda", "gemm", name="g", n=8, k=8, wdtype=wd, has_bias=False, adtype="f32"), "g")
        for wd in ("f32", "bf16")
    }
    assert "const float* w" in sig["f32"] and "const uint16_t* w" in sig["bf16"]
    for wdtype in ("f16", "fp8"):  # the compiler emits f32 and bf16 weights only
        with pytest.raises(CompileError, match="wdtype must be one of"):
            render_kernel("cuda", "gemm", name="g", n=8, k=8, wdtype=wdtype, has_bias=False, adtype="f32")


def test_render_errors_name_the_cuda_template():
    with pytest.raises(CompileError, match=r"template cuda/paged_attention.cu.j2.*missing adtype, kv_dtype, scale"):
        render_kernel("cuda", "paged_attention", name="a", num_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
    with pytest.raises(CompileError, match="head_dim/2"):
        render_kernel("cuda", "rope", name="r", num_heads=2, head_dim=8, inv_freq=[1.0] * 5, adtype="f32")
    assert "1e-06f" in render_kernel(
        "cuda", "rmsnorm", name="n", hidden=8, eps=1e-6, wdtype="f32", add_residual=False, adtype="f32"
    )
    assert (
        kernel_id("cuda", "paged_attention", dict(COMMON["paged_attention"], adtype="bf16"))
        == "cuda_paged_attention_qh4_kvh2_d16_bs4_sc0p25_sw0_kvbf16_actbf16"
    )
    assert math.isfinite(0.25)


def test_the_build_ships_every_header(tmp_path):
    """render.target_headers, the headers that go next to model.cu, are all of templates/cuda/include (the
    simulator's in its sim/ subfolder), and with them alone (no include path into the repository) kernels compile
    for the simulator."""
    headers = target_headers("cuda")
    inc = simulator.INCLUDE_DIR
    assert set(headers) == {p.relative_to(inc).as_posix() for p in inc.rglob("*") if p.is_file()}
    assert "llmc_device.cuh" in headers and "sim/llmc_sim.h" in headers
    for name, text in headers.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    (source,), _ = kernels_source("cuda", [("rmsnorm", dict(COMMON["rmsnorm"], adtype="bf16"))])
    (tmp_path / "model.cu").write_text(source)
    cmd = [
        simulator.CXX,
        "-x",
        "c++",
        "-std=c++17",
        "-fsyntax-only",
        "-DLLMC_SIMULATOR",
        f"-I{simulator.cuda_include_dir()}",
        "model.cu",
    ]
    r = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
