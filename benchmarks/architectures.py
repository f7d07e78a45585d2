#!/usr/bin/env python
"""Decode speed of each family llmc compiles against Llama's on the same shape, side by side in one run.

    python benchmarks/architectures.py [--threads 2] [--rounds 5] [--families qwen3] [--dtype bfloat16]
    python benchmarks/architectures.py --sm90-layer [--families qwen3]

Each family's checkpoint is SmolLM-135M's shape (head_dim 64) in that family's transformers config class, with
random weights (common.random_checkpoint), compiled for this CPU at --dtype. Per round, in turn: Llama, then
each family, a 64-token prompt and 64 greedy decode steps at batch 1 through the C ABI (common.LlmcStep).
Medians over the rounds; the ratio is a family's decode tok/s over Llama's. A family's own work per layer
shows there (Qwen3: its per-head q / k norms inside the RoPE launches), since the GEMVs are the same.

--sm90-layer: instead, a one-layer checkpoint of each family's 8B-class layer shape (LAYER_8B; Llama-3-8B's
for llama), compiled for sm90 in bf16 (weights, activations, KV cache), and one decode step at batch 1 and
context 1024 under the CUDA simulator's counters (`llmc profile --simulate`): the bytes its kernels move
against their floor, and its launches. A family's decode step should move its floor and launch what Llama's
does. Every shape keeps a 32000-token vocabulary, so the lm_head weighs the same in each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import gpu_check  # noqa: E402

PROMPT, STEPS = 64, 64

LAYER_8B = {  # a family's 8B-class layer shape: config kwargs, one layer, the GPU check's 32000-token vocabulary
    "llama": gpu_check.SHAPES["llama3-8b-layer"],  # Llama-3-8B
    "qwen3": {  # Qwen3-8B
        **gpu_check.SHAPES["llama3-8b-layer"],
        "intermediate_size": 12288,
        "head_dim": 128,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
    },
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--families", default="qwen3", help=f"comma-separated, of {', '.join(common.FAMILIES)}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--sm90-layer", action="store_true", help="the 8B-class layer under the CUDA simulator (above)")
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
    if args.sm90_layer:
        return simulated_layers(families, cache)
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


def simulated_layers(families: list[str], cache: Path) -> int:
    from llmc.compiler.compile import compile_checkpoint
    from llmc.tools.profile import profile_simulated

    missing = [f for f in families if f not in LAYER_8B]
    if missing:
        sys.exit(f"no 8B-class layer shape for: {', '.join(missing)} (LAYER_8B)")
    rows = []
    for family in families:
        ckpt = common.random_checkpoint(cache / f"layer8b-{family}", LAYER_8B[family], family=family)
        artifact = cache / f"layer8b-{family}.sm90"
        shutil.rmtree(artifact, ignore_errors=True)
        common.log(f"compiling {ckpt.name} for sm90 (bf16)")
        compile_checkpoint(ckpt, target="sm90", output=artifact, weight_dtype="bfloat16", kv_dtype="bfloat16")
        common.log(f"{family}: one decode step under the simulator (batch 1, context 1024)")
        step = profile_simulated(artifact, phase="decode", batch=1, context=1024)["step"]
        rows.append((family, step))
    print(
        "sm90 (simulated), bf16, one layer of each family's 8B-class shape, vocabulary 32000; decode, batch 1, context 1024"
    )
    for family, step in rows:
        print(
            f"  {family:<8} {step['dram_bytes'] / 1e6:8.1f} MB moved, floor {step['floor_bytes'] / 1e6:8.1f} MB "
            f"({step['dram_bytes'] / step['floor_bytes']:.3f}x), {step['launches']} launches, "
            f"predicted {step['floor_fraction']:.1%} of the floor time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
