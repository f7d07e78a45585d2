"""Tuning candidates for a GPU target with no GPU at hand (`llmc tune --target sm90 --simulate`).

Each admissible candidate is built by nvcc for the target and pruned by what `ptxas -v` reports (the
template's ptxas_constraints: spills, registers per block), then built for the CUDA simulator with the
counters of `llmc profile --simulate`, run at each of the template's `rows` on fresh random inputs in
cudaMalloc'ed memory, checked against the numpy reference, and ranked by the time tools/profile.py
predicts from its counters (DRAM sectors, tensor-core FLOPs, blocks against the target's SMs, launches).
Entries it writes are marked "simulated"; a measured entry replaces them.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import tempfile
import time
from pathlib import Path

from llmc.compiler.codegen.render import kernel_id, render_kernel
from llmc.compiler.codegen.simulator import build_profiled, nvcc_compile
from llmc.compiler.tuning.space import TuneSpace
from llmc.dtypes import ELEMENTS_BY_SHORT
from llmc.errors import CompileError
from llmc.targets import Target

from ..profile import _kernel_row, ceilings, read_counters
from .reference import Candidate, KernelShape, make_inputs

log = logging.getLogger("llmc.tune")

_TRAMPOLINE = r"""
namespace {{
void* to_device(const void* host, size_t n) {{
  void* d = nullptr;
  if (host == nullptr || n == 0) return nullptr;
  cudaMalloc(&d, n);
  cudaMemcpy(d, host, n, cudaMemcpyHostToDevice);
  return d;
}}
}}  // namespace
// One launch on copies of the inputs in device memory (the counters see only cudaMalloc'ed addresses).
extern "C" int run_{kid}(const void* x, size_t x_bytes, const void* w, size_t w_bytes, const void* bias,
                         size_t bias_bytes, void* y, size_t y_bytes, int T) {{
  void *dx = to_device(x, x_bytes), *dw = to_device(w, w_bytes), *db = to_device(bias, bias_bytes), *dy = nullptr;
  cudaMalloc(&dy, y_bytes);
  {kid}(static_cast<const {at}*>(dx), static_cast<const {wt}*>(dw), static_cast<const {wt}*>(db),
        static_cast<{at}*>(dy), T, (cudaStream_t)0);
  int err = (int)cudaGetLastError();
  if (err == 0) err = (int)cudaDeviceSynchronize();
  cudaMemcpy(y, dy, y_bytes, cudaMemcpyDeviceToHost);
  for (void* p : {{dx, dw, db, dy}}) if (p) cudaFree(p);
  return err;
}}
"""


def render_kernel_source(shape: KernelShape, config: dict) -> tuple[str, str, dict[str, str]]:
    """(kernel id, CUDA source, the C types of its weights `wt` and activations `at`) of one configuration, before
    its trampoline."""
    if shape.op not in ("gemm", "gemm_swiglu"):
        raise CompileError(f"llmc tune has no CUDA runner for op {shape.op!r}")
    params = {**shape.kwargs, **config}
    kid = kernel_id("cuda", shape.op, params)
    types = {
        "wt": ELEMENTS_BY_SHORT[params["wdtype"]].ctype,
        "at": ELEMENTS_BY_SHORT[params.get("adtype", "f32")].ctype,
    }
    return kid, '#include "llmc_kernels.cuh"\n' + render_kernel("cuda", shape.op, name=kid, **params), types


def render_candidate(shape: KernelShape, config: dict) -> tuple[str, str]:
    """(kernel id, CUDA source) of one configuration with its run_ trampoline."""
    kid, source, types = render_kernel_source(shape, config)
    return kid, source + _TRAMPOLINE.format(kid=kid, **types)


def ptxas_figures(target: Target, source: str) -> dict[str, int]:
    """registers: the most of any kernel; gemv_registers / tiled_registers: the GEMV's and the tiled kernel's own
    (a block rule of one kernel must not read the other's); spill_bytes: all kernels' spill stores and loads."""
    with tempfile.TemporaryDirectory(prefix="llmc-tune-") as tmp:
        report = nvcc_compile(source, f"sm_{target.compute_capability}", Path(tmp) / "k.cubin")
    figures = {
        "registers": max((r.registers for r in report.values()), default=0),
        "spill_bytes": sum(r.spill_stores + r.spill_loads for r in report.values()),
    }
    for kernel in ("gemv", "tiled"):  # the __global__ functions `<kernel id>_gemv` / `_tiled` (mangled)
        figures[f"{kernel}_registers"] = max((r.registers for n, r in report.items() if f"_{kernel}" in n), default=0)
    return figures


def _simulate(shape: KernelShape, library: Path, kid: str, rows: tuple[int, ...], target: Target):
    """(predicted seconds summed over `rows`, why the output is wrong or None, counters summary)."""
    lib = ctypes.CDLL(str(library))
    run = getattr(lib, f"run_{kid}")
    run.restype = ctypes.c_int
    run.argtypes = [ctypes.c_void_p, ctypes.c_size_t] * 4 + [ctypes.c_int]
    for fn in ("llmc_sim_prof_num_fields", "llmc_sim_prof_num_kernels", "llmc_sim_prof_kernel"):
        getattr(lib, fn).restype = ctypes.c_int
    ceil = ceilings(target.raw)
    total_us, summary = 0.0, {"dram_bytes": 0, "blocks": 0}
    for t in rows:
        inp = make_inputs(shape, t, seed=t)
        y = inp.poisoned_output()
        (w,) = inp.weights
        lib.llmc_sim_prof_clear()
        lib.llmc_sim_prof_enable(1)
        try:
            err = run(
                inp.x.ctypes.data,
                inp.x.nbytes,
                w.ctypes.data,
                w.nbytes,
                None if inp.bias is None else inp.bias.ctypes.data,
                0 if inp.bias is None else inp.bias.nbytes,
                y.ctypes.data,
                y.nbytes,
                t,
            )
        finally:
            lib.llmc_sim_prof_enable(0)
        if err:
            return 0.0, f"the launch at T={t} failed with cudaError {err}", summary
        if (why := inp.mismatch(y)) is not None:
            return 0.0, f"T={t}: {why}", summary
        for name, v in read_counters(lib).items():
            row = _kernel_row(name, v, ceil)
            total_us += row["time_us"]
            summary["dram_bytes"] += row["dram_bytes"]
            summary["blocks"] += row["blocks"]
    return total_us * 1e-6, None, summary


def admit_by_ptxas(
    shape: KernelShape, space: TuneSpace, target: Target, config: dict, source: str, candidate: Candidate
) -> str | None:
    """Why ptxas's report (registers, spills: recorded in candidate.figures) rules the configuration out, or None."""
    candidate.figures = ptxas_figures(target, source)
    if space.admits(config, shape.kwargs, target.raw, candidate.figures):
        return None
    return f"ptxas: {candidate.figures['registers']} registers, {candidate.figures['spill_bytes']} spill bytes"


def _build(shape: KernelShape, space: TuneSpace, target: Target, config: dict, render, workdir: Path):
    """(the candidate with its ptxas figures, its simulator library or None where ptxas rules it out)."""
    kid, source = render(shape, config)
    c = Candidate(config, kid)
    c.rejected = admit_by_ptxas(shape, space, target, config, source, c)
    return c, None if c.rejected else build_profiled(source, workdir / f"{kid}.so")


def simulate_shape(
    shape: KernelShape, space: TuneSpace, target: Target, deadline: float, *, render=render_candidate, progress=None
) -> list[Candidate]:
    """Every candidate admissible before building, the defaults first; pruned by ptxas, checked, predicted.
    Builds run in parallel; the simulations one at a time (the simulator's launch state is per process)."""
    configs = space.candidates(shape.kwargs, target.raw)
    out: list[Candidate] = []
    with (
        tempfile.TemporaryDirectory(prefix="llmc-tune-") as tmp,
        concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool,
    ):
        futures = [pool.submit(_build, shape, space, target, c, render, Path(tmp)) for c in configs]
        for f in futures:
            if time.monotonic() > deadline:
                for other in futures:
                    other.cancel()
                break
            c, library = f.result()
            if library is not None:
                seconds, c.rejected, counters = _simulate(shape, library, c.kid, space.rows, target)
                c.figures.update(counters)
                if c.rejected is None:
                    c.times.append(seconds)
            if c.rejected:
                log.warning("rejected %s %s: %s", shape, c.config, c.rejected)
            out.append(c)
            if progress:
                progress(f"simulated {len(out)}/{len(configs)}")
    return out
