"""The quality gate of a quantized build: how far its next-token distributions are from the unquantized model's.

Both models run on the CPU, through the runtime's CompiledModel, over the same calibration tokens (the first
2,048: the bundled model's held-out text by default, or `--calibration FILE`; a text of fewer than 2,000 is
refused, a perplexity over a few hundred tokens moves by more than the quantization does), cut into windows of the
model's context as `llmc eval ppl` cuts them (runtime/scoring.next_token_logits). At every scored position,
with p the reference's and q the quantized model's next-token distribution:

    KL(p || q) = sum_v p_v (log p_v - log q_v)         averaged over positions: kl_mean
    argmax p == argmax q                               the fraction of positions: top1_agreement

and each model's perplexity on the text, exp(mean -log p(next token)). The figures go into the manifest as
`quality`; `--max-kl X` fails the compile when kl_mean > X, and `--max-ppl-increase P` when the quantized
perplexity is more than P percent over the reference's, before anything is written.
"""

from __future__ import annotations

import codecs
import dataclasses
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmc.digests import file_sha256
from llmc.errors import CompileError
from llmc.manifest import read_manifest
from llmc.model_config import ModelConfig
from llmc.runtime.kv_cache import cdiv, kv_bytes_per_block
from llmc.runtime.module import CompiledModel, load_tokenizer
from llmc.runtime.scoring import next_token_logits

QUALITY_STAGE = "quality"  # a quantized build's last compile stage (tools/build.py)
DEFAULT_CALIBRATION_TOKENS = 2048
MIN_CALIBRATION_TOKENS = 2000
BUNDLED_HELDOUT = "bundled heldout"
_HELDOUT_FILE = "heldout.txt"
_MAX_BYTES_PER_TOKEN = 1024  # read per token asked, however long the vocabulary's longest token


@dataclasses.dataclass(frozen=True)
class Quality:
    kl_mean: float  # nats
    top1_agreement: float  # 0..1
    tokens: int  # positions scored
    ppl_reference: float
    ppl_quantized: float
    calibration: str | dict  # BUNDLED_HELDOUT, or {"file": name, "sha256": hex}
    # "this build", or for a CUDA build "cpu build": the CPU build of the same weights and schemes, whose
    # qgemm quantizes activations to int8 where CUDA's keeps them bf16, so the figures bound its loss
    measured_on: str = "this build"

    def to_manifest(self) -> dict:
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """One line of the figures, as `llmc inspect` and the --max-kl error show them."""
        return describe(self.to_manifest())


def describe(quality: dict) -> str:
    """A manifest's `quality` in one line. The manifest is untrusted (inspect reads it unverified): a field of
    the wrong type shows as '?' rather than failing."""

    def num(key: str, fmt: str) -> str:
        value = quality.get(key)
        kinds = (int,) if fmt == "d" else (int, float)
        return format(value, fmt) if type(value) in kinds and math.isfinite(value) else "?"

    ref, quant = quality.get("ppl_reference"), quality.get("ppl_quantized")
    change = (
        f" ({quant / ref - 1:+.2%})"
        if all(type(v) in (int, float) and math.isfinite(v) for v in (ref, quant)) and ref > 0
        else ""
    )
    calib = quality.get("calibration")
    if isinstance(calib, dict):
        digest = calib.get("sha256")
        calib = f"{calib.get('file')}, sha256 {digest[:12] if isinstance(digest, str) else '?'}"
    return (
        f"mean KL {num('kl_mean', '.4g')} nats, top-1 agreement {num('top1_agreement', '.2%')}, perplexity "
        f"{num('ppl_reference', '.4f')} -> {num('ppl_quantized', '.4f')}{change} over {num('tokens', 'd')} tokens "
        f"of {calib if isinstance(calib, str) else '?'}"
        + (" (measured on the CPU build)" if quality.get("measured_on") == "cpu build" else "")
    )


def compare_logits(reference: np.ndarray, candidate: np.ndarray, targets: np.ndarray) -> dict[str, np.ndarray]:
    """Per row of [n, vocab] logits: KL(softmax(reference) || softmax(candidate)) ("kl"), whether the argmaxes
    agree ("top1"), and each model's negative log-likelihood of the target token ("nll_reference",
    "nll_candidate"). float64 throughout: a KL of 1e-6 is a difference of nearly equal log-probabilities."""
    log_p = _log_softmax(reference)
    log_q = _log_softmax(candidate)
    rows = np.arange(len(targets))
    return {
        "kl": (np.exp(log_p) * (log_p - log_q)).sum(axis=-1),
        "top1": reference.argmax(axis=-1) == candidate.argmax(axis=-1),
        "nll_reference": -log_p[rows, targets],
        "nll_candidate": -log_q[rows, targets],
    }


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def measure(reference, candidate, token_ids: Sequence[int], calibration: str | dict) -> Quality:
    """The figures of `candidate` against `reference` (CompiledModel interfaces, loaded alike: same config and
    cache geometry, so both cut the tokens into the same windows and steps) over `token_ids` (at least 2)."""
    sums = dict.fromkeys(("kl", "top1", "nll_reference", "nll_candidate"), 0.0)
    tokens = 0
    steps = zip(next_token_logits(reference, token_ids), next_token_logits(candidate, token_ids), strict=True)
    for (ref_logits, targets), (cand_logits, cand_targets) in steps:
        if not np.array_equal(targets, cand_targets):
            raise AssertionError("the two models scored different positions: they were not loaded alike")
        for key, values in compare_logits(ref_logits, cand_logits, targets).items():
            sums[key] += float(values.sum())
        tokens += len(targets)
    return Quality(
        kl_mean=sums["kl"] / tokens,
        top1_agreement=sums["top1"] / tokens,
        tokens=tokens,
        ppl_reference=math.exp(sums["nll_reference"] / tokens),
        ppl_quantized=math.exp(sums["nll_candidate"] / tokens),
        calibration=calibration,
    )


def calibration_tokens(
    tokenizer_path: Path, calibration: Path | None = None, max_tokens: int = DEFAULT_CALIBRATION_TOKENS
) -> tuple[list[int], str | dict]:
    """The first `max_tokens` token ids of the calibration text (the bundled model's held-out text unless a file
    is given), with the checkpoint's tokenizer, and how the manifest names that text (a file: its name and the
    sha256 of all of it). Only the prefix the tokens need is read and tokenized (_text_prefix)."""
    if calibration is None:
        from llmc.examples import bundled_checkpoint

        path, label = bundled_checkpoint() / _HELDOUT_FILE, BUNDLED_HELDOUT
    else:
        path = Path(calibration)
        if not path.is_file():
            why = "not a regular file" if path.exists() else "no such file"
            raise CompileError(f"calibration text {path}: {why}", "pass a UTF-8 text file to --calibration")
        label = {"file": path.name, "sha256": file_sha256(path)}
    tokenizer = load_tokenizer(tokenizer_path)
    text = _text_prefix(path, _prefix_bytes(tokenizer, max_tokens))
    ids = tokenizer.encode(text).ids[:max_tokens]
    if len(ids) < min(MIN_CALIBRATION_TOKENS, max_tokens):
        raise CompileError(
            f"calibration text {path.name} has {len(ids)} token(s); the quality gate needs at least "
            f"{MIN_CALIBRATION_TOKENS} for a perplexity that means something",
            "pass a longer --calibration file (text the model was not trained on)",
        )
    return ids, label


def _prefix_bytes(tokenizer, max_tokens: int) -> int:
    """Bytes of text that hold at least max_tokens + 1 tokens even if each is the vocabulary's longest, twice
    over (the prefix is cut back to a word boundary). A token covers at most as many bytes of text as its own
    UTF-8 (byte-level and SentencePiece pieces spell each byte in 1 to 6), an unknown one a character."""
    longest = max((len(token.encode("utf-8")) for token in tokenizer.get_vocab()), default=1)
    return 2 * (max_tokens + 1) * min(max(longest, 4), _MAX_BYTES_PER_TOKEN)


def _text_prefix(path: Path, max_bytes: int) -> str:
    """The first max_bytes of a UTF-8 text file, cut at a character and, unless the file ends there, at the
    last whitespace (no word is tokenized in part); a NUL byte or bytes that are not UTF-8 are a CompileError.
    Only the prefix is read: a gigabyte of text costs what a page does."""
    hint = "pass a UTF-8 text file to --calibration"
    try:
        with open(path, "rb") as f:  # a read allocates what it asks for: no more than the file holds
            data = f.read(min(max_bytes, os.fstat(f.fileno()).st_size or max_bytes) + 1)
    except OSError as e:
        raise CompileError(f"calibration text {path}: cannot be read ({e.strerror})", hint) from None
    whole, data = len(data) <= max_bytes, data[:max_bytes]
    if (nul := data.find(b"\0")) >= 0:
        raise CompileError(f"calibration text {path}: not text (a NUL byte at offset {nul})", hint)
    try:  # not final: a character cut at the end waits for bytes that never come, and is dropped
        text = codecs.getincrementaldecoder("utf-8")().decode(data, final=whole)
    except UnicodeDecodeError as e:
        raise CompileError(f"calibration text {path}: not UTF-8 (at byte {e.start})", hint) from None
    if not whole and (cut := re.search(r"\s\S*\Z", text)) is not None and cut.start() > len(text) // 2:
        text = text[: cut.start()]
    return text


def _load_for_scoring(path: Path, num_tokens: int) -> CompiledModel:
    """A model loaded to score `num_tokens` tokens: one sequence, a cache of (at least) one window, and logits
    at every row of a step. The cache size is fixed, not a share of free memory, so that two models loaded one
    after the other get the same windows."""
    manifest = read_manifest(path)
    c = ModelConfig.from_dict(manifest["model_config"])
    block_size = manifest["block_size"]
    tokens = min(num_tokens, c.max_context)
    kv_bytes = cdiv(tokens, block_size) * kv_bytes_per_block(
        c.num_layers, c.num_kv_heads, c.head_dim, block_size, manifest.get("kv_cache_dtype", "float32")
    )
    return CompiledModel.load(path, kv_cache_memory=kv_bytes, max_num_seqs=1, max_num_logits=512)


def measure_artifacts(reference: Path, candidate: Path, token_ids: Sequence[int], calibration: str | dict) -> Quality:
    """`measure` of two CPU artifacts, loaded alike."""
    with _load_for_scoring(reference, len(token_ids)) as ref, _load_for_scoring(candidate, len(token_ids)) as cand:
        return measure(ref, cand, token_ids, calibration)


def check_gate(quality: Quality, max_kl: float | None, max_ppl_increase: float | None) -> None:
    """CompileError when the build is over its --max-kl or --max-ppl-increase (percent) bound."""
    over = []
    if max_kl is not None and not quality.kl_mean <= max_kl:
        over.append(f"the mean KL is over --max-kl {max_kl:g}")
    increase = 100 * (quality.ppl_quantized / quality.ppl_reference - 1)
    if max_ppl_increase is not None and not increase <= max_ppl_increase:
        over.append(f"the perplexity rose {increase:.2f}%, over --max-ppl-increase {max_ppl_increase:g}%")
    if over:
        raise CompileError(
            f"quality gate: {' and '.join(over)}: {quality.describe()}; no artifact was written",
            "quantize less (int8, a smaller --group-size) or raise the bound",
        )
