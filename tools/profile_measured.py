"""`llmc profile ARTIFACT` on the device itself (the module's llmc_profile_* exports), per kernel against its floor:
tools/profile.py's docstring says how each figure is taken; this is its measured half.

A decode step's cached context is written first, by prefill steps of random ids over each sequence's blocks, as
serving would have: a cache never written is zero pages, which the attention reads from cache, not memory.
"""

from __future__ import annotations

import ctypes
import math
import statistics
import time
from pathlib import Path

import numpy as np

from llmc.artifact import load_artifact
from llmc.compiler.codegen.host_probes import cpu_ceilings
from llmc.errors import LlmcError
from llmc.host import host_llc_bytes
from llmc.runtime.batch import StepBatch
from llmc.runtime.module import CompiledModel

from .profile import (
    TIMING,
    Ceilings,
    StepShape,
    ceilings,
    check_shape,
    flops_us,
    load_for_step,
    manifest_kernel_id,
    program_floors_of,
    report_header,
    step_batch,
    step_seqs,
    timed_launches,
)

FILL_CHUNK = 512  # prompt tokens a step when the cached context is written before a decode profile


def fill_context(model: CompiledModel, step: StepBatch, context: int, vocab: int, seed: int) -> None:
    """Write each decode sequence's `context` cached tokens, as serving would have: prefill steps of random ids
    over its blocks. A cache never written is zero pages, which the attention reads from cache, not memory."""
    rng = np.random.default_rng(seed + 1)
    bs = model.block_size
    for b in range(step.num_seqs):
        table = [int(t) for t in step.block_tables[b, : math.ceil(context / bs)]]
        for start in range(0, context, model.max_num_tokens):
            ids = rng.integers(0, vocab, min(model.max_num_tokens, context - start)).tolist()
            model.step(StepBatch.build([ids], [start], [table], bs))


def profile_measured(
    artifact_path: str | Path,
    *,
    phase: str,
    batch: int = 1,
    context: int = 0,
    prompt_len: int = 1,
    seed: int = 0,
    repeats: int = 10,
    library: str | Path | None = None,
    ceil: Ceilings | None = None,
    progress=None,
) -> dict:
    """Time one step of the stated shape, per kernel (CUDA events on a GPU, the host's clock on the CPU): the
    median of `repeats` steps after two warm-up steps. The `llmc profile --json` object, with the byte
    counters null.

    library: a module to load instead of the artifact's, e.g. a CUDA artifact's simulated build, whose events
    hold the host clock (so the mechanics run in CI). ceil: the ceilings of the floors; default the target's
    for a GPU, this host's measured for the CPU. progress(stage) is called as each stage starts ("ceilings",
    "load", "run")."""
    if repeats < 1:
        raise LlmcError("--repeats must be >= 1")
    artifact = load_artifact(artifact_path, verify=False)
    check_shape(artifact, phase, batch, context, prompt_len)
    if progress:
        progress("ceilings")
    if ceil is None:
        ceil = ceilings(artifact.target) if artifact.is_cuda else Ceilings(**cpu_ceilings())
    step, blocks = step_batch(phase, batch, context, prompt_len, artifact.block_size, artifact.config.vocab_size, seed)
    shape = StepShape(tuple(step_seqs(phase, batch, context, prompt_len)), step.num_seqs)
    templates = {k["id"]: k.get("template", "") for k in artifact.manifest.get("kernels") or []}
    ids = list(templates)
    if progress:
        progress("load")
    fill = context if phase == "decode" else 0
    with load_for_step(artifact, library, step, blocks, fill, FILL_CHUNK) as model:
        if fill:
            fill_context(model, step, fill, artifact.config.vocab_size, seed)
        lib = ctypes.CDLL(str(Path(library or artifact.library_path).resolve()))  # the loaded object, again
        if not all(hasattr(lib, fn) for fn in TIMING):
            raise LlmcError(
                f"{artifact.path}: its module does not time kernels (compiled by an older llmc)",
                "recompile the artifact",
            )
        for fn in TIMING:
            getattr(lib, fn).restype = ctypes.c_int
        if progress:
            progress("run")
        for _ in range(2):  # warm-up: first-touch costs, the decode step's graph capture, the pool's threads
            model.step(step)
        wall = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.step(step)
            wall.append(1e6 * (time.perf_counter() - start))
        per_kernel: dict[str, list[float]] = {}
        launches: dict[str, int] = {}
        for _ in range(repeats):
            step_times: dict[str, float] = {}
            counts: dict[str, int] = {}
            launched = timed_launches(lib, model, step)  # the same launches each repeat, the step being one
            for name, us, _ in launched:
                kid = manifest_kernel_id(name, ids)
                step_times[kid] = step_times.get(kid, 0.0) + us
                counts[kid] = counts.get(kid, 0) + 1
            for kid, us in step_times.items():
                per_kernel.setdefault(kid, []).append(us)
            launches = counts
    floors, experts = program_floors_of(artifact, shape, launched)
    kernels, step_flop_us = [], 0.0
    for kid, times in per_kernel.items():
        f = floors[kid]
        flop_us = flops_us(ceil, artifact, f.flops, templates[kid])
        floor_us = max(ceil.byte_us(f.bytes), flop_us)
        time_us = statistics.median(times)
        kernels.append(
            {
                "name": kid,
                "launches": launches[kid],
                "requested_bytes": None,
                "dram_bytes": None,
                "floor_bytes": f.bytes,
                "sector_efficiency": None,
                "bank_conflicts_per_request": None,
                "tensor_core_instructions": None,
                "flops": f.flops,
                "floor_us": floor_us,
                "time_us": time_us,
            }
        )
        step_flop_us += flop_us
    floor_bytes = sum(k["floor_bytes"] for k in kernels)
    flops = sum(k["flops"] for k in kernels)
    floor_us = max(ceil.byte_us(floor_bytes), step_flop_us)
    time_us = sum(k["time_us"] for k in kernels)
    return {
        **report_header(artifact, ceil, "gpu" if artifact.is_cuda else "cpu", phase, batch, context, prompt_len),
        **({} if artifact.is_cuda else {"host_llc_bytes": host_llc_bytes()}),
        "repeats": repeats,
        "step": {
            "floor_bytes": floor_bytes,
            "dram_bytes": None,
            "flops": flops,
            "launches": sum(k["launches"] for k in kernels),
            "floor_us": floor_us,
            "time_us": time_us,
            "wall_us": statistics.median(wall),
            "floor_fraction": floor_us / time_us if time_us else 0.0,
            **({"experts": experts} if experts else {}),
        },
        "kernels": kernels,
    }
