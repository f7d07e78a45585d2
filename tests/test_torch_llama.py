"""benchmarks/torch_llama.py, the torch peer of the GPU check, against transformers on the tiny checkpoints:
a prefill chunk, a second chunk after it, then decode steps, each step's last logits at the full sequence's."""

import sys
from pathlib import Path

import pytest
import torch

from tests.checkpoints import VARIANTS, hf_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from torch_llama import TorchLlama  # noqa: E402

# the families the peer computes (torch_llama.ARCHITECTURES)
PEER_ARCHS = tuple(a for a, v in VARIANTS.items() if v["arch"] in ("llama", "mistral", "qwen2", "qwen3", "smollm3"))


@pytest.mark.parametrize(
    "arch,overrides",
    [*((a, {}) for a in PEER_ARCHS), ("mistral", {"sliding_window": 6})],
    ids=[*PEER_ARCHS, "mistral-window6"],
)
def test_matches_transformers(arch, overrides, checkpoint_dir):
    path = checkpoint_dir(arch, **overrides)
    reference = hf_model(path)
    peer = TorchLlama(path, max_seq=32)
    ids = torch.randint(0, peer.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = reference(ids).logits[0]
        steps = [(0, 9), (9, 14), *((p, p + 1) for p in range(14, 20))]
        for start, end in steps:
            got = peer(ids[:, start:end], torch.arange(start, end))
            torch.testing.assert_close(got[0], want[end - 1], rtol=1e-4, atol=1e-4)
