#!/usr/bin/env python
"""CPU gemm / gemv kernels alone: GB/s and GFLOP/s against the machine's measured roofline.

    python benchmarks/cpu_kernels.py [--threads 2] [--rounds 5] [--baseline REV] [--only gemv,gemv1b,batch,gemm]
    python benchmarks/cpu_kernels.py --step [--threads 2] [--baseline REV: that revision's headers instead]

Each case renders the gemm template (templates/cpu/gemm.cc.j2) with llmc's own build flags and times it in a
C++ loop (no Python between calls). Weights are cycled through enough copies to span 4x the last-level cache,
so every call streams its weights from DRAM as a decode step does (one layer's weights are long evicted by the
other layers' when they come round again); "hot" cases reuse one copy (the weights stay in cache).

Floors, measured in this process: read bandwidth (a C++ loop reading 1 GiB with --threads threads; best of 3)
and FMA peak (independent FMAs of the build's widest vector, zmm on an AVX-512 host, on --threads threads, i.e.
FMA pipes x lanes x 2 flops x clock); where the host has AVX-512 BF16, also vdpbf16ps's peak (4 flops per fp32
lane), the bf16 rows' peak where it beats the FMAs'; where it has AMX, tdpbf16ps's (four C tiles), the bf16 rows'
peak there, as bf16 GEMMs run on AMX tiles.
A gemv's floor is weight bytes / bandwidth; a gemm's is max(bytes / bandwidth, flops / peak).

--step times a whole SmolLM-135M decode step's kernels (30 layers of rmsnorm, qkv GEMV, RoPE, o GEMV, rmsnorm,
gate_up GEMV, silu_mul, down GEMV; final rmsnorm and lm_head; attention left out: its header is another
engine's) in one C++ loop, with each GEMV also timed inside the step: overhead = step - sum of its GEMVs is what
the small ops and the pool's launches cost. It runs back to back and with a sleep between steps (as the Python
runtime leaves the pool idle), which shows what waking the pool's sleeping workers costs.

--baseline REV builds the same kernels from the CPU headers at git revision REV too, and times the two
builds interleaved round by round (machine noise hits both alike): the rows show both and their ratio.
Every figure is the median over --rounds rounds; on a shared machine compare rows of one run only.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import os
import statistics
import sys
from pathlib import Path

from llmc.compiler.codegen import host_probes
from llmc.compiler.codegen.host_probes import CLOCK_SOURCE
from llmc.dtypes import ELEMENTS_BY_SHORT
from llmc.host import host_llc_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from common import (  # noqa: E402
    LLAMA_32_1B,
    SMOLLM_135M,
    ab_cells,
    ab_header,
    decode_gemv_shapes,
    headers_at,
    settle_pools,
)

# (label, n, k, T, wdtype, cold): decode GEMVs of SmolLM-135M (fused qkv, o, fused gate_up, down, lm_head),
# one far above the LLC, and the same layers at batched-decode and prefill T.
SMOL_ALL = decode_gemv_shapes(SMOLLM_135M)
SMOL = SMOL_ALL[:4]
BIG = ("big", 2048, 8192)
# Llama-3.2-1B's largest layers at prefill: K = 2048 and 8192, far longer rows than SmolLM's.
LLAMA_1B = [("1b gate_up", 16384, 2048), ("1b down", 2048, 8192)]


def cases(only: set[str]) -> list[tuple]:
    out = []
    for wd in ("f32", "bf16"):
        if "gemv" in only:
            out += [(f"{lab} T=1", n, k, 1, wd, True) for lab, n, k in [*SMOL_ALL, BIG]]
        if "gemv1b" in only:  # Llama-3.2-1B's decode step: rows of 2048 and 8192, far above the LLC together
            out += [(f"1b {lab} T=1", n, k, 1, wd, True) for lab, n, k in decode_gemv_shapes(LLAMA_32_1B)]
        if "hot" in only:  # the kernel's own speed, weights in cache: the most it could stream
            out += [(f"{lab} T=1 hot", n, k, 1, wd, False) for lab, n, k in SMOL]
        if "batch" in only:
            out += [(f"gate_up T={t}", 3072, 576, t, wd, True) for t in (4, 8, 16, 32, 64)]
        if "gemm" in only:
            out += [(f"{lab} T=128", n, k, 128, wd, False) for lab, n, k in SMOL]
            out += [(f"{lab} T=128", n, k, 128, wd, True) for lab, n, k in LLAMA_1B]
    return out


_LOOP = r"""
extern "C" double bench_{kid}(const float* x, {wt}* const* ws, int nw, float* y, int T, int iters, int cpu) {{
  const double t0 = bench_clock(cpu);
  for (int i = 0; i < iters; ++i) {kid}(x, ws[i % nw], nullptr, y, T);
  return (bench_clock(cpu) - t0) / iters;
}}
"""


_STEP = r"""
#include "common.h"
#include <thread>
%CLOCK%
namespace {
int g_cpu = 0;  // time by the thread's CPU time
constexpr int H = 576, QKV = 960, I = 1536, V = 49152, L = 30;
template <typename W>
struct Model {
  const W* qkv[L]; const W* o[L]; const W* gu[L]; const W* down[L]; const W* norm; const W* lm_head;
};
struct Clock {
  double gemv = 0;
  template <typename F>
  void time(F&& f) {
    const double t0 = bench_clock(g_cpu);
    f();
    gemv += bench_clock(g_cpu) - t0;
  }
};
// One decode step of T rows; small = false leaves the non-GEMV kernels out.
template <typename W>
void step(const Model<W>& m, float* bufs, const int32_t* pos, const float* inv_freq, int T, bool small, Clock& c) {
  float *h = bufs, *res = h + T * H, *xn = res + T * H, *qkv = xn + T * H, *gu = qkv + T * QKV,
        *act = gu + T * 2 * I, *logits = act + T * I;
  for (int l = 0; l < L; ++l) {
    if (small) llmc::rmsnorm<H, true>(h, res, res, m.norm, xn, T, 1e-5f);
    c.time([&] { llmc::gemm<QKV, H, false>(xn, m.qkv[l], (const W*)nullptr, qkv, T); });
    if (small) llmc::rope<12, 64>(qkv, QKV, pos, T, inv_freq);
    c.time([&] { llmc::gemm<H, H, false>(qkv, m.o[l], (const W*)nullptr, h, T); });
    if (small) llmc::rmsnorm<H, true>(h, res, res, m.norm, xn, T, 1e-5f);
    c.time([&] { llmc::gemm<2 * I, H, false>(xn, m.gu[l], (const W*)nullptr, gu, T); });
    if (small) llmc::silu_mul<I>(gu, act, T);
    c.time([&] { llmc::gemm<H, I, false>(act, m.down[l], (const W*)nullptr, h, T); });
  }
  if (small) llmc::rmsnorm<H, true>(h, res, res, m.norm, xn, T, 1e-5f);
  c.time([&] { llmc::gemm<V, H, false>(xn, m.lm_head, (const W*)nullptr, logits, T); });
}
template <typename W>
double run(const W* const* ws, float* bufs, int T, int steps, int small, int gap_us, double* gemv) {
  Model<W> m;
  for (int l = 0; l < L; ++l) {
    m.qkv[l] = ws[4 * l]; m.o[l] = ws[4 * l + 1]; m.gu[l] = ws[4 * l + 2]; m.down[l] = ws[4 * l + 3];
  }
  m.norm = ws[4 * L];
  m.lm_head = ws[4 * L + 1];
  int32_t pos[256];
  for (int t = 0; t < 256; ++t) pos[t] = 100 + t;
  float inv_freq[32];
  for (int i = 0; i < 32; ++i) inv_freq[i] = std::pow(10000.0f, -i / 32.0f);
  Clock c;
  double total = 0;
  for (int s = 0; s < steps; ++s) {
    if (gap_us) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    const double t0 = bench_clock(g_cpu);
    step(m, bufs, pos, inv_freq, T, small, c);
    total += bench_clock(g_cpu) - t0;
  }
  *gemv = c.gemv / steps;
  return total / steps;
}
}  // namespace
extern "C" void step_clock(int cpu) { g_cpu = cpu; }
// Seconds per parallel_for launch of `tasks` empty tasks (the pool's fork/join alone), `gap_us` idle before each.
extern "C" double pool_launch(int tasks, int gap_us, int n) {
  double total = 0;
  std::atomic<int> sink{0};
  for (int i = 0; i < n; ++i) {
    if (gap_us) std::this_thread::sleep_for(std::chrono::microseconds(gap_us));
    const double t0 = bench_clock(0);
    llmc::parallel_for(tasks, true, [&](int t) { sink.fetch_add(t, std::memory_order_relaxed); });
    total += bench_clock(0) - t0;
  }
  return total / n;
}
extern "C" double step_f32(const float* const* ws, float* b, int T, int n, int small, int gap, double* g) {
  return run(ws, b, T, n, small, gap, g);
}
extern "C" double step_bf16(const uint16_t* const* ws, float* b, int T, int n, int small, int gap, double* g) {
  return run(ws, b, T, n, small, gap, g);
}
"""


def step_bench(args, headers: dict[str, str]) -> None:
    """--step: a decode step's kernels, their GEMVs and the rest (see the top)."""
    import numpy as np

    from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library

    step_src = _STEP.replace("%CLOCK%", CLOCK_SOURCE)
    lib = ctypes.CDLL(str(build_shared_library({**headers, "step.cc": step_src}, flags=CPU_FLAGS)))
    lib.step_clock(int(args.cpu_time))
    lib.pool_launch.restype = ctypes.c_double
    lib.pool_launch.argtypes = [ctypes.c_int] * 3
    rng = np.random.default_rng(0)
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(1, 576), (49152, 576)]
    head = ["weights", "T", "gap us", "step ms", "its GEMVs ms", "overhead us", "GEMVs-only step ms", "GEMV GB/s"]
    rows = [[*head, "floor ms"]]
    bw = _bandwidth_probe(args.threads)
    for wd in args.step_dtypes.split(","):
        ws = []
        for n, k in shapes:
            a = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
            ws.append(a if wd == "f32" else (a.view(np.uint32) >> 16).astype(np.uint16))
        nbytes = sum(a.nbytes for a in ws)
        ptrs = (ctypes.c_void_p * len(ws))(*[a.ctypes.data for a in ws])
        fn = getattr(lib, f"step_{wd}")
        fn.restype = ctypes.c_double
        fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, *[ctypes.c_int] * 4, ctypes.c_void_p]
        for T in args.step_rows:
            bufs = np.zeros(T * (4 * 576 + 960 + 3 * 1536 + 49152) + 64, dtype=np.float32)
            for gap in (0, 2000):
                res = {}
                for _ in range(args.rounds):  # interleaved: with and without the small kernels
                    for small in (1, 0):
                        g = ctypes.c_double()
                        t = fn(ptrs, bufs.ctypes.data, T, 8, small, gap, ctypes.byref(g))
                        res.setdefault(small, []).append((t, g.value))
                t, g = (statistics.median(v) for v in zip(*res[1], strict=True))
                bare = statistics.median(v[0] for v in res[0])
                rows.append(
                    [
                        wd,
                        str(T),
                        str(gap),
                        f"{t * 1e3:.2f}",
                        f"{g * 1e3:.2f}",
                        f"{(t - g) * 1e6:.0f}",
                        f"{bare * 1e3:.2f}",
                        f"{nbytes / g / 1e9:.1f}",
                        f"{nbytes / bw * 1e3:.2f}",
                    ]
                )
    from llmc.runtime.bench import align_columns

    print(f"decode step kernels (SmolLM-135M, attention left out), threads {args.threads}, read {bw / 1e9:.1f} GB/s")
    print("\n".join(align_columns(rows)))
    print("overhead = step - its GEMVs (the small kernels and their launches); floor = weight bytes / read bandwidth")
    if args.threads > 1:
        for gap in (0, 2000):
            us = statistics.median(lib.pool_launch(2 * args.threads, gap, 200) for _ in range(args.rounds)) * 1e6
            print(f"pool launch of {2 * args.threads} empty tasks after {gap} us idle: {us:.1f} us")


def build(headers: dict[str, str], specs: list[tuple]) -> ctypes.CDLL:
    from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
    from llmc.compiler.codegen.render import kernel_id, render_kernel

    parts = ['#include "common.h"\n' + CLOCK_SOURCE]
    for _, n, k, _, wd, _ in specs:
        params = dict(n=n, k=k, wdtype=wd, has_bias=False)
        kid = kernel_id("cpu", "gemm", params)
        if kid in "".join(parts):
            continue
        parts.append(render_kernel("cpu", "gemm", name=kid, **params))
        parts.append(_LOOP.format(kid=kid, wt=ELEMENTS_BY_SHORT[wd].ctype))
    lib = ctypes.CDLL(str(build_shared_library({**headers, "bench.cc": "".join(parts)}, flags=CPU_FLAGS)))
    return lib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--baseline", help="git revision whose templates/cpu/include is timed too, interleaved")
    p.add_argument("--only", default="gemv,batch,gemm", help="comma-separated of gemv, gemv1b, hot, batch, gemm")
    p.add_argument(
        "--cpu-time", action="store_true", help="time by the thread's CPU time (needs --threads 1; see bench_clock)"
    )
    p.add_argument("--step", action="store_true", help="time a decode step's kernels instead (see the top)")
    p.add_argument("--step-dtypes", default="f32,bf16", help="weight dtypes of --step")
    p.add_argument("--step-rows", default="1,4,16", type=lambda v: [int(t) for t in v.split(",")], help="T of --step")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample")
    args = p.parse_args(argv)
    if args.cpu_time and args.threads != 1:
        p.error("--cpu-time measures one thread: add --threads 1")
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before libgomp loads: the kernels' pool size

    import numpy as np

    from llmc.compiler.codegen.render import kernel_id

    if args.step:
        step_bench(args, headers_at(args.baseline))
        return
    probes = host_probes.probes()
    specs = cases(set(args.only.split(",")))
    builds = {"llmc": build(headers_at(None), specs)}
    if args.baseline:
        builds[args.baseline] = build(headers_at(args.baseline), specs)

    rng = np.random.default_rng(0)
    span = 4 * host_llc_bytes()
    # The cold cases' copies, one after another in one pool that they share (they run one at a time; a pool
    # per case held 4x the LLC each, over 20 GB on a 480 MiB L3). Its bytes are bf16 normals, so a copy read
    # as float32 holds normals too (no denormal slow paths).
    pool = None
    if any(cold for *_, cold in specs):
        pool = (rng.standard_normal(span // 2, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    data = []
    for label, n, k, T, wd, cold in specs:
        w32 = (rng.standard_normal((n, k), dtype=np.float32) / np.sqrt(k)).astype(np.float32)
        w = w32 if wd == "f32" else (w32.view(np.uint32) >> 16).astype(np.uint16)
        stride = -(-w.nbytes // 64) * 64
        addrs = [w.ctypes.data]
        if cold:
            addrs += [pool.ctypes.data + i * stride for i in range(max(0, pool.nbytes // stride - 1))]
        ptrs = (ctypes.c_void_p * len(addrs))(*addrs)
        x = rng.standard_normal((T, k), dtype=np.float32)
        y = np.empty((T, n), dtype=np.float32)
        kid = kernel_id("cpu", "gemm", dict(n=n, k=k, wdtype=wd, has_bias=False))
        fns = {}
        for name, lib in builds.items():
            fn = getattr(lib, f"bench_{kid}")
            fn.restype = ctypes.c_double
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, *[ctypes.c_int] * 3]
            fns[name] = fn
        data.append(dict(label=label, n=n, k=k, T=T, wd=wd, w=w, ptrs=ptrs, x=x, y=y, fns=fns, times={}))

    bws, peaks, dot_peaks, amx_peaks = [], [], [], []
    for _ in range(args.rounds):
        bws.append(_bandwidth_probe(args.threads))
        peaks.append(probes.fma_probe(args.threads, 20_000_000, args.cpu_time))
        dot_peaks.append(probes.dpbf16_probe(args.threads, 20_000_000, args.cpu_time))
        amx_peaks.append(probes.amx_bf16_probe(args.threads, 20_000_000, args.cpu_time))
        for d in data:
            for name, fn in d["fns"].items():
                args_ = (d["x"].ctypes.data, d["ptrs"], len(d["ptrs"]), d["y"].ctypes.data, d["T"])
                settle_pools()
                once = fn(*args_, 2, args.cpu_time)
                iters = max(4, int(args.min_time / max(once, 1e-7)))
                d["times"].setdefault(name, []).append(fn(*args_, iters, args.cpu_time))
    bw, peak, dot_peak = statistics.median(bws), statistics.median(peaks), statistics.median(dot_peaks)
    amx_peak = statistics.median(amx_peaks)
    # bf16 weights run on AMX tiles where the host has them (llmc_gemm_amx.h), else as vdpbf16ps or as fp32 FMAs,
    # whichever is faster here (llmc_gemm.h)
    bf16_peak = amx_peak or max(peak, dot_peak)
    print(
        f"threads {args.threads}; read bandwidth {bw / 1e9:.1f} GB/s; FMA peak {peak / 1e9:.0f} GFLOP/s (fp32)"
        + (f", {dot_peak / 1e9:.0f} (vdpbf16ps)" if dot_peak else "")
        + (f", {amx_peak / 1e9:.0f} (AMX tdpbf16ps)" if amx_peak else "")
        + "; "
        f"LLC {host_llc_bytes() >> 20} MiB; medians of {args.rounds} interleaved rounds"
        + ("; times are the thread's CPU time" if args.cpu_time else "")
    )
    rows = [ab_header(["case", "dtype", "n x k", "MiB", "floor us"], list(builds), ["GB/s", "GFLOP/s", "% roof"])]
    for d in data:
        nbytes, flops = d["w"].nbytes, 2.0 * d["T"] * d["n"] * d["k"]
        floor = max(nbytes / bw, flops / (bf16_peak if d["wd"] == "bf16" else peak))
        rows.append(
            [
                d["label"],
                d["wd"],
                f"{d['n']}x{d['k']}",
                f"{nbytes / 2**20:.1f}",
                f"{floor * 1e6:.1f}",
                *ab_cells(d["times"], nbytes, flops, floor),
            ]
        )
    from llmc.runtime.bench import align_columns

    print("\n".join(align_columns(rows)))
    print(
        "floor = max(weight bytes / read bandwidth, flops / peak: fp32 FMA, or for bf16 AMX's where the host has "
        "it, else the faster of the FMA's and vdpbf16ps's); % roof = floor / time"
    )
    sys.stdout.flush()


@functools.cache
def _bandwidth(threads: int) -> common.Bandwidth:
    return common.Bandwidth(threads)


def _bandwidth_probe(threads: int) -> float:
    """Read bytes/s of 1 GiB with `threads` threads, best of 3."""
    return _bandwidth(threads).read(threads, 3) * 1e9


if __name__ == "__main__":
    main()
