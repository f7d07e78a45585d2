#!/usr/bin/env python
"""The DRAM traffic of a mixture-of-experts step on a CUDA target, under the simulator's counters (no GPU needed):
each kernel's DRAM bytes against the kernel program's floor, with the expert GEMMs' floors at the experts the
step activated.

    python benchmarks/moe_traffic.py [--layers 1] [--target sm90] [--cache DIR] [--json]

The model is Qwen3-30B-A3B's shape (benchmarks/common.py QWEN3_30B_A3B_4L) cut to --layers layers, random
weights, compiled to bf16 for the target. Steps (`llmc profile --simulate`'s): decode at batch 1 and batch 16
(context 64), and a 64-token prefill. For each: the experts a layer activated, the DRAM bytes the layer's
kernels moved (attention and the mixture-of-experts: everything but the embedding, the final norm and the head)
against their floor, the whole step's, and the expert GEMMs' tensor-core instructions.

The floor (tools/profile.py program_floor_bytes, floors.py): every weight a step uses read once (an expert's
when a token chose it), every activation and the KV cache read and written once. At batch 1 the experts are
exactly top_k a layer.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.common import QWEN3_30B_A3B_4L, cache_dir, log, random_checkpoint  # noqa: E402

STEPS = {
    "decode b1": dict(phase="decode", batch=1, context=64),
    "decode b16": dict(phase="decode", batch=16, context=64),
    "prefill 64": dict(phase="prefill", prompt_len=64),
}


def traffic(report: dict, manifest_kernels: list[dict]) -> dict:
    """The layers' and the step's DRAM bytes against their floors, and the expert GEMMs' mma count. The layers'
    kernels: those that run over the step's tokens ("T" rows), but the embedding's gather; the final norm and the
    head run over its logits rows ("N")."""
    floors = report["program_floors"]
    layer = {
        k["id"]
        for k in manifest_kernels
        if "T" in k["rows"] and not k["template"].endswith(("/embedding", "/qembedding")) and k["id"] in floors
    }
    dram: dict[str, int] = {}
    mma = 0
    for k in report["kernels"]:
        dram[k["kernel"]] = dram.get(k["kernel"], 0) + k["dram_bytes"]
        if "_moe_gemm_" in k["kernel"] or "_moe_qgemm_" in k["kernel"]:
            mma += k["tensor_core_instructions"]
    layer_dram, layer_floor = sum(dram.get(kid, 0) for kid in layer), sum(floors[kid] for kid in layer)
    step = report["step"]
    return {
        "experts_per_layer": step["experts"]["per_layer"],
        "expert_weight_bytes": step["experts"]["weight_bytes"],
        "layers_dram_bytes": layer_dram,
        "layers_floor_bytes": layer_floor,
        "layers_ratio": layer_dram / layer_floor,
        "step_dram_bytes": step["dram_bytes"],
        "step_floor_bytes": step["program_floor_bytes"],
        "step_ratio": step["dram_bytes"] / step["program_floor_bytes"],
        "expert_gemm_mma": mma,
        "per_kernel": {kid: (dram.get(kid, 0), floors[kid]) for kid in floors},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    from llmc.artifact import load_artifact
    from llmc.compiler.compile import compile_checkpoint
    from llmc.tools.profile import profile_simulated

    cache = cache_dir(args.cache)
    config = dict(QWEN3_30B_A3B_4L, num_hidden_layers=args.layers)
    ckpt = random_checkpoint(cache / f"qwen3-30b-a3b-{args.layers}l-random", config, family="qwen3_moe")
    art = cache / f"qwen3-30b-a3b-{args.layers}l-bf16.{args.target}"
    if not (art / "manifest.json").is_file():
        log(f"compiling -> {art}")
        compile_checkpoint(ckpt, target=args.target, output=art, weight_dtype="bfloat16", progress=True)
    manifest_kernels = load_artifact(art, verify=False).manifest["kernels"]
    results = {}
    for name, shape in STEPS.items():
        t = time.perf_counter()
        results[name] = traffic(profile_simulated(art, **shape), manifest_kernels)
        log(f"{name}: simulated in {time.perf_counter() - t:.0f} s")
    if args.json:
        print(json.dumps(results, indent=1))
        return
    print(f"Qwen3-30B-A3B shape, {args.layers} layer(s), bf16, {args.target} under the simulator's counters")
    print(
        f"{'step':<12} {'experts/layer':>14} {'layers MB':>10} {'floor MB':>9} {'ratio':>6} "
        f"{'step MB':>9} {'floor MB':>9} {'ratio':>6} {'expert mma':>11}"
    )
    for name, r in results.items():
        per = r["experts_per_layer"]
        print(
            f"{name:<12} {sum(per) / len(per):>14.1f} {r['layers_dram_bytes'] / 1e6:>10.2f} "
            f"{r['layers_floor_bytes'] / 1e6:>9.2f} {r['layers_ratio']:>6.3f} {r['step_dram_bytes'] / 1e6:>9.2f} "
            f"{r['step_floor_bytes'] / 1e6:>9.2f} {r['step_ratio']:>6.3f} {r['expert_gemm_mma']:>11}"
        )


if __name__ == "__main__":
    main()
