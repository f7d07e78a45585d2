"""Tuning candidates on a GPU: `llmc tune --target sm90` where one is present.

Each admissible candidate is pruned by what `ptxas -v` reports, as under --simulate, built by nvcc for the
target, run once on fresh random inputs and checked against the numpy reference, then timed in this process
with CUDA events around `iters` back-to-back launches. The weights are cycled through device copies spanning
twice the GPU's L2 (as the driver reports it), so each launch reads them from DRAM as a decode step does. The
figure is the median over rounds that interleave the candidates in a new order each round.

The same code runs under the CUDA simulator (`build=build_simulated`, for tests: no GPU needed); its events
give the simulator's wall time, so what it ranks there means nothing about a GPU.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from llmc.compiler.codegen.build import build_shared_library
from llmc.compiler.codegen.render import target_headers
from llmc.compiler.codegen.simulator import nvcc_path
from llmc.compiler.tuning.space import TuneSpace
from llmc.targets import Target

from .reference import Candidate, KernelShape, make_inputs
from .simulate_cuda import admit_by_ptxas, render_kernel_source

log = logging.getLogger("llmc.tune")

_TIMER = r"""
namespace {{
struct DeviceInputs {{
  void *x = nullptr, *w = nullptr, *bias = nullptr, *y = nullptr;
  ~DeviceInputs() {{ for (void* p : {{x, w, bias, y}}) if (p) cudaFree(p); }}
}};
}}  // namespace
// Seconds per launch over `iters` launches at T rows (after one launch whose output lands in y), the weights
// cycled through `nsets` device copies; *err: the first CUDA error, 0 for none.
extern "C" double time_{kid}(const void* x, size_t x_bytes, const void* w, size_t w_bytes, int nsets,
                             const void* bias, size_t bias_bytes, void* y, size_t y_bytes, int T, int iters,
                             int* err) {{
  DeviceInputs d;
  int e = (int)cudaMalloc(&d.x, x_bytes);
  if (!e) e = (int)cudaMalloc(&d.w, w_bytes * nsets);
  if (!e && bias) e = (int)cudaMalloc(&d.bias, bias_bytes);
  if (!e) e = (int)cudaMalloc(&d.y, y_bytes);
  if (!e) e = (int)cudaMemcpy(d.x, x, x_bytes, cudaMemcpyHostToDevice);
  for (int s = 0; !e && s < nsets; ++s)
    e = (int)cudaMemcpy(static_cast<char*>(d.w) + w_bytes * s, w, w_bytes, cudaMemcpyHostToDevice);
  if (!e && bias) e = (int)cudaMemcpy(d.bias, bias, bias_bytes, cudaMemcpyHostToDevice);
  auto launch = [&](int s) {{
    {kid}(static_cast<const {at}*>(d.x), reinterpret_cast<const {wt}*>(static_cast<char*>(d.w) + w_bytes * s),
          static_cast<const {wt}*>(d.bias), static_cast<{at}*>(d.y), T, (cudaStream_t)0);
  }};
  if (!e) {{
    launch(0);
    e = (int)cudaGetLastError();
  }}
  if (!e) e = (int)cudaMemcpy(y, d.y, y_bytes, cudaMemcpyDeviceToHost);
  float ms = 0.0f;
  if (!e) {{
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, 0);
    for (int i = 0; i < iters; ++i) launch(i % nsets);
    cudaEventRecord(b, 0);
    e = (int)cudaGetLastError();
    if (!e) e = (int)cudaEventSynchronize(b);
    cudaEventElapsedTime(&ms, a, b);
    cudaEventDestroy(a);
    cudaEventDestroy(b);
  }}
  *err = e;
  return 1e-3 * ms / (iters > 0 ? iters : 1);
}}
"""


def render_candidate(shape: KernelShape, config: dict) -> tuple[str, str]:
    """(kernel id, CUDA source) of one configuration with its time_ trampoline."""
    kid, source, types = render_kernel_source(shape, config)
    return kid, source + _TIMER.format(kid=kid, **types)


def gpu_device() -> dict | None:
    """The first CUDA device as the driver describes it ({"name", "l2_bytes"}); None where there is no driver
    or no device."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    count, dev, l2, name = ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.create_string_buffer(256)
    if cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(count)) or count.value < 1:
        return None
    if cuda.cuDeviceGet(ctypes.byref(dev), 0) or cuda.cuDeviceGetName(name, 256, dev):
        return None
    cuda.cuDeviceGetAttribute(ctypes.byref(l2), 38, dev)  # CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE
    return {"name": name.value.decode(errors="replace"), "l2_bytes": l2.value or 50 << 20}


def build_for_gpu(target: Target, source: str, out: Path) -> Path:
    """The candidate's library, built by nvcc for the target (kept in llmc's build cache, not at `out`)."""
    del out
    return build_shared_library(
        {**target_headers("cuda"), "tune.cu": source}, flags=target.build_flags, compiler=nvcc_path()
    )


class _Timer:
    def __init__(self, library: Path, kid: str):
        self.fn = getattr(ctypes.CDLL(str(library)), f"time_{kid}")
        self.fn.restype = ctypes.c_double
        self.fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t] * 2 + [ctypes.c_int] + [ctypes.c_void_p, ctypes.c_size_t]
        self.fn.argtypes += [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]

    def __call__(self, inp, nsets: int, y: np.ndarray, iters: int) -> tuple[float, int]:
        (w,) = inp.weights
        err = ctypes.c_int(0)
        seconds = self.fn(
            inp.x.ctypes.data,
            inp.x.nbytes,
            w.ctypes.data,
            w.nbytes,
            nsets,
            None if inp.bias is None else inp.bias.ctypes.data,
            0 if inp.bias is None else inp.bias.nbytes,
            y.ctypes.data,
            y.nbytes,
            y.shape[0],
            iters,
            ctypes.byref(err),
        )
        return seconds, err.value


def measure_shape(
    shape: KernelShape,
    space: TuneSpace,
    target: Target,
    deadline: float,
    rounds: int,
    *,
    span_bytes: int,
    render=render_candidate,
    build=build_for_gpu,
    min_time: float = 0.02,
    progress=None,
) -> list[Candidate]:
    """Every candidate admissible before building, the defaults first: pruned by ptxas, checked at each of the
    template's rows, then timed at each (the figure: their sum) until `deadline`. span_bytes: device memory the
    weight copies span (twice the GPU's L2: gpu_device())."""
    configs = space.candidates(shape.kwargs, target.raw)
    with (
        tempfile.TemporaryDirectory(prefix="llmc-tune-") as tmp,
        concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool,
    ):

        def make(config: dict):
            kid, source = render(shape, config)
            c = Candidate(config, kid)
            c.rejected = admit_by_ptxas(shape, space, target, config, source, c)
            return c, None if c.rejected else _Timer(build(target, source, Path(tmp) / f"{kid}.so"), kid)

        built = []
        for f in [pool.submit(make, c) for c in configs]:
            built.append(f.result())
            if progress:
                progress(f"built {len(built)}/{len(configs)}")
        candidates = [c for c, _ in built]
        inputs = {t: make_inputs(shape, t, seed=t) for t in space.rows}
        nsets = {t: max(1, span_bytes // inputs[t].weights[0].nbytes) for t in space.rows}
        ys = {t: inputs[t].poisoned_output() for t in space.rows}
        iters: dict[tuple[int, int], int] = {}  # (candidate, rows) -> launches per timed figure
        for i, (c, timer) in enumerate(built):
            if timer is None:
                continue
            for t in space.rows:
                ys[t] = inputs[t].poisoned_output()
                once, err = timer(inputs[t], 1, ys[t], 1)
                why = f"the launch failed with cudaError {err}" if err else inputs[t].mismatch(ys[t])
                if why is not None:
                    c.rejected = f"T={t}: {why}"
                    log.warning("rejected %s %s: %s", shape, c.config, c.rejected)
                    break
                iters[i, t] = max(nsets[t], int(min_time / max(once, 1e-7)))
        live = [i for i, (c, timer) in enumerate(built) if timer is not None and c.rejected is None]
        order = np.random.default_rng(0)
        for _ in range(rounds):
            for i in order.permutation(live):  # no candidate always runs first
                if time.monotonic() > deadline:
                    return candidates
                c, timer = built[i]
                total = 0.0
                for t in space.rows:
                    seconds, err = timer(inputs[t], nsets[t], ys[t], iters[i, t])
                    if err:
                        c.rejected = f"T={t}: a timed launch failed with cudaError {err}"
                        break
                    total += seconds
                if c.rejected:
                    live.remove(i)
                    continue
                c.times.append(total)
        return candidates
