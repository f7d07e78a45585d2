"""Hostile GGUF files: each one loads or fails with one line (an LlmcError), in bounded time and memory, and
never gives a silently wrong result. The files are written byte by byte (gguf_raw), from a one-layer model with
the vocabulary each test needs or from the tiny checkpoints' files.
"""

import struct

import pytest
from tokenizers import Tokenizer

from llmc.compiler.frontend import gguf_names as names
from llmc.compiler.frontend.load import load_checkpoint
from tests.compiler.frontend.bounded import run_bounded
from tests.compiler.frontend.gguf_raw import Raw, V, tiny_llama

SPECIALS = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
SPECIAL_TYPES = [2, 3, 3] + [6] * 256


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "llmc_cache"))


def _sentencepiece(pieces: list[str]):
    """SentencePiece tokens: the specials and bytes, then `pieces` scored best first."""
    tokens = SPECIALS + pieces
    scores = [0.0] * len(SPECIALS) + [-float(i) for i in range(len(pieces))]
    raw = tiny_llama(tokens, scores, SPECIAL_TYPES + [1] * len(pieces))
    return raw.set(names.BOS_ID, V.UINT32, 1).set(names.EOS_ID, V.UINT32, 2)


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
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def test_sentencepiece_merges_are_every_split(tmp_path):
    """The bounded scan finds the same merges, in the same order, as trying every split: on a trained vocabulary
    with runs of spaces and dashes added (the most overlapping pieces real vocabularies have) and tied scores."""
    from llmc.compiler.frontend.gguf_tokenizer import _sentencepiece_merges
    from tests.compiler.frontend.test_gguf import _sentencepiece_vocab

    tokens, _, scores = _sentencepiece_vocab()
    tokens += ["▁" * n for n in range(2, 17)] + ["-" * n for n in range(1, 17)] + ["▁▁▁▁ab", "ab▁▁"]
    scores = scores + [-float(n % 5) for n in range(len(tokens) - len(scores))]
    vocab, scored = {t: i for i, t in enumerate(tokens)}, dict(zip(tokens, scores, strict=True))
    want = _all_splits(vocab, scored)
    assert len(want) > 200 and _sentencepiece_merges(vocab, scored, tmp_path) == want


def _outcome(raw, tmp_path, check=None):
    """Load `raw` in a bounded child: ("ok", check(checkpoint)) or ("error", its one line); anything else fails."""
    path = tmp_path / "m.gguf"
    path.write_bytes(raw.to_bytes())
    out = run_bounded(lambda: (check or (lambda c: None))(load_checkpoint(path)), seconds=20)
    assert out.kind in ("ok", "error") and "\n" not in str(out.value), str(out)
    return out.kind, out.value


def _small():
    return _sentencepiece(["▁", "h", "e", "l", "o", "▁h", "el", "lo", "▁hel", "▁hello"])


def test_deeply_nested_metadata_array_is_one_line(tmp_path):
    one_inside = struct.pack("<IQ", V.ARRAY, 1)  # an array holding one array
    value = Raw(one_inside * 599 + struct.pack("<IQii", V.INT32, 2, 1, 2))
    kind, message = _outcome(_small().set("general.nested", V.ARRAY, value), tmp_path)
    assert kind == "error" and "nested" in message


def test_shallow_nested_metadata_array_loads(tmp_path):
    """An array of arrays (which gguf-py writes) is read as before: only absurd nesting is refused."""
    assert _outcome(_small().set("general.nested", V.ARRAY, (V.ARRAY, [(V.INT32, [1, 2])] * 3)), tmp_path)[0] == "ok"


def _gpt2(merges):
    tokens = ["a", "b", "c", "ab", "<|end|>"]
    raw = tiny_llama(tokens, types=[1, 1, 1, 1, 3], model="gpt2")
    return raw.set(names.MERGES, V.ARRAY, (V.STRING, merges)).set(names.EOS_ID, V.UINT32, 4)


@pytest.mark.parametrize("merge", ["a d", "d a", "b a", "a  b"], ids=["left", "right", "result", "empty"])
def test_merge_of_a_token_outside_the_vocabulary_is_one_line(merge, tmp_path):
    kind, message = _outcome(_gpt2(["a b", merge]), tmp_path)
    assert kind == "error" and "tokenizer.ggml.merges" in message and repr(merge) in message


def _ids(ckpt, text="hello"):
    return Tokenizer.from_file(str(ckpt.tokenizer_path)).encode(text).ids


@pytest.mark.parametrize("bos", ["<s>:0", "<s> x", "$A", "$B:1", "<s>:1 $A:0"])
def test_bos_text_is_not_template_syntax(bos, tmp_path):
    """BOS is added by id whatever its text: the same ids as with BOS "<s>"."""
    want = _outcome(_small(), tmp_path, _ids)
    tokens = list(_small().get(names.TOKENS)[1])
    tokens[1] = bos
    got = _outcome(_small().set(names.TOKENS, V.ARRAY, (V.STRING, tokens)), tmp_path, _ids)
    assert want == got == ("ok", [1, 10 + len(SPECIALS) - 1])


def _offsets(raw, change):
    laid = raw.layout()
    for i, offset in change(laid).items():
        raw.tensors[i].offset = offset
    return raw


# tensor index -> its offset in the data section. The first tensor is token_embd (vocabulary x 8 floats).
OFFSETS = {
    "wraps": (lambda laid: {1: 2**64 - 1}, "offset"),
    "wraps_to_zero": (lambda laid: {1: 2**64 - laid[1]}, "offset"),
    "misaligned": (lambda laid: {1: laid[1] + 4}, "multiple of 32"),
    "overlapping": (lambda laid: {2: laid[1]}, "overlap"),
    "past_the_end": (lambda laid: {1: laid[-1] + 4096}, "past the end"),
}


@pytest.mark.parametrize("case", OFFSETS)
def test_bad_tensor_offset_is_one_line(case, tmp_path):
    change, expected = OFFSETS[case]
    kind, message = _outcome(_offsets(_small(), change), tmp_path)
    assert kind == "error" and expected in message, message


def test_tensor_shape_whose_size_wraps_is_one_line(tmp_path):
    raw = _small()
    assert raw.tensors[1].name == "output_norm.weight"
    raw.tensors[1].dims = [2**32, 2**32]  # 2^64 elements: 0 in uint64
    kind, message = _outcome(raw, tmp_path)
    assert kind == "error" and "output_norm.weight" in message, message


def test_vocabulary_longer_than_the_embedding_is_one_line(tmp_path):
    """A token past llama.vocab_size (the embedding's rows) would encode to an id the model has no row for."""
    raw = _small()
    for key, extra in ((names.TOKENS, "<extra>"), (names.TOKEN_TYPE, 3), ("tokenizer.ggml.scores", 0.0)):
        vtype, items = raw.get(key)
        raw.set(key, V.ARRAY, (vtype, items + [extra]))
    kind, message = _outcome(raw, tmp_path, lambda c: _ids(c, "<extra>"))
    assert kind == "error" and "vocab" in message, message
