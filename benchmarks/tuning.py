#!/usr/bin/env python
"""Tuned against default kernel parameters, end to end on the CPU, in the same run.

    python benchmarks/tuning.py [--shape smollm-135m] [--rows fp32,bf16,int8,int4] [--threads N] [--json]

For each row (vs_llamacpp.py's: fp32, bf16, int8 g32 and int4 g32 with the lm_head quantized), the same random
checkpoint is compiled twice: with the target's tuning database (targets/cpu.tuning.json, what `llmc compile`
takes by default) and with `--tuning-db none` (every template's defaults). Both builds get the same prompt ids
and greedy decode tokens (common.LlmcStep: one prefill step timed, then --tokens decode steps timed together),
in --rounds rounds that interleave them; figures are medians. A tunable changes the speed, never the numbers, so
the two builds must generate the same tokens: the table says whether they do.

Per kernel, the tuned and default times are those `llmc tune` measured and recorded in the database (its
`figures`); `llmc tune --retune` measures them again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import TOKENIZER_VOCAB, LlmcStep, log  # noqa: E402
from vs_llamacpp import ROWS, SHAPES  # noqa: E402

from llmc.runtime.bench import align_columns  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm-135m", choices=list(SHAPES))
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--cache-dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    rows = [r for r in args.rows.split(",") if r]
    if not rows or any(r not in ROWS for r in rows):
        p.error(f"--rows takes a comma-separated list of {', '.join(ROWS)}")
    common.set_threads(args.threads)
    import numpy as np

    cache = common.cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = common.random_checkpoint(cache / f"{args.shape}-random", SHAPES[args.shape][0], log)
    prompt = np.random.default_rng(0).integers(2, TOKENIZER_VOCAB, size=args.prompt_len).tolist()
    machine = common.machine()
    log(f"{common.describe_machine(machine)}; {args.threads} threads")
    result = {"machine": {**machine, "threads": args.threads}, "shape": args.shape, "rows": []}
    for row in rows:
        options = dict(ROWS[row][0])
        dtype = options.pop("dtype")
        builds = {
            "default": common.compiled(ckpt, cache, args.shape, dtype, log, tuning_db=False, **options),
            "tuned": common.compiled(ckpt, cache, args.shape, dtype, log, **options),
        }
        tuning = json.loads((builds["tuned"] / "manifest.json").read_text()).get("tuning", {}).get("kernels", {})
        peers = {name: LlmcStep(path, len(prompt) + args.tokens + 1) for name, path in builds.items()}
        for peer in peers.values():
            peer.run(prompt, 4)
        prefill, decode, out = {n: [] for n in peers}, {n: [] for n in peers}, {}
        for _ in range(args.rounds):
            for name, peer in peers.items():
                pre, dec, out[name] = peer.run(prompt, args.tokens)
                prefill[name].append(len(prompt) / pre)
                decode[name].append(args.tokens / dec)
        del peers
        result["rows"].append(
            {
                "row": row,
                "decode_tok_s": {n: statistics.median(v) for n, v in decode.items()},
                "prefill_tok_s": {n: statistics.median(v) for n, v in prefill.items()},
                "same_tokens": out["default"] == out["tuned"],
                "kernels": {
                    kid: {"source": k["source"], "params": k["params"], **(k.get("figures") or {})}
                    for kid, k in tuning.items()
                },
            }
        )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return result


def format_table(result: dict) -> str:
    head = ["row", "decode default", "tuned", "ratio", "prefill default", "tuned", "ratio", "same tokens"]
    table = [head]
    kernels = [["kernel", "source", "params", "default us", "tuned us", "speed-up"]]
    for r in result["rows"]:
        d, pf = r["decode_tok_s"], r["prefill_tok_s"]
        table.append(
            [
                r["row"],
                f"{d['default']:.1f}",
                f"{d['tuned']:.1f}",
                f"{d['tuned'] / d['default']:.2f}x",
                f"{pf['default']:.0f}",
                f"{pf['tuned']:.0f}",
                f"{pf['tuned'] / pf['default']:.2f}x",
                "yes" if r["same_tokens"] else "NO",
            ]
        )
        for kid, k in r["kernels"].items():
            figures = (
                [f"{k['default_time_us']:.1f}", f"{k['time_us']:.1f}", f"{k['speedup']:.2f}x"]
                if "time_us" in k
                else ["", "", ""]
            )
            kernels.append([kid, k["source"], " ".join(f"{a}={b}" for a, b in k["params"].items()), *figures])
    m = result["machine"]
    return "\n".join(
        [f"{common.describe_machine(m)}; {m['threads']} threads; {result['shape']}; tok/s, medians"]
        + align_columns(table)
        + ["", "per kernel (llmc tune's figures, T = 1, weights streamed from memory):"]
        + align_columns(kernels)
    )


if __name__ == "__main__":
    main()
