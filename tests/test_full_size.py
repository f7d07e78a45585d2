"""Compile at full size (DESIGN.md, Scale): an 8B Llama checkpoint on this 2-core, 24 GB machine.

The checkpoint is written to disk shard by shard (zeros: compile never reads values for their meaning).
The compile runs in a subprocess so its peak RSS can be measured; it must stay far under the weights'
size, which proves they are streamed, never held. Its wall time is printed, not asserted (benchmarks are
never timed assertions); the figure belongs in the notes.
"""

import math
import shutil
import subprocess
import sys
import time

import pytest

from tests.checkpoints import write_large_checkpoint

LLAMA3_8B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
)

# Compile in a fresh process and print its own peak RSS (KiB) last.
_COMPILE = """
import resource, sys
from llmc.compiler.compile import compile_checkpoint
compile_checkpoint(sys.argv[1], target=sys.argv[2], output=sys.argv[3])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    """A 15 GiB checkpoint on disk, removed after the module's tests (disks here are not large)."""
    from transformers import LlamaConfig

    from llmc.compiler.frontend.config import parse_config

    ckpt = tmp_path_factory.mktemp("llama3-8b")
    config = LlamaConfig(**LLAMA3_8B, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    # The checkpoint and one artifact of the same size live on disk together, plus room for the build.
    weight_bytes = sum(math.prod(s) * 2 for s in parse_config(config.to_dict()).weight_shapes().values())
    need, free = 2 * weight_bytes + (2 << 30), shutil.disk_usage(ckpt).free
    if free < need:
        pytest.skip(f"needs {need / 2**30:.0f} GiB free under {ckpt.parent}, has {free / 2**30:.0f} GiB")
    yield write_large_checkpoint(ckpt, config)
    shutil.rmtree(ckpt, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.parametrize("target", ["sm90", "cpu"])
def test_compile_8b_streams_weights(target, llama8b, tmp_path):
    ckpt = llama8b
    weight_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    out = tmp_path / f"llama8b.{target}"
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _COMPILE, str(ckpt), target, str(out)], capture_output=True, text=True)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr[-3000:]
    peak_rss = int(proc.stdout.split()[-1]) * 1024  # the compiling process itself, not g++/nvcc
    print(
        f"\n8B compile for {target}: {wall:.1f} s, peak RSS {peak_rss / 2**30:.2f} GiB, "
        f"weights {weight_bytes / 2**30:.1f} GiB"
    )
    assert peak_rss < weight_bytes / 4, f"peak RSS {peak_rss} is not far under the weights ({weight_bytes})"
    assert (out / "manifest.json").is_file()
    shutil.rmtree(out)
