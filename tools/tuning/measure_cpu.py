"""Tuning candidates on the CPU: built with the CPU target's flags, checked, timed on this machine.

Each candidate is timed in a C++ loop at the template's `rows` (T = 1: a decode step's GEMV), its weights
cycled through copies spanning twice the last-level cache (capped at 1 GiB) so that each call streams them
from memory as a decode step does, on the machine's threads. The figure is the median over rounds that
interleave the candidates in a new order each round (machine noise hits them alike). Since a tunable
changes the speed and never the numbers, a candidate must also equal the defaults' output bit for bit.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import time

import numpy as np

from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
from llmc.compiler.codegen.render import kernel_id, render_kernel, scale_ctype, target_headers
from llmc.compiler.tuning.space import TuneSpace
from llmc.dtypes import ELEMENTS_BY_SHORT
from llmc.errors import CompileError
from llmc.host import host_llc_bytes

from .reference import Candidate, Inputs, KernelShape, make_inputs

log = logging.getLogger("llmc.tune")
_SPAN_MAX = 1 << 30

_TRAMPOLINES = r"""
#include <time.h>
extern "C" void run_{kid}(const float* x, const void* const* w, const void* bias, float* y, int T) {{
  {call};
}}
// Seconds per call over `iters` calls, cycling through `nsets` copies of the weights.
extern "C" double time_{kid}(const float* x, const void* const* ws, int nsets, const void* bias, float* y, int T,
                             int iters) {{
  timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  for (int i = 0; i < iters; ++i) {{
    const void* const* w = ws + (long)(i % nsets) * {nw};
    {call};
  }}
  clock_gettime(CLOCK_MONOTONIC, &b);
  return ((b.tv_sec - a.tv_sec) + 1e-9 * (b.tv_nsec - a.tv_nsec)) / iters;
}}
"""
_CALLS = {
    "gemm": (1, "{kid}(x, static_cast<const {wt}*>(w[0]), static_cast<const {wt}*>(bias), y, T)"),
    "qgemm": (
        3,
        "{kid}(x, static_cast<const uint8_t*>(w[0]), static_cast<const {st}*>(w[1]), "
        "static_cast<const {st}*>(w[2]), static_cast<const float*>(bias), y, T)",
    ),
}


def render_candidate(shape: KernelShape, config: dict) -> tuple[str, str]:
    """(kernel id, C++ source) of one configuration with its run_/time_ trampolines."""
    params = {**shape.kwargs, **config}
    kid = kernel_id("cpu", shape.op, params)
    nw, call = _CALLS[shape.op]
    call = call.format(
        kid=kid,
        wt=ELEMENTS_BY_SHORT[params.get("wdtype", "f32")].ctype,
        st=scale_ctype(params["scale_bits"], params["asymmetric"], params.get("codebook", False), params["group_size"])
        if "scale_bits" in params
        else "float",
    )  # bf16 weights, fp16 scales: their bits; K-quant records as the kernel reads them
    return kid, render_kernel("cpu", shape.op, name=kid, **params) + _TRAMPOLINES.format(kid=kid, call=call, nw=nw)


class _Built:
    def __init__(self, shape: KernelShape, config: dict, render):
        self.kid, source = render(shape, config)
        files = {**target_headers("cpu"), "tune.cc": '#include "common.h"\n' + source}
        lib = ctypes.CDLL(str(build_shared_library(files, flags=CPU_FLAGS)))
        self.run, self.timer = getattr(lib, f"run_{self.kid}"), getattr(lib, f"time_{self.kid}")
        self.run.restype, self.run.argtypes = None, [ctypes.c_void_p] * 4 + [ctypes.c_int]
        self.timer.restype = ctypes.c_double
        self.timer.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 2


def _ptr(a: np.ndarray | None):
    return None if a is None else a.ctypes.data


def _output(built: _Built, inp: Inputs) -> np.ndarray:
    rows = inp.x.shape[0]
    y = np.full((rows, inp.reference.shape[1]), np.nan, np.float32)
    ptrs = (ctypes.c_void_p * len(inp.weights))(*[_ptr(w) for w in inp.weights])
    built.run(_ptr(inp.x), ptrs, _ptr(inp.bias), _ptr(y), rows)
    return y


def measure_shape(
    shape: KernelShape,
    space: TuneSpace,
    deadline: float,
    rounds: int,
    *,
    render=render_candidate,
    min_time: float = 0.02,
    progress=None,
) -> list[Candidate]:
    """Every admissible candidate of `shape`, the defaults first: checked, then timed until `deadline`."""
    configs = space.candidates(shape.kwargs, {})
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        futures = [pool.submit(_Built, shape, c, render) for c in configs]
        built = []
        for f in futures:
            built.append(f.result())
            if progress:
                progress(f"built {len(built)}/{len(configs)}")
    candidates = [Candidate(c, b.kid) for c, b in zip(configs, built, strict=True)]
    (rows,) = space.rows  # one T: the CPU's tunables serve the GEMV's T of a decode step
    inp = make_inputs(shape, rows)
    default_y = _output(built[0], inp)
    if (why := inp.mismatch(default_y)) is not None:
        raise CompileError(
            f"{shape}: the template's defaults fail the reference check ({why})",
            "the kernel is broken; fix it before tuning",
        )
    for c, b in zip(candidates[1:], built[1:], strict=True):
        y = _output(b, inp)
        c.rejected = inp.mismatch(y)
        if c.rejected is None and not np.array_equal(y.view(np.uint32), default_y.view(np.uint32)):
            c.rejected = "output differs from the defaults' bit for bit (a tunable must not change the numbers)"
        if c.rejected:
            log.warning("rejected %s %s: %s", shape, c.config, c.rejected)
    copies = max(1, min(_SPAN_MAX, 2 * host_llc_bytes()) // sum(w.nbytes for w in inp.weights))
    sets = [inp.weights] + [[w.copy() for w in inp.weights] for _ in range(copies - 1)]
    ptrs = (ctypes.c_void_p * (len(sets) * len(inp.weights)))(*[_ptr(w) for s in sets for w in s])
    y = np.empty((rows, inp.reference.shape[1]), np.float32)
    args = (_ptr(inp.x), ptrs, len(sets), _ptr(inp.bias), _ptr(y), rows)
    live = [i for i, c in enumerate(candidates) if c.rejected is None]
    order = np.random.default_rng(0)
    for _ in range(rounds):
        for i in order.permutation(live):  # no candidate always runs first
            if time.monotonic() > deadline:
                return candidates
            once = built[i].timer(*args, len(sets))
            candidates[i].times.append(built[i].timer(*args, max(len(sets), int(min_time / max(once, 1e-7)))))
    return candidates
