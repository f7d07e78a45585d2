#!/usr/bin/env python
"""Decode tokens/s at long context with a float32, bf16 or int8 KV cache (`llmc compile --kv-cache-dtype`).

    python benchmarks/kv_cache_decode.py [--shape smollm-135m] [--context 1920] [--tokens 64] [--batch 1]
        [--weight-dtypes bfloat16,float32] [--kv-dtypes float32,bfloat16,int8]

The model is a random checkpoint of --shape (benchmarks/common.py): SmolLM-135M's (30 layers, 3 KV heads of 64) or
Llama-3.2-1B's (16 layers, 8 KV heads of 64), compiled for the CPU target once per (weight dtype, KV cache dtype,
llmc source state) into the benchmark cache dir. Each
build prefills --batch prompts of --context tokens once (untimed, in chunks of --chunk tokens; each sequence its own
random ids and its own cache blocks). Each round, for each build in turn (interleaved, so machine noise hits every
build), --tokens greedy decode steps of --batch rows from the end of the prompts are timed through
CompiledModel.step: every round rewrites the same cache slots with the same values. A row's figure is the median
over --rounds rounds, in output tokens/s (--batch tokens a step).

A decode step reads every weight once and the whole KV cache of each sequence's context once: the table shows both
byte counts per step (an int8 cache's with its scales), so the gain of a smaller cache is read against its share of
the step's bytes; batched, the cache's share grows with the batch. The table says how many of the decoded tokens agree with the first --kv-dtypes build of the same
weights (a smaller cache changes k/v by a rounding, not the argmax of a clear margin), and each build's speed
against that one's.
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

from common import LLAMA_32_1B, random_checkpoint
from cpu_decode import SMOLLM_135M, cache_dir, set_threads, source_hash

from llmc.dtypes import kv_slot_bytes
from llmc.runtime.bench import align_columns

SHAPES = {"smollm-135m": SMOLLM_135M, "llama-3.2-1b": LLAMA_32_1B}
CHECKPOINTS = {"smollm-135m": "smollm135m-random", "llama-3.2-1b": "llama-3.2-1b-random"}  # as the other scripts'


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="smollm-135m")
    p.add_argument("--context", type=int, default=1920, help="prompt tokens before the timed decode steps")
    p.add_argument("--tokens", type=int, default=64, help="timed decode steps per round")
    p.add_argument("--chunk", type=int, default=512, help="prefill chunk (tokens per step)")
    p.add_argument("--batch", type=int, default=1, help="sequences decoded together, one row each a step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS (default: all cores)")
    p.add_argument("--weight-dtypes", default="bfloat16", help="comma-separated: float32, bfloat16")
    p.add_argument("--kv-dtypes", default="float32,bfloat16,int8", help="comma-separated; the first is the base")
    p.add_argument("--cache-dir", type=Path, default=None)
    args = p.parse_args(argv)
    if args.context + args.tokens > SHAPES[args.shape]["max_position_embeddings"]:
        p.error(f"--context + --tokens exceeds the model's {SHAPES[args.shape]['max_position_embeddings']} positions")
    return args


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build(ckpt: Path, cache: Path, shape: str, weight_dtype: str, kv_dtype: str) -> Path:
    from llmc.compiler.compile import compile_checkpoint

    stem = f"{shape}-{weight_dtype}-kv{kv_dtype}"
    out = cache / f"{stem}-{source_hash()}.cpu"
    if (out / "manifest.json").is_file():
        return out
    for old in cache.glob(f"{stem}-*.cpu"):  # builds of older sources
        shutil.rmtree(old, ignore_errors=True)
    log(f"compiling (weights {weight_dtype}, KV cache {kv_dtype}) -> {out}")
    compile_checkpoint(ckpt, target="cpu", output=out, weight_dtype=weight_dtype, kv_dtype=kv_dtype, progress=True)
    return out


class Decoder:
    """One build: the prompts prefilled once in chunks, then timed greedy decode steps of one row each after them."""

    def __init__(self, path: Path, prompts: list[list[int]], max_len: int, chunk: int):
        import numpy as np

        from llmc.runtime.batch import StepBatch
        from llmc.runtime.module import CompiledModel

        n = len(prompts)
        sizes = CompiledModel.load(path, kv_cache_memory=4 << 20, max_num_tokens=max(chunk, n), max_num_seqs=n)
        bs, per_block = sizes.block_size, sizes.kv_cache_bytes // sizes.num_blocks
        del sizes
        per_seq = -(-max_len // bs)
        memory = n * per_seq * per_block
        self.model = CompiledModel.load(path, kv_cache_memory=memory, max_num_tokens=max(chunk, n), max_num_seqs=n)
        assert self.model.num_blocks >= n * per_seq, "the cache holds every sequence's max_len"
        self.blocks = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
        self.first = []
        for prompt, blocks in zip(prompts, self.blocks, strict=True):
            for start in range(0, len(prompt), chunk):
                logits = self.model.step(StepBatch.build([prompt[start : start + chunk]], [start], [blocks], bs))
            self.first.append(int(np.argmax(logits[0])))
        self.context = len(prompts[0])

    def run(self, n: int) -> tuple[float, list[list[int]]]:
        import numpy as np

        from llmc.runtime.batch import StepBatch

        bs, b = self.model.block_size, len(self.blocks)
        toks, pos, out = list(self.first), self.context, []
        t = time.perf_counter()
        for _ in range(n):
            out.append(toks)
            logits = self.model.step(StepBatch.build([[tok] for tok in toks], [pos] * b, self.blocks, bs))
            toks, pos = [int(i) for i in np.argmax(logits[:b], axis=-1)], pos + 1
        return time.perf_counter() - t, out


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        set_threads(args.threads)
    cache = cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    c = SHAPES[args.shape]
    ckpt = random_checkpoint(cache / CHECKPOINTS[args.shape], c, log)
    weight_dtypes, kv_dtypes = args.weight_dtypes.split(","), args.kv_dtypes.split(",")
    builds = {(w, kv): build(ckpt, cache, args.shape, w, kv) for w in weight_dtypes for kv in kv_dtypes}
    rng = random.Random(0)
    # ids of the checkpoint's 384-token tokenizer
    prompts = [[rng.randrange(3, 384) for _ in range(args.context)] for _ in range(args.batch)]
    decoders = {}
    for key, path in builds.items():
        log(f"prefilling {args.batch} x {args.context} tokens: weights {key[0]}, KV cache {key[1]}")
        decoders[key] = Decoder(path, prompts, args.context + args.tokens, args.chunk)

    times: dict = {key: [] for key in decoders}
    tokens: dict = {}
    for r in range(args.rounds):
        for key, dec in decoders.items():
            seconds, out = dec.run(args.tokens)
            times[key].append(seconds)
            tokens[key] = out
        log(
            f"round {r + 1}/{args.rounds}: "
            + ", ".join(f"{w}/{kv} {args.batch * args.tokens / t[-1]:.1f}" for (w, kv), t in times.items())
        )

    head_dim = c["hidden_size"] // c["num_attention_heads"]
    ctx = args.context + args.tokens // 2  # the mean context of the timed steps
    base_kv = kv_dtypes[0]
    rows = [["weights", "KV cache", "decode tok/s", f"vs {base_kv} KV", "KV MB/step", "weights MB", "tokens equal"]]
    n_out = args.batch * args.tokens
    for (w, kv), ts in times.items():
        tps = n_out / statistics.median(ts)
        base = n_out / statistics.median(times[(w, base_kv)])
        same = sum(
            a == b
            for step, base_step in zip(tokens[(w, kv)], tokens[(w, base_kv)], strict=True)
            for a, b in zip(step, base_step, strict=True)
        )
        weights = decoders[(w, kv)].model.weight_bytes
        slot = kv_slot_bytes(kv, c["num_key_value_heads"], head_dim)
        kv_mb = args.batch * c["num_hidden_layers"] * 2 * slot * ctx / 1e6
        rows.append(
            [w, kv, f"{tps:.1f}", f"{tps / base:.2f}x", f"{kv_mb:.1f}", f"{weights / 1e6:.0f}", f"{same}/{n_out}"]
        )
    print(
        f"{args.shape} shape, context {args.context} + {args.tokens} decode steps, batch {args.batch}, median of "
        f"{args.rounds} interleaved rounds"
    )
    print("\n".join(align_columns(rows, left=2)))


if __name__ == "__main__":
    main()
