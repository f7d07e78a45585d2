"""`llmc profile`: the simulator's counters (llmc_sim_profile.h) against hand-computed figures on small kernels,
the CLI's JSON on a tiny compiled model, and the CUDA-event timing of the GPU mode run on the simulated build
(whose events hold the host clock), its floors against the simulator's distinct bytes."""

from __future__ import annotations

import ctypes
import json

import pytest
import torch
from click.testing import CliRunner

from llmc.artifact import load_artifact
from llmc.compiler.codegen.simulator import build_profiled, build_simulated, build_simulated_library
from llmc.tools.cli import main
from llmc.tools.profile import (
    Ceilings,
    manifest_kernel_id,
    profile_simulated,
    program_flops,
    read_counters,
)
from llmc.tools.profile_measured import profile_measured
from llmc.tools.profile_table import format_table

N = 1000  # not a multiple of the 128-thread block: the last warp has 8 lanes

KERNELS = r"""
#include "llmc_device.cuh"

__global__ void copy_k(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = x[i];
}
// 4 bytes out of each 32-byte sector, loaded and stored
__global__ void strided_k(const float* x, float* y, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  y[8 * i] = x[8 * i];
}
// static shared memory: two conflict-free stores, one load of every other word (2 words per bank)
__global__ void smem_k(float* y) {
  __shared__ float buf[64];
  buf[threadIdx.x] = 1.0f;
  buf[threadIdx.x + 32] = 2.0f;
  __syncthreads();
  y[threadIdx.x] = buf[2 * threadIdx.x];
}
// dynamic shared memory: a 32-word stride puts every lane in bank 0; a broadcast read is conflict-free
__global__ void dyn_smem_k(float* y) {
  LLMC_DYNAMIC_SMEM(float, buf);
  buf[32 * threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  y[threadIdx.x] = buf[32 * threadIdx.x] + buf[0];
}
// per warp: one cp.async of 16 bytes per lane, ldmatrix x4 over 128 contiguous bytes per matrix (no
// conflict), ldmatrix x1 with 64-byte row pitch (4 rows per bank group: 3 replays), three mma.sync
__global__ void mma_k(const uint16_t* a, float* d) {
  LLMC_DYNAMIC_SMEM(unsigned char, smem);
  const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  unsigned char* mine = smem + warp * 1024;
  llmc::cp_async_16(mine + 16 * lane, a + 8 * (32 * warp + lane));
  llmc::cp_async_commit();
  llmc::cp_async_wait_all();
  __syncwarp();
  uint32_t ra[4], rb[2], r1[1];
  llmc::ldmatrix_x4(ra, mine + 16 * lane);
  llmc::ldmatrix_x1(r1, mine + 64 * (lane % 8));
  rb[0] = ra[0];
  rb[1] = r1[0];
  float acc[4] = {0, 0, 0, 0};
  for (int k = 0; k < 3; ++k) llmc::mma_m16n8k16_bf16(acc, ra, rb, acc);
  for (int i = 0; i < 4; ++i) d[64 * i + threadIdx.x] = acc[i];
}

extern "C" int run(int n) {
  float *x, *y;
  uint16_t* a;
  cudaMalloc(&x, 8 * n * sizeof(float));
  cudaMalloc(&y, 8 * n * sizeof(float));
  cudaMalloc(&a, 2 * 32 * 8 * sizeof(uint16_t));
  cudaMemset(x, 0, 8 * n * sizeof(float));
  cudaMemset(a, 0, 2 * 32 * 8 * sizeof(uint16_t));
  LLMC_LAUNCH(copy_k, dim3((n + 127) / 128), dim3(128), 0, nullptr, x, y, n);
  LLMC_LAUNCH(copy_k, dim3((n + 127) / 128), dim3(128), 0, nullptr, x, y, n);
  LLMC_LAUNCH(strided_k, dim3((n + 127) / 128), dim3(128), 0, nullptr, x, y, n);
  LLMC_LAUNCH(smem_k, dim3(1), dim3(32), 0, nullptr, y);
  LLMC_LAUNCH(dyn_smem_k, dim3(1), dim3(32), 32 * 32 * sizeof(float), nullptr, y);
  LLMC_LAUNCH(mma_k, dim3(1), dim3(64), 2048, nullptr, a, y);
  cudaFree(x);
  cudaFree(y);
  cudaFree(a);
  return static_cast<int>(cudaGetLastError());
}
"""


@pytest.fixture(scope="module")
def counters(tmp_path_factory):
    so = build_profiled(KERNELS, tmp_path_factory.mktemp("prof") / "k.so")
    lib = ctypes.CDLL(str(so))
    lib.llmc_sim_prof_enable(1)
    assert lib.run(N) == 0
    return read_counters(lib)


def test_coalesced_copy(counters):
    c = counters["copy_k"]
    assert c["launches"] == 2
    assert c["requested_bytes"] == 2 * 2 * 4 * N
    # 4000 bytes in and out per launch: 125 sectors each way, every sector fetched is used
    assert c["dram_bytes"] == c["floor_bytes"] == 2 * 2 * 4 * N
    assert c["useful_bytes"] == c["fetched_bytes"]
    assert c["global_requests"] == 2 * 2 * (N + 31) // 32


def test_strided_access_is_one_eighth_efficient(counters):
    c = counters["strided_k"]
    assert c["requested_bytes"] == c["floor_bytes"] == 2 * 4 * N
    assert c["useful_bytes"] * 8 == c["fetched_bytes"]
    assert c["dram_bytes"] == 2 * 32 * N


def test_shared_memory_bank_conflicts(counters):
    s = counters["smem_k"]
    assert (s["shared_requests"], s["bank_conflicts"]) == (3, 1)  # the stride-2 load: 2 passes, 1 replay
    d = counters["dyn_smem_k"]
    assert (d["shared_requests"], d["bank_conflicts"]) == (3, 2 * 31)  # two 32-way accesses, one broadcast


def test_mma_ldmatrix_and_cp_async(counters):
    m = counters["mma_k"]
    assert m["tensor_core_instructions"] == 2 * 3
    assert m["flops"] == 2 * 3 * 2 * 16 * 8 * 16
    # per warp: ldmatrix x4 conflict-free, ldmatrix x1 at a 64-byte pitch (4 words in a bank: 3 replays)
    assert (m["shared_requests"], m["bank_conflicts"]) == (2 * 2, 2 * 3)
    # cp.async reads 512 contiguous bytes per warp; d is written 4 coalesced floats per lane
    assert m["requested_bytes"] == 2 * 512 + 64 * 16
    assert m["useful_bytes"] == m["fetched_bytes"] == 2 * 512 + 64 * 16


def test_plain_simulated_build_has_no_counters(tmp_path):
    lib = ctypes.CDLL(str(build_simulated(KERNELS, tmp_path / "plain.so", extra_flags=("-O2",))))
    assert not hasattr(lib, "llmc_sim_prof_enable")
    assert lib.run(N) == 0


@pytest.fixture(scope="module")
def tiny_sm90(tmp_path_factory):
    from llmc.tools.build import compile_checkpoint
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", dtype=torch.bfloat16, num_hidden_layers=1)
    return compile_checkpoint(
        ckpt, target="sm90", output=tmp_path_factory.mktemp("art") / "model.sm90", weight_dtype="bfloat16"
    )


KERNEL_KEYS = {
    "name",
    "launches",
    "requested_bytes",
    "dram_bytes",
    "sector_efficiency",
    "bank_conflicts_per_request",
    "tensor_core_instructions",
    "flops",
    "floor_us",
    "time_us",
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "args", [["--phase", "decode", "--batch", "2", "--context", "37"], ["--phase", "prefill", "--prompt-len", "19"]]
)
def test_cli_json(tiny_sm90, args):
    r = CliRunner().invoke(main, ["profile", str(tiny_sm90), "--simulate", "--json", *args])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    step, kernels = report["step"], report["kernels"]
    assert {"floor_bytes", "dram_bytes", "floor_us", "time_us"} <= step.keys()
    assert kernels and all(KERNEL_KEYS <= k.keys() for k in kernels)
    launch_us = report["ceilings"]["launch_us"]
    for k in kernels:
        assert k["launches"] >= 1 and k["dram_bytes"] >= k["floor_bytes"] > 0
        assert 0 < k["sector_efficiency"] <= 1
        assert k["time_us"] >= k["floor_us"] + k["launches"] * launch_us - 1e-9
    assert step["dram_bytes"] == sum(k["dram_bytes"] for k in kernels)
    assert step["time_us"] == pytest.approx(sum(k["time_us"] for k in kernels))
    assert step["time_us"] >= step["floor_us"]


STEPS = [{"phase": "decode", "batch": 2, "context": 37}, {"phase": "prefill", "prompt_len": 19}]


@pytest.mark.parametrize("shape", STEPS)
def test_measured_profile_times_every_kernel(tiny_sm90, shape):
    report = profile_measured(tiny_sm90, library=build_simulated_library(tiny_sm90), repeats=2, **shape)
    artifact = load_artifact(tiny_sm90, verify=False)
    manifest = {k["id"]: k for k in artifact.manifest["kernels"]}
    step, kernels = report["step"], report["kernels"]
    assert report["mode"] == "gpu" and {k["name"] for k in kernels} == set(manifest)
    assert KERNEL_KEYS <= kernels[0].keys() and kernels[0]["dram_bytes"] is None
    # paged attention launches its KV write and its attention; every other kernel one __global__ per call
    for k in kernels:
        calls = manifest[k["name"]]["launches"]
        assert k["launches"] == (2 * calls if "paged_attention" in k["name"] else calls)
        assert k["time_us"] > 0 and k["floor_bytes"] > 0
    assert step["time_us"] == pytest.approx(sum(k["time_us"] for k in kernels))
    assert step["wall_us"] > 0 and step["floor_fraction"] == pytest.approx(step["floor_us"] / step["time_us"])
    # the kernels' FLOPs add up to the program's
    c = artifact.config
    assert step["flops"] == program_flops(
        c, shape["phase"], shape.get("batch", 1), shape.get("context", 0), shape.get("prompt_len", 1)
    )


@pytest.mark.slow
@pytest.mark.parametrize("shape", STEPS)
def test_floors_match_the_simulators_distinct_bytes(tiny_sm90, shape):
    """The analytic floors (floors.py) against the bytes each kernel's launches did touch under the simulator."""
    measured = profile_measured(tiny_sm90, library=build_simulated_library(tiny_sm90), repeats=1, **shape)
    simulated = profile_simulated(tiny_sm90, **shape)
    touched: dict[str, int] = {}
    for k in simulated["kernels"]:
        kid = manifest_kernel_id(k["name"], [m["name"] for m in measured["kernels"]])
        touched[kid] = touched.get(kid, 0) + k["floor_bytes"]
    for k in measured["kernels"]:
        if "paged_attention" in k["name"]:
            # the attention kernel reads back the new keys and values the write kernel stored
            assert 0.8 * touched[k["name"]] <= k["floor_bytes"] < touched[k["name"]]
        else:
            assert k["floor_bytes"] == touched[k["name"]], k["name"]


@pytest.fixture(scope="module")
def tiny_cpu(tmp_path_factory):
    from llmc.tools.build import compile_checkpoint
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(tmp_path_factory.mktemp("ckpt"), "llama", dtype=torch.bfloat16, num_hidden_layers=1)
    return compile_checkpoint(
        ckpt, target="cpu", output=tmp_path_factory.mktemp("art") / "model.cpu", weight_dtype="bfloat16"
    )


# fixed ceilings: the CPU's are measured (cpu_ceilings), which the CLI test below does once
HOST = Ceilings(
    part="test host", bandwidth_gb_s=20.0, bf16_tensor_tflop_s=0.4, fp32_tflop_s=0.2, launch_us=0.0, int8_tops=0.8
)


@pytest.mark.parametrize("shape", STEPS)
def test_cpu_profile_times_every_kernel_on_the_host(tiny_cpu, shape):
    report = profile_measured(tiny_cpu, repeats=3, ceil=HOST, **shape)
    artifact = load_artifact(tiny_cpu, verify=False)
    manifest = {k["id"]: k for k in artifact.manifest["kernels"]}
    step, kernels = report["step"], report["kernels"]
    assert report["mode"] == "cpu" and {k["name"] for k in kernels} == set(manifest)
    assert report["host_llc_bytes"] > 0
    for k in kernels:  # one timed call per launch of the kernel program; bf16 weights: floors at the bf16 rate
        assert k["launches"] == manifest[k["name"]]["launches"] and k["time_us"] > 0
        assert k["floor_us"] == pytest.approx(max(k["floor_bytes"] / 20e3, k["flops"] / 0.4e6))
    assert step["time_us"] == pytest.approx(sum(k["time_us"] for k in kernels)) and step["wall_us"] > 0
    c = artifact.config
    assert step["flops"] == program_flops(
        c, shape["phase"], shape.get("batch", 1), shape.get("context", 0), shape.get("prompt_len", 1)
    )
    assert "timed on the CPU" in format_table(report) and "outside the kernels" in format_table(report)
    assert report["decode_weight_bytes"] == artifact.decode_weight_bytes
    assert f"reads {artifact.decode_weight_bytes / 1e6:.2f} MB of weights" in format_table(report)


def test_quantized_gemms_take_the_int8_rate(tmp_path, checkpoint_dir):
    from llmc.compiler.quant import QuantConfig
    from llmc.tools.build import compile_checkpoint

    art = compile_checkpoint(
        checkpoint_dir("llama"),
        target="cpu",
        output=tmp_path / "q.cpu",
        quant=QuantConfig(mode="int8", group_size=32),
        max_kl=None,
    )
    report = profile_measured(art, phase="prefill", prompt_len=40, repeats=1, ceil=HOST)
    templates = {k["id"]: k["template"] for k in load_artifact(art, verify=False).manifest["kernels"]}
    rate = {"cpu/qgemm": 0.8, "cpu/gemm": 0.2}  # int8 activations; the float32 lm_head
    gemms = [k for k in report["kernels"] if templates[k["name"]] in rate]
    assert {templates[k["name"]] for k in gemms} == set(rate)
    for k in gemms:
        assert k["floor_us"] == pytest.approx(
            max(k["floor_bytes"] / 20e3, k["flops"] / (rate[templates[k["name"]]] * 1e6))
        )


def test_tvm_fallback_kernels_are_floored_by_their_tensors_bytes(tmp_path, checkpoint_dir, monkeypatch):
    """silu(gate) * up left unfused runs as two TVM fallback kernels: timed like the rest, each floored by the
    float32 tensors it reads and writes (T rows of the intermediate size), with no FLOPs."""
    from llmc.compiler.passes import pipeline
    from llmc.tools.build import compile_checkpoint

    monkeypatch.setattr(pipeline, "PASSES", [p for p in pipeline.PASSES if p.__name__ != "fuse_swiglu"])
    art = compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path / "m.cpu", max_kl=None)
    report = profile_measured(art, phase="prefill", prompt_len=23, repeats=1, ceil=HOST)
    manifest = {k["id"]: k for k in load_artifact(art, verify=False).manifest["kernels"]}
    fallbacks = [k for k in report["kernels"] if manifest[k["name"]]["template"] == "cpu/tvm_call"]
    inter = load_artifact(art, verify=False).config.intermediate_size
    tensors = {"relax.nn.silu": 2, "relax.multiply": 3}  # in and out; both inputs and the out
    assert sorted(manifest[k["name"]]["fuses"][0] for k in fallbacks) == sorted(tensors)
    for k in fallbacks:
        per_launch = tensors[manifest[k["name"]]["fuses"][0]] * 23 * inter * 4
        assert k["floor_bytes"] == k["launches"] * per_launch and k["flops"] == 0 and k["time_us"] > 0


def test_cli_profiles_a_cpu_artifact_against_this_hosts_ceilings(tiny_cpu):
    r = CliRunner().invoke(main, ["profile", str(tiny_cpu), "--context", "20", "--repeats", "2", "--json"])
    assert r.exit_code == 0, r.output
    report = json.loads(r.stdout.strip().splitlines()[-1])
    c = report["ceilings"]
    assert report["mode"] == "cpu" and c["bandwidth_gb_s"] > 0 and c["launch_us"] == 0
    assert c["bf16_tensor_tflop_s"] >= c["fp32_tflop_s"] > 0 and c["int8_tops"] > 0


def test_cli_on_the_gpu_or_a_clear_error_without_one(tiny_sm90):
    r = CliRunner().invoke(main, ["profile", str(tiny_sm90), "--context", "40", "--repeats", "2"])
    if r.exit_code == 0:  # a machine with an sm90 GPU
        assert "timed with CUDA events" in r.stdout
    else:
        assert r.exit_code == 1 and "--simulate" in r.output and "Traceback" not in r.output


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "float32"])
def test_decode_attention_reads_shared_memory_without_bank_conflicts(tmp_path, kv_dtype):
    """head_dim 128: over a bf16 cache each lane reads two float4s of q from shared memory (q_slot's swizzle;
    in order they conflicted 2-way), over a float32 one one float4."""
    from llmc.tools.build import compile_checkpoint
    from tests.checkpoints import make_checkpoint

    ckpt = make_checkpoint(
        tmp_path / "ckpt",
        "llama",
        dtype=torch.bfloat16,
        num_hidden_layers=1,
        hidden_size=256,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=256,
    )
    art = compile_checkpoint(
        ckpt, target="sm90", output=tmp_path / "m.sm90", weight_dtype="bfloat16", kv_dtype=kv_dtype
    )
    report = profile_simulated(art, phase="decode", batch=2, context=100)
    (attend,) = [k for k in report["kernels"] if k["name"].endswith("_attend")]
    assert attend["shared_requests"] > 0 and attend["bank_conflicts_per_request"] == 0.0


def test_cpu_profile_counts_the_experts_each_step_reads(tmp_path, checkpoint_dir):
    """Qwen3-MoE (6 experts, top 2, layers 0 and 2 sparse): decode at batch 1 reads 2 experts a layer, exactly;
    at batch 16, each expert its tokens chose once, however many chose it; the expert GEMMs' floors count those,
    and the step's FLOPs a token's 2 experts and the router."""
    from llmc.compiler.codegen.floors import expert_bytes
    from llmc.tools.build import compile_checkpoint

    art = compile_checkpoint(checkpoint_dir("qwen3_moe"), target="cpu", output=tmp_path / "m.cpu")
    manifest = {k["id"]: k for k in load_artifact(art, verify=False).manifest["kernels"]}
    experts = [k for k in manifest.values() if k["template"] == "cpu/moe_gemm"]
    both = sum(expert_bytes("moe_gemm", k["params"]) for k in experts)  # one expert's gate_up and down
    one = profile_measured(art, phase="decode", batch=1, context=5, repeats=1, ceil=HOST)
    assert one["step"]["experts"] == {"per_layer": [2, 2], "of": 6, "weight_bytes": 2 * 2 * both}
    sixteen = profile_measured(art, phase="decode", batch=16, context=5, repeats=1, ceil=HOST)
    e = sixteen["step"]["experts"]
    assert len(e["per_layer"]) == 2 and all(2 < n <= 6 for n in e["per_layer"])
    assert e["weight_bytes"] == sum(e["per_layer"]) * both
    floors = {k["name"]: k["floor_bytes"] for k in sixteen["kernels"]}
    gate_up = next(k for k in experts if k["params"]["swiglu"])
    acts = 16 * (64 + 2 * 40 + 2 * 2) * 4  # a token's x in, its 2 slots' SwiGLU out, its route read
    assert floors[gate_up["id"]] == sum(e["per_layer"]) * expert_bytes("moe_gemm", gate_up["params"]) + 2 * acts
    assert sixteen["step"]["flops"] == program_flops(load_artifact(art, verify=False).config, "decode", 16, 5, 1)
    assert "experts: " in format_table(one)


def test_simulated_profile_counts_the_experts_and_their_traffic(tmp_path, checkpoint_dir):
    """sm90, bf16 Qwen3-MoE (6 experts, top 2, layers 0 and 2 sparse), under the counters: decode at batch 1
    activates 2 experts a layer, exactly, and each expert GEMM moves its program floor (the chosen experts'
    weights once each, their rows in and out) within 5%; at 16 prompt tokens (past the GEMV's 8) they run on
    tensor cores without bank conflicts."""
    from llmc.tools.build import compile_checkpoint

    art = compile_checkpoint(
        checkpoint_dir("qwen3_moe"), target="sm90", output=tmp_path / "m.sm90", weight_dtype="bfloat16"
    )
    one = profile_simulated(art, phase="decode", batch=1, context=5)
    assert one["step"]["experts"]["per_layer"] == [2, 2] and one["step"]["experts"]["of"] == 6
    moved: dict[str, int] = {}
    for k in one["kernels"]:
        moved[k["kernel"]] = moved.get(k["kernel"], 0) + k["dram_bytes"]
    experts = [kid for kid in one["program_floors"] if "_moe_gemm_" in kid]
    assert len(experts) == 2
    for kid in experts:
        assert one["program_floors"][kid] <= moved[kid] <= 1.05 * one["program_floors"][kid], kid
    assert "experts: 2.0 of 6 a layer activated" in format_table(one)
    prefill = profile_simulated(art, phase="prefill", prompt_len=16)
    tiled = [k for k in prefill["kernels"] if "_moe_gemm_" in k["kernel"] and "_tiled<" in k["name"]]
    assert len(tiled) == 3  # gate_up's two halves and down
    assert all(k["tensor_core_instructions"] > 0 and k["bank_conflicts_per_request"] == 0.0 for k in tiled)
