#!/usr/bin/env python
"""Prefix caching: time to first token (TTFT) of a request whose long prefix is cached, against the same request
uncached, side by side in one process.

    python benchmarks/prefix_cache.py [--threads 2] [--rounds 7] [--models bundled,smollm] [--json]

Models:
  bundled  the checkpoint in examples/, compiled for this CPU by llmc.tools.build.cached_artifact (as
           `llmc run` does). Its context is 512 tokens, so its prompt is 512 tokens, of which the 496 of the
           31 full blocks can be cached (a request always computes its last token, to get logits).
  smollm   SmolLM-135M's shape with random weights, written and compiled by benchmarks/cpu_decode.py's
           make_checkpoint and compiled (cached in the same dir). Prompt: the --prefix tokens, then --suffix.
Each round draws a fresh random prefix and suffix, and runs, in this order, on fresh LLMEngines over one
CompiledModel (greedy, max_tokens 1):
  cached    an engine with prefix caching that has just served the prefix + another suffix: it computes only
            the tokens past the cached full blocks.
  uncached  an engine with --no-prefix-caching: it computes the whole prompt.
TTFT = LLMEngine.add_request -> the end of the step that returns the first token (the engine's own time: no
HTTP). The model is loaded with max_num_tokens >= the prompt, so an uncached prompt is one step, not chunks.
Numbers: medians over --rounds rounds after one untimed round; both rows' first tokens must be equal (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from llmc.host import host_llc_bytes
from llmc.runtime.bench import align_columns

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_decode  # noqa: E402  (its SmolLM-135M checkpoint and build cache)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS")
    p.add_argument("--rounds", type=int, default=7, help="timed rounds (median)")
    p.add_argument("--prefix", type=int, default=512, help="cached prefix tokens (smollm; bundled: 496 of 512)")
    p.add_argument("--suffix", type=int, default=16, help="tokens after the prefix (smollm)")
    p.add_argument("--models", default="bundled,smollm", help="comma-separated: bundled, smollm")
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="the smollm checkpoint and artifact (default: cpu_decode.py's, $LLMC_CACHE_DIR/bench)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return p.parse_args(argv)


def first_token_time(engine, prompt: list[int]) -> tuple[float, int]:
    """Seconds from add_request to the step that returns the request's first token, and that token."""
    from llmc.sampling_params import SamplingParams

    start = time.perf_counter()
    req_id = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.error is not None:
                raise out.error
            if out.req_id == req_id and out.new_token_ids:
                return time.perf_counter() - start, out.new_token_ids[0]


def bench_model(name: str, path: Path, prefix_len: int, suffix_len: int, rounds: int, log) -> dict:
    import numpy as np

    from llmc.runtime.engine import LLMEngine
    from llmc.runtime.module import CompiledModel

    prompt_len = prefix_len + suffix_len
    with CompiledModel.load(
        path, kv_cache_memory=256 << 20, max_num_tokens=max(prompt_len, 512), max_num_seqs=4
    ) as model:
        if prompt_len > model.config.max_context:
            raise SystemExit(
                f"{name}: a {prompt_len}-token prompt exceeds the model's context ({model.config.max_context})"
            )
        vocab = min(int(model.config.vocab_size), 384)  # ids that both models embed (cpu_decode trains 384 tokens)
        rng = np.random.default_rng(0)
        times: dict[str, list[float]] = {"cached": [], "uncached": []}
        hits = []
        for r in range(rounds + 1):
            prefix = rng.integers(2, vocab, prefix_len).tolist()
            warm, prompt = (prefix + rng.integers(2, vocab, suffix_len).tolist() for _ in range(2))
            cached = LLMEngine(model, enable_prefix_caching=True)
            first_token_time(cached, warm)
            before = cached.stats()
            t_cached, tok_cached = first_token_time(cached, prompt)
            after = cached.stats()
            t_uncached, tok_uncached = first_token_time(LLMEngine(model, enable_prefix_caching=False), prompt)
            if tok_cached != tok_uncached:
                raise SystemExit(
                    f"{name}: the first token differs with the prefix cached ({tok_cached}) and "
                    f"uncached ({tok_uncached}): prefix caching changed the output"
                )
            if r == 0:
                continue  # untimed: first-call costs (page faults on mmapped weights, lazy inits)
            log(f"{name} round {r}/{rounds}: cached {t_cached * 1e3:.1f} ms, uncached {t_uncached * 1e3:.1f} ms")
            times["cached"].append(t_cached)
            times["uncached"].append(t_uncached)
            hits.append(after.prefix_cache_hits - before.prefix_cache_hits)
        block_size = model.block_size
    cached_ms = statistics.median(times["cached"]) * 1e3
    uncached_ms = statistics.median(times["uncached"]) * 1e3
    return {
        "model": name,
        "artifact": str(path),
        "prompt_tokens": prompt_len,
        "cached_tokens": statistics.median(hits),
        "block_size": block_size,
        "ttft_cached_ms": cached_ms,
        "ttft_uncached_ms": uncached_ms,
        "speedup": uncached_ms / cached_ms,
        "ttft_cached_ms_rounds": [t * 1e3 for t in times["cached"]],
        "ttft_uncached_ms_rounds": [t * 1e3 for t in times["uncached"]],
    }


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "llc_bytes": host_llc_bytes(),
        "python": platform.python_version(),
    }


def main(argv=None) -> dict:
    args = parse_args(argv)
    cpu_decode.set_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    rows = []
    for name in [m for m in args.models.split(",") if m]:
        if name == "bundled":
            from llmc.examples import bundled_checkpoint
            from llmc.tools.build import cached_artifact

            path = cached_artifact(bundled_checkpoint())
            rows.append(bench_model(name, path, 496, 16, args.rounds, log))
        elif name == "smollm":
            cache = cpu_decode.cache_dir(args.cache_dir)
            cache.mkdir(parents=True, exist_ok=True)
            ckpt = cpu_decode.make_checkpoint(cache / "smollm135m-random", log)
            path = cpu_decode.compiled(ckpt, cache, "float32", log)
            rows.append(
                bench_model("SmolLM-135M shape (fp32, random)", path, args.prefix, args.suffix, args.rounds, log)
            )
        else:
            raise SystemExit(f"unknown model {name!r}: choose from bundled, smollm")
    result = {"threads": args.threads, "rounds": args.rounds, "machine": machine(), "rows": rows}
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return result


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"TTFT of one request, prefix cached vs not; median of {result['rounds']} rounds; "
        f"{m['cpu']}, {m['cores']} cores, OMP_NUM_THREADS={result['threads']}"
    ]
    cells = [["model", "prompt", "cached", "TTFT cached ms", "TTFT uncached ms", "speedup"]]
    for r in result["rows"]:
        cells.append(
            [
                r["model"],
                str(r["prompt_tokens"]),
                f"{r['cached_tokens']:.0f}",
                f"{r['ttft_cached_ms']:.1f}",
                f"{r['ttft_uncached_ms']:.1f}",
                f"{r['speedup']:.1f}x",
            ]
        )
    lines += align_columns(cells, left=1)
    return "\n".join(lines)


if __name__ == "__main__":
    main()
