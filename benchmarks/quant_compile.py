#!/usr/bin/env python
"""Peak RSS and wall time of quantized compiles of a Llama-3-8B-shaped checkpoint, in fresh processes.

    python benchmarks/quant_compile.py [--layers 4] [--modes int4,q4_k_m] [--dir DIR]

The checkpoint has `--layers` of Llama-3-8B's 32 layers, every tensor at its 8B size (the 128256 x 4096
embedding and head, the 14336 x 4096 MLP matrices), bf16 zeros (tests/checkpoints.write_large_checkpoint: the
compile never looks at the values). Each mode compiles it for the CPU through compile_checkpoint, with activation
importance over 1,024 random token ids and no quality gate, in a process of its own, so that each peak RSS is that
compile's alone. Quantizing streams a tensor at a time: the peak stays near one layer's working set, not the
model's.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

COMPILE = """
import resource, sys
import numpy as np
from llmc.compiler.compile import compile_checkpoint
from llmc.compiler.quant import QuantConfig
ids = np.random.default_rng(0).integers(2, 128000, 1024).tolist()
compile_checkpoint(sys.argv[1], target="cpu", output=sys.argv[2], quant=QuantConfig(sys.argv[3]), importance_tokens=ids)
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--modes", default="int4,q4_k_m")
    parser.add_argument("--dir", type=Path, default=None, help="where the checkpoint is written (default: a temp dir)")
    args = parser.parse_args()

    sys.path.insert(0, str(REPO))
    from transformers import LlamaConfig

    from tests.checkpoints import write_large_checkpoint
    from tests.test_full_size import LLAMA3_8B

    root = Path(tempfile.mkdtemp(prefix="quant-compile-", dir=args.dir))
    try:
        config = LlamaConfig(
            **{**LLAMA3_8B, "num_hidden_layers": args.layers},
            tie_word_embeddings=False,
            architectures=["LlamaForCausalLM"],
        )
        ckpt = write_large_checkpoint(root / "ckpt", config)
        size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors")) / 2**30
        print(f"Llama-3-8B shape, {args.layers} layers: {size:.2f} GiB of bf16", flush=True)
        for mode in args.modes.split(","):
            start = time.perf_counter()
            run = subprocess.run(
                [sys.executable, "-c", COMPILE, str(ckpt), str(root / mode), mode], capture_output=True, text=True
            )
            wall = time.perf_counter() - start
            if run.returncode:
                raise SystemExit(f"--quant {mode} failed:\n{run.stderr[-3000:]}")
            print(f"--quant {mode}: {wall:.1f} s, peak RSS {int(run.stdout.split()[-1]) / 2**20:.2f} GiB", flush=True)
            shutil.rmtree(root / mode)
    finally:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
