#!/usr/bin/env python
"""CPU quantized gemm / gemv kernels (templates/cpu/qgemm.cc.j2) alone: GB/s against the read roofline.

    python benchmarks/cpu_qgemm.py [--threads 2] [--rounds 5] [--only gemv,gemv1b,hot,gemm,batch] [--schemes "int4 g32,bf16"]
                                   [--baseline REV]

Each case renders the qgemm template with llmc's own build flags and times it in a C++ loop (no Python between
calls). Decode cases (T = 1) cycle through copies of the packed weights spanning 4x the last-level cache, so
every call streams its bytes from DRAM as a decode step does; prefill cases (T = 128) reuse one copy. The gemm
template's fp32 and bf16 kernels run the same shapes in the same rounds, for comparison.

The roofline is the read bandwidth measured in this process (a C++ loop reading 1 GiB on --threads threads, best
of 3); a case's floor is its packed bytes (qweight + scales + mins) / bandwidth. Every figure is the median over
--rounds interleaved rounds; on a shared machine compare rows of one run only. --baseline REV builds the same
kernels from the CPU headers at git revision REV too and times the two builds interleaved, round by round.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import statistics
import sys
from pathlib import Path

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

# decode GEMVs of SmolLM-135M (fused qkv, o, fused gate_up, down, lm_head) and one far above the LLC
SHAPES = decode_gemv_shapes(SMOLLM_135M)
BIG = ("big", 2048, 8192)
# (label, bits, group_size or 0 for one per output channel, asymmetric, scale_bits); bits None: the dense gemm of
# that wdtype. Scales are fp16 (llmc's quantizer) but for the fp32-scale rows (GGUF's K-quants)
SCHEMES = [
    ("int8", 8, 0, False, 16),
    ("int8 g32", 8, 32, False, 16),
    ("int8 g32 fp32s", 8, 32, False, 32),
    ("int4 g32", 4, 32, False, 16),
    ("int4 g32 fp32s", 4, 32, False, 32),
    ("int4 g32 asym", 4, 32, True, 32),
    ("q4_k", 4, 32, True, 8),  # GGUF Q4_K's own superblock records (K a multiple of 256 only)
    ("int8 g16 fp32s", 8, 16, False, 32),  # how GGUF Q6_K was held before int6 (a CUDA build still holds it so)
    ("q6_k", 6, 16, False, 8),  # GGUF Q6_K's int6 under its own records (K a multiple of 256 only)
    ("int8 q5_k", 8, 32, True, 8),  # how GGUF Q5_K was held before int5: its records, q widened to int8
    ("q5_k", 5, 32, True, 8),  # GGUF Q5_K's int5 under its own records
    ("q5_0", 5, 32, False, 16),  # GGUF Q5_0
    ("int4 g128", 4, 128, False, 16),
    ("bf16", None, "bf16", False, None),
    ("f32", None, "f32", False, None),
]

_QLOOP = r"""
extern "C" double bench_{kid}(const float* x, void* const* parts, int copies, float* y, int T, int iters) {{
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {{
    void* const* p = parts + 3 * (i % copies);
    {kid}(x, (const uint8_t*)p[0], (const {sc}*)p[1], (const {sc}*)p[2], nullptr, y, T);
  }}
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}}
"""

_LOOP = r"""
extern "C" double bench_{kid}(const float* x, void* const* parts, int copies, float* y, int T, int iters) {{
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) {kid}(x, ({wt}*)parts[3 * (i % copies)], nullptr, y, T);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}}
"""


def case_params(n: int, k: int, scheme: tuple) -> tuple[str, dict]:
    _, bits, g, asym, scale_bits = scheme
    if bits is None:
        return "gemm", dict(n=n, k=k, wdtype=g, has_bias=False)
    return "qgemm", dict(n=n, k=k, bits=bits, group_size=g or k, asymmetric=asym, scale_bits=scale_bits, has_bias=False)


def cases(only: set[str], schemes: set[str] | None = None) -> list[tuple]:
    out = []
    for scheme in SCHEMES:
        if schemes and scheme[0] not in schemes:
            continue
        rows = []
        if "gemv" in only:
            rows += [(f"{lab} T=1", n, k, 1, scheme, True) for lab, n, k in [*SHAPES, BIG]]
        if "gemv1b" in only:  # Llama-3.2-1B's decode step
            rows += [(f"1b {lab} T=1", n, k, 1, scheme, True) for lab, n, k in decode_gemv_shapes(LLAMA_32_1B)]
        if "hot" in only:  # the kernel's own speed, weights in cache: the most it could stream
            rows += [(f"{lab} T=1 hot", n, k, 1, scheme, False) for lab, n, k in [*SHAPES[:4], BIG]]
        if "gemm" in only:
            rows += [(f"{lab} T=128", n, k, 128, scheme, False) for lab, n, k in SHAPES[:4]]
        if "batch" in only:  # a batched decode step's 16 rows
            rows += [(f"{lab} T=16", n, k, 16, scheme, False) for lab, n, k in SHAPES[:4]]
        out += [r for r in rows if scheme[4] != 8 or r[2] % 256 == 0]  # K-quant records: superblocks of 256
    return out


def build(headers: dict[str, str], specs: list[tuple]) -> ctypes.CDLL:
    from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
    from llmc.compiler.codegen.render import kernel_id, render_kernel, scale_ctype

    parts, seen = ['#include "common.h"\n#include <chrono>\n'], set()
    for _, n, k, _, scheme, _ in specs:
        op, params = case_params(n, k, scheme)
        kid = kernel_id("cpu", op, params)
        if kid in seen:
            continue
        seen.add(kid)
        parts.append(render_kernel("cpu", op, name=kid, **params))
        if op == "qgemm":
            parts.append(
                _QLOOP.format(
                    kid=kid,
                    sc=scale_ctype(
                        params["scale_bits"], params["asymmetric"], params.get("codebook", False), params["group_size"]
                    ),
                )
            )
        else:
            parts.append(_LOOP.format(kid=kid, wt=ELEMENTS_BY_SHORT[params["wdtype"]].ctype))
    return ctypes.CDLL(str(build_shared_library({**headers, "bench.cc": "".join(parts)}, flags=CPU_FLAGS)))


def weight_parts(n: int, k: int, scheme: tuple, rng) -> list:
    """The arrays the kernel reads for a random w [n, k]: (qweight, scales, mins | None) or (w,)."""
    import numpy as np

    from llmc.compiler.quant import QuantScheme, quantize
    from llmc.compiler.quant_pack import pack_cpu
    from llmc.compiler.quant_widen import widen_exactly

    w = rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k))
    _, bits, g, asym, scale_bits = scheme
    if bits is None:
        return [w if g == "f32" else (w.view(np.uint32) >> 16).astype(np.uint16)]
    scheme = QuantScheme.of_kernel(dict(bits=bits, group_size=g or k, asymmetric=asym, scale_bits=scale_bits))
    if scheme.scale_dtype == "kquant" and scheme.bits in (5, 8):  # Q5_K's records: llmc writes them at 4 bits
        t = widen_exactly(quantize(w, QuantScheme(4, 32, True, "kquant")), scheme)
    else:
        t = quantize(w, scheme)
    return [a for a in pack_cpu(t) if a is not None]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--only", default="gemv,gemm", help="comma-separated of gemv, gemv1b, hot, gemm, batch")
    p.add_argument("--schemes", help="comma-separated of " + ", ".join(s[0] for s in SCHEMES) + " (default: all)")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample")
    p.add_argument("--baseline", help="git revision whose templates/cpu/include is timed too, interleaved")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before libgomp loads: the kernels' pool size

    import numpy as np

    from llmc.compiler.codegen.render import kernel_id
    from llmc.runtime.bench import align_columns

    probe = common.Bandwidth(args.threads)

    def bandwidth() -> float:
        return probe.read(args.threads, 3) * 1e9

    specs = cases(set(args.only.split(",")), set(args.schemes.split(",")) if args.schemes else None)
    libs = {"llmc": build(headers_at(None), specs)}
    if args.baseline:
        libs[args.baseline] = build(headers_at(args.baseline), specs)
    rng = np.random.default_rng(0)
    # The cold cases' copies, one after another in one pool that they share (they run one at a time; a pool per
    # case held 4x the LLC each, over 20 GB on a 480 MiB L3). Every byte 0x3c: any byte is a valid quantized
    # weight, and every 4-byte word a normal float32 scale (no denormal slow paths).
    pool = np.full(4 * host_llc_bytes(), 0x3C, dtype=np.uint8) if any(c for *_, c in specs) else None
    data = []
    for label, n, k, T, scheme, cold in specs:
        first = weight_parts(n, k, scheme, rng)
        nbytes = sum(a.nbytes for a in first)
        sets = [[a.ctypes.data for a in first]]
        if cold:
            offsets = [0]
            for a in first:
                offsets.append(offsets[-1] + -(-a.nbytes // 64) * 64)
            for i in range(pool.nbytes // offsets[-1] - 1):
                base = pool.ctypes.data + i * offsets[-1]
                sets.append([base + off for off in offsets[: len(first)]])
        copies = len(sets)
        ptrs = (ctypes.c_void_p * (3 * copies))(*[ptr for s in sets for ptr in (s + [None] * 3)[:3]])
        x = rng.standard_normal((T, k), dtype=np.float32)
        y = np.empty((T, n), dtype=np.float32)
        fns = {}
        for name, lib in libs.items():
            fn = fns[name] = getattr(lib, f"bench_{kernel_id('cpu', *case_params(n, k, scheme))}")
            fn.restype = ctypes.c_double
            fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        data.append(
            dict(
                label=label,
                scheme=scheme[0],
                n=n,
                k=k,
                T=T,
                nbytes=nbytes,
                keep=(first, pool),
                fns=fns,
                times={},
                call=(x.ctypes.data, ptrs, copies, y.ctypes.data, T),
                xy=(x, y),
            )
        )

    bws = []
    for _ in range(args.rounds):
        bws.append(bandwidth())
        for d in data:
            for name, fn in d["fns"].items():
                settle_pools()
                once = fn(*d["call"], 2)
                d["times"].setdefault(name, []).append(fn(*d["call"], max(4, int(args.min_time / max(once, 1e-7)))))
    bw = statistics.median(bws)
    print(
        f"threads {args.threads}; read bandwidth {bw / 1e9:.1f} GB/s; LLC {host_llc_bytes() >> 20} MiB; "
        f"medians of {args.rounds} interleaved rounds"
    )
    rows = [ab_header(["case", "weights", "n x k", "MiB", "floor us"], list(libs), ["GB/s", "GMAC/s", "% roof"])]
    for d in data:
        floor, macs = d["nbytes"] / bw, d["T"] * d["n"] * d["k"]
        rows.append(
            [
                d["label"],
                d["scheme"],
                f"{d['n']}x{d['k']}",
                f"{d['nbytes'] / 2**20:.2f}",
                f"{floor * 1e6:.1f}",
                *ab_cells(d["times"], d["nbytes"], macs, floor),
            ]
        )
    print("\n".join(align_columns(rows)))
    print(
        "floor = packed bytes (qweight + scales + mins, or the dense weights) / read bandwidth; % roof = floor / time"
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
