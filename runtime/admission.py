"""What a request must satisfy to be served at all: a prompt that fits the model's context, the KV cache and
max_model_len, token ids inside the vocabulary, and sampling parameters the model can honour. The engine
checks each request here before it is queued; a server checks it before it answers, so a bad request gets
its 400 at once."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from llmc.errors import RequestError
from llmc.sampling_params import SamplingParams


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    context_len: int  # the model's max_position_embeddings
    max_model_len: int  # the longest sequence the engine serves (context, cache and its own cap)
    cache_tokens: int  # the most tokens the KV cache holds
    cache_blocks: int
    block_size: int

    def check(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise RequestError if the request can never be served.

        Lengths are checked before the tokens, so an oversized prompt costs no scan.
        """
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError(
                "the prompt is empty", "give at least one token (most models want BOS first)", param="prompt"
            )
        if n > self.context_len:
            raise RequestError(
                f"the prompt has {n} tokens, more than the model's context of {self.context_len} tokens "
                "(max_position_embeddings)",
                "shorten the prompt",
                param="prompt",
            )
        if n > self.cache_tokens:
            raise RequestError(
                f"the prompt has {n} tokens, but the KV cache can hold at most {self.cache_tokens} "
                f"({self.cache_blocks} blocks of {self.block_size})",
                "give the cache more memory (--kv-cache-memory) or shorten the prompt",
                param="prompt",
            )
        if n > self.max_model_len:
            raise RequestError(
                f"the prompt has {n} tokens, more than max_model_len={self.max_model_len}",
                "shorten the prompt",
                param="prompt",
            )
        bad = [t for t in prompt_token_ids if not (isinstance(t, (int, np.integer)) and 0 <= t < self.vocab_size)]
        if bad:
            raise RequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary",
                f"ids must be in [0, {self.vocab_size})",
                param="prompt",
            )
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise RequestError(
                f"stop_token_ids {params.stop_token_ids[:5]} reach outside the vocabulary",
                f"ids must be in [0, {self.vocab_size})",
                param="stop_token_ids",
            )
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise RequestError(
                f"logprobs={params.logprobs} exceeds the vocabulary ({self.vocab_size})", param="logprobs"
            )
