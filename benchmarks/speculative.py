#!/usr/bin/env python
"""Speculative decoding: decode tokens/s of one greedy request with and without speculation, side by side in one
process, and the acceptance rate.

    python benchmarks/speculative.py [--threads 2] [--rounds 3] [--ks 2,4,8] [--max-tokens 160] [--json]

Model: the bundled checkpoint (examples/pystdlib-5m), compiled for this CPU by llmc.tools.build.cached_artifact
(as `llmc run` does). Draft: --draft (default: examples/pystdlib-5m-draft, the small model train_tiny.py made with
the bundled model's tokenizer; skipped if absent).
Prompts:
  rewrite  a Python function, "Rewrite this function with one change", and the start of the copy: the answer
           repeats spans of the prompt, the case prompt lookup (n-gram) is for.
  open     the bundled model's demo prompt "The list type": nothing to copy.
Rows, per prompt: no speculation; n-gram at each K of --ks; the draft at each K. Every row runs on a fresh
LLMEngine over one CompiledModel (loaded with logits rows for K+1 tokens), greedy, ignore_eos, --max-tokens.
decode tok/s = (tokens - 1) / (time of the last token - time of the first): the prefill is left out. Numbers:
medians over --rounds after one untimed round. Every row's tokens must equal the row without speculation
(checked: speculation must not change greedy output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from llmc.runtime.bench import align_columns

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_decode  # noqa: E402  (thread setting, machine facts)
from prefix_cache import machine  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
REWRITE_PROMPT = '''def parse_header(line, lower=True):
    """Split a header line such as "Content-Type: text/plain" into its name and value."""
    name, sep, value = line.partition(":")
    if not sep:
        raise ValueError("a header line needs a colon: %r" % line)
    name = name.strip()
    if lower:
        name = name.lower()
    return name, value.strip()


Rewrite this function with one change: strip the value of quotes too.

def parse_header(line, lower=True):
    """Split a header line such as "Content-Type: text/plain" into its name and value."""
'''
PROMPTS = {"rewrite": REWRITE_PROMPT, "open": "The list type"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds (median)")
    p.add_argument("--ks", default="2,4,8", help="comma-separated numbers of speculative tokens")
    p.add_argument("--max-tokens", type=int, default=160, help="tokens generated per request")
    p.add_argument(
        "--draft",
        type=Path,
        default=ROOT / "examples" / "pystdlib-5m-draft",
        help="draft checkpoint or artifact (skipped if absent)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return p.parse_args(argv)


def decode(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """One greedy request alone: its tokens and its decode tokens/s (first token to last)."""
    from llmc.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    tokens, first, last = [], None, None
    while engine.has_unfinished():
        for out in engine.step():
            if out.error is not None:
                raise out.error
            now = time.perf_counter()
            if first is None:
                first = now
            last = now
            tokens += out.new_token_ids
    return tokens, (len(tokens) - 1) / (last - first)


def bench(target: Path, draft: Path | None, ks: list[int], max_tokens: int, rounds: int, log) -> list[dict]:
    from llmc.runtime.engine import LLMEngine
    from llmc.runtime.module import CompiledModel, load_tokenizer
    from llmc.runtime.spec_decode import SpeculativeConfig

    rows = []
    max_k = max(ks)
    with CompiledModel.load(target, kv_cache_memory=64 << 20, max_num_seqs=1, max_num_logits=max_k + 1) as model:
        tokenizer = load_tokenizer(model.tokenizer_path)
        draft_model = None if draft is None else CompiledModel.load(draft, kv_cache_memory=64 << 20, max_num_seqs=1)
        try:
            configs = [("none", 0, None)] + [("ngram", k, SpeculativeConfig("ngram", k)) for k in ks]
            if draft_model is not None:
                configs += [("draft", k, SpeculativeConfig("draft", k, draft_model=draft_model)) for k in ks]
            for prompt_name, text in PROMPTS.items():
                prompt = tokenizer.encode(text).ids
                reference = None
                for method, k, speculative in configs:
                    rates, stats = [], None
                    for r in range(rounds + 1):
                        engine = LLMEngine(model, tokenizer, speculative=speculative)
                        tokens, rate = decode(engine, prompt, max_tokens)
                        reference = reference or tokens
                        if tokens != reference:
                            raise SystemExit(
                                f"{prompt_name}, {method} K={k}: the greedy tokens differ from those "
                                "without speculation"
                            )
                        if r:  # round 0 is untimed: first-call costs (page faults on mmapped weights, lazy inits)
                            rates.append(rate)
                        stats = engine.stats()
                    row = {
                        "prompt": prompt_name,
                        "prompt_tokens": len(prompt),
                        "method": method,
                        "k": k,
                        "decode_tokens_per_s": statistics.median(rates),
                        "rounds": rates,
                        "draft_tokens": stats.spec_num_draft_tokens,
                        "accepted_tokens": stats.spec_num_accepted_tokens,
                        "acceptance_rate": stats.spec_acceptance_rate,
                    }
                    rows.append(row)
                    log(
                        f"{prompt_name} {method} K={k}: {row['decode_tokens_per_s']:.0f} tok/s, "
                        f"accepted {row['accepted_tokens']}/{row['draft_tokens']}"
                    )
                base = next(r for r in rows if r["prompt"] == prompt_name and r["method"] == "none")
                for row in rows:
                    if row["prompt"] == prompt_name:
                        row["speedup"] = row["decode_tokens_per_s"] / base["decode_tokens_per_s"]
        finally:
            if draft_model is not None:
                draft_model.close()
    return rows


def main(argv=None) -> dict:
    args = parse_args(argv)
    cpu_decode.set_threads(args.threads)
    from llmc.examples import bundled_checkpoint
    from llmc.tools.build import cached_artifact

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    ks = [int(k) for k in args.ks.split(",") if k]
    target = cached_artifact(bundled_checkpoint())
    draft = None
    if args.draft.exists():
        draft = args.draft if (args.draft / "manifest.json").exists() else cached_artifact(args.draft)
    else:
        log(f"no draft model at {args.draft}: draft rows skipped")
    rows = bench(target, draft, ks, args.max_tokens, args.rounds, log)
    result = {
        "threads": args.threads,
        "rounds": args.rounds,
        "max_tokens": args.max_tokens,
        "machine": machine(),
        "target": str(bundled_checkpoint()),
        "draft": None if draft is None else str(args.draft),
        "rows": rows,
    }
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return result


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"one greedy request, {result['max_tokens']} tokens; decode tok/s median of {result['rounds']} rounds; "
        f"{m['cpu']}, {m['cores']} cores, OMP_NUM_THREADS={result['threads']}"
    ]
    cells = [["prompt", "method", "K", "decode tok/s", "speedup", "accepted", "acceptance"]]
    for r in result["rows"]:
        spec = r["method"] != "none"
        cells.append(
            [
                r["prompt"],
                r["method"],
                str(r["k"]) if spec else "-",
                f"{r['decode_tokens_per_s']:.0f}",
                f"{r['speedup']:.2f}x",
                f"{r['accepted_tokens']}/{r['draft_tokens']}" if spec else "-",
                f"{r['acceptance_rate']:.1%}" if spec else "-",
            ]
        )
    lines += align_columns(cells, left=2)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
