#!/usr/bin/env python
"""llmc against llama.cpp on the CPU, in the same run, on the same checkpoint: prefill and batch-1 greedy decode.

    python benchmarks/vs_llamacpp.py [--shapes smollm-135m,llama-3.2-1b] [--threads N] [--json]

Needs the `bench` extra (llama-cpp-python, built for the host: CMAKE_ARGS="-DGGML_NATIVE=ON", and gguf). Each row
first runs llama.cpp on its file in a child process, so a peer that crashes is an error that names the file, not a
dead benchmark. On some AMX hosts ggml's AMX int8 matmul segfaults in every Q8_0 / Q4_0 eval (llama.cpp issue 20824;
the 2-core Xeon of the README's tuning figures is one). -DGGML_NATIVE=ON turns AMX on wherever the CPU has it,
whatever -DGGML_AMX_INT8 says, so there build for the ISA by name (this list: an AVX-512 VNNI/BF16 host):
  CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF" \
    pip install --force-reinstall --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36

Models (random weights, written once into the cache dir as an fp32 safetensors checkpoint, benchmarks/common.py):
  smollm-135m    SmolLM-135M's shape: hidden 576, 30 layers, 9 heads / 3 KV heads, intermediate 1536,
                 vocab 49152, tied embeddings.
  llama-3.2-1b   Llama-3.2-1B's shape: hidden 2048, 16 layers, 32 heads / 8 KV heads, intermediate 8192,
                 vocab 128256, tied embeddings, rope_theta 500000, plain RoPE (the real model's llama3 rope
                 scaling reads no weight byte and only changes positions past 8192). 1.2 G parameters: its
                 weights (2.5 GB in bf16) are far above any last-level cache, so decode is DRAM-bound.
  qwen3-30b-a3b-4l  (not run by default) Qwen3-30B-A3B's shape, 4 of its 48 layers: 128 experts of 768 a layer, 8
                 a token, renormalized; vocab 151936, untied. 3.0 G parameters; a decode token reads its 8
                 experts a layer (the roofline's bytes count those, not all 128), attention and the head.

Rows: each pairs one llmc build with the llama.cpp GGUF file of the same weights, written from the checkpoint by
llmc.compiler.frontend.gguf_write (as llama.cpp's convert_hf_to_gguf.py writes them; Q8_0 / Q4_0 through
gguf.quants, every matrix including the embedding, norms F32):
  fp32   llmc weight_dtype float32                            llama.cpp F32
  bf16   llmc weight_dtype bfloat16                           llama.cpp BF16
  int8   llmc --quant int8 --group-size 32 --quant-lm-head    llama.cpp Q8_0
  int4   llmc --quant int4 --group-size 32 --quant-lm-head    llama.cpp Q4_0
and, not run by default (--rows), llama.cpp's own file types, quantized by llama.cpp (llama_model_quantize) from
the F32 file, where llmc compiles that same file (imported exactly, at the types it holds natively or widened):
  q4_k_m  q5_k_m  q6_k  q4_1  iq4_nl  iq4_xs  q3_k_m  q2_k    llama.cpp Q4_K_M, Q5_K_M, Q6_K, Q4_1, IQ4_NL, IQ4_XS,
                                                              Q3_K_M, Q2_K
A row whose llmc options are None measures llama.cpp alone and prints "—" for llmc.
For each row, both peers get the same prompt token ids (--prompt-len random ids of the checkpoint's tokenizer),
the same --tokens greedy decode tokens and the same --threads, and a KV cache of the same bytes: 16 bits a value,
llama.cpp's default f16 and llmc's --kv-cache-dtype bfloat16 (--kv-cache-dtype float32 gives llmc a float32 one):
  llmc       CompiledModel.step (benchmarks/common.LlmcStep): one prefill step of the whole prompt, timed; then
             --tokens decode steps with argmax in numpy, timed together.
  llama.cpp  llama_cpp.Llama (n_threads = n_threads_batch = --threads, the prompt in one batch, logits of the
             last token only, the library's default KV cache and attention): reset() + eval(prompt), timed; then
             --tokens times sample(temp=0) (llama.cpp's greedy sampler) + eval([token]), timed together, which is
             what Llama.generate does per token.
Prefill tok/s = prompt tokens / prefill seconds; decode tok/s = --tokens / decode seconds. Each row loads its two
peers, warms both up, then runs --rounds rounds of (llmc, llama.cpp), interleaved so that machine noise hits both;
figures are medians over rounds. Rows run one after another and unload their peers (the 1B fp32 pair alone maps
10 GB).

Roofline: batch-1 decode reads every weight once per token, so decode tok/s <= read bandwidth / weight bytes per
token. llmc's bytes come from its artifact's kernel program (llmc.kernel_program.decode_weight_bytes); llama.cpp's from
its own file: every tensor in full, except the token embedding, of which a step reads one row, plus the whole table
again when it doubles as the tied output matrix. Read bandwidth: a C++ OpenMP loop reading a 1 GiB buffer with --threads
threads (common.Bandwidth), best of 3, once per round of every row; the median over all is used for every row.

Same process, same threads, no pinning: on a machine shared with other work, figures are noisy; compare the two
peers of one row. Run it on an otherwise idle machine: ggml's worker threads busy-wait at every op's barrier, so
when other processes hold the cores, a preempted llama.cpp thread stalls all of them (on a 2-core machine at load
8, llama.cpp BF16 decode on SmolLM-135M fell from 10-12 tok/s with 1 thread to 0.5-0.7 tok/s with 2); llmc's pool
lets a late worker's blocks be taken by the others. On a loaded machine, --threads 1 still compares the kernels. `tokens agree` is how many of the generated tokens equal the other peer's, up to the first
difference (random weights make near-ties, so bf16 and quantized rows may part early).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import LLAMA_32_1B, QWEN3_30B_A3B_4L, SMOLLM_135M, TOKENIZER_VOCAB, LlmcStep, log  # noqa: E402
from llamacpp_peer import LlamaCpp, PeerCrashed, check_llamacpp_runs, gguf_decode_bytes, gguf_file  # noqa: E402

from llmc.compiler.quant import QuantConfig  # noqa: E402
from llmc.runtime.bench import align_columns  # noqa: E402

SHAPES = {  # --shapes name -> (LlamaConfig kwargs, description)
    "smollm-135m": (SMOLLM_135M, "SmolLM-135M shape (576 hidden, 30 layers, 9/3 heads, 1536, vocab 49152, tied)"),
    "llama-3.2-1b": (
        LLAMA_32_1B,
        "Llama-3.2-1B shape (2048 hidden, 16 layers, 32/8 heads, 8192, vocab 128256, tied, rope 5e5, no rope scaling)",
    ),
    "qwen3-30b-a3b-4l": (
        QWEN3_30B_A3B_4L,
        "Qwen3-30B-A3B shape, 4 of 48 layers (2048 hidden, 32/4 heads, 128 experts of 768, top 8, vocab 151936)",
    ),
}
DEFAULT_SHAPES = ("smollm-135m", "llama-3.2-1b")
SHAPE_FAMILY = {"qwen3-30b-a3b-4l": "qwen3_moe"}  # common.FAMILIES; the others are Llama's

GGUF_ITSELF = {"dtype": "float32", "from_gguf": True}  # llmc compiles the llama.cpp file of the row

# row -> (llmc compile options for common.compiled, None for a row llmc has no build for; llama.cpp GGUF type).
# The quantized rows match llama.cpp's files: symmetric groups of 32 over every matrix, the tied lm_head included
# (the files hold token_embd in Q8_0 / Q4_0), int8 activations per 32 in the GEMMs.
ROWS = {
    "fp32": ({"dtype": "float32"}, "F32"),
    "bf16": ({"dtype": "bfloat16"}, "BF16"),
    "int8": ({"dtype": "float32", "quant": QuantConfig("int8", group_size=32, lm_head=True)}, "Q8_0"),
    "int4": ({"dtype": "float32", "quant": QuantConfig("int4", group_size=32, lm_head=True)}, "Q4_0"),
    # llama.cpp's own file types, quantized by llama.cpp from the F32 file; llmc compiles that very file
    "q4_k_m": (GGUF_ITSELF, "Q4_K_M"),
    "q5_k_m": (GGUF_ITSELF, "Q5_K_M"),
    "q6_k": (GGUF_ITSELF, "Q6_K"),
    "q4_1": (GGUF_ITSELF, "Q4_1"),
    "iq4_nl": (GGUF_ITSELF, "IQ4_NL"),
    "iq4_xs": (GGUF_ITSELF, "IQ4_XS"),
    "q3_k_m": (GGUF_ITSELF, "Q3_K_M"),
    "q2_k": (GGUF_ITSELF, "Q2_K"),
}
DEFAULT_ROWS = ("fp32", "bf16", "int8", "int4")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads of both peers")
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="greedy decode tokens per round")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (medians)")
    p.add_argument(
        "--kv-cache-dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="llmc's KV cache (default bfloat16: 16 bits a value, as llama.cpp's default f16 cache)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=None,
        help="checkpoints, GGUF files and artifacts (default: $LLMC_CACHE_DIR/bench or ~/.cache/llmc/bench)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")
    args = p.parse_args(argv)
    for opt, known in (("shapes", SHAPES), ("rows", ROWS)):
        names = [s for s in getattr(args, opt).split(",") if s]
        if not names or any(n not in known for n in names):
            p.error(f"--{opt} takes a comma-separated list of {', '.join(known)}")
        setattr(args, opt, names)
    return args


# -- measuring --------------------------------------------------------------------------------------------------


def _agree(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def measure_row(
    llmc_path: Path | None,
    gguf_path: Path,
    prompt: list[int],
    tokens: int,
    rounds: int,
    threads: int,
    probe=None,
    log=log,
) -> dict:
    """One row: load its peers (llmc only when llmc_path), warm both up, then `rounds` interleaved rounds
    (llmc, llama.cpp, and a bandwidth read when probe is given). Returns the per-round seconds, the last round's
    tokens of each peer, the weight bytes per decode token, and the bandwidth reads."""
    check_llamacpp_runs(gguf_path, threads)
    max_len = len(prompt) + tokens + 1
    peers = {}
    if llmc_path is not None:
        peers["llmc"] = LlmcStep(llmc_path, max_len)
    peers["llama.cpp"] = LlamaCpp(gguf_path, threads, max_len, len(prompt))
    weight_bytes = {"llama.cpp": gguf_decode_bytes(gguf_path)}
    if "llmc" in peers:
        weight_bytes["llmc"] = peers["llmc"].model.artifact.decode_weight_bytes
    for peer in peers.values():
        peer.run(prompt, min(4, tokens))
    prefill = {name: [] for name in peers}
    decode = {name: [] for name in peers}
    out, bandwidth = {}, []
    for r in range(rounds):
        for name, peer in peers.items():
            p, d, out[name] = peer.run(prompt, tokens)
            prefill[name].append(p)
            decode[name].append(d)
            log(f"  round {r + 1}/{rounds} {name}: prefill {len(prompt) / p:.1f} tok/s, decode {tokens / d:.1f} tok/s")
        if probe is not None:
            bandwidth.append(probe.read(threads, 3))
    if "llama.cpp" in peers:
        peers["llama.cpp"].close()
    del peers
    gc.collect()
    return {
        "prefill_s": prefill,
        "decode_s": decode,
        "tokens": out,
        "weight_bytes_per_token": weight_bytes,
        "read_GBps": bandwidth,
    }


def summarize(row: str, m: dict, prompt_len: int, tokens: int, read_GBps: float) -> dict:
    """Medians, ratios and roofline fractions of one measured row."""
    out = {"row": row}
    for peer in ("llmc", "llama.cpp"):
        if peer not in m["decode_s"]:
            out[peer] = None
            continue
        decode = tokens / statistics.median(m["decode_s"][peer])
        wb = m["weight_bytes_per_token"][peer]
        roof = read_GBps * 1e9 / wb
        toks = m["tokens"][peer]
        out[peer] = {
            "decode_tokens_per_s": decode,
            "prefill_tokens_per_s": prompt_len / statistics.median(m["prefill_s"][peer]),
            "decode_tokens_per_s_rounds": [tokens / s for s in m["decode_s"][peer]],
            "prefill_tokens_per_s_rounds": [prompt_len / s for s in m["prefill_s"][peer]],
            "weight_MB_per_token": wb / 1e6,
            "roofline_tokens_per_s": roof,
            "of_roofline": decode / roof,
            "distinct_tokens": len(set(toks)),
        }
    both = out["llmc"] is not None and out["llama.cpp"] is not None
    for k in ("decode", "prefill"):
        key = f"{k}_tokens_per_s"
        out[f"{k}_ratio"] = out["llmc"][key] / out["llama.cpp"][key] if both else None
    out["tokens_agree"] = _agree(m["tokens"]["llmc"], m["tokens"]["llama.cpp"]) if both else None
    out["tokens"] = tokens + 1
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    common.set_threads(args.threads)
    import numpy as np

    cache = common.cache_dir(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    prompt = rng.integers(2, TOKENIZER_VOCAB, size=args.prompt_len).tolist()
    machine = common.machine()
    log(f"{common.describe_machine(machine)}; {args.threads} threads")
    probe = common.Bandwidth(args.threads)
    bandwidth = [probe.read(args.threads, 5)]
    shapes = []
    for shape in args.shapes:
        config, description = SHAPES[shape]
        ckpt = common.random_checkpoint(cache / f"{shape}-random", config, log, family=SHAPE_FAMILY.get(shape, "llama"))
        measured = {}
        for row in args.rows:
            options, gguf_type = ROWS[row]
            gguf_path = gguf_file(ckpt, cache, shape, gguf_type, log)
            llmc_path = None
            if options is not None:
                options = dict(options)
                options["kv_dtype"] = args.kv_cache_dtype
                source, tag = (gguf_path, gguf_path.stem) if options.pop("from_gguf", False) else (ckpt, shape)
                llmc_path = common.compiled(source, cache, tag, options.pop("dtype"), log, **options)
            log(f"{shape} {row}: llmc {'-' if llmc_path is None else llmc_path.name} vs llama.cpp {gguf_path.name}")
            measured[row] = measure_row(
                llmc_path, gguf_path, prompt, args.tokens, args.rounds, args.threads, probe=probe, log=log
            )
            bandwidth += measured[row]["read_GBps"]
        shapes.append((shape, description, measured))
    read = statistics.median(bandwidth)
    result = {
        "machine": {**machine, "read_GBps": read, "read_GBps_samples": bandwidth, "threads": args.threads},
        "prompt_len": args.prompt_len,
        "decode_tokens": args.tokens,
        "rounds": args.rounds,
        "kv_cache_dtype": args.kv_cache_dtype,
        "shapes": [
            {
                "shape": shape,
                "model": description,
                "rows": [summarize(row, m, args.prompt_len, args.tokens, read) for row, m in measured.items()],
            }
            for shape, description, measured in shapes
        ],
    }
    for s in result["shapes"]:
        for r in s["rows"]:
            for peer in ("llmc", "llama.cpp"):
                if r[peer] and r[peer]["distinct_tokens"] < r["tokens"] // 4:
                    log(
                        f"warning: {s['shape']} {r['row']} {peer} generated only {r[peer]['distinct_tokens']} "
                        "distinct tokens: a degenerate model measures a degenerate step"
                    )
    print(json.dumps(result, indent=2) if args.json else format_table(result))
    return result


def format_table(result: dict) -> str:
    m = result["machine"]
    lines = [
        f"machine: {common.describe_machine(m)}",
        f"memory read bandwidth: {m['read_GBps']:.1f} GB/s with {m['threads']} threads (1 GiB buffer; median of "
        f"{len(m['read_GBps_samples'])} reads, {min(m['read_GBps_samples']):.1f}-{max(m['read_GBps_samples']):.1f})",
        f"batch 1, prompt {result['prompt_len']} tokens, {result['decode_tokens']} greedy decode tokens, "
        f"{m['threads']} threads for both peers, median of {result['rounds']} interleaved rounds, KV cache llmc "
        f"{result['kv_cache_dtype']}, llama.cpp f16",
    ]

    def num(v, fmt):
        return "—" if v is None else fmt.format(v)

    def peer(r, name, key, fmt):
        return num(r[name][key] if r[name] else None, fmt)

    head = [
        "shape",
        "row",
        "decode llmc",
        "llama.cpp",
        "llmc/l.cpp",
        "prefill llmc",
        "llama.cpp",
        "llmc/l.cpp",
        "MB/tok llmc",
        "llama.cpp",
        "roofline llmc",
        "llama.cpp",
        "tokens agree",
    ]
    cells = [head]
    for s in result["shapes"]:
        for r in s["rows"]:
            cells.append(
                [
                    s["shape"],
                    r["row"],
                    peer(r, "llmc", "decode_tokens_per_s", "{:.1f}"),
                    peer(r, "llama.cpp", "decode_tokens_per_s", "{:.1f}"),
                    num(r["decode_ratio"], "{:.2f}x"),
                    peer(r, "llmc", "prefill_tokens_per_s", "{:.0f}"),
                    peer(r, "llama.cpp", "prefill_tokens_per_s", "{:.0f}"),
                    num(r["prefill_ratio"], "{:.2f}x"),
                    peer(r, "llmc", "weight_MB_per_token", "{:.0f}"),
                    peer(r, "llama.cpp", "weight_MB_per_token", "{:.0f}"),
                    peer(r, "llmc", "of_roofline", "{:.0%}"),
                    peer(r, "llama.cpp", "of_roofline", "{:.0%}"),
                    "—" if r["tokens_agree"] is None else f"{r['tokens_agree']}/{r['tokens']}",
                ]
            )
    lines += align_columns(cells, left=2)
    lines += [f"{s['shape']}: {s['model']}, random weights" for s in result["shapes"]]
    lines.append(
        "decode / prefill in tokens/s; roofline = decode tok/s / (read bandwidth / that peer's weight bytes per "
        "decode token); rows: fp32 = llmc float32 vs llama.cpp F32, bf16 = bfloat16 vs BF16, int8 = Q8_0, "
        "int4 = Q4_0 (both group 32); tokens agree = greedy tokens equal up to the first difference"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    try:
        main()
    except PeerCrashed as e:
        raise SystemExit(f"error: {e}") from None
