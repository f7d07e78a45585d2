"""The kernel program's JSON (the manifest's kernel_program) holds all its printed form shows: printed from the
JSON, after a trip through JSON text, it is the program as the dataclasses print it, and the decode weight bytes
read from the JSON are those the printed lines give."""

import json
import math
import re

import pytest

from llmc.compiler.compile import build_program, quant_schemes
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.passes import pipeline
from llmc.compiler.program import KernelProgram
from llmc.compiler.quant import QuantConfig
from llmc.dtypes import DTYPES
from llmc.kernel_program import SCHEMA, decode_weight_bytes, format_program, schema_problem


def _printed(program: KernelProgram) -> str:
    """The program printed from its dataclasses, without the JSON: the form `llmc inspect` has always shown."""
    lines = [
        f"kernel program: {len(program.launches)} launches, {len(program.buffers)} buffers, "
        f"{len(program.weights)} packed weights, {program.kv_dtype} KV cache, {program.act_dtype} activations"
    ]
    lines += [f"  buf{i}: {program.act_dtype}[{b.rows}, {b.cols}]" for i, b in enumerate(program.buffers)]
    for i, w in enumerate(program.weights):
        quant = f" ({w.quant.describe()})" if w.quant is not None else ""
        rows = f" (rows interleaved {w.interleave} at a time)" if w.interleave else ""
        lines.append(f"  W[{i}] {w.name}: {w.dtype}{list(w.stored_shape)}{quant}{rows} <- {', '.join(w.sources)}")
    for launch in program.launches:
        params = ", ".join(f"{k}={v}" for k, v in launch.params.items() if k != "inv_freq")
        lines.append(f"  {launch.op}({params})({', '.join(launch.args)})  # {' + '.join(launch.fused)}")
    for name, func in program.tvm_funcs.items():
        lines.append(f"  TVM fallback {name}:")
        lines += ["    " + line for line in func.script(show_meta=False).splitlines()]
    return "\n".join(lines)


def _bytes_from_text(text: str) -> dict[str, int]:
    """Decode weight bytes by op, parsed off the printed program's weight and launch lines."""
    weights = {}
    for m in re.finditer(r"^\s*W\[(\d+)\] \S+: (\w+)\[([\d, ]*)\]", text, re.M):
        weights[int(m[1])] = (DTYPES[m[2]].nbytes, [int(d) for d in m[3].split(",") if d.strip()])
    by_op: dict[str, int] = {}
    for m in re.finditer(r"^\s*(\w+)\((.*?)\)\((.*)\)\s*#", text, re.M):
        for i in re.findall(r"\bW\[(\d+)\]", m[3]):
            size, shape = weights[int(i)]
            by_op[m[1]] = by_op.get(m[1], 0) + size * (shape[-1] if m[1] == "embedding" else math.prod(shape))
    return by_op


@pytest.mark.parametrize(
    "variant, weight_dtype, quant, cuda, swiglu",
    [
        ("llama", "float32", "none", False, True),
        ("qwen2", "bfloat16", "int4", False, True),  # quantized parts, qkv bias
        ("llama", "bfloat16", "none", True, True),  # CUDA: bf16 activations and KV cache, interleaved gate_up
        ("llama", "float32", "none", False, False),  # silu * up unfused: TVM fallbacks
    ],
    ids=["cpu-fp32", "cpu-bf16-int4", "cuda-bf16", "tvm-fallback"],
)
def test_the_json_prints_and_reads_as_the_program(
    checkpoint_dir, monkeypatch, variant, weight_dtype, quant, cuda, swiglu
):
    if not swiglu:
        monkeypatch.setattr(pipeline, "PASSES", [p for p in pipeline.PASSES if p.__name__ != "fuse_swiglu"])
    ckpt = load_checkpoint(checkpoint_dir(variant))
    schemes = quant_schemes(ckpt, QuantConfig(quant)) if quant != "none" else None
    kv_dtype = weight_dtype if cuda else "float32"
    program = build_program(ckpt, weight_dtype, 16, schemes=schemes, kv_dtype=kv_dtype, cuda=cuda)
    stored = json.loads(json.dumps(program.to_json()))  # as the manifest holds it
    assert stored["schema"] == SCHEMA and schema_problem(stored) is None
    text = _printed(program)
    assert format_program(stored) == str(program) == text
    assert decode_weight_bytes(stored) == _bytes_from_text(text)
    assert ("gemm_swiglu" in decode_weight_bytes(stored)) == (cuda and swiglu)
    assert bool(stored["tvm_funcs"]) == (not swiglu)
