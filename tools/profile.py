"""`llmc profile ARTIFACT`: one decode or prefill step of an artifact, per kernel against its floor.

Measured (profile_measured.py), each kernel is timed around its launches (the module's llmc_profile_* exports):
on a GPU with CUDA events, on the CPU with the host's clock (a launch's time includes its thread pool's
dispatch). Each kernel's time is the median of several steps after a warm-up, and its floor comes from its
template parameters and the step's shape (floors.py): floor_us = max(floor bytes / bandwidth, FLOPs / rate),
at the rate its operands run at. A GPU's ceilings are its target's [ceilings]; a CPU's are measured on this host
(host_probes.cpu_ceilings: read bandwidth, and the fp32 FMA, bf16 (AMX or vdpbf16ps) and int8 dot-product
rates). A decode step's cached context is written first, as serving would have. The byte
and sector counters need the simulator and are null there. The step's time_us is the sum of its kernels'
(on a GPU with graphs off, as the events need), and wall_us the whole step as `llmc run` takes it (host
copies, a CUDA graph replay at decode, logits back): wall_us - time_us is what a step costs outside its
kernels.

With --simulate (profile_simulated), the step runs under the simulator's counters
(templates/cuda/include/sim/llmc_sim_profile.h defines them), with each kernel's floor and predicted time.

Per kernel (a __global__ function, by its demangled name): launches, requested_bytes, dram_bytes (distinct
32-byte sectors per launch), sector_efficiency, bank_conflicts_per_request, tensor_core_instructions, flops
(the mma.sync ones, 2*16*8*16 each: SIMT arithmetic is not counted), floor_bytes (distinct bytes loaded plus
distinct bytes stored per launch: each byte the kernel uses, moved once), floor_us and time_us:

    floor_us = max(floor_bytes / bandwidth, flops / tensor rate)
    time_us  = max(dram_bytes / bandwidth, flops / tensor rate) / sm_share + launches * launch_us

with the target's [ceilings] (targets/<name>.toml), and sm_share = min(1, blocks per launch / the target's
sm_count), counting the blocks that stored to global memory (a block that found no work stores nothing): a
grid of fewer blocks than SMs leaves the rest idle, so it gets that share of the bandwidth and
the tensor rate (a first-order model: one SM can draw more than its even share of DRAM bandwidth, so a very
small grid is predicted slower than it runs; it ranks grids of one kernel, as `llmc tune --simulate` does). The step's floor takes the FLOPs of the kernel program's
shapes instead (every GEMM 2*M*N*K, attention 4*heads*head_dim per query-key pair, whichever rate the
artifact's dtype runs at), so SIMT GEMMs have a FLOP floor too: step floor_us = max(sum floor_bytes /
bandwidth, program FLOPs / rate); step time_us = the sum of the kernels' time_us, or the step's floor_us plus
its launch costs where that is more (SIMT FLOPs, which the kernels' counts miss, bound the step).

The decode step's KV cache holds what the simulator's cudaMalloc gave it (zero pages): the counters depend on
the shapes and the block tables, not on the values.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import tomllib
from pathlib import Path

import numpy as np

from llmc.artifact import load_artifact
from llmc.compiler.codegen.floors import StepShape, expert_bytes, kernel_floor, launch_floor
from llmc.compiler.codegen.simulator import build_profiled_library
from llmc.errors import LlmcError
from llmc.kernel_program import EXPERT_GEMMS
from llmc.manifest import quant_bits_per_weight
from llmc.runtime.batch import StepBatch
from llmc.runtime.module import CompiledModel

# the order of llmc_sim_prof_kernel's counters (llmc_sim_profile.h, enum Field)
FIELDS = (
    "launches",
    "requested_bytes",
    "dram_bytes",
    "floor_bytes",
    "useful_bytes",
    "fetched_bytes",
    "global_requests",
    "shared_requests",
    "bank_conflicts",
    "tensor_core_instructions",
    "flops",
    "blocks",
)
_NAME_LEN = 4096


@dataclasses.dataclass(frozen=True)
class Ceilings:
    part: str
    bandwidth_gb_s: float
    bf16_tensor_tflop_s: float
    fp32_tflop_s: float
    launch_us: float
    sm_count: int = 0  # the target's; 0: unknown, every launch counts as filling the GPU
    int8_tops: float = 0.0  # quantized GEMMs on int8 activations (the CPU's); 0: they run at the weight dtype's rate

    def sm_share(self, blocks_per_launch: float) -> float:
        """The fraction of the SMs a launch of that many blocks keeps busy (1 where the count is unknown)."""
        return 1.0 if not self.sm_count or not blocks_per_launch else min(1.0, blocks_per_launch / self.sm_count)

    def byte_us(self, n: float) -> float:
        return n / (self.bandwidth_gb_s * 1e3)

    def tensor_us(self, flops: float) -> float:
        return flops / (self.bf16_tensor_tflop_s * 1e6)


def ceilings(target: dict) -> Ceilings:
    """The target's [ceilings]: the artifact's recorded table, else the built-in targets/<name>.toml's."""
    table = target.get("ceilings")
    if not isinstance(table, dict):
        path = Path(__file__).resolve().parents[2] / "targets" / f"{target.get('name')}.toml"
        table = tomllib.loads(path.read_text()).get("ceilings") if path.is_file() else None
    if not isinstance(table, dict):
        raise LlmcError(
            f"target {target.get('name')!r} states no [ceilings] (bandwidth and tensor rate)",
            "add a [ceilings] table to its targets/*.toml",
        )
    required = [f.name for f in dataclasses.fields(Ceilings) if f.default is dataclasses.MISSING]
    return Ceilings(**{name: table[name] for name in required}, sm_count=int(target.get("sm_count") or 0))


def program_flops(config, phase: str, batch: int, context: int, prompt_len: int) -> int:
    """FLOPs of one step from the kernel program's shapes: the GEMMs (2*M*N*K, logits for one row per
    sequence; a mixture-of-experts layer: its router and a token's top_k experts) and attention's QK and PV
    products (4 * heads * head_dim per query-key pair)."""
    c = config
    attn = c.hidden_size * (c.q_size + 2 * c.kv_size) + c.q_size * c.hidden_size
    dense, sparse = c.num_layers - len(c.moe_layers), len(c.moe_layers)
    per_token = attn * c.num_layers + 3 * c.hidden_size * c.intermediate_size * dense
    if sparse:
        experts = c.hidden_size * (c.num_experts + 3 * c.experts_per_token * c.expert_intermediate_size)
        per_token += experts * sparse
    if phase == "decode":
        tokens, seqs, pairs = batch, batch, batch * (context + 1)
    else:
        tokens, seqs, pairs = prompt_len, 1, prompt_len * (prompt_len + 1) // 2
    attention = 4 * c.num_heads * c.head_dim * pairs
    return 2 * tokens * per_token + attention * c.num_layers + 2 * seqs * c.hidden_size * c.vocab_size


def step_seqs(phase: str, batch: int, context: int, prompt_len: int) -> list[tuple[int, int]]:
    """(cached, new) tokens of each sequence of the step."""
    return [(context, 1)] * batch if phase == "decode" else [(0, prompt_len)]


def step_batch(phase: str, batch: int, context: int, prompt_len: int, block_size: int, vocab: int, seed: int):
    """decode: `batch` sequences with `context` tokens cached, one new token each; prefill: one sequence of
    `prompt_len` tokens. Blocks are handed out in order."""
    rng = np.random.default_rng(seed)
    seqs = step_seqs(phase, batch, context, prompt_len)
    tables, next_block = [], 0
    for cached, new in seqs:
        n = math.ceil((cached + new) / block_size)
        tables.append(list(range(next_block, next_block + n)))
        next_block += n
    ids = [rng.integers(0, vocab, new).tolist() for _, new in seqs]
    return StepBatch.build(ids, [cached for cached, _ in seqs], tables, block_size), next_block


def _kernel_row(name: str, v: dict, ceil: Ceilings) -> dict:
    flops = v["flops"]
    floor_us = max(ceil.byte_us(v["floor_bytes"]), ceil.tensor_us(flops))
    share = ceil.sm_share(v["blocks"] / v["launches"] if v["launches"] else 0)
    time_us = max(ceil.byte_us(v["dram_bytes"]), ceil.tensor_us(flops)) / share + v["launches"] * ceil.launch_us
    return {
        "name": name,
        "launches": v["launches"],
        "blocks": v["blocks"],
        "requested_bytes": v["requested_bytes"],
        "dram_bytes": v["dram_bytes"],
        "floor_bytes": v["floor_bytes"],
        "sector_efficiency": v["useful_bytes"] / v["fetched_bytes"] if v["fetched_bytes"] else 1.0,
        "bank_conflicts_per_request": v["bank_conflicts"] / v["shared_requests"] if v["shared_requests"] else 0.0,
        "shared_requests": v["shared_requests"],
        "tensor_core_instructions": v["tensor_core_instructions"],
        "flops": flops,
        "floor_us": floor_us,
        "time_us": time_us,
    }


def read_counters(lib: ctypes.CDLL) -> dict[str, dict]:
    """Every kernel's counters from a build_profiled library, by kernel name (launched ones only)."""
    nf = lib.llmc_sim_prof_num_fields()
    if nf != len(FIELDS):
        raise LlmcError(
            f"the profiling library has {nf} counters per kernel, this llmc reads {len(FIELDS)}",
            "rebuild it (clear the build cache)",
        )
    out: dict[str, dict] = {}
    name = ctypes.create_string_buffer(_NAME_LEN)
    values = (ctypes.c_uint64 * nf)()
    for i in range(lib.llmc_sim_prof_num_kernels()):
        if lib.llmc_sim_prof_kernel(i, name, _NAME_LEN, values) != 0:
            continue
        v = dict(zip(FIELDS, values, strict=True))
        if v["launches"]:
            out[name.value.decode(errors="replace")] = v
    return out


def check_shape(artifact, phase: str, batch: int, context: int, prompt_len: int) -> None:
    if phase not in ("decode", "prefill"):
        raise LlmcError(f"unknown phase {phase!r}", "use --phase decode or --phase prefill")
    if min(batch, prompt_len) < 1 or context < 0:
        raise LlmcError("--batch and --prompt-len must be >= 1 and --context >= 0")
    longest = context + 1 if phase == "decode" else prompt_len
    if longest > artifact.config.max_context:
        raise LlmcError(
            f"a sequence of {longest} tokens exceeds the model's context of {artifact.config.max_context}",
            "lower --context / --prompt-len",
        )


def load_for_step(
    artifact, library, step: StepBatch, blocks: int, context: int = 0, fill_chunk: int = 0
) -> CompiledModel:
    """The artifact's module (or `library`) with a KV cache of the step's blocks, sized for that one step (and
    for the chunks of up to `fill_chunk` tokens that write a decode step's `context` first)."""
    c = artifact.config
    per_block = 2 * c.num_layers * c.num_kv_heads * c.head_dim * artifact.block_size * 4
    model = CompiledModel.load(
        artifact.path,
        library=library,
        kv_cache_memory=blocks * per_block,
        max_num_tokens=max(step.num_tokens, min(context, fill_chunk)),
        max_num_seqs=step.num_seqs,
    )
    if model.num_blocks < blocks:
        model.close()
        raise LlmcError(f"the KV cache got {model.num_blocks} blocks, the step needs {blocks}")
    return model


def flops_us(ceil: Ceilings, artifact, flops: float, template: str = "") -> float:
    """FLOPs at the rate their operands run at: a quantized GEMM's on int8 activations where the ceilings
    give that rate, else the artifact's weight dtype's (the tensor cores' or vdpbf16ps for bf16 / fp16, else
    fp32 FMAs)."""
    if template.endswith("/qgemm") and ceil.int8_tops:
        rate = ceil.int8_tops
    elif artifact.weight_dtype in ("bfloat16", "float16"):
        rate = ceil.bf16_tensor_tflop_s
    else:
        rate = ceil.fp32_tflop_s
    return flops / (rate * 1e6)


def report_header(artifact, ceil: Ceilings, mode: str, phase: str, batch: int, context: int, prompt_len: int) -> dict:
    return {
        "artifact": str(artifact.path),
        "target": artifact.target_name,
        "part": ceil.part,
        "mode": mode,
        "phase": phase,
        "batch": batch if phase == "decode" else 1,
        "context": context if phase == "decode" else 0,
        "prompt_len": prompt_len if phase == "prefill" else 0,
        "ceilings": dataclasses.asdict(ceil),
        "quantization": artifact.manifest.get("quantization", "none"),
        "quantized_bits_per_weight": quant_bits_per_weight(artifact.manifest.get("quant")),
        # what one token's decode step reads of the weights (every weight once, one embedding row), to set beside
        # a GGUF file's tensor bytes
        "decode_weight_bytes": artifact.decode_weight_bytes,
    }


def profile_simulated(
    artifact_path: str | Path,
    *,
    phase: str,
    batch: int = 1,
    context: int = 0,
    prompt_len: int = 1,
    seed: int = 0,
    progress=None,
) -> dict:
    """Run one step of the stated shape under the counters; the `llmc profile --json` object.

    progress(stage) is called as each stage starts ("build", "load", "run")."""
    artifact = load_artifact(artifact_path, verify=False)
    check_shape(artifact, phase, batch, context, prompt_len)
    ceil = ceilings(artifact.target)
    c = artifact.config
    step, blocks = step_batch(phase, batch, context, prompt_len, artifact.block_size, c.vocab_size, seed)
    if progress:
        progress("build")
    lib_path = build_profiled_library(artifact.path)
    if progress:
        progress("load")
    with load_for_step(artifact, lib_path, step, blocks) as model:
        lib = ctypes.CDLL(str(Path(lib_path).resolve()))  # the same loaded object: dlopen counts references
        for fn in ("llmc_sim_prof_num_fields", "llmc_sim_prof_num_kernels", "llmc_sim_prof_kernel", *TIMING):
            getattr(lib, fn).restype = ctypes.c_int
        if progress:
            progress("run")
        lib.llmc_sim_prof_clear()
        lib.llmc_sim_prof_enable(1)
        try:
            launched = timed_launches(lib, model, step)  # the launches' order and the experts each read
        finally:
            lib.llmc_sim_prof_enable(0)
        counters = read_counters(lib)
    shape = StepShape(tuple(step_seqs(phase, batch, context, prompt_len)), step.num_seqs)
    program_floors, experts = program_floors_of(artifact, shape, launched)
    ids = list(program_floors)
    kernels = [{**_kernel_row(name, v, ceil), "kernel": manifest_kernel_id(name, ids)} for name, v in counters.items()]
    floor_bytes = sum(k["floor_bytes"] for k in kernels)
    flops = program_flops(c, phase, batch, context, prompt_len)
    floor_us = max(ceil.byte_us(floor_bytes), flops_us(ceil, artifact, flops))
    launches = sum(k["launches"] for k in kernels)
    # at least the floor plus the launches, even where SIMT FLOPs the kernels' counts miss bound the step
    time_us = max(sum(k["time_us"] for k in kernels), floor_us + launches * ceil.launch_us)
    return {
        **report_header(artifact, ceil, "simulate", phase, batch, context, prompt_len),
        "step": {
            "floor_bytes": floor_bytes,
            "dram_bytes": sum(k["dram_bytes"] for k in kernels),
            "flops": flops,
            "launches": launches,
            "floor_us": floor_us,
            "time_us": time_us,
            "floor_fraction": floor_us / time_us if time_us else 0.0,
            # the measured path's floor (floors.py: the bytes the program's shapes must move, the expert GEMMs' at
            # the experts they read), beside the counters' own (floor_bytes: the distinct bytes the kernels touched)
            "program_floor_bytes": sum(f.bytes for f in program_floors.values()),
            **({"experts": experts} if experts else {}),
        },
        "kernels": kernels,
        "program_floors": {kid: f.bytes for kid, f in program_floors.items()},  # by manifest kernel id
    }


TIMING = ("llmc_profile_timing", "llmc_profile_num_launches", "llmc_profile_launch")


def timed_launches(lib: ctypes.CDLL, model: CompiledModel, step: StepBatch) -> list[tuple[str, float, int]]:
    """(kernel, microseconds, experts it read: an expert GEMM's, else 0) of each launch of one step, in order."""
    lib.llmc_profile_timing(1)
    experts = getattr(lib, "llmc_profile_launch_experts", None)  # optional in the C ABI
    try:
        model.step(step)
        name, ms, out = ctypes.create_string_buffer(_NAME_LEN), ctypes.c_float(), []
        for i in range(lib.llmc_profile_num_launches()):
            if lib.llmc_profile_launch(i, name, _NAME_LEN, ctypes.byref(ms)) != 0:
                raise LlmcError(f"reading the time of launch {i} failed")
            out.append((name.value.decode(errors="replace"), 1e3 * ms.value, experts(i) if experts else 0))
        return out
    finally:
        lib.llmc_profile_timing(0)


def program_floors_of(artifact, shape: StepShape, launched: list[tuple[str, float, int]]) -> tuple[dict, dict | None]:
    """The floor of each kernel a step launched (floors.py, from the kernel program's shapes; an expert GEMM's at
    the experts it read), by kernel id; and the report's `experts` entry (None for a model without experts)."""
    kernels = {k["id"]: k for k in artifact.manifest.get("kernels") or []}
    ids, read, seen = list(kernels), [], {}
    for name, _, n in launched:
        kid = manifest_kernel_id(name, ids)
        seen[kid] = kernels[kid]
        if n and kernels[kid].get("template", "").split("/")[-1] in EXPERT_GEMMS:  # a CUDA SwiGLU's up half: 0
            read.append((kid, n))
    floors = {kid: kernel_floor(k, shape) for kid, k in seen.items()}
    expert_floors, experts = _experts(kernels, read, shape)
    return floors | expert_floors, experts


def _experts(kernels: dict[str, dict], read: list[tuple[str, int]], shape: StepShape) -> tuple[dict, dict | None]:
    """From the (kernel, experts read) of a step's expert GEMMs: their floors at the experts they read, and the
    report's `experts` entry (None for a model without experts): the experts each MoE layer activated (its
    gate/up GEMM's) and the weight bytes streamed for them (both GEMMs)."""
    floors: dict = {}
    per_layer, streamed = [], 0
    for kid, n in read:
        k = kernels[kid]
        op = k["template"].split("/", 1)[-1]
        f = launch_floor(k["template"], k["params"], "T", shape, n)
        floors[kid] = floors[kid] + f if kid in floors else f
        streamed += n * expert_bytes(op, k["params"])
        if k["params"]["swiglu"]:
            per_layer.append(n)
    if not read:
        return floors, None
    total = kernels[read[0][0]]["params"]["experts"]
    return floors, {"per_layer": per_layer, "of": total, "weight_bytes": streamed}


def manifest_kernel_id(launched: str, ids: list[str]) -> str:
    """The manifest kernel a launched __global__ belongs to: its name is the kernel id plus a suffix (a template
    kernel's demangled name starts with its return type, `void `)."""
    launched = launched.removeprefix("void ")
    owners = [kid for kid in ids if launched == kid or launched.startswith(kid + "_")]
    if not owners:
        raise LlmcError(f"the module launched {launched!r}, which no kernel of the manifest names")
    return max(owners, key=len)
