"""Scoring text: the log-likelihood of every next token under a model (`llmc eval ppl`).

The text is cut into windows of the model's context (or of the whole KV cache, if smaller); each window
starts from an empty cache. Its cache slots come from the runtime's `KVCacheManager`, like any request's.
A window runs as prefill chunks of up to min(max_num_tokens, max_num_logits) tokens, each step asking for
the logits of every one of its rows (StepBatch num_logits), so a window of n tokens takes about
n / max_num_logits steps; the logits are those of the full-sequence forward, with no approximation.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator, Sequence

import numpy as np

from llmc.errors import RequestError
from llmc.runtime.batch import StepBatch
from llmc.runtime.kv_cache import KVCacheManager
from llmc.runtime.sampling import log_softmax


@dataclasses.dataclass(frozen=True)
class Perplexity:
    perplexity: float
    num_tokens: int  # tokens scored: each window's tokens after its first
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        return self.num_tokens / self.seconds if self.seconds > 0 else 0.0


def next_token_logits(model, token_ids: Sequence[int]) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Per step: the logits rows [n, vocab] of a chunk of a window and the next tokens [n] they predict.

    model: the CompiledModel interface (config, block_size, num_blocks, max_num_tokens, max_num_logits, step),
    idle: scoring uses its cache. Two models loaded alike (same config, block size, cache and step sizes) cut
    the text into the same windows and steps, so their rows can be compared one for one.
    """
    ids = [int(t) for t in token_ids]
    kv_cache = KVCacheManager(model.num_blocks, model.block_size, sliding_window=int(model.config.kv_window))
    window = min(int(model.config.max_context), kv_cache.max_num_tokens)
    step_tokens = min(model.max_num_tokens, model.max_num_logits)
    for w in range(0, len(ids), window):
        chunk, req_id = ids[w : w + window], f"window-{w}"
        try:
            # the last token of a window has no next token to score, so it never runs
            for i in range(0, len(chunk) - 1, step_tokens):
                new = chunk[i : min(i + step_tokens, len(chunk) - 1)]
                if not kv_cache.allocate_slots(req_id, len(new)):
                    raise AssertionError(f"{window} tokens do not fit the cache they were sized for")
                batch = StepBatch.build(
                    [new],
                    [i],
                    [kv_cache.block_ids(req_id)],
                    model.block_size,
                    num_logits=[len(new)],
                    seq_totals=[len(chunk) - 1],  # the window's tokens that run (LongRoPE's switch)
                )
                yield model.step(batch), np.asarray(chunk[i + 1 : i + 1 + len(new)])
        finally:
            if req_id in kv_cache:
                kv_cache.free(req_id)


def perplexity(model, token_ids: Sequence[int]) -> Perplexity:
    """exp(mean negative log-likelihood) of each token given those before it in its window."""
    if len(token_ids) < 2:
        raise RequestError(f"the text has {len(token_ids)} token(s); perplexity needs at least 2", param="prompt")
    nll, count = 0.0, 0
    start = time.perf_counter()
    for logits, targets in next_token_logits(model, token_ids):
        for row, target in zip(logits, targets, strict=True):
            nll -= float(log_softmax(row)[target])
        count += len(targets)
    return Perplexity(math.exp(nll / count), count, time.perf_counter() - start)
