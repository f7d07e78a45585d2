#!/usr/bin/env python
"""Decode speed of each family llmc compiles against Llama's on the same shape, side by side in one run.

    python benchmarks/architectures.py [--threads 2] [--rounds 5] [--families qwen3] [--dtype bfloat16]

Each family's checkpoint is SmolLM-135M's shape (head_dim 64) in that family's transformers config class, with
random weights (common.random_checkpoint), compiled for this CPU at --dtype. Per round, in turn: Llama, then
each family, a 64-token prompt and 64 greedy decode steps at batch 1 through the C ABI (common.LlmcStep).
Medians over the rounds; the ratio is a family's decode tok/s over Llama's. A family's own work per layer
shows there (Qwen3: its per-head q / k norms inside the RoPE launches), since the GEMVs are the same.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

PROMPT, STEPS = 64, 64


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--families", default="qwen3", help=f"comma-separated, of {', '.join(common.FAMILIES)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $LLMC_CACHE_DIR/bench")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import numpy as np

    families = ["llama", *(f for f in args.families.split(",") if f != "llama")]
    unknown = set(families) - set(common.FAMILIES)
    if unknown:
        sys.exit(f"unknown families: {', '.join(sorted(unknown))}")
    cache = common.cache_dir(args.cache_dir)
    shape = {**common.SMOLLM_135M, "head_dim": 64}
    steps = {}
    for family in families:
        ckpt = common.random_checkpoint(cache / f"smollm135m-{family}", shape, family=family)
        steps[family] = common.LlmcStep(
            common.compiled(ckpt, cache, f"smollm135m-{family}", args.dtype), PROMPT + STEPS + 1
        )
    prompt = np.random.default_rng(0).integers(2, shape["vocab_size"], PROMPT).tolist()
    seconds: dict[str, list[float]] = {f: [] for f in families}
    for family in families:  # warm-up, untimed
        steps[family].generate(prompt, 4)
    for _ in range(args.rounds):
        for family in families:
            seconds[family].append(steps[family].generate(prompt, STEPS)[0])
    print(f"{common.describe_machine(common.machine())}; {args.threads} threads")
    print(
        f"SmolLM-135M shape, {args.dtype}; prompt {PROMPT}, {STEPS} greedy decode steps at batch 1; median of {args.rounds} interleaved rounds"
    )
    base = STEPS / statistics.median(seconds["llama"])
    for family in families:
        rate = STEPS / statistics.median(seconds[family])
        print(f"  {family:<8} {rate:8.1f} tok/s  {rate / base:6.1%} of llama")
    return 0


if __name__ == "__main__":
    sys.exit(main())
