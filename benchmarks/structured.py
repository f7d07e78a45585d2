#!/usr/bin/env python
"""Structured output's cost: decode throughput with every output constrained to a JSON schema, against the same
workload unconstrained, in one process on one CompiledModel.

    python benchmarks/structured.py [--threads 2] [--rounds 3] [--concurrency 1,4,16] [--json]

Model: SmolLM-135M's shape with random weights (benchmarks/common.py's random_checkpoint), bf16, with a
byte-level BPE of SmolLM's vocabulary size (49,152 tokens) trained here on the Python standard library's
sources: the grammar engine's cost grows with the token trie, so a toy vocabulary would flatter it.
Workload: llmc.runtime.bench's (greedy, ignore_eos, a closed loop of `concurrency` requests), structured with
its RECORDS_SCHEMA, which no output ends within --output-len, so both runs generate the same number of tokens.
Plain and structured runs alternate, --rounds times each; the table has each one's best round. Mask time per
step is the grammar engine's time filling the step's token masks (beside the model step, on its own thread).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

VOCAB = common.SMOLLM_135M["vocab_size"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each run (the best is shown)")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $LLMC_CACHE_DIR/bench")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def smollm_with_a_full_vocabulary(cache: Path) -> Path:
    """The random SmolLM-135M checkpoint, its tokenizer replaced by a 49,152-token byte-level BPE."""
    out = cache / "smollm135m-vocab49152"
    if (out / "tokenizer.json").is_file() and (out / ".full-vocab").is_file():
        return out
    common.random_checkpoint(out, common.SMOLLM_135M, common.log)
    from checkpoints import train_tokenizer  # tests/, on the path random_checkpoint set

    common.log(f"training a {VOCAB}-token BPE on the standard library's sources")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_tokenizer(out, VOCAB, [p.read_text(errors="replace") for p in sorted(stdlib.rglob("*.py"))[:3000]])
    (out / ".full-vocab").write_text(str(VOCAB))
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    from tokenizers import Tokenizer

    from llmc.runtime.bench import STRUCTURED_WORKLOADS, compare_structured, format_structured_comparison, run_bench
    from llmc.runtime.engine import LLMEngine
    from llmc.runtime.module import CompiledModel

    cache = common.cache_dir(args.cache_dir)
    ckpt = smollm_with_a_full_vocabulary(cache)
    artifact = common.compiled(ckpt, cache, "smollm135m-vocab49152", "bfloat16")
    levels = [int(c) for c in args.concurrency.split(",")]
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    workload = dict(concurrency=levels, prompt_len=args.prompt_len, output_len=args.output_len, progress=False)
    best: dict[str, dict] = {}
    with CompiledModel.load(artifact, kv_cache_memory=512 << 20, max_num_seqs=max(levels)) as model:
        for _ in range(args.rounds):
            for name, structured in (("plain", None), ("json", STRUCTURED_WORKLOADS["json"])):
                result = run_bench(lambda: LLMEngine(model, tokenizer), structured=structured, **workload)
                if name not in best:
                    best[name] = result
                else:
                    for kept, new in zip(best[name]["levels"], result["levels"], strict=True):
                        if new["output_tokens_per_s"] > kept["output_tokens_per_s"]:
                            kept.update(new)
    rows = compare_structured(best["plain"], best["json"])
    machine = common.machine()
    if args.json:
        print(json.dumps({"machine": machine, "threads": args.threads, "tokenizer_vocab": tokenizer.get_vocab_size(),
                          "levels": rows}, indent=2))  # fmt: skip
        return 0
    print(f"{common.describe_machine(machine)}; {args.threads} threads")
    print(
        f"SmolLM-135M shape, bf16, tokenizer of {tokenizer.get_vocab_size()} tokens; prompt {args.prompt_len}, "
        f"output {args.output_len} tokens; best of {args.rounds} rounds each"
    )
    print(format_structured_comparison(rows, "json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
