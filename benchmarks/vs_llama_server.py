#!/usr/bin/env python
"""`llmc serve` against llama.cpp's `llama-server --parallel N` on the CPU, in the same run, on the same GGUF file:
output tok/s, TTFT and TPOT under concurrency.

    bash benchmarks/build_llama_server.sh            # once: llama-server for this host
    python benchmarks/vs_llama_server.py [--shape smollm-135m] [--rows bf16,int8,q4_k_m,q5_k_m] [--threads N] [--json]

The model: a random checkpoint of the shape (vs_llamacpp.py's SHAPES, benchmarks/common.py), written to GGUF by
llmc's writer (BF16, or Q8_0 for int8: every matrix in groups of 32, the tied head included), or for the K-quant
rows by llama.cpp's quantizer. llmc compiles that file (a BF16 file to bfloat16 weights, a quantized one at its
own types); llama-server loads it. The checkpoint's tokenizer gets one added token per id past its own 384, so
that every token either server generates is text: each token is then one streamed chunk in both (a token without
text is held back by both servers).

The servers: both up at once on loopback ports, each with --threads threads (llmc: OMP_NUM_THREADS; llama-server:
-t and -tb), each started as a user would start it for this load:
  llmc          llmc serve ARTIFACT --max-num-seqs <largest level> --kv-cache-memory <room for every sequence>
                (bf16 KV cache, prefix caching on, its default scheduler: up to 512 tokens a step)
  llama-server  llama-server -m FILE -np <largest level> -c <that many full sequences> (its defaults otherwise:
                continuous batching, f16 KV cache, prompt caching; built by build_llama_server.sh)

The workload, the same for both: at each --concurrency level, a closed loop keeps that many requests in flight
(when one finishes the next starts) until --requests-per-level requests are done (default: 2 per slot, at least 4);
each request is POST /v1/completions with a prompt of --prompt-len random token ids (never seen before by either
server: no prefix cache hit), max_tokens --output-len, greedy, ignore_eos, streamed. Levels alternate between the
peers (llmc, then llama-server, at each level) so that machine noise hits both. Per level and peer:
  output tok/s   output tokens of all its requests / the level's wall time
  TTFT           request sent -> first streamed token, p50 and p99 over its requests
  TPOT           (last token - first token) / (tokens - 1), p50 and p99
Run it on an otherwise idle machine (vs_llamacpp.py's docstring says why ggml's threads suffer most from a busy one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import TOKENIZER_VOCAB, log  # noqa: E402
from llamacpp_peer import gguf_file  # noqa: E402
from load_server import free_port, terminate, wait_healthy  # noqa: E402
from vs_llamacpp import SHAPES  # noqa: E402

# row -> (llmc weight dtype, GGUF type); the K-quant files, Ollama's default Q4_K_M among them, written by llama.cpp's
# own quantizer from the F32 file (llamacpp_peer.gguf_file) and compiled by llmc at their own types
ROWS = {
    "bf16": ("bfloat16", "BF16"),
    "int8": ("float32", "Q8_0"),
    "q4_k_m": ("float32", "Q4_K_M"),
    "q5_k_m": ("float32", "Q5_K_M"),
}
SLACK_TOKENS = 16  # per sequence, beyond prompt + output, in either server's context


def full_vocab_checkpoint(ckpt: Path, cache: Path) -> Path:
    """ckpt with its tokenizer grown to the model's vocabulary by added tokens `<t{id}>` (weights linked)."""
    from tokenizers import AddedToken, Tokenizer

    out = cache / f"{ckpt.name}-fullvocab"
    if (out / "tokenizer.json").is_file():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.name != "tokenizer.json":
            (tmp / f.name).symlink_to(f.resolve())
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    tok = Tokenizer.from_file(str(ckpt / "tokenizer.json"))
    first = tok.get_vocab_size(with_added_tokens=True)
    tok.add_tokens([AddedToken(f"<t{i}>", normalized=False) for i in range(first, vocab)])
    tok.save(str(tmp / "tokenizer.json"))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


class Served:
    """A server in a subprocess on a free loopback port, its output in `log_path`."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path, env: dict | None = None):
        self.name, self.log_path, self.base = name, log_path, f"http://127.0.0.1:{port}"
        with open(log_path, "wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )

    def wait_up(self) -> None:
        try:
            wait_healthy(self.proc, self.base, self.name, lambda: self.log_path.read_text(errors="replace")[-3000:])
        except RuntimeError as e:
            raise SystemExit(str(e)) from None

    def stop(self) -> None:
        terminate(self.proc)


async def one_request(client, base: str, prompt: list[int], output_len: int) -> dict:
    """One streamed completion: its token arrival times, relative to the request's start."""
    body = {
        "prompt": prompt,
        "max_tokens": output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    arrivals, usage = [], None
    async with client.stream("POST", f"{base}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise SystemExit(f"{base}: HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:500]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any(c.get("text") for c in chunk.get("choices") or ()):
                arrivals.append(time.perf_counter() - t0)
    tokens = usage["completion_tokens"] if usage else len(arrivals)
    if tokens != output_len:
        raise SystemExit(f"{base}: a request generated {tokens} tokens, not {output_len} (ignore_eos not honoured?)")
    return {"arrivals": arrivals, "tokens": tokens}


async def run_level(base: str, prompts: list[list[int]], concurrency: int, output_len: int) -> dict:
    import httpx
    import numpy as np

    gate = asyncio.Semaphore(concurrency)
    # a connection per request: llama-server may close a kept-alive one just as the next request reuses it
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def gated(prompt):
            async with gate:
                return await one_request(client, base, prompt, output_len)

        t = time.perf_counter()
        done = await asyncio.gather(*(gated(p) for p in prompts))
        wall = time.perf_counter() - t
    ttft = [d["arrivals"][0] for d in done]
    tpot = [(d["arrivals"][-1] - d["arrivals"][0]) / (len(d["arrivals"]) - 1) for d in done if len(d["arrivals"]) > 1]

    def pct(v, q):
        return float(np.percentile(v, q) * 1e3)

    return {
        "requests": len(done),
        "output_tok_s": sum(d["tokens"] for d in done) / wall,
        "ttft_ms": [pct(ttft, 50), pct(ttft, 99)],
        "tpot_ms": [pct(tpot, 50), pct(tpot, 99)],
        "wall_s": wall,
    }


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", default="smollm-135m", choices=sorted(SHAPES))
    p.add_argument("--rows", default="bf16", help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both servers")
    p.add_argument("--concurrency", default="1,4,16", help="comma-separated levels")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--requests-per-level", type=int, default=None, help="default: 2 per slot, at least 4")
    p.add_argument("--llama-server", type=Path, default=None, help="default: build_llama_server.sh's output")
    p.add_argument("--cache-dir", type=Path, default=None, help="default: $LLMC_CACHE_DIR/bench or ~/.cache/llmc/bench")
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv)
    args.rows = args.rows.split(",")
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if unknown := [r for r in args.rows if r not in ROWS]:
        p.error(f"unknown rows {unknown}; choose from {', '.join(ROWS)}")
    return args


def start_servers(args, artifact: Path, gguf: Path, binary: Path, logs: Path) -> list[Served]:
    from llmc.artifact import load_artifact
    from llmc.runtime.kv_cache import kv_bytes_per_block

    slots = max(args.concurrency)
    seq_tokens = args.prompt_len + args.output_len + SLACK_TOKENS
    a = load_artifact(artifact)
    c = a.config
    blocks = slots * -(-seq_tokens // a.block_size) + 1
    kv_bytes = blocks * kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, a.block_size, a.kv_dtype)
    threads = str(args.threads)
    port = free_port()
    llmc = Served(
        "llmc serve",
        [sys.executable, "-m", "llmc.tools.cli", "serve", str(artifact), "--port", str(port)]
        + ["--max-num-seqs", str(slots), "--kv-cache-memory", str(kv_bytes)],
        port,
        logs / "llmc.log",
        env={"OMP_NUM_THREADS": threads},
    )
    port = free_port()
    peer = Served(
        "llama-server",
        [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", threads, "-tb", threads]
        + ["-np", str(slots), "-c", str(slots * seq_tokens)],
        port,
        logs / "llama-server.log",
    )
    return [llmc, peer]


def main(argv=None) -> dict:
    args = parse_args(argv)
    import numpy as np

    binary = args.llama_server or common.cache_dir(None) / "llama-server" / "bin" / "llama-server"
    if not binary.is_file():
        raise SystemExit(f"no llama-server at {binary}: build it with `bash benchmarks/build_llama_server.sh`")
    cache = common.cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    machine = common.machine()
    log(f"{common.describe_machine(machine)}; {args.threads} threads")
    config, description = SHAPES[args.shape]
    ckpt = common.random_checkpoint(cache / f"{args.shape}-random", config, log)
    ckpt = full_vocab_checkpoint(ckpt, cache)
    vocab = config["vocab_size"]
    rng = np.random.default_rng(0)
    rows = []
    for row in args.rows:
        dtype, gguf_type = ROWS[row]
        gguf = gguf_file(ckpt, cache, ckpt.name, gguf_type, log)
        artifact = common.compiled(gguf, cache, gguf.stem, dtype, log, kv_dtype="bfloat16")
        servers = start_servers(args, artifact, gguf, binary, cache)
        try:
            for s in servers:
                s.wait_up()
                asyncio.run(run_level(s.base, [rng.integers(TOKENIZER_VOCAB, vocab, args.prompt_len).tolist()], 1, 8))
            levels = []
            for c in args.concurrency:
                n = args.requests_per_level or max(4, 2 * c)
                level = {"concurrency": c}
                for s in servers:
                    prompts = rng.integers(TOKENIZER_VOCAB, vocab, (n, args.prompt_len)).tolist()
                    log(f"{row} concurrency {c}: {s.name}, {n} requests")
                    level[s.name] = asyncio.run(run_level(s.base, prompts, c, args.output_len))
                levels.append(level)
        finally:
            for s in servers:
                s.stop()
        rows.append({"row": row, "gguf": gguf.name, "artifact": artifact.name, "levels": levels})
    result = {
        "machine": {**machine, "threads": args.threads},
        "model": description,
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "rows": rows,
    }
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return result


def format_table(result: dict) -> str:
    from llmc.runtime.bench import align_columns

    lines = [
        f"{result['model']}; prompt {result['prompt_len']}, output {result['output_len']}; "
        f"{common.describe_machine(result['machine'])}; {result['machine']['threads']} threads",
    ]
    cells = [
        ["row", "concurrency", "output tok/s llmc", "llama-server", "ratio"]
        + ["TTFT p50/p99 ms llmc", "llama-server", "TPOT p50/p99 ms llmc", "llama-server"]
    ]
    for r in result["rows"]:
        for lv in r["levels"]:
            a, b = lv["llmc serve"], lv["llama-server"]
            cells.append(
                [r["row"], str(lv["concurrency"]), f"{a['output_tok_s']:.1f}", f"{b['output_tok_s']:.1f}"]
                + [f"{a['output_tok_s'] / b['output_tok_s']:.2f}x"]
                + [f"{x[k][0]:.0f} / {x[k][1]:.0f}" for k in ("ttft_ms",) for x in (a, b)]
                + [f"{x[k][0]:.1f} / {x[k][1]:.1f}" for k in ("tpot_ms",) for x in (a, b)]
            )
    return "\n".join(lines + align_columns(cells))


if __name__ == "__main__":
    main()
