#!/usr/bin/env python
"""CPU paged attention at decode (templates/cpu/paged_attention.cc.j2) alone: one token per call, GB/s of the KV
cache it reads against the read roofline.

    python benchmarks/cpu_attention.py [--threads 2] [--rounds 7] [--baseline REV]

Each case renders the paged_attention template with llmc's own build flags and times it in a C++ loop (no Python
between calls): one decode token of one sequence whose context fills cache blocks in a shuffled order, as the
runtime's block pool hands them out. Cold cases cycle over enough separate caches to span 4x the last-level
cache (in a decode step the weights of the other layers evict a layer's KV cache before it comes round again);
hot cases reuse one (the kernel's own speed). A case's floor is its K and V bytes / read bandwidth (a 1 GiB read
on --threads threads, best of 5, in this process). --baseline REV builds the CPU headers at git revision REV
too and times the two builds interleaved, round by round; every figure is the median over --rounds rounds.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
from pathlib import Path

from llmc.host import host_llc_bytes

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Bandwidth, ab_cells, ab_header, headers_at, settle_pools  # noqa: E402

# (label, num_heads, num_kv_heads, head_dim, context, cold)
CASES = [
    ("SmolLM-135M", 9, 3, 64, 256, False),
    ("SmolLM-135M", 9, 3, 64, 256, True),
    ("Llama-3.2-1B", 32, 8, 64, 1024, True),
    ("Llama-3-8B", 32, 8, 128, 2048, True),
    ("Qwen2-7B", 28, 4, 128, 1024, True),
    ("MHA 12 heads", 12, 12, 64, 512, True),
]
BLOCK = 16

_LOOP = r"""
extern "C" double bench_{kid}(const float* q, void* const* k, void* const* v, const int64_t* slot, const int32_t* qsl,
                              const int32_t* seq_lens, const int32_t* table, int max_blocks, float* out, int copies,
                              int iters) {{
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i)
    {kid}(q, q, q, 0, (float*)k[i % copies], (float*)v[i % copies], slot, qsl, seq_lens, table, max_blocks, 1, out);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
}}
"""


def params(nh: int, nkv: int, hd: int) -> dict:
    return dict(
        num_heads=nh, num_kv_heads=nkv, head_dim=hd, block_size=BLOCK, scale=hd**-0.5, sliding_window=0, kv_dtype="f32"
    )


def build(headers: dict[str, str]) -> ctypes.CDLL:
    from llmc.compiler.codegen.build import CPU_FLAGS, build_shared_library
    from llmc.compiler.codegen.render import kernel_id, render_kernel

    parts, seen = ['#include "common.h"\n#include <chrono>\n'], set()
    for _, nh, nkv, hd, _, _ in CASES:
        kid = kernel_id("cpu", "paged_attention", params(nh, nkv, hd))
        if kid not in seen:
            seen.add(kid)
            parts += [render_kernel("cpu", "paged_attention", name=kid, **params(nh, nkv, hd)), _LOOP.format(kid=kid)]
    lib = ctypes.CDLL(str(build_shared_library({**headers, "bench.cc": "".join(parts)}, flags=CPU_FLAGS)))
    for kid in seen:
        getattr(lib, f"bench_{kid}").restype = ctypes.c_double
    return lib


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--baseline", help="git revision whose templates/cpu/include is timed too, interleaved")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per timed sample")
    args = p.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before libgomp loads: the kernels' pool size

    import numpy as np

    from llmc.compiler.codegen.render import kernel_id
    from llmc.runtime.bench import align_columns

    libs = {"llmc": build(headers_at(None))}
    if args.baseline:
        libs[args.baseline] = build(headers_at(args.baseline))
    bw = Bandwidth(args.threads).read(args.threads, 5) * 1e9
    rng = np.random.default_rng(0)
    P = ctypes.c_void_p
    head = ["case", "heads", "kv heads", "head dim", "context", "KV MiB"]
    rows = [ab_header(head, list(libs), ["GB/s", "GMAC/s", "% roof"])]
    for label, nh, nkv, hd, ctx, cold in CASES:
        blocks = -(-ctx // BLOCK)
        kv_bytes = 2 * ctx * nkv * hd * 4
        copies = max(1, 4 * host_llc_bytes() // (2 * blocks * BLOCK * nkv * hd * 4)) if cold else 1
        caches = [rng.standard_normal((2, blocks, BLOCK, nkv, hd), dtype=np.float32) for _ in range(copies)]
        k = (P * copies)(*[c[0].ctypes.data for c in caches])
        v = (P * copies)(*[c[1].ctypes.data for c in caches])
        q = rng.standard_normal(nh * hd, dtype=np.float32)
        table = rng.permutation(blocks).astype(np.int32)
        slot, qsl, seq_lens = np.array([-1], np.int64), np.array([0, 1], np.int32), np.array([ctx], np.int32)
        out = np.zeros(nh * hd, np.float32)
        call = [
            P(q.ctypes.data),
            k,
            v,
            P(slot.ctypes.data),
            P(qsl.ctypes.data),
            P(seq_lens.ctypes.data),
            P(table.ctypes.data),
            blocks,
            P(out.ctypes.data),
            copies,
        ]
        kid = f"bench_{kernel_id('cpu', 'paged_attention', params(nh, nkv, hd))}"
        times = {name: [] for name in libs}
        for _ in range(args.rounds):
            for name, lib in libs.items():
                settle_pools()
                once = getattr(lib, kid)(*call, copies)
                times[name].append(getattr(lib, kid)(*call, max(3 * copies, int(args.min_time / once))))
        cells = ab_cells(times, kv_bytes, nh * ctx * hd * 2, kv_bytes / bw)
        rows.append([f"{label} {'cold' if cold else 'hot'}", nh, nkv, hd, ctx, f"{kv_bytes / 2**20:.2f}", *cells])
    print(f"decode attention, 1 token, f32 KV cache, block {BLOCK}; threads {args.threads}; read {bw / 1e9:.1f} GB/s")
    print("\n".join(align_columns([[str(c) for c in r] for r in rows])))
    print("floor = K and V bytes / read bandwidth; GMAC/s counts q.k and p.v multiply-adds")


if __name__ == "__main__":
    main()
