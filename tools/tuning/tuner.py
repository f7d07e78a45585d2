"""`llmc tune`: for each kernel shape, every admissible configuration of its template's tunables is built,
checked against a numpy reference, timed (on the CPU: tools/tuning/measure_cpu.py; on a GPU, with CUDA events:
measure_cuda.py) or, for a GPU target with no GPU, predicted under the CUDA simulator (simulate_cuda.py), and the
fastest written to the target's tuning database.

Shapes come from a model's kernel program (the kernels compile would render for it) or from a standard set of
Llama-family GEMM shapes. A template whose tunables fall into groups (separate kernels) gets each group's
winner, the others at their defaults, combined; its time is the defaults' plus each group's gain.

Resumable: a shape whose entry for this machine (and source) is already in the database is skipped (--retune
runs it again); the database is saved after each shape. The budget stops the run between candidates; a shape
cut short is left untuned.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import statistics
import time
from collections.abc import Iterable

from tqdm import tqdm

from llmc.compiler.codegen.render import template_params
from llmc.compiler.tuning.database import SOURCES, TuningDB, cpu_machine, entry_key
from llmc.compiler.tuning.space import TuneSpace, tune_space
from llmc.dtypes import ELEMENTS_BY_SHORT
from llmc.errors import CompileError
from llmc.runtime.kv_cache import mem_available_bytes
from llmc.targets import load_target

from . import measure_cuda
from .measure_cpu import measure_shape
from .reference import Candidate, KernelShape, input_bytes
from .simulate_cuda import simulate_shape

log = logging.getLogger("llmc.tune")

# Standard Llama-family GEMMs (n, k) when no model is given: SmolLM-135M's fused qkv, o, fused gate_up, down;
# Llama-3.2-1B's; Llama-3-8B's, per weight dtype.
STANDARD_GEMMS = [
    (960, 576),
    (576, 576),
    (3072, 576),
    (576, 1536),
    (3072, 2048),
    (2048, 2048),
    (16384, 2048),
    (2048, 8192),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
]


def _with_activations(family: str, op: str, params: dict) -> dict:
    """params with the activation element that a build of their weights gives, where `family`'s template takes
    one (CUDA's adtype) and params have none: bf16 for bf16 weights, else f32."""
    if "adtype" in params or "adtype" not in template_params(family, op):
        return params
    return {**params, "adtype": "bf16" if params.get("wdtype") == "bf16" else "f32"}


def standard_shapes(family: str) -> list[KernelShape]:
    shapes = [
        KernelShape.of("gemm", dict(n=n, k=k, wdtype=wd, has_bias=False))
        for wd in ELEMENTS_BY_SHORT
        for n, k in STANDARD_GEMMS
    ]
    shapes += [
        KernelShape.of(
            "qgemm", dict(n=n, k=k, bits=bits, group_size=32, asymmetric=False, scale_bits=16, has_bias=False)
        )
        for bits in (8, 4)
        for n, k in STANDARD_GEMMS
    ]
    return [
        KernelShape.of(s.op, _with_activations(family, s.op, s.kwargs))
        for s in shapes
        if tune_space(family, s.op) is not None
    ]


def parse_shape(text: str, target: str = "cpu") -> KernelShape:
    """`gemm:n=576,k=576,wdtype=bf16,has_bias=0` or `gemm_swiglu:inter=1536,k=576,wdtype=bf16` (the `--shape`
    option) as a KernelShape of `target`'s template (an adtype left out: _with_activations)."""
    op, _, rest = text.partition(":")
    params: dict = {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise CompileError(f"--shape {text!r}: {item!r} is not key=value", "e.g. gemm:n=576,k=576,wdtype=bf16")
        params[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    flags = {"qgemm": ("has_bias", "asymmetric"), "gemm": ("has_bias",)}.get(op.strip(), ())
    for key in flags:
        params[key] = bool(params.get(key, 0))
    if op.strip() == "qgemm":
        params.setdefault("scale_bits", 16)
    return KernelShape.of(op.strip(), _with_activations(load_target(target).template_dir, op.strip(), params))


def model_shapes(checkpoint, target: str, weight_dtype: str = "auto", quant=None) -> list[KernelShape]:
    """The tunable kernels compile would render for this checkpoint, target, dtype and quantization."""
    from llmc.compiler.compile import build_program, quant_schemes, resolve_weight_dtype
    from llmc.compiler.frontend.load import load_checkpoint
    from llmc.compiler.quant import QuantConfig

    tgt = load_target(target)
    ckpt = load_checkpoint(checkpoint)
    program = build_program(
        ckpt,
        resolve_weight_dtype(ckpt, weight_dtype),
        tgt.block_size,
        schemes=quant_schemes(ckpt, quant or QuantConfig(), cuda=tgt.is_cuda),
        cuda=tgt.is_cuda,
    )
    out: dict[KernelShape, None] = {}
    for launch in program.launches:
        if tune_space(tgt.template_dir, launch.op) is not None:
            # a qgemm writing columns of a wider output (ldy) is timed, and keyed, as its own [T, n] output
            params = {k: v for k, v in launch.params.items() if k != "ldy"}
            out[KernelShape.of(launch.op, params)] = None
    return list(out)


def _median(c: Candidate) -> float:
    return statistics.median(c.times)


def pick(space: TuneSpace, candidates: list[Candidate]) -> tuple[dict, float]:
    """The winning configuration and its time: per group, the fastest candidate moving only that group (or
    the defaults; of equal times, the one nearest the defaults), combined; time = the defaults' less each
    group's gain."""
    default = candidates[0]
    config, t = dict(default.config), _median(default)
    for group in space.groups:
        inside = [c for c in candidates if c.times and space.group_of(c.config) in (group, None)]
        best = min(inside, key=lambda c: (_median(c), sum(c.config[k] != v for k, v in default.config.items())))
        config.update({p.name: best.config[p.name] for p in space.groups[group]})
        t -= _median(default) - _median(best)
    return config, t


@dataclasses.dataclass
class ShapeResult:
    shape: KernelShape
    config: dict  # the winner
    time_s: float | None  # its time (None: skipped, already in the database)
    default_time_s: float | None
    candidates: list[Candidate]
    source: str = "measured"

    @property
    def skipped(self) -> bool:
        return self.time_s is None


def _check_memory(shapes: list[KernelShape], family: str, space: TuneSpace | None) -> None:
    """A CompileError, before anything is allocated, for a shape whose inputs would not fit in the memory this
    machine has available."""
    try:
        available = mem_available_bytes()
    except (OSError, ValueError):  # no /proc/meminfo: the parameters are still checked
        available = None
    for shape in shapes:
        shape_space = space or tune_space(family, shape.op)
        if shape_space is None:
            continue
        need = input_bytes(shape, shape_space.rows)
        if available is not None and need > available:
            raise CompileError(
                f"{shape}: checking it takes about {need} bytes ({need / 2**30:.1f} GiB) of memory, "
                f"more than the {available} bytes ({available / 2**30:.1f} GiB) available here",
                "tune a smaller shape",
            )


def tune(
    target: str,
    shapes: Iterable[KernelShape],
    db: TuningDB,
    *,
    simulate: bool = False,
    budget_s: float = 600.0,
    rounds: int = 5,
    retune: bool = False,
    progress: bool = True,
    render=None,
    space: TuneSpace | None = None,
) -> list[ShapeResult]:
    """Tunes `shapes` for `target` into `db` (saved after each shape); returns what it found.
    simulate: rank a GPU target's candidates under the CUDA simulator (the only way without a GPU).
    render, space: how a candidate is rendered and the space searched, for tests (default: the templates')."""
    if not budget_s >= 0:  # NaN compares false with every deadline: it would never run out
        raise CompileError(f"--budget {budget_s}: not a number of seconds", "pass a number >= 0")
    tgt = load_target(target)
    if simulate and not tgt.is_cuda:
        raise CompileError("--simulate ranks CUDA kernels under the CUDA simulator", "tune --target cpu without it")
    gpu = measure_cuda.gpu_device() if tgt.is_cuda and not simulate else None
    if tgt.is_cuda and not simulate and gpu is None:
        raise CompileError(
            f"target {target}: timing CUDA kernels needs a GPU, and the CUDA driver sees none here",
            "add --simulate to rank them under the CUDA simulator",
        )
    source = "simulated" if simulate else "measured"
    threads = int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    if simulate:
        machine = {"gpu": f"{tgt.raw.get('ceilings', {}).get('part', target)} (simulated)"}
    else:
        machine = {"gpu": gpu["name"]} if tgt.is_cuda else cpu_machine(threads)
    isa = machine.get("isa")
    shapes = list(shapes)
    _check_memory(shapes, tgt.template_dir, space)
    deadline = time.monotonic() + budget_s
    results = []
    bar = tqdm(shapes, desc="tune", unit="shape", disable=not progress)
    for shape in bar:
        shape_space = space or tune_space(tgt.template_dir, shape.op)
        if shape_space is None:
            continue
        key = entry_key(f"{tgt.template_dir}/{shape.op}", shape.kwargs, shape_space.names)
        have = db.lookup(key, isa)
        if have is not None and SOURCES.index(have["source"]) >= SOURCES.index(source) and not retune:
            results.append(ShapeResult(shape, have["params"], None, None, [], have["source"]))
            continue
        if time.monotonic() > deadline:
            break
        bar.set_postfix_str(str(shape))

        def note(text: str, shape=shape) -> None:
            bar.set_postfix_str(f"{shape}: {text}")

        kw = {"render": render} if render else {}
        if simulate:
            candidates = simulate_shape(shape, shape_space, tgt, deadline, progress=note, **kw)
        elif tgt.is_cuda:
            candidates = measure_cuda.measure_shape(
                shape, shape_space, tgt, deadline, rounds, progress=note, span_bytes=2 * gpu["l2_bytes"], **kw
            )
        else:
            candidates = measure_shape(shape, shape_space, deadline, rounds, progress=note, **kw)
        if not candidates or candidates[0].rejected:
            why = candidates[0].rejected if candidates else "no candidate"
            raise CompileError(
                f"{shape}: the template's defaults are not admissible ({why})",
                "fix the kernel or its tune.toml before tuning",
            )
        if time.monotonic() > deadline:
            log.warning("budget of %.0f s spent while tuning %s: left untuned", budget_s, shape)
            break
        config, t = pick(shape_space, candidates)
        t_default = _median(candidates[0])
        figures = {
            "time_us": round(t * 1e6, 3),
            "default_time_us": round(t_default * 1e6, 3),
            "speedup": round(t_default / t, 3),
            "rows": list(shape_space.rows),
            "rounds": len(candidates[0].times),
            "candidates": len(candidates),
            "rejected": sum(c.rejected is not None for c in candidates),
        }
        db.put(key, config, figures, source, machine)
        db.save()
        results.append(ShapeResult(shape, config, t, t_default, candidates, source))
    bar.close()
    left = len(shapes) - len(results)
    if left:
        log.warning("budget of %.0f s spent: %d shapes left untuned (run again to resume)", budget_s, left)
    return results
