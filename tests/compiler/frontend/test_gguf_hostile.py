"""Hostile GGUF files: each one loads or fails with one line (an LlmcError), in bounded time and memory, and
never gives a silently wrong result. The files are written byte by byte (gguf_raw), from a one-layer model with
the vocabulary each test needs or from the tiny checkpoints' files.
"""

import pytest
from tokenizers import Tokenizer

from llmc.compiler.frontend.load import load_checkpoint
from tests.compiler.frontend.bounded import run_bounded
from tests.compiler.frontend.gguf_raw import tiny_llama

SPECIALS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
SPECIAL_TYPES = [2, 3, 3] + [6] * 256


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "llmc_cache"))


def _sentencepiece(pieces: list[str]):
    """SentencePiece tokens: the specials and bytes, then `pieces` scored best first."""
    tokens = SPECIALS + pieces
    scores = [0.0] * len(SPECIALS) + [-float(i) for i in range(len(pieces))]
    return tiny_llama(tokens, scores, SPECIAL_TYPES + [1] * len(pieces))


def _load_and_encode(path):
    ckpt = load_checkpoint(path)
    return Tokenizer.from_file(str(ckpt.tokenizer_path)).encode("x" * 50 + " hello").ids


# Vocabularies whose implied merges are quadratic in a piece's length (every split of x^n into x^i + x^(n-i)),
# or one piece of 400k characters; each file is under 1 MB.
QUADRATIC = {
    "x2_to_x800": ["x" * n for n in range(2, 801)],
    "x1_to_x800": ["x" * n for n in range(1, 801)],
    "x1_to_x1300": ["x" * n for n in range(1, 1301)],
    "one_400k_piece": ["x", "▁", "x" * 400_000],
}


@pytest.mark.parametrize("case", QUADRATIC)
def test_sentencepiece_vocabulary_of_long_pieces_is_bounded(case, tmp_path):
    path = tmp_path / "m.gguf"
    path.write_bytes(_sentencepiece(QUADRATIC[case]).to_bytes())
    assert path.stat().st_size < 1 << 20
    out = run_bounded(lambda: _load_and_encode(path), seconds=10, memory=1 << 30)
    assert out.kind in ("ok", "error"), str(out)
    assert "\n" not in str(out.value)
    assert out.wall < 2.0, str(out)
    assert out.peak is None or out.peak < 300 << 20, str(out)


def _all_splits(vocab, scores):
    """The merges as transformers' generate_merges lists them: every split, by brute force."""
    merges = []
    for piece, score in scores.items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]  # fmt: skip
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def test_sentencepiece_merges_are_every_split(tmp_path):
    """The bounded scan finds the same merges, in the same order, as trying every split: on a trained vocabulary
    with runs of spaces and dashes added (the most overlapping pieces real vocabularies have) and tied scores."""
    from llmc.compiler.frontend.gguf_tokenizer import _sentencepiece_merges
    from tests.compiler.frontend.test_gguf import _sentencepiece_vocab

    tokens, _, scores = _sentencepiece_vocab()
    tokens = tokens + ["▁" * n for n in range(2, 17)] + ["-" * n for n in range(1, 17)] + ["▁▁▁▁ab", "ab▁▁"]
    scores = scores + [-float(n % 5) for n in range(len(tokens) - len(scores))]
    vocab, scored = {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True))
    want = _all_splits(vocab, scored)
    assert len(want) > 200 and _sentencepiece_merges(vocab, scored, tmp_path) == want
