#!/usr/bin/env python
"""CPU decode benchmark at batch 1: llmc (fp32 and bf16 weights) vs transformers eager, against the roofline.

    python benchmarks/cpu_decode.py [--threads 2] [--tokens 64] [--json]

The model is SmolLM-135M's shape (LlamaConfig: hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate
1536, vocab 49152, tied embeddings) with random fp32 weights, written once by common.random_checkpoint (plus a
small byte-level BPE tokenizer) into the cache dir. It is compiled for the CPU target with compile_checkpoint once
per weight dtype and llmc source state (the artifact is cached under a hash of compiler/ and templates/cpu/).

Rows, all measured in this one process, interleaved round by round so that machine noise hits every peer:
  llmc step      CompiledModel.step directly: one prefill of --prompt-len tokens (untimed), then --tokens
                 greedy decode steps (argmax in numpy), timed; tokens/s of the window.
  llmc engine    the same request through LLMEngine (scheduler, StepBatch, sampler), timed from the first
                 token (the prefill step's) to the last: the runtime's overhead over the bare step.
  transformers   LlamaForCausalLM (fp32, torch eager, default attention) with a DynamicCache: the same prompt
                 prefilled untimed, then --tokens greedy steps with past_key_values, timed.
Each row's number is the median over --rounds windows. With --threads > 1, llmc fp32 (step) and
transformers also run on 1 thread, in the same rounds (omp_set_num_threads / torch.set_num_threads).

Roofline: batch-1 decode reads every weight once per token, so tokens/s <= bandwidth / weight bytes per
token. Weight bytes per token = the bytes the step's kernels read from the packed weights (from the
artifact's kernel program: every gemm and rmsnorm weight in full, the lm_head (the tied embedding table)
in full, the embedding one row). Bandwidth = memory read bandwidth measured in this process, once per
round next to the peers: a C++ loop (built with llmc's own g++ flags) that reads a 1 GiB buffer (several
times the last-level cache) with --threads OpenMP threads, static schedule; best of 5 reads per round,
median over rounds. A 1-thread read and a 1-thread numpy copy ((read + write) bytes / time) are shown
for reference. Note: an fp32 SmolLM-135M (0.54 GB) is under 2x a 300 MB LLC and its bf16 weights fit in
one, so part of a step's weights may come from the LLC and a row can beat the DRAM roofline.

Threads: llmc's kernels run on their own pool sized by OMP_NUM_THREADS (templates/cpu/include/llmc_pool.h); torch
uses --threads too. No thread pinning: on a machine whose cores are shared with other work, a pinned
thread cannot leave a busy core. Numbers on a shared machine are noisy: compare rows of one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

# prefix_cache.py, kv_cache_decode.py and speculative.py import these from here
from common import (  # noqa: E402
    SMOLLM_135M,
    Bandwidth,
    LlmcStep,
    cache_dir,
    set_threads,
    source_hash,  # noqa: E402, F401
)

from llmc.host import host_llc_bytes  # noqa: E402
from llmc.kernel_program import decode_weight_bytes  # noqa: E402
from llmc.runtime.bench import align_columns  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OMP_NUM_THREADS and torch threads")
    p.add_argument("--tokens", type=int, default=64, help="decode steps per timed window")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--rounds", type=int, default=5, help="timed windows per row (median)")
    p.add_argument("--dtypes", default="float32,bfloat16", help="llmc weight dtypes, comma-separated")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers row")
    p.add_argument("--no-engine", action="store_true", help="skip the LLMEngine rows")
    p.add_argument(
        "--no-1thread",
        action="store_true",
        help="with --threads > 1, skip the 1-thread rows of llmc fp32 and transformers",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="checkpoint and artifacts (default: $LLMC_CACHE_DIR/bench or ~/.cache/llmc/bench)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    return p.parse_args(argv)


def make_checkpoint(out: Path, log) -> Path:
    """The random SmolLM-135M-shaped checkpoint (common.random_checkpoint)."""
    return common.random_checkpoint(out, SMOLLM_135M, log)


def compiled(ckpt: Path, cache: Path, dtype: str, log) -> Path:
    return common.compiled(ckpt, cache, "smollm135m", dtype, log)


# -- the other peers ----------------------------------------------------------------------------------


class LlmcEngine:
    """The same through LLMEngine: scheduler, block manager, batch building and the sampler."""

    def __init__(self, step: LlmcStep):
        self.model = step.model

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        from llmc.runtime.engine import LLMEngine
        from llmc.sampling_params import SamplingParams

        engine = LLMEngine(self.model)
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=n + 1, ignore_eos=True))
        out = []
        t0 = None
        while engine.has_unfinished():
            for o in engine.step():
                if o.error is not None:
                    raise o.error
                out += o.new_token_ids
            if t0 is None:  # the prefill step made the first token
                t0 = time.perf_counter()
        return time.perf_counter() - t0, out


class Transformers:
    def __init__(self, ckpt: Path):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()

    def generate(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        torch = self.torch
        with torch.inference_mode():
            out = self.model(torch.tensor([prompt]), use_cache=True)
            past = out.past_key_values
            tok = int(out.logits[0, -1].argmax())
            toks = [tok]
            t = time.perf_counter()
            for _ in range(n):
                out = self.model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past = out.past_key_values
                tok = int(out.logits[0, -1].argmax())
                toks.append(tok)
            return time.perf_counter() - t, toks


# -- main ---------------------------------------------------------------------------------------------


def main(argv=None) -> dict:
    args = parse_args(argv)
    set_threads(args.threads)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import numpy as np

    cache = cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(cache / "smollm135m-random", log)
    dtypes = [d for d in args.dtypes.split(",") if d]
    artifacts = {d: compiled(ckpt, cache, d, log) for d in dtypes}

    rng = np.random.default_rng(0)
    prompt = rng.integers(2, 384, size=args.prompt_len).tolist()
    max_len = args.prompt_len + args.tokens + 1

    # name -> (peer, threads, weight bytes per token)
    peers: dict[str, tuple[object, int, int | None]] = {}
    by_op = {}
    one = args.threads > 1 and not args.no_1thread
    for d, path in artifacts.items():
        step = LlmcStep(path, max_len)
        by_op[d] = decode_weight_bytes(step.model.artifact.manifest["kernel_program"])
        total = sum(by_op[d].values())
        peers[f"llmc {d} step"] = (step, args.threads, total)
        if not args.no_engine:
            peers[f"llmc {d} engine"] = (LlmcEngine(step), args.threads, total)
        if one and d == "float32":
            peers[f"llmc {d} step, 1 thread"] = (step, 1, total)
    if not args.no_hf:
        hf, fp32_bytes = Transformers(ckpt), peers.get("llmc float32 step", (None, 0, None))[2]
        peers["transformers eager fp32"] = (hf, args.threads, fp32_bytes)
        if one:
            peers["transformers eager fp32, 1 thread"] = (hf, 1, fp32_bytes)

    import ctypes

    import torch

    gomp = ctypes.CDLL("libgomp.so.1")  # the OpenMP runtime of the llmc modules (torch bundles its own)

    def use_threads(n: int) -> None:
        gomp.omp_set_num_threads(n)
        torch.set_num_threads(n)

    probe = Bandwidth(args.threads)
    log(f"warm-up ({len(peers)} peers, {args.threads} threads)")
    tokens = {}
    for name, (peer, threads, _) in peers.items():
        use_threads(threads)
        _, tokens[name] = peer.generate(prompt, min(4, args.tokens))
    times: dict[str, list[float]] = {name: [] for name in peers}
    bandwidth = []
    for r in range(args.rounds):
        log(f"round {r + 1}/{args.rounds}")
        for name, (peer, threads, _) in peers.items():
            use_threads(threads)
            sec, toks = peer.generate(prompt, args.tokens)
            times[name].append(sec)
            tokens[name] = toks
        use_threads(args.threads)
        bandwidth.append(probe.measure())
    bw = {k: statistics.median(b[k] for b in bandwidth) for k in bandwidth[0]}

    ref = tokens.get("transformers eager fp32")
    hf_tps = args.tokens / statistics.median(times["transformers eager fp32"]) if ref is not None else None
    rows = []
    for name, (_, threads, wb) in peers.items():
        tps = args.tokens / statistics.median(times[name])
        roof = bw["read_GBps" if threads == args.threads else "read_1thread_GBps"] * 1e9 / wb if wb else None
        rows.append(
            {
                "row": name,
                "threads": threads,
                "tokens_per_s": tps,
                "tokens_per_s_windows": [args.tokens / s for s in times[name]],
                "weight_MB_per_token": wb / 1e6 if wb else None,
                "roofline_tokens_per_s": roof,
                "of_roofline": tps / roof if roof else None,
                "vs_transformers": tps / hf_tps if hf_tps else None,
                "greedy_tokens_match_transformers": (
                    sum(a == b for a, b in zip(tokens[name], ref, strict=False)) / len(ref) if ref is not None else None
                ),
            }
        )
    result = {
        "model": "SmolLM-135M shape, random weights (LlamaConfig: 576 hidden, 30 layers, 9/3 heads, 1536, 49152)",
        "threads": args.threads,
        "prompt_len": args.prompt_len,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "bandwidth": {
            **bw,
            "llc_bytes": host_llc_bytes(),
            "method": "read: C++ xor-reduce of a 1 GiB buffer with --threads OpenMP threads (static), "
            "best of 5 per round, median over rounds; copy: 1-thread numpy copy of 1 GiB, "
            "(read+write)/time",
        },
        "weight_bytes_by_op": by_op,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return result


def format_table(result: dict) -> str:
    bw = result["bandwidth"]
    lines = [
        f"{result['model']}",
        (
            f"batch 1, prompt {result['prompt_len']} tokens, {result['decode_tokens']} greedy decode tokens per "
            f"window, median of {result['rounds']} windows; OMP_NUM_THREADS={result['threads']}"
        ),
        (
            f"memory bandwidth: {bw['read_GBps']:.1f} GB/s read with {result['threads']} threads (1 GiB buffer, LLC "
            f"{bw['llc_bytes'] / 2**20:.0f} MiB); 1 thread: {bw['read_1thread_GBps']:.1f} GB/s read, "
            f"{bw['copy_1thread_GBps']:.1f} GB/s numpy copy (read + write)"
        ),
    ]
    cols = [
        ("row", "row", "{}"),
        ("tok/s", "tokens_per_s", "{:.1f}"),
        ("MB/token", "weight_MB_per_token", "{:.1f}"),
        ("roofline tok/s", "roofline_tokens_per_s", "{:.1f}"),
        ("of roofline", "of_roofline", "{:.0%}"),
        ("vs transformers", "vs_transformers", "{:.2f}x"),
        ("tokens = HF", "greedy_tokens_match_transformers", "{:.0%}"),
    ]
    cells = [[c[0] for c in cols]]
    for r in result["rows"]:
        cells.append(["-" if r[k] is None else f.format(r[k]) for _, k, f in cols])
    lines += align_columns(cells, left=1)
    lines.append(
        "roofline tok/s = read bandwidth (at the row's thread count) / weight bytes per decode token "
        "(every layer weight and the lm_head in full, one embedding row); transformers is held to the fp32 "
        "weights' roofline; 'vs transformers' and 'tokens = HF' compare with the transformers row at "
        f"{result['threads']} threads"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
