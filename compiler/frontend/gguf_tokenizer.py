"""A GGUF file's tokenizer, rebuilt from its token lists as a `tokenizers` tokenizer the way transformers' GGUF
conversion does (`gpt2`: byte-level BPE from tokens and merges; `llama`: SentencePiece BPE from tokens and
scores, with byte fallback), but for the splits before byte-level BPE, which are llama.cpp's for the
`tokenizer.ggml.pre` it names, and SentencePiece's dummy prefix, which is added as llama.cpp adds it. It is
written as tokenizer.json under llmc's cache, named by its content.
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

# tokenizer.ggml.pre -> (split regexes, ignore_merges, add_bos default) for a byte-level BPE vocabulary, as
# llama.cpp's llama-vocab.cpp sets them: the regexes run one after another, each on every piece the one before left;
# ignore_merges: a pre-token found whole in the vocabulary skips the merges; add_bos: whether BOS is added when the
# file does not say. A GGUF file's ids are llama.cpp's, so these are the regexes as llama.cpp's unicode.cpp runs
# them, which is not always as they read (nor as the model's tokenizer.json wrote them):
# - a regex with \p{..} runs on text where each non-ASCII character stands for its category, so \p{Lu}, \p{Ll},
#   \p{Lt}, \p{Lm} and \p{Lo} all match any letter (tiny_aya, youtu);
# - the others run on text whose non-ASCII white space is \v, which their literal ranges never match (&&\S, and
#   U+3000 left out of deepseek-llm's punctuation); their \d is [0-9] and their $ the end of the piece (\z);
# - some run as hand-written code instead: GPT-2's regex takes \s+ as well, Kimi-K2's letters have no case and
#   its Han is a list of ranges, and digits grouped in threes from the right keep the text before a number with
#   the number's first group.
_CONTRACTION = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_DIGITS_BY_THREE = r"[^\p{N}]*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_DEEPSEEK_LETTERS = (
    r"\s?[A-Za-z\x{B5}\x{C0}-\x{D6}\x{D8}-\x{F6}\x{F8}-\x{1BA}\x{1BC}-\x{1BF}\x{1C4}-\x{293}\x{295}-\x{2AF}"
    r"\x{370}-\x{373}\x{376}\x{377}\x{37B}-\x{37D}\x{37F}\x{386}\x{388}-\x{38A}\x{38C}\x{38E}-\x{3A1}"
    r"\x{3A3}-\x{3F5}\x{3F7}-\x{481}\x{48A}-\x{52F}\x{531}-\x{556}\x{10A0}-\x{10C5}\x{13A0}-\x{13F5}"
    r"\x{13F8}-\x{13FD}\x{1C90}-\x{1CBA}\x{1CBD}-\x{1CBF}\x{1D00}-\x{1D2B}\x{1D6B}-\x{1D77}\x{1D79}-\x{1D9A}"
    r"\x{1E00}-\x{1F15}\x{1F18}-\x{1F1D}\x{1F20}-\x{1F45}\x{1F48}-\x{1F4D}\x{1F50}-\x{1F57}\x{1F59}\x{1F5B}"
    r"\x{1F5D}\x{1F5F}-\x{1F7D}\x{1F80}-\x{1FB4}\x{1FB6}-\x{1FBC}\x{1FBE}\x{1FC2}-\x{1FC4}\x{1FC6}-\x{1FCC}"
    r"\x{1FD0}-\x{1FD3}\x{1FD6}-\x{1FDB}\x{1FE0}-\x{1FEC}\x{1FF2}-\x{1FF4}\x{1FF6}-\x{1FFC}\x{2102}\x{2107}"
    r"\x{210A}-\x{2113}\x{2115}\x{2119}-\x{211D}\x{2124}\x{2126}\x{2128}\x{212A}-\x{212D}\x{212F}-\x{2134}\x{2139}"
    r"\x{213C}-\x{213F}\x{2145}-\x{2149}\x{214E}\x{2183}\x{2184}\x{2C00}-\x{2C7B}\x{2C7E}-\x{2CE4}"
    r"\x{2CEB}-\x{2CEE}\x{2CF2}\x{2CF3}\x{A640}-\x{A66D}\x{A680}-\x{A69B}\x{A722}-\x{A76F}\x{A771}-\x{A787}"
    r"\x{A78B}-\x{A78E}\x{AB70}-\x{ABBF}\x{FB00}-\x{FB06}\x{FB13}-\x{FB17}\x{FF21}-\x{FF3A}\x{FF41}-\x{FF5A}"
    r"\x{10400}-\x{1044F}\x{104B0}-\x{104D3}\x{104D8}-\x{104FB}\x{10C80}-\x{10CB2}\x{10CC0}-\x{10CF2}"
    r"\x{118A0}-\x{118DF}\x{1E900}-\x{1E943}]+"
)
_DEEPSEEK_PUNCT = r"\s?[!-/:-~\x{FF01}-\x{FF0F}\x{FF1A}-\x{FF5E}\x{2018}-\x{201F}\x{3001}-\x{3002}]+"
_CJK = r"[\x{4E00}-\x{9FA5}\x{800}-\x{4E00}\x{AC00}-\x{D7FF}&&\S]+"
_HAN_KANA = r"[\x{4E00}-\x{9FA5}\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
_YOUTU_CJK = (
    r"[\x{AC00}-\x{D7A3}\x{3131}-\x{318E}]+|[\x{FF01}\x{2026}\x{201C}\x{201D}\x{2018}\x{2019}\x{2014}\x{FF1A}"
    r"\x{FF1B}\x{FF0C}\x{3001}-\x{303F}\x{FE30}-\x{FE4F}]+|[\x{3105}-\x{312F}]+|[\x{4E00}-\x{9FA5}"
    r"\x{3040}-\x{309F}\x{30A0}-\x{30FF}]+"
)
_AFMOE_CJK = (
    r"[\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{8C48}-\x{FAFF}\x{3040}-\x{309F}\x{30A0}-\x{30FF}\x{FF65}-\x{FF9F}"
    r"\x{2F00}-\x{2FDF}\x{E40}-\x{E7F}\x{E80}-\x{EFF}\x{1780}-\x{17FF}\x{1000}-\x{109F}\x{AA60}-\x{AA7F}"
    r"\x{A9E0}-\x{A9FF}\x{AC00}-\x{D7AF}\x{1100}-\x{11FF}]+"
)
_ASCII_PUNCT_WORD = r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"""
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    _HAN_KANA,
    _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_UPPER_LOWER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+"
_UPPER = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*"
_GPT4O = (
    f"{_UPPER_LOWER}{_CONTRACTION}?|{_UPPER}{_CONTRACTION}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SENTENCE = r" ?[^(\s|.,!?\x{2026}\x{3002}\x{FF0C}\x{3001}\x{964}\x{6D4}\x{60C})]+"
_HAN = r"\x{4E00}-\x{9FFF}\x{3400}-\x{4DBF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}\x{F900}-\x{FAFF}\x{2F800}-\x{2FA1F}"
_PRE_TYPES = (  # (pre strings, regexes, ignore_merges, add_bos)
    (("default",), (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"), False, False),
    (
        ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum"),
        (_GPT2,),
        False,
        False,
    ),
    (("modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"), (_GPT2,), False, False),
    (
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"),
        (_LLAMA3,),
        True,
        True,
    ),
    (("dbrx", "smaug-bpe", "chatglm-bpe"), (_LLAMA3,), False, False),
    (("glm4", "glm5"), (_LLAMA3,), True, False),
    (
        ("jais-2",),
        (
            _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s{512}(?!\S)"
            r"|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)"
            r"|\s{1,2}(?!\S)|\s{1}",
        ),
        False,
        False,
    ),
    (
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan", "solar-open", "grok-2"),
        (_QWEN2,),
        False,
        False,
    ),
    (
        ("qwen35",),
        (
            _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+",
        ),
        False,
        False,
    ),
    (("laguna",), (r"[^\n]+|[\n]+", _QWEN2), False, False),
    (
        ("ufakzeka",),
        (r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
        False,
        False,
    ),
    (
        ("minicpm5",),
        (
            r"\p{N}{1,3}",
            _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        True,
        False,
    ),
    (
        ("seed-coder",),
        (_CONTRACTION + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+",),
        False,
        False,
    ),
    (
        ("bailingmoe", "bailingmoe2", "llada-moe"),
        (
            r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        False,
        False,
    ),
    (
        ("exaone-moe",),
        (
            _CONTRACTION + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
            r"|\s*[\r\n]|\s+(?!\S)|\s+",
        ),
        False,
        False,
    ),
    (
        ("starcoder", "refact", "command-r", "smollm", "codeshell", "exaone", "minerva-7b", "mellum2"),
        (r"\p{N}", _GPT2),
        False,
        False,
    ),
    (("falcon",), (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"), False, False),
    (("poro-chat", "bloom", "gpt3-finnish"), (_SENTENCE,), False, False),
    (("viking",), (_SENTENCE, r"\p{N}"), False, False),
    (
        ("deepseek-llm",),
        (r"[\r\n]", _DEEPSEEK_LETTERS, _DEEPSEEK_PUNCT, r"\s+\z", _CJK, r"\p{N}+"),
        False,
        False,
    ),
    (("deepseek-coder",), (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"), False, False),
    (("deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"), _DEEPSEEK3, False, False),
    (
        ("spark2_5",),
        (
            *_DEEPSEEK3[:2],
            _ASCII_PUNCT_WORD + r"|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]|\s+(?!\S)|\s+",
            r"\p{N}",
        ),
        False,
        False,
    ),
    (
        ("afmoe",),
        (_DIGITS_BY_THREE, _AFMOE_CJK, _DEEPSEEK3[2]),
        False,
        False,
    ),
    (
        ("youtu",),
        (
            _YOUTU_CJK,
            r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTION + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+"
            r"|\s+(?!\S)|\s+",
        ),
        True,
        False,
    ),
    (
        ("tiny_aya", "cohere2moe"),
        (
            _DIGITS_BY_THREE,
            r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+" + _CONTRACTION + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*"
            r"|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        False,
        False,
    ),
    (
        ("tekken",),
        (f"{_UPPER_LOWER}|{_UPPER}" + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",),
        True,
        True,
    ),
    (("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), (_GPT4O,), False, False),
    (
        ("granite-embed-multi-97m",),
        (_GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),),
        True,
        False,
    ),
    (
        ("kimi-k2",),
        (
            f"[{_HAN}]+|"
            r"[^\r\n\p{L}\p{N}]?[\p{L}&&[^"
            f"{_HAN}]]+{_CONTRACTION}?"
            r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        ),
        False,
        False,
    ),
    (("superbpe",), (r"\p{N}+", "(?=([0-9]{3})+(?![0-9]))"), False, False),
    (
        ("chameleon",),
        (
            "<sentinel:[0-9]+>",
            "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
            r"([\t\n]|    |  )",
            r"\p{N}",
            r"[\p{P}!-/:-@\[-`{-~]",
            _GPT2,
        ),
        False,
        True,
    ),
)
_PRE = {pre: spec for pres, *spec in _PRE_TYPES for pre in pres}


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
        splits, ignore_merges, bos_default = _PRE[pre]
        tok = Tokenizer(models.BPE(vocab=ids, merges=pairs, ignore_merges=ignore_merges))
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
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
