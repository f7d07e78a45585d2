#!/usr/bin/env python
"""llmc's quantization against llama.cpp's file types of the same weights, by quality, all run by llmc.

    python benchmarks/quant_quality.py [CHECKPOINT] [--calibration FILE] [--types Q4_0,Q4_K_M,...] [--modes ...]
                                       [--tokens N]

The checkpoint (default: the bundled model; a GGUF file is taken at its values, dequantized) is written as an F32
GGUF (llmc.compiler.frontend.gguf_write) and quantized to each llama.cpp type by llama.cpp itself
(llama-cpp-python's llama_model_quantize, no imatrix); llmc imports each file exactly and compiles it, and compiles the checkpoint with each `--quant` mode. Every build is
measured against the unquantized build on the same tokens: the first --tokens (default 2,048, what the quality
gate scores; 0: all of it) of the bundled model's held-out text, or --calibration, scored in windows of the
model's context as the gate scores them: mean KL, top-1 agreement and the perplexity change
(tools/quality.measure_artifacts), and its weights' bytes. At 2,048 tokens a perplexity change of a few tenths of a
percent is within its noise; a longer text steadies it. Needs the `bench` extra (llama-cpp-python).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from llamacpp_peer import llama_cpp_quantize

from llmc.examples import bundled_checkpoint

DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K_M", "Q5_K_M", "Q6_K")  # llama.cpp's file types (LLAMA_FTYPE_MOSTLY_<type>)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path, default=None)
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--types", default=",".join(DEFAULT_TYPES))
    parser.add_argument("--modes", default="int8,q8_0,int4,q4_k,q4_k_m")
    parser.add_argument("--tokens", type=int, default=None, help="tokens to score (default 2048; 0: the whole text)")
    args = parser.parse_args()

    from llmc.compiler.frontend.gguf_write import write_gguf
    from llmc.compiler.frontend.load import load_checkpoint
    from llmc.compiler.quant import QuantConfig
    from llmc.tools.build import compile_checkpoint
    from llmc.tools.quality import DEFAULT_CALIBRATION_TOKENS, calibration_tokens, measure_artifacts

    src = args.checkpoint or bundled_checkpoint()
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        f32 = write_gguf(src, root / "f32.gguf", "F32")
        if src.suffix == ".gguf":  # a quantized download: every build starts from its values, unquantized
            src = f32
        tokens = DEFAULT_CALIBRATION_TOKENS if args.tokens is None else args.tokens or sys.maxsize
        ids, label = calibration_tokens(load_checkpoint(src).tokenizer_path, args.calibration, tokens)
        reference = compile_checkpoint(src, target="cpu", output=root / "reference")
        builds = []
        for name in args.types.split(","):
            gguf = llama_cpp_quantize(f32, root / f"{name}.gguf", name)
            builds.append((f"llama.cpp {name}", compile_checkpoint(gguf, target="cpu", output=root / name)))
        for mode in args.modes.split(","):
            out = compile_checkpoint(
                src, target="cpu", output=root / mode, quant=QuantConfig(mode), calibration=args.calibration
            )
            builds.append((f"--quant {mode}", out))
        print(f"{src}: {len(ids)} tokens of {label}, against the unquantized build")
        print("| build | mean KL | top-1 | perplexity | weights |\n|---|---|---|---|---|")
        for name, art in builds:
            q = measure_artifacts(reference, art, ids, label)
            size = (art / "weights.safetensors").stat().st_size
            print(
                f"| {name} | {q.kl_mean:.5f} | {100 * q.top1_agreement:.1f}% | "
                f"{100 * (q.ppl_quantized / q.ppl_reference - 1):+.2f}% | {size / 1e6:.2f} MB |",
                flush=True,
            )


if __name__ == "__main__":
    main()
