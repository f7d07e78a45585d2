"""`llmc compile`: checkpoint -> traced graph -> fused Relax -> kernel program -> built artifact.

Weights are touched once, late: the trace runs on meta tensors, and the packed weights are streamed
tensor by tensor into the artifact (compiler/weights.py), so peak memory stays near one tensor.
"""

from __future__ import annotations

import math
import os
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path

import tvm
from tqdm import tqdm

from llmc.artifact_writer import write_artifact
from llmc.dtypes import (
    ELEMENT_DTYPES,
    FP8_KV_MIN_COMPUTE_CAPABILITY,
    KV_DTYPE_SPELLINGS,
    KV_DTYPES,
    resolve_kv_dtype,
)
from llmc.errors import CompileError, UnsupportedModelError
from llmc.targets import Target, load_target, tuning_db_path

from .codegen.build import build_shared_library
from .codegen.module import render_module
from .codegen.render import target_headers, template_file
from .codegen.simulator import nvcc_path
from .codegen.tvm_fallback import include_dirs
from .export import to_relax
from .frontend.checkpoint import Checkpoint
from .frontend.load import load_checkpoint
from .frontend.trace import trace
from .importance import input_importance
from .lower import lower
from .passes.common import rewrite_counts
from .passes.pipeline import run_passes
from .passes.quantize_embedding import quantize_embedding
from .passes.quantize_linear import quantize_linear
from .program import KernelProgram
from .quant import K_MULTIPLE, Q8_0, QuantConfig, QuantScheme
from .quant_widen import held_on_cuda
from .tuning.database import TuningDB
from .weights import WeightSpec, write_packed_weights

WEIGHT_DTYPES = ("auto", *ELEMENT_DTYPES)
STAGES = ("trace", "import to Relax", "fuse", "lower", "pack weights", "render", "build")
IMPORTANCE_STAGE = "activation importance"  # before them, when the quantizer weighs its error by it
# A gate: (stage name, check(directory, fields) -> fields to add). It runs after STAGES on the populated
# directory, under the output's lock; raising writes nothing (tools/build.py's quality gate).
Gate = tuple[str, Callable[[Path, dict], dict]]
# Test hook, off unless set: LLMC_TEST_SIGNAL_AT="STAGE[:SIGNAL]" makes compile send itself SIGNAL (default
# SIGKILL) as it enters STAGE, so tests/llmc/test_artifact_durability.py can kill -9 or stop a real compile there.
SIGNAL_AT_ENV = "LLMC_TEST_SIGNAL_AT"
# How templates/cpu/qgemm.cc.j2 and templates/cuda/qgemm.cu.j2 treat the activations of a quantized GEMM, as the
# manifest records it; CUDA's by the build's activation dtype.
CPU_QGEMM_ACTIVATIONS = "int8 per 32"
CUDA_QGEMM_ACTIVATIONS = {"float32": "float32 (GEMV, T <= 8), bf16 (tensor-core GEMM)", "bfloat16": "bf16"}
# a bf16 CUDA build holds a token's routed expert ids in its activation dtype: integers exact up to 256
MAX_BF16_EXPERTS = 256


def resolve_weight_dtype(ckpt: Checkpoint, requested: str) -> str:
    if requested not in WEIGHT_DTYPES:
        raise CompileError(f"weight dtype {requested!r} is not supported", f"choose one of {', '.join(WEIGHT_DTYPES)}")
    if requested != "auto":
        return requested
    # fp16 has more mantissa than bf16: keep it exact as fp32 rather than round it.
    return "bfloat16" if ckpt.weight_dtype == "bfloat16" else "float32"


def check_fusion(mod: tvm.IRModule, num_layers: int) -> None:
    """A model whose attention was not rewritten cannot use the KV cache: refuse to compile it."""
    counts = rewrite_counts(mod)
    if counts.get("fuse_attention", 0) != num_layers:
        raise CompileError(
            f"fuse_attention rewrote {counts.get('fuse_attention', 0)} of {num_layers} attention layers",
            "this model's attention does not match the Llama-family pattern; llmc will not compile it silently",
        )


def quant_schemes(ckpt: Checkpoint, quant: QuantConfig, cuda: bool = False) -> dict[str, QuantScheme]:
    """Checkpoint weight name -> scheme of each weight a GEMM or the embedding's gather reads quantized.

    From the flags (QuantConfig.tensor_scheme): the linears of the blocks, the lm_head (the embedding, when tied)
    and an untied embedding, as the mode chooses. A tensor the checkpoint holds quantized (GGUF) keeps its own
    scheme whatever the flags, so a file imports with no requantization: an untied embedding too, which the
    gather reads quantized (passes/quantize_embedding.py). cuda: a held int5 or int6 tensor (GGUF Q5_* and Q6_K)
    becomes the int8 scheme that holds it exactly (quant_widen.held_on_cuda), one quantized here to int6 becomes Q8_0,
    and one to int5 (q5_k) is refused: the CUDA kernels read no 5- or 6-bit layout yet.
    """
    shapes = ckpt.config.weight_shapes()
    tied = "lm_head.weight" not in shapes
    linears = [
        n
        for n, s in shapes.items()
        if len(s) == 2 and n.startswith("model.layers.") and (n.endswith("_proj.weight") or ".experts." in n)
    ]
    roles = {n: n for n in linears} | {"model.embed_tokens.weight" if tied else "lm_head.weight": "lm_head.weight"}
    if not tied:  # its own table, read only by the gather
        roles["model.embed_tokens.weight"] = "model.embed_tokens.weight"
    schemes = {}
    for name, role in roles.items():
        held = ckpt.quant_scheme(name)
        if held is not None:
            schemes[name] = held_on_cuda(held) if cuda else held
            continue
        scheme = quant.tensor_scheme(role, shapes[name][1], ckpt.config.num_layers, one_scheme_qkv=cuda)
        if cuda and scheme is not None and scheme.bits == 5:
            raise CompileError(
                f"{name}: {scheme.describe()} (q5_k) has no CUDA kernels yet",
                "quantize for a CUDA target with q4_k, q4_k_m or q8_0",
            )
        if scheme is not None:
            schemes[name] = Q8_0 if cuda and scheme.bits == 6 else scheme
    return schemes


def quant_manifest(
    quant: QuantConfig, weights: list[WeightSpec], activations: str = CPU_QGEMM_ACTIVATIONS
) -> dict | None:
    """The manifest's `quant` entry: the flags, how activations are treated, each quantized GEMM's scheme and
    the packed bytes; None for a build with no quantized weight."""
    quantized = [w for w in weights if w.quant is not None]
    if not quantized:
        return None
    return {
        "mode": quant.mode,
        "default": quant.describe(),
        "lm_head": quant.quantizes_head,
        "activations": activations,
        "weights": {w.name.removesuffix(".qweight"): w.quant.describe() for w in quantized if w.part == "qweight"},
        "quantized_weights": sum(math.prod(w.shape) for w in quantized if w.part == "qweight"),
        "packed_bytes": {
            "quantized": sum(w.nbytes for w in quantized),
            "float": sum(w.nbytes for w in weights if w.quant is None),
        },
    }


def build_program(
    ckpt: Checkpoint,
    weight_dtype: str,
    block_size: int,
    step=lambda name: None,
    after_each_pass=None,
    schemes: dict[str, QuantScheme] | None = None,
    kv_dtype: str = "float32",
    cuda: bool = False,
) -> KernelProgram:
    """step(stage) marks each stage's start (a progress bar); after_each_pass(name, mod) sees every pass;
    schemes (quant_schemes) adds quantize_linear to the passes; cuda: lower for the CUDA templates
    (activations in the weight dtype, the SwiGLU epilogue: see lower()), else for the CPU's (a quantized head's
    int8 activations in two passes)."""
    step("trace")
    traced = trace(ckpt.config)
    step("import to Relax")
    mod = to_relax(traced)
    step("fuse")
    quantize = []
    if schemes:
        # the CPU's qgemm writes a column range of a wider output: a fused weight of mixed schemes is one GEMM each
        names = traced.weight_names
        quantize = [quantize_linear(schemes, names, split_mixed=not cuda), quantize_embedding(schemes, names)]
    mod = run_passes(mod, after_each=after_each_pass, quantize=quantize)
    check_fusion(mod, ckpt.config.num_layers)
    step("lower")
    return lower(
        mod,
        traced.weight_names,
        weight_dtype=weight_dtype,
        block_size=block_size,
        kv_dtype=kv_dtype,
        act_dtype=weight_dtype if cuda else None,
        swiglu_epilogue=cuda,
        two_pass_head=not cuda,
    )


def module_sources(target: Target, source: str, tvm_source: str | None = None) -> dict[str, str]:
    """The files a target's build compiles: the generated sources and the fixed files they need."""
    family = target.template_dir
    sources = {target.source_file: source, **target_headers(family)}
    if tvm_source is not None:
        sources |= {"tvm_kernels.cc": tvm_source, "tvm_backend.cc": template_file(family, "tvm_backend.cc")}
    return sources


def build_module(target: Target, source: str, tvm_source: str | None = None) -> Path:
    """model.so, built with the target's compiler and flags (targets/<name>.toml)."""
    flags = target.build_flags
    if tvm_source is not None:  # TVM's C includes its headers; -Bsymbolic: our runtime shims, not a loaded TVM's
        flags += [f"-I{d}" for d in include_dirs()] + ["-Wl,-Bsymbolic"]
    compiler = nvcc_path() if target.compiler == "nvcc" else target.compiler  # nvcc: the CUDA toolkit's own
    return build_shared_library(module_sources(target, source, tvm_source), flags=flags, compiler=compiler)


def compile_checkpoint(
    checkpoint: str | Path | Checkpoint,
    *,
    target: str = "cpu",
    output: str | Path,
    weight_dtype: str = "auto",
    block_size: int | None = None,
    progress: bool = False,
    quant: QuantConfig | None = None,
    kv_dtype: str = "auto",
    tuning_db: str | Path | None | bool = None,
    gate: Gate | None = None,
    importance_tokens: Sequence[int] | None = None,
) -> Path:
    """quant: llmc's own quantization (`--quant`); None or QuantConfig() for none.
    importance_tokens: calibration token ids (one sequence) over which each quantized linear's input channels
    are measured (compiler/importance.py); llmc's quantizer then weighs each weight's error by its channel's
    importance. None: unweighted.
    kv_dtype: what the KV cache stores (`--kv-cache-dtype`): float32, bfloat16 at half the bytes, or int8 or (CUDA
    sm89 and later) fp8 e4m3 ("fp8" or "float8_e4m3fn") with a float32 scale per (token, kv head); "auto"
    (resolve_kv_dtype): bfloat16 for a bf16 / fp16 CUDA build, else float32.
    gate: a last check of the built directory before it is written (Gate); the quality gate of a quantized
    build is one (tools/build.py).
    tuning_db: the tuning database whose matching entries set kernel tunables (None: the target's own,
    targets/<target>.tuning.json, if there is one; False: none, every template's defaults); a path given
    must exist."""
    tgt = load_target(target)
    tuning = None
    if tuning_db is not False:  # only the target's own database may be absent
        tuning = TuningDB.load(tuning_db or tuning_db_path(target), target, required=tuning_db is not None)
    block_size = block_size or tgt.block_size
    quant = quant or QuantConfig()
    kv_dtype = KV_DTYPE_SPELLINGS.get(kv_dtype, kv_dtype)
    if kv_dtype not in ("auto", *KV_DTYPES):
        raise CompileError(
            f"KV cache dtype {kv_dtype!r} is not supported",
            f"--kv-cache-dtype takes auto, fp8 or one of {', '.join(KV_DTYPES)}",
        )
    if kv_dtype == "float8_e4m3fn" and (tgt.compute_capability or 0) < FP8_KV_MIN_COMPUTE_CAPABILITY:
        raise CompileError(
            f"an fp8 KV cache needs a CUDA target of sm{FP8_KV_MIN_COMPUTE_CAPABILITY} or later, not {tgt.name}",
            "use --kv-cache-dtype int8 (a quarter of float32's bytes plus a scale, on every target) or bfloat16",
        )
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    dtype = resolve_weight_dtype(ckpt, weight_dtype)
    if tgt.is_cuda and ckpt.config.moe_layers and dtype == "bfloat16" and ckpt.config.num_experts > MAX_BF16_EXPERTS:
        raise UnsupportedModelError(
            f"{ckpt.config.architecture}: {ckpt.config.num_experts} experts; a bf16 CUDA build holds the routed "
            f"expert ids in bf16, exact up to {MAX_BF16_EXPERTS}",
            "compile it with --dtype float32, or for --target cpu",
        )
    kv_dtype = resolve_kv_dtype(kv_dtype, cuda=tgt.is_cuda, weight_dtype=dtype)
    schemes = quant_schemes(ckpt, quant, cuda=tgt.is_cuda)
    if quant.enabled and not schemes:
        raise CompileError(
            f"--quant {quant.mode} quantizes nothing in this model: no linear's input size is a multiple of "
            f"{K_MULTIPLE}",
            "compile it without --quant",
        )
    fresh = [n for n in schemes if ckpt.quant_scheme(n) is None]  # quantized here, from float weights
    measured = bool(importance_tokens) and bool(fresh)
    stages = len(STAGES) + (gate is not None) + measured
    bar = tqdm(total=stages, desc="compile", unit="stage", disable=not progress, leave=False)
    started: list[str] = []

    def step(name: str) -> None:
        stage, _, signal_name = os.environ.get(SIGNAL_AT_ENV, "").partition(":")
        if stage == name:
            os.kill(os.getpid(), getattr(signal, signal_name or "SIGKILL"))
        if started:
            bar.update(1)  # the previous stage is done
        started.append(name)
        bar.set_description(name)

    def populate(tmp: Path) -> dict:  # all of it under the output's lock: a second compile fails before it traces
        importance = None
        if measured:
            step(IMPORTANCE_STAGE)
            importance = input_importance(ckpt, importance_tokens, fresh)
        program = build_program(ckpt, dtype, block_size, step, schemes=schemes, kv_dtype=kv_dtype, cuda=tgt.is_cuda)
        step("pack weights")
        weights = tmp / "weights.safetensors"
        layout = "cuda" if tgt.is_cuda else "cpu"
        offsets = write_packed_weights(ckpt, program.weights, weights, layout=layout, importance=importance)
        step("render")
        rendered = render_module(program, tgt, offsets, weights.stat().st_size, tuning)
        (tmp / tgt.source_file).write_text(rendered.source)
        if rendered.tvm_source is not None:
            (tmp / "tvm_kernels.cc").write_text(rendered.tvm_source)
        if tgt.is_cuda:  # `--simulate` rebuilds model.cu later: against these headers, not a newer llmc's
            for name, text in target_headers(tgt.template_dir).items():  # sim/: the simulator's, in a subfolder
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_text(text)
        step("build")
        shutil.copyfile(build_module(tgt, rendered.source, rendered.tvm_source), tmp / "model.so")
        shutil.copyfile(ckpt.tokenizer_path, tmp / "tokenizer.json")
        tok_config = ckpt.path / "tokenizer_config.json"
        if tok_config.is_file():
            shutil.copyfile(tok_config, tmp / "tokenizer_config.json")
        activations = CUDA_QGEMM_ACTIVATIONS[program.act_dtype] if tgt.is_cuda else CPU_QGEMM_ACTIVATIONS
        quant_entry = quant_manifest(quant, program.weights, activations)
        if quant_entry and measured:
            quant_entry["importance_tokens"] = len(importance_tokens)
        fields = {
            **({"quant": quant_entry} if quant_entry else {}),
            "target": {**tgt.raw, "name": tgt.name},
            "model_config": ckpt.config,
            "weight_dtype": dtype,
            "quantization": quant.mode if quant.enabled else ("checkpoint" if schemes else "none"),
            "block_size": block_size,
            "kv_cache_dtype": kv_dtype,
            "activation_dtype": program.act_dtype,
            "kernels": rendered.kernels,
            **({"tuning": rendered.tuning} if rendered.tuning else {}),
            "passes": program.rewrites,
            "buffer_plan": {
                "buffers": [{"cols": b.cols, "rows": b.rows} for b in program.buffers],
                "values_per_token_row": sum(b.cols for b in program.buffers if b.rows == "T"),
                "values_per_logits_row": sum(b.cols for b in program.buffers if b.rows == "N"),
            },
            "kernel_program": program.to_json(),
            "tokenizer": {"chat_template": ckpt.chat_template, **ckpt.special_tokens},
            "generation_defaults": ckpt.generation_defaults,
        }
        if gate is not None:
            stage, check = gate
            step(stage)
            fields |= check(tmp, fields)
        bar.update(1)
        return fields

    try:
        return write_artifact(output, populate)
    finally:
        bar.close()
