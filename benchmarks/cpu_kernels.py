#!/usr/bin/env python
"""CPU gemm / gemv kernels alone: GB/s and GFLOP/s against the machine's measured roofline.

    python benchmarks/cpu_kernels.py [--threads 2] [--rounds 5] [--baseline REV] [--only gemv,gemm]

Each case renders the gemm template (templates/cpu/gemm.cc.j2) with llmc's own build flags and times it in a
C++ loop (no Python between calls). Weights are cycled through enough copies to span 4x the last-level cache,
so every call streams its weights from DRAM as a decode step does (one layer's weights are long evicted by the
other layers' when they come round again); "hot" cases reuse one copy (the weights stay in cache).

Floors, measured in this process: read bandwidth (a C++ loop reading 1 GiB with --threads threads; best of 3)
and FMA peak (independent 8-wide FMAs on --threads threads, i.e. 2 FMA pipes x lanes x 2 flops x clock).
A gemv's floor is weight bytes / bandwidth; a gemm's is max(bytes / bandwidth, flops / peak).

--baseline REV builds the same kernels from the CPU headers at git revision REV too, and times the two
builds interleaved round by round (machine noise hits both alike): the rows show both and their ratio.
Every figure is the median over --rounds rounds; on a shared machine compare rows of one run only.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# (label, n, k, T, wdtype, cold): decode GEMVs of SmolLM-135M (fused qkv, o, fused gate_up, down, lm_head),
# one far above the LLC, and the same layers at batched-decode and prefill T.
SMOL = [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536)]
BIG = ("big", 2048, 8192)


def cases(only: set[str]) -> list[tuple]:
    out = []
    for wd in ("f32", "bf16"):
        if "gemv" in only:
            out += [(f"{lab} T=1", n, k, 1, wd, True) for lab, n, k in [*SMOL, ("lm_head", 49152, 576), BIG]]
        if "batch" in only:
            out += [(f"gate_up T={t}", 3072, 576, t, wd, True) for t in (4, 8, 16, 32, 64)]
        if "gemm" in only:
            out += [(f"{lab} T=128", n, k, 128, wd, False) for lab, n, k in SMOL]
    return out


_PROBES = r"""
#include <chrono>
#include <cstdint>
#include <omp.h>
#include <immintrin.h>
extern "C" uint64_t read_probe(const uint64_t* p, long n, int threads) {
  uint64_t acc = 0;
#pragma omp parallel for schedule(static) reduction(^ : acc) num_threads(threads)
  for (long i = 0; i < n; ++i) acc ^= p[i];
  return acc;
}
// flops/s of independent 8-wide FMA chains (10 per thread: > latency x pipes) on `threads` threads.
extern "C" double fma_probe(int threads, long iters) {
  const auto t0 = std::chrono::steady_clock::now();
  float sink = 0;
#pragma omp parallel num_threads(threads) reduction(+ : sink)
  {
    __m256 a[10], m = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-3f);
    for (int j = 0; j < 10; ++j) a[j] = _mm256_set1_ps(float(j));
    for (long i = 0; i < iters; ++i)
      for (int j = 0; j < 10; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
    for (int j = 0; j < 10; ++j) sink += a[j][0];
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return sink == 12345.f ? 0 : 2.0 * 8 * 10 * iters * threads / s;
}
"""

_LOOP = r"""
extern "C" double bench_{kid}(const float* x, {wt}* const* ws, int nw, float* y, int T, int iters) {{
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {kid}(x, ws[i % nw], nullptr, y, T);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}}
"""


def headers_at(rev: str | None) -> dict[str, str]:
    from llmc.compiler.codegen.render import target_headers

    if rev is None:
        return target_headers("cpu")
    names = subprocess.run(
        ["git", "ls-tree", "--name-only", rev, "templates/cpu/include/"], cwd=REPO, check=True, capture_output=True
    ).stdout.split()
    show = ["git", "show"]
    return {
        Path(n.decode()).name: subprocess.run(
            [*show, f"{rev}:{n.decode()}"], cwd=REPO, check=True, capture_output=True
        ).stdout.decode()
        for n in names
    }


def build(headers: dict[str, str], specs: list[tuple]) -> ctypes.CDLL:
    from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
    from llmc.compiler.codegen.render import kernel_id, render_kernel

    parts = ['#include "common.h"\n#include <chrono>\n']
    for _, n, k, _, wd, _ in specs:
        params = dict(n=n, k=k, wdtype=wd, has_bias=False)
        kid = kernel_id("cpu", "gemm", params)
        if kid in "".join(parts):
            continue
        parts.append(render_kernel("cpu", "gemm", name=kid, **params))
        parts.append(_LOOP.format(kid=kid, wt="float" if wd == "f32" else "uint16_t"))
    lib = ctypes.CDLL(str(build_shared_library({**headers, "bench.cc": "".join(parts)}, flags=CPU_FLAGS)))
    return lib


def llc_bytes() -> int:
    try:
        return int(os.sysconf("SC_LEVEL3_CACHE_SIZE")) or 32 << 20
    except (ValueError, OSError):
        return 32 << 20


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", help="git revision whose templates/cpu/include is timed too, interleaved")
    p.add_argument("--only", default="gemv,batch,gemm", help="comma-separated of gemv, batch, gemm")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before libgomp loads: the kernels' pool size

    import numpy as np

    from llmc.compiler.codegen.build import build_shared_library
    from llmc.compiler.codegen.render import kernel_id

    probes = ctypes.CDLL(str(build_shared_library({"probes.cc": _PROBES})))
    probes.read_probe.restype = ctypes.c_uint64
    probes.read_probe.argtypes = [ctypes.c_void_p, ctypes.c_long, ctypes.c_int]
    probes.fma_probe.restype = ctypes.c_double
    probes.fma_probe.argtypes = [ctypes.c_int, ctypes.c_long]
    buf = np.ones(1 << 27, dtype=np.uint64)

    def bandwidth() -> float:
        best = 0.0
        for _ in range(3):
            t = _now()
            probes.read_probe(buf.ctypes.data, buf.size, args.threads)
            best = max(best, buf.nbytes / (_now() - t))
        return best

    specs = cases(set(args.only.split(",")))
    builds = {"llmc": build(headers_at(None), specs)}
    if args.baseline:
        builds[args.baseline] = build(headers_at(args.baseline), specs)

    rng = np.random.default_rng(0)
    span = 4 * llc_bytes()
    data = []
    for label, n, k, T, wd, cold in specs:
        w32 = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
        w = w32 if wd == "f32" else (w32.view(np.uint32) >> 16).astype(np.uint16)
        copies = max(1, -(-span // w.nbytes)) if cold else 1
        ws = [w] + [w.copy() for _ in range(copies - 1)]
        ptrs = (ctypes.c_void_p * len(ws))(*[a.ctypes.data for a in ws])
        x = rng.standard_normal((T, k), dtype=np.float32)
        y = np.empty((T, n), dtype=np.float32)
        kid = kernel_id("cpu", "gemm", dict(n=n, k=k, wdtype=wd, has_bias=False))
        fns = {}
        for name, lib in builds.items():
            fn = getattr(lib, f"bench_{kid}")
            fn.restype = ctypes.c_double
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
            fns[name] = fn
        data.append(dict(label=label, n=n, k=k, T=T, wd=wd, ws=ws, ptrs=ptrs, x=x, y=y, fns=fns, times={}))

    bws, peaks = [], []
    for _ in range(args.rounds):
        bws.append(bandwidth())
        peaks.append(probes.fma_probe(args.threads, 20_000_000))
        for d in data:
            for name, fn in d["fns"].items():
                args_ = (d["x"].ctypes.data, d["ptrs"], len(d["ws"]), d["y"].ctypes.data, d["T"])
                once = fn(*args_, 2)
                iters = max(4, int(args.min_time / max(once, 1e-7)))
                d["times"].setdefault(name, []).append(fn(*args_, iters))
    bw, peak = statistics.median(bws), statistics.median(peaks)
    print(
        f"threads {args.threads}; read bandwidth {bw / 1e9:.1f} GB/s; FMA peak {peak / 1e9:.0f} GFLOP/s (fp32); "
        f"LLC {llc_bytes() >> 20} MiB; medians of {args.rounds} interleaved rounds"
    )
    names = list(builds)
    head = ["case", "dtype", "n x k", "MiB", "floor us"]
    for name in names:
        head += [f"{name} us", "GB/s", "GFLOP/s", "% roof"]
    if len(names) > 1:
        head.append(f"speed-up vs {names[1]}")
    rows = [head]
    for d in data:
        nbytes = d["ws"][0].nbytes
        flops = 2.0 * d["T"] * d["n"] * d["k"]
        floor = max(nbytes / bw, flops / peak)
        row = [d["label"], d["wd"], f"{d['n']}x{d['k']}", f"{nbytes / 2**20:.1f}", f"{floor * 1e6:.1f}"]
        meds = {}
        for name in names:
            t = meds[name] = statistics.median(d["times"][name])
            row += [f"{t * 1e6:.1f}", f"{nbytes / t / 1e9:.1f}", f"{flops / t / 1e9:.1f}", f"{100 * floor / t:.0f}%"]
        if len(names) > 1:
            row.append(f"{meds[names[1]] / meds[names[0]]:.2f}x")
        rows.append(row)
    from llmc.runtime.bench import align_columns

    print("\n".join(align_columns(rows)))
    print("floor = max(weight bytes / read bandwidth, flops / FMA peak); % roof = floor / time")
    sys.stdout.flush()


def _now() -> float:
    import time

    return time.perf_counter()


if __name__ == "__main__":
    main()
