"""The GPU check: llmc's CUDA path checked and timed on a machine with one GPU (an H200 for the default
target sm90), in one command of about 5 minutes:

    python benchmarks/gpu_check.py [--target sm90] [--out gpu_check.json]

1. tests: the kernel template tests' CUDA cases on the GPU (LLMC_TEST_CUDA=gpu: fresh random inputs, tail
   sizes, outputs poisoned with NaN, numpy references), then the CUDA parity tests there (tiny Llama,
   Mistral with a sliding window and Qwen2 against transformers token for token; bf16, int8 / int4 and the
   bf16 KV cache within their tolerances).
2. ceilings, measured through torch: device-to-device copy bandwidth (bytes read + written) and an 8192^3
   bf16 matmul.
3. a one-layer checkpoint of Llama-3-8B's layer shape with random weights, compiled for the target (bf16
   weights, activations and KV cache): its logits against the torch peer's (benchmarks/torch_llama.py) within the bf16
   rule, then `llmc profile` (CUDA events per kernel) of a decode step at batch 1, context 1024, and of a
   256-token prefill.
4. the same two steps through the torch peer, eager and torch.compile(mode="max-autotune").

It prints one table: per row the time, the floor at the ceilings measured in this run, and floor / time;
the JSON of everything goes to --out. --simulate is a dry run for a machine without a GPU: the model steps
under the CUDA simulator (no tests, no ceilings: the target's stated ones; the peers on the CPU), on a tiny
layer shape unless --shape says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

from common import cache_dir, log, random_checkpoint  # noqa: E402
from torch_llama import TorchLlama  # noqa: E402

from llmc.tools.profile_measured import profile_measured  # noqa: E402
from llmc.tools.profile_table import format_table  # noqa: E402

_BASE = {
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
}
SHAPES = {  # LlamaConfig kwargs of one layer
    "llama3-8b-layer": {
        **_BASE,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 1,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "rope_theta": 500000.0,
    },
    "tiny": {
        **_BASE,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "rope_theta": 10000.0,
    },
}
BF16_REL = 3e-2  # the bf16 parity rule of tests/test_cuda_parity.py
KERNEL_TESTS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests" / "templates").glob("test_*.py"))
PARITY_TESTS = [
    ["tests/test_cuda_parity.py", "-k", "not nvcc"],
    ["tests/test_cuda_quant_parity.py", "-m", "slow or not slow"],
    ["tests/test_kv_cache_dtype.py", "-m", "slow or not slow", "-k", "sm90"],
]


def run_tests(target: str, timeout: float) -> list[dict]:
    """The CUDA test cases on this GPU, each group in a pytest of its own, the groups at once (their builds
    are CPU-bound; the GPU work is small): each group's outcome line and wall time."""
    env = {**os.environ, "LLMC_TEST_CUDA": "gpu", "LLMC_TEST_GPU_TARGET": target}
    groups = [("kernel tests (CUDA cases)", [*KERNEL_TESTS, "-k", "cuda"])]
    groups += [(f"parity {args[0].split('/')[-1]}", args) for args in PARITY_TESTS]
    start = time.perf_counter()
    running = [
        (
            name,
            subprocess.Popen(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for name, args in groups
    ]
    rows = []
    for name, proc in running:
        try:
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - start)))
            lines = stdout.strip().splitlines()
            outcome, ok = (lines[-1] if lines else stderr.strip()[-200:]), proc.returncode == 0
            if not ok:
                print(stdout[-4000:], stderr[-2000:], sep="\n", file=sys.stderr)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            outcome, ok = f"timed out after {timeout:.0f} s", False
        rows.append({"row": name, "ok": ok, "outcome": outcome, "seconds": time.perf_counter() - start})
        log(f"{name}: {outcome}")
    return rows


def _cuda_time_us(fn, repeats: int) -> float:
    """Median microseconds of fn() by CUDA events (after two warm-up calls); host clock off the GPU."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(1e3 * start.elapsed_time(stop))
        else:
            t = time.perf_counter()
            fn()
            times.append(1e6 * (time.perf_counter() - t))
    return statistics.median(times)


def copy_gb_s(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth, the bytes read plus the bytes written."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / (_cuda_time_us(lambda: dst.copy_(src), 10) * 1e3)


def matmul_tflop_s(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    return 2 * n**3 / (_cuda_time_us(lambda: torch.mm(a, b), 10) * 1e6)


def _floor_us(step: dict, ceil: dict) -> float:
    return max(
        step["floor_bytes"] / (ceil["bandwidth_gb_s"] * 1e3), step["flops"] / (ceil["bf16_tensor_tflop_s"] * 1e6)
    )


def check_logits(artifact: Path, peer: TorchLlama, library, device: str, prompt_len: int) -> dict:
    """A prefill of random tokens and one decode step, llmc against the peer in fp32 over the same bf16 weights:
    the bf16 rule."""
    from llmc.runtime.batch import StepBatch
    from llmc.runtime.module import CompiledModel

    vocab = peer.cfg.vocab_size
    ids = np.random.default_rng(1).integers(0, vocab, prompt_len + 1).tolist()
    worst = 0.0
    with CompiledModel.load(artifact, library=library, max_num_seqs=1) as model, torch.no_grad():
        table = list(range(-(-(prompt_len + 1) // model.block_size)))
        steps = [(0, ids[:prompt_len]), (prompt_len, ids[prompt_len:])]
        for start, new in steps:
            got = model.step(StepBatch.build([new], [start], [table], model.block_size))[0]
            pos = torch.arange(start, start + len(new), device=device)
            want = peer(torch.tensor([new], device=device), pos)[0].cpu().numpy()
            worst = max(worst, float(np.abs(got - want).max() / np.abs(want).max()))
    return {
        "row": "logits, llmc vs torch fp32 over the bf16 weights",
        "ok": worst <= BF16_REL,
        "outcome": f"max |llmc - torch| = {worst:.4f} x max|logit| (rule: <= {BF16_REL})",
    }


def time_peer(peer, phase: str, context: int, prompt_len: int, device: str, repeats: int) -> float:
    if phase == "decode":
        ids, pos = torch.zeros(1, 1, dtype=torch.long, device=device), torch.tensor([context], device=device)
    else:
        ids = torch.zeros(1, prompt_len, dtype=torch.long, device=device)
        pos = torch.arange(prompt_len, device=device)
    with torch.no_grad():
        return _cuda_time_us(lambda: peer(ids, pos), repeats)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="sm90")
    ap.add_argument("--shape", choices=sorted(SHAPES), help="default: llama3-8b-layer (tiny with --simulate)")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--skip-tests", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile peer")
    ap.add_argument("--simulate", action="store_true", help="a dry run without a GPU (see above)")
    ap.add_argument("--test-timeout", type=float, default=180.0, help="seconds for the tests, all groups")
    ap.add_argument("--cache", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = ap.parse_args(argv)
    shape_name = args.shape or ("tiny" if args.simulate else "llama3-8b-layer")
    device = "cpu" if args.simulate else "cuda"
    if not args.simulate and not torch.cuda.is_available():
        print("error: no CUDA device visible to torch (pass --simulate for a dry run without a GPU)", file=sys.stderr)
        return 1
    from llmc.compiler.codegen.simulator import build_simulated_library
    from llmc.compiler.compile import compile_checkpoint
    from llmc.targets import load_target

    started = time.perf_counter()
    report: dict = {"target": args.target, "shape": shape_name, "simulate": args.simulate, "checks": []}
    if not args.simulate:
        report["device"] = torch.cuda.get_device_name()
        if not args.skip_tests:
            report["checks"] += run_tests(args.target, args.test_timeout)
        ceil = {"bandwidth_gb_s": copy_gb_s(), "bf16_tensor_tflop_s": matmul_tflop_s()}
        torch.cuda.empty_cache()
        log(f"ceilings: {ceil['bandwidth_gb_s']:.0f} GB/s copy, {ceil['bf16_tensor_tflop_s']:.0f} bf16 TFLOP/s")
    else:
        ceil = {k: v for k, v in load_target(args.target).raw["ceilings"].items() if k != "part"}
    report["ceilings"] = ceil

    cache = cache_dir(args.cache)
    ckpt = random_checkpoint(cache / f"gpu-check-{shape_name}", SHAPES[shape_name])
    artifact = cache / f"gpu-check-{shape_name}.{args.target}"
    log(f"compiling {ckpt.name} for {args.target} (bf16 weights, activations and KV cache)")
    shutil.rmtree(artifact, ignore_errors=True)
    compile_checkpoint(ckpt, target=args.target, output=artifact, weight_dtype="bfloat16", kv_dtype="bfloat16")
    library = build_simulated_library(artifact) if args.simulate else None
    reference = TorchLlama(ckpt, dtype=torch.float32, weight_dtype=torch.bfloat16, device=device, max_seq=128)
    report["checks"].append(check_logits(artifact, reference, library, device, 64))
    log(report["checks"][-1]["outcome"])
    del reference
    max_seq = -(-(max(args.context + 1, args.prompt_len + 1)) // 64) * 64
    peer = TorchLlama(ckpt, dtype=torch.bfloat16, device=device, max_seq=max_seq)

    # the peer's cache is filled once, as the decode step's context
    with torch.no_grad():
        fill = torch.zeros(1, args.context, dtype=torch.long, device=device)
        peer(fill, torch.arange(args.context, device=device))
    peers = {"torch eager": peer}
    if not args.no_compile:
        peers["torch.compile max-autotune"] = torch.compile(peer, mode="max-autotune", fullgraph=True)
    timings = []
    for phase in ("decode", "prefill"):
        shape = {"phase": phase, "batch": 1, "context": args.context, "prompt_len": args.prompt_len}
        profiled = profile_measured(artifact, library=library, repeats=args.repeats, **shape)
        print(format_table(profiled))
        report[f"llmc_{phase}"] = profiled
        floor = _floor_us(profiled["step"], ceil)
        label = f"decode b1 ctx {args.context}" if phase == "decode" else f"prefill {args.prompt_len}"
        timings.append({"row": f"llmc {label} (kernels)", "us": profiled["step"]["time_us"], "floor_us": floor})
        timings.append({"row": f"llmc {label} (whole step)", "us": profiled["step"]["wall_us"], "floor_us": floor})
        for name, fn in peers.items():
            try:
                us = time_peer(fn, phase, args.context, args.prompt_len, device, args.repeats)
            except Exception as e:  # a peer that fails to build is a row of the table, not the end of the check
                log(f"{name} {phase}: {type(e).__name__}: {e}")
                us = float("nan")
            timings.append({"row": f"{name} {label}", "us": us, "floor_us": floor})
    report["timings"] = timings
    report["seconds"] = time.perf_counter() - started
    args.out.write_text(json.dumps(report, indent=1))
    print_table(report)
    return 0 if all(c["ok"] for c in report["checks"]) else 1


def print_table(report: dict) -> None:
    c = report["ceilings"]
    where = "stated" if report["simulate"] else "measured"
    print(
        f"\nGPU check, {report.get('device', 'simulated ' + report['target'])}, {report['shape']}; ceilings "
        f"({where}): {c['bandwidth_gb_s']:.0f} GB/s, {c['bf16_tensor_tflop_s']:.0f} bf16 TFLOP/s; "
        f"{report['seconds']:.0f} s"
    )
    print(f"{'row':<52} {'time us':>10} {'floor us':>10} {'floor/time':>10}")
    for t in report["timings"]:
        fraction = t["floor_us"] / t["us"] if t["us"] == t["us"] and t["us"] > 0 else float("nan")
        print(f"{t['row']:<52} {t['us']:>10.1f} {t['floor_us']:>10.1f} {100 * fraction:>9.1f}%")
    for check in report["checks"]:
        print(f"{'ok  ' if check['ok'] else 'FAIL'} {check['row']}: {check['outcome']}")


if __name__ == "__main__":
    sys.exit(main())
