"""runtime/scoring.py: perplexity over windows, with cache slots from the KV cache manager."""

import math

import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.scoring import perplexity
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, context_logits


def reference_perplexity(ids: list[int], window: int, config: FakeConfig) -> tuple[float, int]:
    """Without any cache: each token's log-probability from the fake model's logits of its window's prefix."""
    nll, count = 0.0, 0
    for w in range(0, len(ids), window):
        chunk = ids[w : w + window]
        for i in range(len(chunk) - 1):
            logits = context_logits(np.asarray(chunk[: i + 1]), config.vocab_size).astype(np.float64)
            nll += np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[chunk[i + 1]]
            count += 1
    return math.exp(nll / count), count


@pytest.mark.parametrize("max_num_logits", [1, 16, 256])  # rows scored per step: one, a chunk, a whole window
@pytest.mark.parametrize("num_blocks, window", [(64, 100), (4, 64)])  # the context, or the whole cache if smaller
def test_perplexity_matches_a_cacheless_reference_over_windows(num_blocks, window, max_num_logits):
    config = FakeConfig(max_position_embeddings=100)
    model = FakeModel(config, num_blocks=num_blocks, block_size=16, max_num_logits=max_num_logits)
    ids = [int(t) for t in np.random.default_rng(0).integers(2, config.vocab_size, 230)]
    got = perplexity(model, ids)
    want, count = reference_perplexity(ids, window, config)
    assert got.num_tokens == count and got.perplexity == pytest.approx(want, rel=1e-9)
    assert got.tokens_per_s > 0
    windows = [min(window, len(ids) - w) - 1 for w in range(0, len(ids), window)]
    assert model.num_steps == sum(-(-n // max_num_logits) for n in windows), (
        "each step scores up to max_num_logits rows"
    )


def test_perplexity_needs_two_tokens():
    with pytest.raises(RequestError, match="at least 2"):
        perplexity(FakeModel(), [5])
