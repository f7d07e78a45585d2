"""Test doubles for the runtime: a fake CompiledModel and tiny tokenizers trained on the spot.

The fake model really uses the paged KV cache, so paging and scheduling bugs change outputs.

Its "cache" is int64 [num_blocks, block_size]: step() writes each new token id at its slot_mapping, then
reads every sequence's whole context back through its block table and derives the logits from a hash of
it. A wrong slot, a stale or shared block, a wrong position or a lost token all give different logits.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
from tokenizers import SentencePieceBPETokenizer, Tokenizer, decoders, models, pre_tokenizers, trainers

from llmc.runtime.batch import StepBatch


@dataclasses.dataclass(frozen=True)
class FakeConfig:
    vocab_size: int = 64
    max_position_embeddings: int = 512
    eos_token_ids: tuple[int, ...] = (1,)
    kv_window: int = 0

    @property
    def max_context(self) -> int:
        return self.max_position_embeddings


def context_logits(context: np.ndarray, vocab_size: int) -> np.ndarray:
    """float32 [vocab]: a deterministic function of every token of the context, in order."""
    digest = hashlib.blake2b(np.ascontiguousarray(context, dtype=np.int64).tobytes(), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(digest, "little"))
    return (3.0 * rng.standard_normal(vocab_size)).astype(np.float32)


class FakeModel:
    def __init__(
        self,
        config: FakeConfig | None = None,
        *,
        num_blocks=64,
        block_size=16,
        max_num_tokens=256,
        max_num_seqs=16,
        max_num_logits=None,
    ):
        self.config = config or FakeConfig()
        self.num_blocks, self.block_size = num_blocks, block_size
        self.max_num_tokens, self.max_num_seqs = max_num_tokens, max_num_seqs
        self.max_num_logits = max_num_seqs if max_num_logits is None else max_num_logits
        self.cache = np.full((num_blocks, block_size), -1, dtype=np.int64)
        self.num_steps = 0
        self.max_batch_seen = 0

    def step(self, batch: StepBatch) -> np.ndarray:
        batch.validate()
        t, b, rows = batch.num_tokens, batch.num_seqs, batch.num_logits
        assert t <= self.max_num_tokens and b <= self.max_num_seqs and rows <= self.max_num_logits, (t, b, rows)
        assert (batch.block_tables < self.num_blocks).all()
        assert (batch.slot_mapping < self.num_blocks * self.block_size).all()
        qsl = batch.query_start_loc
        for s in range(b):  # the ABI's position invariant
            n = qsl[s + 1] - qsl[s]
            expect = np.arange(batch.seq_lens[s] - n, batch.seq_lens[s])
            assert (batch.positions[qsl[s] : qsl[s + 1]] == expect).all(), "positions disagree with seq_lens"
        assert len(np.unique(batch.slot_mapping)) == t, "two tokens of one step share a cache slot"
        self.cache.reshape(-1)[batch.slot_mapping] = batch.token_ids
        logits = np.empty((rows, self.config.vocab_size), dtype=np.float32)
        for i, row in enumerate(batch.logits_indices):
            s = int(np.searchsorted(qsl, row, side="right")) - 1  # the sequence that owns token row `row`
            pos = int(batch.positions[row])
            context = self.cache[batch.block_tables[s]].reshape(-1)[: pos + 1]
            assert (context >= 0).all(), "context reads a slot never written"
            logits[i] = context_logits(context, self.config.vocab_size)
        self.num_steps += 1
        self.max_batch_seen = max(self.max_batch_seen, b)
        return logits


def reference_greedy(prompt: list[int], max_tokens: int, config: FakeConfig, max_len: int | None = None) -> list[int]:
    """What greedy decoding must give, computed without any cache, scheduler or engine."""
    max_len = max_len or config.max_context
    tokens = list(prompt)
    out: list[int] = []
    while True:
        tok = int(np.argmax(context_logits(np.asarray(tokens), config.vocab_size)))
        tokens.append(tok)
        out.append(tok)
        if tok in config.eos_token_ids or len(out) >= max_tokens or len(tokens) >= max_len:
            return out


CORPUS = [
    "hello world, this is a small corpus",
    "naïve café déjà vu",
    "日本語のテキスト",
    "emoji 🙂 and 🚀 rockets",
    "the quick brown fox jumps over the lazy dog",
] * 20


def byte_level_bpe() -> Tokenizer:
    """A tiny GPT-2/Llama-3 style byte-level BPE: few merges, so multi-byte characters span tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>"],
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def sentencepiece_bpe() -> Tokenizer:
    """A Llama-2 style Metaspace tokenizer, whose decoder strips the leading space of a decoded window."""
    sp = SentencePieceBPETokenizer()
    sp.train_from_iterator(CORPUS, vocab_size=200, show_progress=False, special_tokens=["<s>", "</s>", "<unk>"])
    return sp._tokenizer


def run_with_arrivals(engine, requests, arrivals):
    """Add request i at step arrivals[i]; step until all finish; return {i: (token ids, finish reason)}."""
    order = sorted(range(len(requests)), key=lambda i: arrivals[i])
    ids: dict[str, int] = {}
    got: dict[int, list[int]] = {i: [] for i in range(len(requests))}
    reasons: dict[int, str] = {}
    step = 0
    while order or engine.has_unfinished():
        while order and arrivals[order[0]] <= step:
            i = order.pop(0)
            prompt, params = requests[i]
            ids[engine.add_request(prompt, params)] = i
        for out in engine.step():
            got[ids[out.req_id]].extend(out.new_token_ids)
            if out.finished:
                reasons[ids[out.req_id]] = out.finish_reason
        step += 1
    return {i: (got[i], reasons[i]) for i in got}
