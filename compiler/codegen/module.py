"""Render a kernel program into one source file for a target: its kernels plus the C ABI host code.

Each distinct (op, params) renders once, named by its kernel id (the same id keys the manifest). A
template's tunables come from the target's tuning database where an entry matches the kernel (and, on the
CPU, this host's ISA), else from the template's defaults; the manifest's `tuning` says which, per kernel.
Launch arguments of the program are mapped onto the host template's names: packed weights become typed
pointers into the mmapped weights file, buffers and caches members of the model.
"""

from __future__ import annotations

import dataclasses
import re

from llmc import __version__
from llmc.dtypes import DTYPES
from llmc.errors import CompileError
from llmc.host import host_cpu_isa
from llmc.manifest import ABI_VERSION
from llmc.targets import Target

from ..program import KernelProgram
from ..tuning.database import TuningDB, entry_key
from ..tuning.space import tune_space
from .render import kernel_id, render_host, render_kernel, scale_ctype
from .tvm_fallback import c_source

HOST_TEMPLATE = {"cpu": "model.cc.j2", "cuda": "model.cu.j2"}
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
    kernels: list[dict]  # manifest entries: id, template, params, tuning_source, launches, rows, fuses
    tvm_source: str | None = None  # C that TVM generated for the program's tvm_funcs (CPU target only)
    tuning: dict | None = None  # the manifest's `tuning`: what the tuning database gave each tunable kernel


def _tuned_params(family: str, op: str, params: dict, tuning: TuningDB | None, isa, record: dict) -> dict:
    """The tunables of one kernel from the database (empty: the template's defaults), noted in `record`."""
    space = tune_space(family, op)
    if space is None:
        return {}
    key = entry_key(f"{family}/{op}", params, space.names)
    entry = tuning.lookup(key, isa) if tuning is not None else None
    if entry is None:
        record.update(source="default", params=space.defaults())
        if tuning is not None and (other := tuning.ignored(key, isa)):
            record["ignored"] = [f"tuned on {e['machine'].get('cpu', '?')} with other ISA flags" for e in other]
        return {}
    # A tunable newer than the entry takes its default: the entry was tuned when that was the template's code.
    tuned = {**space.defaults(), **entry["params"]}
    space.check(tuned)
    record.update(
        source=entry["source"],
        params=tuned,
        machine=entry.get("machine"),
        date=entry.get("date"),
        figures=entry.get("figures"),
    )
    return {k: v for k, v in tuned.items() if v != space.defaults()[k]}


def _c_expr(arg: str, program: KernelProgram, device: bool) -> str:
    def weight(m):
        spec = program.weights[int(m.group(1))]
        # K-quant records are bytes in the file and one struct each to the kernels
        kquant = spec.quant is not None and spec.quant.scale_dtype == "kquant" and spec.part == "scales"
        ctype = (
            scale_ctype(8, spec.quant.asymmetric, spec.quant.codebook, spec.quant.group_size)
            if kquant
            else DTYPES[spec.dtype].ctype
        )
        return f"static_cast<const {ctype}*>(m->w[{m.group(1)}])"

    arg = re.sub(r"\bW\[(\d+)\]", weight, arg)
    arg = re.sub(r"\bbuf(\d+)\b", r"m->buf[\1]", arg)
    if device:
        arg = re.sub(r"\b(" + "|".join(_STEP_ARRAYS) + r")\b", r"m->d_\1", arg)
    return re.sub(r"\b([kv]_cache)\[", r"m->\1[", arg)


def render_module(
    program: KernelProgram,
    target: Target,
    offsets: dict[str, tuple[int, int]],
    weights_file_bytes: int,
    tuning: TuningDB | None = None,
) -> RenderedModule:
    """tuning: the database whose entries set the tunables of matching kernels (None: every default)."""
    family = target.template_dir
    isa = None if target.is_cuda else host_cpu_isa()
    tuned_kernels: dict[str, dict] = {}
    if program.tvm_funcs and target.is_cuda:
        ops = sorted({op for launch in program.launches if launch.op == "tvm_call" for op in launch.fused})
        raise CompileError(
            f"no CUDA kernel template covers {', '.join(ops)}", "the TVM codegen fallback exists for --target cpu only"
        )
    sources: dict[str, str] = {}
    entries: dict[str, dict] = {}
    launches = []
    for launch in program.launches:
        record: dict = {}
        params = {**launch.params, **_tuned_params(family, launch.op, launch.params, tuning, isa, record)}
        kid = kernel_id(family, launch.op, params)
        if kid not in sources:
            sources[kid] = render_kernel(family, launch.op, name=kid, **params)
            if record:
                tuned_kernels[kid] = {"template": f"{family}/{launch.op}", **record}
            entries[kid] = {
                "id": kid,
                "template": f"{family}/{launch.op}",
                "params": {k: v for k, v in params.items() if k != "inv_freq"},
                "tuning_source": record.get("source", "default"),
                "launches": 0,
                "rows": [],
                "fuses": launch.fused,
            }
        entries[kid]["launches"] += 1
        # a launch runs over the step's tokens (T) or its logits rows (N): what `llmc profile` sizes its floor by
        entries[kid]["rows"].append("N" if "N" in launch.args else "T")
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
    summary = None
    if tuned_kernels:
        summary = {"database": str(tuning.path) if tuning is not None else None, "kernels": tuned_kernels}
    return RenderedModule(source, list(entries.values()), tvm_source, summary)
