"""Render a kernel program into one source file for a target: its kernels plus the C ABI host code.

Each distinct (op, params) renders once, named by its kernel id (the same id keys the manifest and the
tuning database). Launch arguments of the program are mapped onto the host template's names: packed
weights become typed pointers into the mmapped weights file, buffers and caches members of the model.
"""

from __future__ import annotations

import dataclasses
import re

from llmc import __version__

from ..lower import KernelProgram
from .render import kernel_id, render_host, render_kernel

HOST_TEMPLATE = {"cpu": "model.cc.j2"}
_CTYPE = {"float32": "float", "bfloat16": "uint16_t"}


@dataclasses.dataclass
class RenderedModule:
    source: str
    kernels: list[dict]  # manifest entries: id, template, params, tuning_source, launches


def _c_expr(arg: str, program: KernelProgram) -> str:
    def weight(m):
        spec = program.weights[int(m.group(1))]
        return f"static_cast<const {_CTYPE[spec.dtype]}*>(m->w[{m.group(1)}])"

    arg = re.sub(r"\bW\[(\d+)\]", weight, arg)
    arg = re.sub(r"\bbuf(\d+)\b", r"m->buf[\1]", arg)
    return re.sub(r"\b([kv]_cache)\[", r"m->\1[", arg)


def render_module(program: KernelProgram, target: str, offsets: dict[str, tuple[int, int]],
                  weights_file_bytes: int, arch: str = "") -> RenderedModule:
    sources: dict[str, str] = {}
    entries: dict[str, dict] = {}
    launches = []
    for launch in program.launches:
        kid = kernel_id(target, launch.op, launch.params)
        if kid not in sources:
            sources[kid] = render_kernel(target, launch.op, name=kid, **launch.params)
            params = {k: v for k, v in launch.params.items() if k != "inv_freq"}
            entries[kid] = {"id": kid, "template": f"{target}/{launch.op}", "params": params,
                            "tuning_source": "default", "launches": 0, "fuses": launch.fused}
        entries[kid]["launches"] += 1
        launches.append({"name": kid, "args": [_c_expr(a, program) for a in launch.args], "fused": launch.fused})
    source = render_host(target, HOST_TEMPLATE[target], version=__version__, arch=arch, program=program,
                         config=program.config, kernels=list(sources.values()), launches=launches,
                         offsets=offsets, weights_file_bytes=weights_file_bytes)
    return RenderedModule(source, list(entries.values()))
