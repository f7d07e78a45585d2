"""The kernel program: plain data, printable, target-independent, and the compiler's side of its JSON.

A kernel program is an ordered list of launches over a static buffer plan. Each launch names a kernel
template and its compile-time parameters, and lists its call arguments as C expressions over:
  - the step arguments of the C ABI (token_ids, positions, slot_mapping, query_start_loc, seq_lens,
    block_tables, max_blocks, B, T, logits_indices, N, logits),
  - packed weights `W[i]` (WeightSpec i of the program),
  - activation buffers `buf<i>` (rows x cols of the program's act_dtype; rows is max_num_tokens, or
    max_num_logits for buffers that hold one row per logits row asked for), and column views of them
    (`buf3 + 64`),
  - the per-layer KV cache halves `k_cache[l]` / `v_cache[l]`.
So a target's codegen only has to render each template once per distinct parameter set and emit the
launches in order. Buffers are reused by liveness, so the plan is a handful of buffers however deep
the model is.

`KernelProgram.to_json` is the manifest's `kernel_program` (its schema: llmc/kernel_program.py), and the
program's str() is that JSON as llmc.kernel_program prints it, so the printed and the stored program agree.
"""

from __future__ import annotations

import dataclasses
import json

import tvm

from llmc.kernel_program import SCHEMA, format_program

from .weights import WeightSpec


@dataclasses.dataclass
class Launch:
    op: str  # template name (templates/<target>/<op>.*.j2)
    params: dict  # compile-time template parameters, without `name`
    args: list[str]  # C expressions, in the template's signature order
    fused: list[str]  # the graph ops this launch computes, for `llmc inspect`


@dataclasses.dataclass
class Buffer:
    cols: int
    rows: str  # "T" (one row per token) or "N" (one per logits row: logits_indices)


@dataclasses.dataclass(frozen=True)
class ModelGeometry:
    """What the host code sizes its KV caches and logits by, read off the fused main's signature."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int


@dataclasses.dataclass
class KernelProgram:
    geometry: ModelGeometry
    weights: list[WeightSpec]
    buffers: list[Buffer]
    launches: list[Launch]
    rewrites: dict[str, int]
    block_size: int
    tvm_funcs: dict[str, tvm.tirx.PrimFunc] = dataclasses.field(default_factory=dict)  # TVM-lowered fallbacks
    kv_dtype: str = "float32"  # the KV cache element: one of llmc.dtypes.ELEMENT_DTYPES
    act_dtype: str = "float32"  # the element of the buffers and the logits: one of ELEMENT_DTYPES

    def to_json(self) -> dict:
        """The program as the manifest's `kernel_program` (llmc/kernel_program.py, schema SCHEMA): plain JSON
        values, as a reader of the manifest parses them."""
        program = {
            "schema": SCHEMA,
            "kv_dtype": self.kv_dtype,
            "act_dtype": self.act_dtype,
            "buffers": [{"rows": b.rows, "cols": b.cols} for b in self.buffers],
            "weights": [
                {
                    "name": w.name,
                    "dtype": w.dtype,
                    "shape": list(w.stored_shape),
                    "quant": w.quant.describe() if w.quant is not None else None,
                    "interleave": w.interleave,
                    "sources": list(w.sources),
                    **({} if w.affine == (1.0, 0.0) else {"affine": list(w.affine)}),
                }
                for w in self.weights
            ],
            "launches": [{"op": x.op, "params": x.params, "args": x.args, "fused": x.fused} for x in self.launches],
            "tvm_funcs": {name: func.script(show_meta=False) for name, func in self.tvm_funcs.items()},
        }
        return json.loads(json.dumps(program))  # tuples become lists, as in the manifest

    def __str__(self) -> str:
        return format_program(self.to_json())
