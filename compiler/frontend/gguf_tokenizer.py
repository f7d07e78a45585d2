"""A GGUF file's tokenizer, rebuilt from its token lists as a `tokenizers` tokenizer the way transformers' GGUF
conversion does (`gpt2`: byte-level BPE from tokens and merges, with the pre-tokenizer that
`tokenizer.ggml.pre` names; `llama`: SentencePiece BPE from tokens and scores, with byte fallback), but for
SentencePiece's dummy prefix, which is added as llama.cpp adds it. It is written as tokenizer.json under
llmc's cache, named by its content.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import gguf

from llmc.errors import CheckpointError, UnsupportedModelError
from llmc.host import cache_root

from . import gguf_names as names
from .gguf_reader import GGUFMetadata

# tokenizer.ggml.pre -> (the split regex its merges were learned with, whether a pre-token found whole in the
# vocabulary skips the merges, whether BOS is added when the file does not say), as llama.cpp's llama-vocab.cpp
# sets them; the regexes are transformers' GGUF conversion's. None: GPT-2's, ByteLevel's built-in one.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE = {
    "gpt-2": (None, False, False),
    "default": (None, False, False),
    "llama-bpe": (_LLAMA3_SPLIT, True, True),
    "llama3": (_LLAMA3_SPLIT, True, True),
    "llama-v3": (_LLAMA3_SPLIT, True, True),
    "smaug-bpe": (_LLAMA3_SPLIT, False, False),
    "qwen2": (_QWEN2_SPLIT, False, False),
    "deepseek-r1-qwen": (_QWEN2_SPLIT, False, False),
}


def gguf_tokenizer(meta: GGUFMetadata, tokens: list, path: Path) -> tuple[dict, str | None, Path]:
    """(special token texts, chat template, tokenizer.json path) from the tokenizer.* metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model = meta.get(names.TOKENIZER_MODEL, str)
    types = meta.get(names.TOKEN_TYPE, list, [names.TOKEN_NORMAL] * len(tokens))
    if not all(isinstance(t, str) for t in tokens) or len(types) != len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.tokens / token_type are malformed", "re-convert the model")
    ids = {t: i for i, t in enumerate(tokens)}  # a repeated text maps to its last id, as in llama.cpp
    bos, eos = meta.get(names.BOS_ID, int, None), meta.get(names.EOS_ID, int, None)
    if model == "gpt2":
        pairs = _merges(meta, ids, path)
        pre = meta.get(names.TOKENIZER_PRE, str, "default")
        if pre not in _PRE:
            raise UnsupportedModelError(
                f"{path}: GGUF pre-tokenizer {pre!r} is not supported", f"llmc imports {', '.join(sorted(_PRE))}"
            )
        split, ignore_merges, bos_default = _PRE[pre]
        tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, ignore_merges=ignore_merges))
        if split is None:
            tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        else:
            regex = pre_tokenizers.Split(Regex(split), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [regex, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
            )
        tok.decoder = decoders.ByteLevel()
        add_bos = meta.get(names.ADD_BOS, bool, bos_default)
    elif model == "llama":
        scores = meta.get(gguf.Keys.Tokenizer.SCORES, list)
        if len(scores) != len(tokens) or not all(isinstance(s, (int, float)) for s in scores):
            raise CheckpointError(f"{path}: tokenizer.ggml.scores is not one number per token", "re-convert it")
        unk = meta.get(gguf.Keys.Tokenizer.UNK_ID, int, None)
        scored = dict(zip(tokens, scores, strict=True))
        merges = (
            _merges(meta, ids, path) if names.MERGES in meta.reader.fields else _sentencepiece_merges(ids, scored, path)
        )
        bpe = models.BPE(
            vocab=ids,
            merges=merges,
            unk_token=tokens[unk] if unk is not None and 0 <= unk < len(tokens) else None,
            fuse_unk=True,
            byte_fallback=True,
        )
        tok = Tokenizer(bpe)
        prefix = meta.get(gguf.Keys.Tokenizer.ADD_PREFIX, bool, True)
        # SentencePiece's dummy prefix, as llama.cpp adds it: before every run of text (the start, and after each
        # special token), even one that starts with spaces. (transformers' Metaspace skips text that starts
        # with a space, so "  x" would lose one.)
        spaces = normalizers.Replace(" ", "▁")
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
        add_bos = meta.get(names.ADD_BOS, bool, True)  # llama.cpp adds BOS to SentencePiece unless told not to
    else:
        raise UnsupportedModelError(
            f"{path}: GGUF tokenizer model {model!r} is not supported",
            "llmc imports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece) tokenizers",
        )
    # Control tokens stay whole and are skipped when decoding; user-defined ones stay whole only.
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == names.TOKEN_CONTROL
        ]
    )
    tok.add_tokens(
        [
            AddedToken(t, special=False, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == names.TOKEN_USER_DEFINED
        ]
    )
    for which, i in (("bos", bos), ("eos", eos)):
        if i is not None and not 0 <= i < len(tokens):
            raise CheckpointError(f"{path}: {which} token id {i} is past the {len(tokens)} tokens", "re-convert it")
    if add_bos and bos is not None:
        # BOS by id under a placeholder name: its text (any text: "$A", "<s>:1", "a b") stays out of the template
        bos_token = {"id": "bos", "ids": [bos], "tokens": [tokens[bos]]}
        tok.post_processor = processors.TemplateProcessing(
            single="bos:0 $A:0", pair="bos:0 $A:0 bos:1 $B:1", special_tokens=[bos_token]
        )
    special = {k: tokens[i] for k, i in (("bos_token", bos), ("eos_token", eos)) if i is not None}
    return special, meta.get(names.CHAT_TEMPLATE, str, None), _save_tokenizer(tok.to_str())


def _merges(meta: GGUFMetadata, vocab: dict[str, int], path: Path) -> list[tuple[str, str]]:
    """The file's merges as pairs; each of a, b and a + b must be a token (the BPE model refuses others)."""
    merges = meta.get(names.MERGES, list)
    pairs = [tuple(m.split(" ", 1)) for m in merges if isinstance(m, str) and " " in m]
    if len(pairs) != len(merges):
        raise CheckpointError(f"{path}: tokenizer.ggml.merges holds an entry that is not 'a b'", "re-convert it")
    for i, (a, b) in enumerate(pairs):
        if a not in vocab or b not in vocab or a + b not in vocab:
            raise CheckpointError(
                f"{path}: tokenizer.ggml.merges[{i}] {merges[i][:80]!r} names a token outside the vocabulary",
                "re-convert the model",
            )
    return pairs


# What a SentencePiece vocabulary's merges may cost: characters of merges per character of the vocabulary. A trained
# vocabulary implies about twice its own text (Mistral's 32000 pieces: 161k characters, 325k of merges); pieces
# that overlap far more (x, xx, xxx, ...: cubic in the longest) are refused rather than built.
MERGE_TEXT_PER_CHAR = 16


def _sentencepiece_merges(vocab: dict[str, int], scores: dict[str, float], path: Path) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, for a file that lists none: every split of a piece
    into two pieces, best score first (transformers' generate_merges, which its GGUF conversion uses).

    A piece is split only where both sides have a length some piece has, the shorter side looked up first:
    a piece costs a lookup per length the vocabulary has below its own, not a slice per character (one piece
    of 400k characters took 33 s). CheckpointError past MERGE_TEXT_PER_CHAR characters of merges per character
    of the vocabulary."""
    lengths = sorted({len(t) for t in vocab})
    has_length = set(lengths)
    budget, used = MERGE_TEXT_PER_CHAR * sum(map(len, vocab)) + 4096, 0
    merges = []
    for piece, score in scores.items():
        n, local = len(piece), []
        for i in lengths:
            if i >= n:
                break
            if n - i not in has_length:
                continue
            left_first = 2 * i <= n  # the shorter side first: most lookups fail there, cheaply
            first = piece[:i] if left_first else piece[i:]
            if first in vocab:
                second = piece[i:] if left_first else piece[:i]
                if second in vocab:
                    local.append((first, second, score) if left_first else (second, first, score))
        used += n * len(local)
        if used > budget:
            raise CheckpointError(
                f"{path}: the SentencePiece vocabulary implies over {budget} characters of BPE "
                f"merges ({MERGE_TEXT_PER_CHAR} per character of its pieces); its pieces overlap far "
                "more than a trained vocabulary's",
                "re-convert the model",
            )
        merges += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _save_tokenizer(text: str) -> Path:
    """tokenizer.json under llmc's cache, named by its content: the same file imports to the same path."""
    folder = cache_root() / "gguf-tokenizers" / hashlib.sha256(text.encode()).hexdigest()[:32]
    out = folder / "tokenizer.json"
    if not out.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".tokenizer.json.{os.getpid()}"
        tmp.write_text(text)
        os.replace(tmp, out)
    return out
