"""Render a kernel program into one source file for a target: its kernels plus the C ABI host code.

Each distinct (op, params) renders once, named by its kernel id (the same id keys the manifest and the
tuning database). Launch arguments of the program are mapped onto the host template's names: packed
weights become typed pointers into the mmapped weights file, buffers and caches members of the model.
"""

from __future__ import annotations

import dataclasses
import re

from llmc import __version__
from llmc.artifact import ABI_VERSION
from llmc.errors import CompileError
from llmc.targets import Target

from ..lower import KernelProgram
from .render import kernel_id, render_host, render_kernel
from .tvm_fallback import c_source

HOST_TEMPLATE = {"cpu": "model.cc.j2", "cuda": "model.cu.j2"}
_CTYPE = {"float32": "float", "bfloat16": "uint16_t", "uint8": "uint8_t"}
# Step arrays of the C ABI; the CUDA host copies them to the device first and launches on the copies.
_STEP_ARRAYS = (
    "token_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "block_tables",
    "logits_indices",
    "logits",
)


@dataclasses.dataclass
class RenderedModule:
    source: str
    kernels: list[dict]  # manifest entries: id, template, params, tuning_source, launches
    tvm_source: str | None = None  # C that TVM generated for the program's tvm_funcs (CPU target only)


def _c_expr(arg: str, program: KernelProgram, device: bool) -> str:
    def weight(m):
        spec = program.weights[int(m.group(1))]
        return f"static_cast<const {_CTYPE[spec.dtype]}*>(m->w[{m.group(1)}])"

    arg = re.sub(r"\bW\[(\d+)\]", weight, arg)
    arg = re.sub(r"\bbuf(\d+)\b", r"m->buf[\1]", arg)
    if device:
        arg = re.sub(r"\b(" + "|".join(_STEP_ARRAYS) + r")\b", r"m->d_\1", arg)
    return re.sub(r"\b([kv]_cache)\[", r"m->\1[", arg)


def render_module(
    program: KernelProgram, target: Target, offsets: dict[str, tuple[int, int]], weights_file_bytes: int
) -> RenderedModule:
    family = target.template_dir
    if program.tvm_funcs and target.is_cuda:
        ops = sorted({op for launch in program.launches if launch.op == "tvm_call" for op in launch.fused})
        raise CompileError(f"no CUDA kernel template covers {', '.join(ops)}",
                           "the TVM codegen fallback exists for --target cpu only")  # fmt: skip
    sources: dict[str, str] = {}
    entries: dict[str, dict] = {}
    launches = []
    for launch in program.launches:
        kid = kernel_id(family, launch.op, launch.params)
        if kid not in sources:
            sources[kid] = render_kernel(family, launch.op, name=kid, **launch.params)
            params = {k: v for k, v in launch.params.items() if k != "inv_freq"}
            entries[kid] = {
                "id": kid,
                "template": f"{family}/{launch.op}",
                "params": params,
                "tuning_source": "default",
                "launches": 0,
                "fuses": launch.fused,
            }
        entries[kid]["launches"] += 1
        args = [_c_expr(a, program, target.is_cuda) for a in launch.args]
        # a TVM fallback returns nonzero when its own argument checks fail: the step returns 5
        launches.append({"name": kid, "args": args, "fused": launch.fused, "checked": launch.op == "tvm_call"})
    source = render_host(
        family,
        HOST_TEMPLATE[family],
        version=__version__,
        abi_version=ABI_VERSION,
        target=target.name,
        arch=target.gencode or " ".join(target.raw.get("flags", [])),
        sm=target.compute_capability,
        program=program,
        geometry=program.geometry,
        kernels=list(sources.values()),
        launches=launches,
        offsets=offsets,
        weights_file_bytes=weights_file_bytes,
        weights_data_start=min((o for o, _ in offsets.values()), default=weights_file_bytes),
    )
    tvm_source = c_source(program.tvm_funcs) if program.tvm_funcs else None
    return RenderedModule(source, list(entries.values()), tvm_source)
