"""Every CUDA template through nvcc for sm_80 / sm_89 / sm_90: ptxas -v reports no spills for any kernel,
and no local memory (stack frame) but for sincosf's slow-path table in rope. One .cu with all templates per architecture (a representative
parameter set each, at Llama-3-8B sizes where register pressure is highest, plus tail shapes), and one
host-side compile that checks the launchers (LLMC_LAUNCH as <<<>>>) with the real CUDA runtime headers.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest

from llmc.compiler.codegen import simulator
from llmc.compiler.codegen.render import kernel_id
from llmc.templates import TEMPLATE_DIR
from tests.templates.kernel_harness import kernels_source


def _inv_freq(head_dim, theta=500000.0):
    return [1.0 / theta ** (i / head_dim) for i in range(0, head_dim, 2)]


_REPRESENTATIVE = [
    ("embedding", dict(hidden=4096, wdtype="bf16")),
    ("embedding", dict(hidden=37, wdtype="f32")),
    ("qembedding", dict(hidden=4096, bits=4, group_size=32, asymmetric=True, scale_bits=32)),
    ("qembedding", dict(hidden=576, bits=8, group_size=32, asymmetric=False, scale_bits=16)),
    ("rmsnorm", dict(hidden=4096, eps=1e-5, wdtype="bf16", add_residual=True)),
    ("rmsnorm", dict(hidden=8192, eps=1e-5, wdtype="f32", add_residual=False)),
    ("gemm", dict(n=4096, k=4096, wdtype="bf16", has_bias=False)),
    ("gemm", dict(n=6144, k=4096, wdtype="bf16", has_bias=True)),
    ("gemm", dict(n=4096, k=14336, wdtype="f32", has_bias=False)),
    ("gemm", dict(n=53, k=37, wdtype="bf16", has_bias=True)),
    ("gemm", dict(n=256000, k=2304, wdtype="bf16", has_bias=False, softcap=30.0)),  # Gemma 2's soft-capped lm_head
    ("gemm_swiglu", dict(inter=14336, k=4096, wdtype="bf16")),
    ("gemm_swiglu", dict(inter=40, k=200, wdtype="bf16")),
    ("rope", dict(num_heads=32, head_dim=128, inv_freq=_inv_freq(128))),
    (
        "paged_attention",
        dict(
            num_heads=32,
            num_kv_heads=8,
            head_dim=128,
            block_size=16,
            scale=1 / math.sqrt(128),
            sliding_window=4096,
            kv_dtype="bf16",
        ),
    ),
    (
        "paged_attention",
        dict(
            num_heads=9,
            num_kv_heads=3,
            head_dim=8,
            block_size=8,
            scale=1 / math.sqrt(8),
            sliding_window=0,
            kv_dtype="f32",
        ),
    ),
    ("silu_mul", dict(inter=14336)),
    ("gather_rows", dict(cols=4096)),
    ("qgemm", dict(n=14336, k=4096, bits=4, group_size=32, asymmetric=True, scale_bits=32, has_bias=False)),
    ("qgemm", dict(n=4096, k=14336, bits=8, group_size=14336, asymmetric=False, scale_bits=16, has_bias=False)),
    ("qgemm", dict(n=53, k=160, bits=4, group_size=128, asymmetric=False, scale_bits=16, has_bias=True)),
    (
        "qgemm",
        dict(n=256000, k=2304, bits=8, group_size=32, asymmetric=False, scale_bits=16, has_bias=False, softcap=30.0),
    ),
    # Qwen3-30B-A3B's experts, and a tail shape
    ("moe_route", dict(experts=128, hidden=2048, top_k=8, norm_topk=True, wdtype="bf16")),
    ("moe_route", dict(experts=9, hidden=72, top_k=3, norm_topk=False, wdtype="f32")),
    ("moe_gemm", dict(experts=128, n=2 * 768, k=2048, top_k=8, per_slot=False, swiglu=True, wdtype="bf16")),
    ("moe_gemm", dict(experts=9, n=72, k=40, top_k=3, per_slot=True, swiglu=False, wdtype="f32")),
    (
        "moe_qgemm",
        dict(experts=128, n=2048, k=768, top_k=8, per_slot=True, swiglu=False, bits=4, group_size=32)
        | dict(asymmetric=True, scale_bits=8),
    ),
    (
        "moe_qgemm",
        dict(experts=9, n=80, k=96, top_k=2, per_slot=False, swiglu=True, bits=8, group_size=32)
        | dict(asymmetric=False, scale_bits=16),
    ),
    ("moe_combine", dict(hidden=2048, top_k=8)),
]
# the bf16 cache's attention with an int8 cache, and with an fp8 one (sm89 and later in llmc compile; the same
# source for sm_80 here)
_REPRESENTATIVE += [
    (op, dict(p, kv_dtype=kv)) for kv in ("i8", "fp8") for op, p in _REPRESENTATIVE if p.get("kv_dtype") == "bf16"
]
# Activations as llmc compile gives them: float32 beside float32 weights, a float32 cache or float32 scales (a
# float32 build), else bf16; rope, silu_mul and gather_rows both ways.
_F32_BUILD = {"wdtype": "f32", "kv_dtype": "f32", "scale_bits": 32}
REPRESENTATIVE = [
    (op, dict(p, adtype="f32" if any(p.get(k) == v for k, v in _F32_BUILD.items()) else "bf16"))
    for op, p in _REPRESENTATIVE
] + [(op, dict(p, adtype="f32")) for op, p in _REPRESENTATIVE if op in ("rope", "silu_mul", "gather_rows")]
# the __global__ functions each template renders, after the kernel name
KERNELS = {
    "gemm": ["gemv", "tiled"],
    "gemm_swiglu": ["gemv", "tiled"],
    "qgemm": ["gemv", "tiled"],
    "moe_gemm": ["sort_rows", "gemv", "tiled"],
    "moe_qgemm": ["sort_rows", "gemv", "tiled"],
    "paged_attention": ["write", "attend", "prefill"],
}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    (text,), _ = kernels_source("cuda", REPRESENTATIVE)
    path = tmp_path_factory.mktemp("nvcc") / "templates.cu"
    path.write_text(text)
    return path


def test_every_template_is_represented():
    ops = {p.name.split(".")[0] for p in (Path(TEMPLATE_DIR) / "cuda").glob("*.cu.j2")} - {"model"}  # host side
    assert ops == {op for op, _ in REPRESENTATIVE}


@pytest.mark.parametrize("arch", ["sm_80", "sm_89", "sm_90"])
def test_ptxas_no_spills(source, tmp_path, arch):
    res = simulator.nvcc_compile(source, arch, tmp_path / "templates.cubin")
    for op, params in REPRESENTATIVE:
        kid = kernel_id("cuda", op, params)
        for suffix in KERNELS.get(op, ["kernel"]):
            assert any(f"{kid}_{suffix}" in name for name in res), f"{kid}_{suffix} missing from ptxas output"
    spills = {name: (r.spill_stores, r.spill_loads) for name, r in res.items() if r.spill_stores or r.spill_loads}
    assert not spills, f"{arch}: spills (store bytes, load bytes): {spills}"
    # No local memory either, except in rope: the accurate sincosf keeps the 7-word table of its Payne-Hanek
    # slow path (|angle| > 105615, i.e. long positions) in a small stack frame on some architectures.
    stacks = {
        name: r.stack_frame
        for name, r in res.items()
        if r.stack_frame and not ("_rope_" in name and r.stack_frame <= 32)
    }
    assert not stacks, f"{arch}: stack frames (bytes): {stacks}"
    # At most 128 registers a thread, but for the flash prefill: its O accumulators (head_dim / 2 floats) and Q's
    # fragments stay in registers, as FlashAttention-2's do, and its launch bounds ask for three 128-thread
    # blocks an SM (at most 170 registers)
    limit = {n: 170 if "_prefill" in n else 128 for n in res}
    assert all(0 < r.registers <= limit[n] for n, r in res.items()), {n: r.registers for n, r in res.items()}


def test_host_launchers_compile_with_nvcc(source, tmp_path):
    """The launchers and trampolines as host code under nvcc (PTX only: ptxas ran above)."""
    cmd = [
        simulator.nvcc_path(),
        "-c",
        "-std=c++17",
        "-gencode=arch=compute_80,code=compute_80",
        f"-I{simulator.INCLUDE_DIR}",
        str(source),
        "-o",
        str(tmp_path / "templates.o"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]


def test_prefill_kernels_run_on_tensor_cores(source, tmp_path):
    """The prefill kernels issue mma.sync m16n8k16 and ldmatrix in their PTX: the tiled kernels of qgemm, of
    gemm_swiglu and of the bf16 gemm with 16-byte rows, and paged attention's flash prefill on a bf16 cache with head_dim % 16 ==
    0; the f32 gemm's and the bf16 one with k % 8 != 0 stay SIMT, and so does attention on an f32 cache. The
    headers have no architecture branches, so one PTX (compute_80, the oldest target) stands for sm_80, sm_89
    and sm_90."""
    ptx = tmp_path / "templates.ptx"
    cmd = [simulator.nvcc_path(), "-ptx", "-std=c++17", "-arch=compute_80", f"-I{simulator.INCLUDE_DIR}"]
    subprocess.run([*cmd, str(source), "-o", str(ptx)], check=True, capture_output=True)
    bodies = {}
    for chunk in ptx.read_text().split(".entry ")[1:]:
        bodies[chunk.split("(", 1)[0].strip()] = chunk
    expected = {
        "gemm": lambda p: ("tiled", p["wdtype"] == "bf16" and p["k"] % 8 == 0),
        "gemm_swiglu": lambda p: ("tiled", True),
        "qgemm": lambda p: ("tiled", True),
        "paged_attention": lambda p: ("prefill", p["kv_dtype"] == "bf16" and p["head_dim"] % 16 == 0),
    }
    for op, params in REPRESENTATIVE:
        if op not in expected:
            continue
        kernel, tensor = expected[op](params)
        (body,) = [b for name, b in bodies.items() if f"{kernel_id('cuda', op, params)}_{kernel}" in name]
        assert ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32" in body) == tensor, (op, params)
        assert ("ldmatrix.sync.aligned" in body) == tensor, (op, params)
