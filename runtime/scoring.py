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
from collections.abc import Sequence

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


def perplexity(model, token_ids: Sequence[int]) -> Perplexity:
    """exp(mean negative log-likelihood) of each token given those before it in its window.

    model: the CompiledModel interface (config, block_size, num_blocks, max_num_tokens, max_num_logits, step),
    idle: scoring uses its cache.
    """
    ids = [int(t) for t in token_ids]
    if len(ids) < 2:
        raise RequestError(f"the text has {len(ids)} token(s); perplexity needs at least 2", param="prompt")
    kv_cache = KVCacheManager(model.num_blocks, model.block_size, sliding_window=int(model.config.kv_window))
    window = min(int(model.config.max_context), kv_cache.max_num_tokens)
    step_tokens = min(model.max_num_tokens, model.max_num_logits)
    nll, count = 0.0, 0
    start = time.perf_counter()
    for w in range(0, len(ids), window):
        chunk, req_id = ids[w : w + window], f"window-{w}"
        try:
            # the last token of a window has no next token to score, so it never runs
            for i in range(0, len(chunk) - 1, step_tokens):
                new = chunk[i : min(i + step_tokens, len(chunk) - 1)]
                if not kv_cache.allocate_slots(req_id, len(new)):
                    raise AssertionError(f"{window} tokens do not fit the cache they were sized for")
                batch = StepBatch.build([new], [i], [kv_cache.block_ids(req_id)], model.block_size,
                                        num_logits=[len(new)])  # fmt: skip
                for row, logits in enumerate(model.step(batch)):
                    nll -= float(log_softmax(logits)[chunk[i + row + 1]])
                count += len(new)
        finally:
            if req_id in kv_cache:
                kv_cache.free(req_id)
    return Perplexity(math.exp(nll / count), count, time.perf_counter() - start)
