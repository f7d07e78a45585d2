"""Open a GGUF file (llama.cpp's format) as a Checkpoint, so `llmc compile model.gguf` works as for a directory.

A GGUF holds in one file what a Hugging Face checkpoint spreads over config.json, tokenizer.json and
safetensors, under llama.cpp's names (gguf_names):
- Architecture metadata (`llama.*`, `qwen2.*`, `gemma3.*`, ...: gguf_names.HF_ARCH) becomes the config.json
  transformers would have, checked by parse_config like any other. llama3 rope scaling is stored by llama.cpp
  as the per-frequency divisors of the `rope_freqs` tensor; the scaling fields are recovered from them
  (`_llama3_scaling`).
- The tokenizer is stored as token lists, and rebuilt as a `tokenizers` tokenizer (gguf_tokenizer.py).
- Tensors are renamed to Hugging Face's, q/k rows of the `llama` and `granite` archs are put back in rotate-half
  order, and Gemma's norm weights, stored as 1 + w, become w again (the traced model adds the 1).

Quantized tensors keep their exact values: each of llama.cpp's legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), K-quants
(Q2_K to Q6_K) and IQ4_NL / IQ4_XS maps onto a QuantizedTensor (compiler/quant.py, `_SCHEMES`) with no rounding,
and `Checkpoint.tensor` returns its dequantization, equal bit for bit to gguf.quants.dequantize. Any other tensor
type (the IQ1-IQ3 codebooks, TQ*) is refused with one line naming the type and the tensor.

The file is mmapped (gguf_reader.py); tensors are read one at a time, as from safetensors.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from llmc.dtypes import BY_SAFETENSORS
from llmc.errors import CheckpointError, CompileError, LlmcError, UnsupportedModelError

from ..quant import QuantizedTensor, QuantScheme, dequantize
from . import gguf_names as names
from .checkpoint import Checkpoint
from .config import parse_config
from .gguf_reader import GGUFFileReader, GGUFMetadata
from .gguf_tokenizer import gguf_tokenizer

GGMLType = gguf.GGMLQuantizationType
_FLOAT_TYPES = (
    GGMLType.F32,
    GGMLType.F16,
    GGMLType.BF16,
)  # tensor() returns these as they are (GGML spells them as safetensors)


@dataclasses.dataclass
class GGUFCheckpoint(Checkpoint):
    gguf_arch: str  # general.architecture: a key of gguf_names.HF_ARCH
    gguf_names: dict[str, str]  # HF name -> GGUF tensor name
    gguf_types: dict[str, str]  # HF name -> "Q4_K", "F32", ...
    gguf_tensors: dict[str, gguf.ReaderTensor]  # GGUF name -> the reader's entry (its data mmapped)

    def quant_scheme(self, name: str) -> QuantScheme | None:
        if len(self._shape(name)) != 2:  # a quantized vector: no GEMM reads one
            return None
        return _SCHEMES.get(self._info(name).tensor_type)

    def quantized_tensor(self, name: str) -> QuantizedTensor | None:
        """The matrix as the file quantizes it (rows in Hugging Face order); None for a float tensor or a
        quantized vector (no GEMM reads one)."""
        if self.quant_scheme(name) is None:
            return None
        shape = self._shape(name)
        qt = self._unpack(name)
        heads = self._qk_heads(name)
        rows = None if heads is None else names.unpermute_qk(np.arange(shape[0]), heads)
        if name in self.slices:  # rows of a fused tensor (phi3's attn_qkv, ffn_up)
            rows = np.arange(*self.slices[name][1:])
        if rows is not None:
            mins = None if qt.mins is None else qt.mins[rows]
            qt = QuantizedTensor(qt.q[rows], qt.scales[rows], mins, qt.scheme)
        return qt

    def tensor(self, name: str) -> torch.Tensor:
        info, shape = self._info(name), self._shape(name)
        if info.tensor_type in _UNPACK:
            w = dequantize(self._unpack(name)).reshape(shape)
        else:  # a copy below: the mmap is read-only
            w = np.asarray(info.data)
            w = (w.view(np.uint16) if info.tensor_type == GGMLType.BF16 else w).reshape(shape)
        heads = self._qk_heads(name)
        w = np.array(w) if heads is None else names.unpermute_qk(w, heads)
        if name in self.slices:  # rows of a fused tensor (phi3's attn_qkv, ffn_up)
            w = np.array(w[slice(*self.slices[name][1:])])
        if names.norm_shifted(self.gguf_arch, self.gguf_names[name]):  # stored 1 + w
            w = (w.astype(np.float64) - 1.0).astype(np.float32)
        if info.tensor_type == GGMLType.BF16:
            return torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(w)

    def _unpack(self, name: str) -> QuantizedTensor:
        """The tensor's blocks as a QuantizedTensor of [rows, last dim], rows in the file's order."""
        info, shape = self._info(name), self._shape(name)
        block, size = gguf.GGML_QUANT_SIZES[info.tensor_type]
        k = shape[-1]
        return _UNPACK[info.tensor_type](np.asarray(info.data).reshape(-1, k // block, size))

    def _info(self, name: str) -> gguf.ReaderTensor:
        return self.gguf_tensors[self.gguf_names[name]]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

    def _qk_heads(self, name: str) -> int | None:
        return names.qk_heads(self.gguf_arch, self.gguf_names[name], self.config.num_heads, self.config.num_kv_heads)


# ---------------------------------------------------------------------------------------------------------
# Block formats -> QuantizedTensor. Each takes the bytes of one tensor as [rows, blocks per row, block bytes]
# (layouts: ../shared/notes/gguf-formats.md, llama.cpp's ggml-common.h). fp16 fields are exact in float32,
# and scale = d * sub-scale is the same float32 product gguf.quants.dequantize forms, so values match exactly.


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian half bytes -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _rows(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


# What each imported type is in compiler/quant.py's terms: exactly its blocks' values. The legacy types' scales
# (and mins) are the blocks' fp16 d (and m); the K-quants' and IQ4_XS's are fp16 d x a 4-, 6- or 8-bit sub-scale,
# which needs fp32. Q4_0 / Q4_1 / Q8_0 keep the file's bytes per weight; the 2-, 3-, 5- and 6-bit types and the
# IQ4 codebook (values -127..113) are held widened, in int8 (CUDA's int4 groups are 32 or more: Q2_K / Q3_K /
# Q6_K groups of 16 are int8 too).
_SCHEMES = {
    GGMLType.Q8_0: QuantScheme(8, 32),
    GGMLType.Q4_0: QuantScheme(4, 32),
    GGMLType.Q4_1: QuantScheme(4, 32, asymmetric=True),
    GGMLType.Q5_0: QuantScheme(8, 32),
    GGMLType.Q5_1: QuantScheme(8, 32, asymmetric=True),
    GGMLType.Q2_K: QuantScheme(8, 16, asymmetric=True, scale_dtype="float32"),
    GGMLType.Q3_K: QuantScheme(8, 16, scale_dtype="float32"),
    GGMLType.Q4_K: QuantScheme(4, 32, asymmetric=True, scale_dtype="float32"),
    GGMLType.Q5_K: QuantScheme(8, 32, asymmetric=True, scale_dtype="float32"),
    GGMLType.Q6_K: QuantScheme(8, 16, scale_dtype="float32"),
    GGMLType.IQ4_NL: QuantScheme(8, 32),
    GGMLType.IQ4_XS: QuantScheme(8, 32, scale_dtype="float32"),
}
# IQ4_NL / IQ4_XS's 16 levels (llama.cpp's kvalues_iq4nl)
_IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are the first 16, the high ones the next 16."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """[..., m] bytes -> [..., n, m]: bit i of each byte in row i (Q5's and Q3_K's high-bit planes)."""
    return (b[..., None, :] >> np.arange(n, dtype=np.uint8)[:, None]) & 1


def _legacy(t, d: np.ndarray, q: np.ndarray, m: np.ndarray | None = None) -> QuantizedTensor:
    """A 32-value block type: value = d * q (+ m, which QuantizedTensor holds as a min to subtract)."""
    mins = None if m is None else _rows(-m)
    return QuantizedTensor(_rows(q.astype(np.int8)), _rows(d), mins, _SCHEMES[t])


def _q8_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: int8[32]
    return _legacy(GGMLType.Q8_0, _f16(b[..., :2]), np.ascontiguousarray(b[..., 2:]).view(np.int8))


def _q4_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: uint8[16]
    return _legacy(GGMLType.Q4_0, _f16(b[..., :2]), _nibbles(b[..., 2:18]).astype(np.int8) - 8)


def _q4_1(b: np.ndarray) -> QuantizedTensor:  # d: f16 | m: f16 | qs: uint8[16]
    return _legacy(GGMLType.Q4_1, _f16(b[..., :2]), _nibbles(b[..., 4:20]), _f16(b[..., 2:4]))


def _q5(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1's 5-bit values: qh (a little-endian uint32, bit i for value i) at `at`, then qs."""
    high = _bits(b[..., at : at + 4], 8).swapaxes(-1, -2).reshape(*b.shape[:-1], 32)
    return _nibbles(b[..., at + 4 : at + 20]) | (high << 4)


def _q5_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qh: uint8[4] | qs: uint8[16]
    return _legacy(GGMLType.Q5_0, _f16(b[..., :2]), _q5(b, 2).astype(np.int8) - 16)


def _q5_1(b: np.ndarray) -> QuantizedTensor:  # d: f16 | m: f16 | qh: uint8[4] | qs: uint8[16]
    return _legacy(GGMLType.Q5_1, _f16(b[..., :2]), _q5(b, 4), _f16(b[..., 2:4]))


def _iq4_nl(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: uint8[16], indices into _IQ4_LEVELS
    return _legacy(GGMLType.IQ4_NL, _f16(b[..., :2]), _IQ4_LEVELS[_nibbles(b[..., 2:18])])


def _k_scales_mins(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's uint8[12]: eight 6-bit scales and eight 6-bit mins."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1).astype(np.float32)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1).astype(np.float32)
    return sc, m


def _q2_k(b: np.ndarray) -> QuantizedTensor:
    """scales: uint8[16] (4-bit scale, 4-bit min) | qs: uint8[64] | d: f16 | dmin: f16; 16 groups of 16 2-bit
    values: half h, shift s, byte l is value 128h + 32s + l."""
    sc, d, dmin = b[..., 0:16], _f16(b[..., 80:82]), _f16(b[..., 82:84])
    qs = b[..., 16:80].reshape(*b.shape[:2], 2, 1, 32)
    q = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    scales = _rows(d[..., None] * (sc & 0xF).astype(np.float32))
    mins = _rows(dmin[..., None] * (sc >> 4).astype(np.float32))
    return QuantizedTensor(_rows(q.astype(np.int8)), scales, mins, _SCHEMES[GGMLType.Q2_K])


def _q3_k(b: np.ndarray) -> QuantizedTensor:
    """hmask: uint8[32] | qs: uint8[64] | scales: uint8[12] (sixteen 6-bit, offset 32) | d: f16; 16 groups of 16
    values in -4..3: the low 2 bits from qs as Q2_K's, the third a cleared bit of hmask (bit j: values 32j..)."""
    low = (b[..., 32:96].reshape(*b.shape[:2], 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    high = _bits(b[..., 0:32], 8) ^ 1
    q = low.reshape(*b.shape[:2], 8, 32).astype(np.int8) - (high << 2).astype(np.int8)
    s = b[..., 96:108]
    lo = np.concatenate([s[..., 0:8] & 0xF, s[..., 0:8] >> 4], axis=-1)
    hi = (s[..., None, 8:12] >> np.array([0, 2, 4, 6], np.uint8)[:, None]).reshape(*b.shape[:2], 16) & 3
    sc = (lo | (hi << 4)).astype(np.int8) - 32
    scales = _rows(_f16(b[..., 108:110])[..., None] * sc.astype(np.float32))
    return QuantizedTensor(_rows(q), scales, None, _SCHEMES[GGMLType.Q3_K])


def _q4_k(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | dmin: f16 | scales: uint8[12] (eight 6-bit scales and mins) | qs: uint8[128]; 8 groups of 32."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales_mins(b[..., 4:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)  # chunk c: groups 2c (low nibbles) and 2c + 1 (high)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).astype(np.int8)
    scales, mins = _rows(d[..., None] * sc), _rows(dmin[..., None] * m)
    return QuantizedTensor(_rows(q), scales, mins, _SCHEMES[GGMLType.Q4_K])


def _q5_k(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | dmin: f16 | scales: uint8[12] | qh: uint8[32] | qs: uint8[128]; 8 groups of 32: Q4_K's low
    nibbles, and bit g of qh[l] as the fifth bit of value l of group g."""
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, m = _k_scales_mins(b[..., 4:16])
    qs = b[..., 48:176].reshape(*b.shape[:2], 4, 32)
    low = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(*b.shape[:2], 8, 32)
    q = (low | (_bits(b[..., 16:48], 8) << 4)).astype(np.int8)
    scales, mins = _rows(d[..., None] * sc), _rows(dmin[..., None] * m)
    return QuantizedTensor(_rows(q), scales, mins, _SCHEMES[GGMLType.Q5_K])


def _q6_k(b: np.ndarray) -> QuantizedTensor:
    """ql: uint8[128] | qh: uint8[64] | scales: int8[16] | d: f16; 16 groups of 16 signed 6-bit values."""
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 2, 32)  # [half, first or second 32 bytes, l]
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=3).reshape(*b.shape[:2], 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return QuantizedTensor(_rows(q), _rows(_f16(b[..., 208:210])[..., None] * sc), None, _SCHEMES[GGMLType.Q6_K])


def _iq4_xs(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | scales_h: uint16 | scales_l: uint8[4] | qs: uint8[128]; 8 groups of 32 of IQ4_NL's levels, each
    with a 6-bit scale (offset 32): low 4 bits in nibble g % 2 of scales_l[g / 2], high 2 at bit 2g of scales_h."""
    sl = b[..., 4:8]
    low = np.stack([sl & 0xF, sl >> 4], axis=-1).reshape(*b.shape[:2], 8)
    sh = np.ascontiguousarray(b[..., 2:4]).view("<u2")
    high = ((sh >> np.arange(0, 16, 2, dtype=np.uint16)) & 3).astype(np.uint8)
    sc = (low | (high << 4)).astype(np.int8) - 32
    q = _IQ4_LEVELS[_nibbles(b[..., 8:136].reshape(*b.shape[:2], 8, 16))]
    scales = _rows(_f16(b[..., 0:2])[..., None] * sc.astype(np.float32))
    return QuantizedTensor(_rows(q), scales, None, _SCHEMES[GGMLType.IQ4_XS])


_UNPACK = {
    GGMLType.Q8_0: _q8_0,
    GGMLType.Q4_0: _q4_0,
    GGMLType.Q4_1: _q4_1,
    GGMLType.Q5_0: _q5_0,
    GGMLType.Q5_1: _q5_1,
    GGMLType.Q2_K: _q2_k,
    GGMLType.Q3_K: _q3_k,
    GGMLType.Q4_K: _q4_k,
    GGMLType.Q5_K: _q5_k,
    GGMLType.Q6_K: _q6_k,
    GGMLType.IQ4_NL: _iq4_nl,
    GGMLType.IQ4_XS: _iq4_xs,
}
SUPPORTED_TYPES = tuple(t.name for t in (*_FLOAT_TYPES, *_UNPACK))


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    path = Path(path)
    try:
        reader = GGUFFileReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})", "re-download or re-convert it") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: a big-endian GGUF file", "convert the model for a little-endian host")
    meta = GGUFMetadata(reader, path)
    arch = meta.get(names.ARCHITECTURE, str)
    if arch not in names.HF_ARCH:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported", f"llmc imports {', '.join(sorted(names.HF_ARCH))}"
        )
    meta.arch = arch
    tensors = {t.name: t for t in reader.tensors}
    tokens = meta.get(names.TOKENS, list)
    config = _config(meta, tensors, tokens, path)
    if len(tokens) > config.vocab_size:  # token ids past the embedding's rows
        raise CheckpointError(
            f"{path}: {len(tokens)} tokens for a vocab_size of {config.vocab_size}",
            "the vocabulary does not match the embedding; re-convert the model",
        )

    gguf_names, dtypes, gguf_types, slices = {}, {}, {}, {}
    fused = config.stored_slices()
    for hf_name, shape in config.stored_shapes().items():
        if hf_name in fused:
            stored, lo, hi = fused[hf_name]
            gguf_name = names.hf_to_gguf(stored, arch)
            slices[hf_name] = (gguf_name, lo, hi)
        else:
            gguf_name = names.hf_to_gguf(hf_name, arch)
        info = tensors.get(gguf_name)
        if info is None:
            raise CheckpointError(
                f"{path}: tensor {gguf_name!r} ({hf_name}) is missing",
                "the metadata does not match the tensors; re-convert the model",
            )
        got = tuple(int(d) for d in reversed(info.shape.tolist()))
        if got != shape:
            raise CheckpointError(
                f"{path}: tensor {gguf_name!r} has shape {list(got)} but the metadata implies {list(shape)}",
                "re-convert the model",
            )
        kind = info.tensor_type
        if kind.name not in SUPPORTED_TYPES:
            raise CompileError(
                f"{path}: tensor {gguf_name!r} is {kind.name}, which llmc does not import",
                f"llmc reads {', '.join(SUPPORTED_TYPES)}; re-quantize to one of them",
            )
        gguf_names[hf_name], gguf_types[hf_name] = gguf_name, kind.name
        dtypes[hf_name] = BY_SAFETENSORS[kind.name].name if kind in _FLOAT_TYPES else "float32"  # what tensor() returns
    special, chat_template, tokenizer_path = gguf_tokenizer(meta, tokens, path)
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensor_files=dict.fromkeys(gguf_names, path),
        dtypes=dtypes,
        tokenizer_path=tokenizer_path,
        chat_template=chat_template,
        special_tokens=special,
        generation_defaults={},
        slices=slices,
        gguf_arch=arch,
        gguf_names=gguf_names,
        gguf_types=gguf_types,
        gguf_tensors=tensors,
    )


def _config(meta: GGUFMetadata, tensors: dict, tokens: list, path: Path):
    """The config.json llama.cpp's converter read, rebuilt from the metadata and checked by parse_config."""
    hidden, heads = meta.get(names.EMBEDDING_LENGTH, int), meta.get(names.HEAD_COUNT, int)
    head_dim = meta.get(names.KEY_LENGTH, int, None) or (hidden // heads if heads else None)
    rope_dims = meta.get(names.ROPE_DIMENSION_COUNT, int, head_dim)
    if rope_dims != head_dim and meta.arch != "phi3":
        raise UnsupportedModelError(
            f"{path}: RoPE over {rope_dims} of {head_dim} head dimensions", "llmc rotates the whole head_dim"
        )
    context = meta.get(names.CONTEXT_LENGTH, int)
    theta = meta.get(names.ROPE_FREQ_BASE, float, 10000.0)
    kv = meta.get(names.HEAD_COUNT_KV, int, heads)
    eos = [meta.get(k, int, None) for k in (names.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID)]
    raw = {
        "architectures": [names.HF_ARCH[meta.arch]],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": meta.get(names.BLOCK_COUNT, int),
        "intermediate_size": meta.get(names.FEED_FORWARD_LENGTH, int),
        "vocab_size": meta.get(names.VOCAB_SIZE, int, len(tokens)),
        "rms_norm_eps": meta.get(names.RMS_EPS, float),
        "rope_theta": theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": names.hf_to_gguf("lm_head.weight", meta.arch) not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get(names.BOS_ID, int, None),
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
    }
    raw.update(_family_fields(meta, raw))
    if meta.arch == "phi3":
        raw.update(_phi3_fields(meta, tensors, raw, rope_dims, path))
    kind = meta.get(names.ROPE_SCALING_TYPE, str, "none")
    freqs = tensors.get(names.ROPE_FREQS)
    if kind == "linear" and freqs is None:
        raw["rope_scaling"] = {"rope_type": "linear", "factor": meta.get(names.ROPE_SCALING_FACTOR, float)}
    elif kind == "none" and freqs is not None:
        orig = meta.get(names.ROPE_SCALING_ORIG_CTX, int, context)
        raw["rope_scaling"] = _llama3_scaling(_rope_freqs(freqs, head_dim, path), theta, head_dim, orig, path)
    elif kind != "none":
        raise UnsupportedModelError(
            f"{path}: rope scaling {kind!r}{' with rope_freqs' if freqs is not None else ''} is not supported",
            "llmc imports none, linear and llama3 (rope_freqs)",
        )
    try:
        config = parse_config(raw)
    except LlmcError as e:  # its messages name config.json; here the metadata is at fault
        raise type(e)(
            f"{path}: GGUF metadata: {e.what.removeprefix('config.json: ')}", "re-convert the model"
        ) from None
    problem = config.inconsistency()
    if problem:
        raise CheckpointError(f"{path}: {problem}", "re-convert the model")
    if config.rope_scaling and config.rope_scaling["rope_type"] == "llama3":
        _check_rope(config, freqs, path)
    return config


def _phi3_fields(meta: GGUFMetadata, tensors: dict, raw: dict, rope_dims: int, path: Path) -> dict:
    """Phi-3's fields as its converter writes them: the rotated dims (partial_rotary_factor), the window (0: none,
    Phi-4's), and LongRoPE as the rope_factors_long / _short tensors with the original length and attention factor.
    llama.cpp itself runs phi3 with no window and picks the long set by its context size, not a sequence's length;
    llmc runs them as transformers does the checkpoint they came from."""
    fields = {
        "partial_rotary_factor": rope_dims / raw["head_dim"],
        "sliding_window": meta.get(names.SLIDING_WINDOW, int, 0) or None,
    }
    long, short = (tensors.get(n) for n in (names.ROPE_FACTORS_LONG, names.ROPE_FACTORS_SHORT))
    if long is None and short is None:
        return fields
    factors = {}
    for key, info in (("long_factor", long), ("short_factor", short)):
        if info is None or info.tensor_type != GGMLType.F32 or int(info.n_elements) != rope_dims // 2:
            raise CheckpointError(
                f"{path}: LongRoPE needs F32 rope_factors_long and rope_factors_short of {rope_dims // 2} values",
                "re-convert the model",
            )
        factors[key] = [float(v) for v in np.asarray(info.data, dtype=np.float32).reshape(-1)]
    orig = meta.get(names.ROPE_SCALING_ORIG_CTX, int)
    fields["rope_scaling"] = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": orig,
        "attention_factor": meta.get(names.ROPE_SCALING_ATTN_FACTOR, float, None),
    }
    fields["original_max_position_embeddings"] = orig
    return fields


def _family_fields(meta: GGUFMetadata, raw: dict) -> dict:
    """The config.json fields of a family beyond Llama's, as llama.cpp's loader reads them for its arch."""
    if meta.arch == "granite":
        keys = {
            "embedding_multiplier": names.EMBEDDING_SCALE,
            "residual_multiplier": names.RESIDUAL_SCALE,
            "attention_multiplier": names.ATTENTION_SCALE,
            "logits_scaling": names.LOGIT_SCALE,
        }
        return {field: meta.get(key, float, None) for field, key in keys.items()}
    if meta.arch == "smollm3":  # llama.cpp fixes the NoPE layers (no key holds them): every 4th
        return {"no_rope_layer_interval": names.SMOLLM3_NOPE_INTERVAL}
    if meta.arch not in ("gemma2", "gemma3"):
        return {}
    # llama.cpp: the softmax scale head_dim^-0.5, but (hidden / heads)^-0.5 for the 27B (46, 62 layers); the
    # sliding layers by its swa pattern (gemma2: every 2nd layer global, gemma3: every 6th, with RoPE base 10000)
    gemma2 = meta.arch == "gemma2"
    layers = raw["num_hidden_layers"]
    big = layers == (46 if gemma2 else 62)
    window = meta.get(names.SLIDING_WINDOW, int, 4096 if gemma2 else None) or None
    fields = {
        "sliding_window": window,
        "query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"],
        "layer_types": _swa_layer_types(meta, 2 if gemma2 else 6, layers) if window else None,
    }
    if gemma2:  # llama.cpp's defaults where the file has no value
        fields["attn_logit_softcapping"] = meta.get(names.ATTN_SOFTCAP, float, 50.0)
        fields["final_logit_softcapping"] = meta.get(names.FINAL_SOFTCAP, float, 30.0)
        return fields
    return {**fields, "rope_local_base_freq": 10000.0}


def _swa_layer_types(meta: GGUFMetadata, default: int, layers: int) -> list[str]:
    """config.json's layer_types as llama.cpp's load_swa_pattern sets them: the file's per-layer flags, or a
    pattern n (the arch's default unless the file gives one) under which layer i slides when i % n < n - 1."""
    key = names.SLIDING_WINDOW_PATTERN
    raw = meta.reader.fields.get(key.format(arch=meta.arch))
    flags = meta.get(key, list) if raw is not None and raw.types[0] == gguf.GGUFValueType.ARRAY else None
    if flags is None:
        n = meta.get(key, int, default)
        flags = [n == 0 or i % n < n - 1 for i in range(layers)] if n >= 0 else None
    if flags is None or len(flags) != layers or not all(isinstance(f, bool) for f in flags):
        raise CheckpointError(
            f"{meta.path}: GGUF metadata {key.format(arch=meta.arch)!r} is no swa pattern of {layers} layers",
            "re-convert the model",
        )
    return [("sliding" if f else "full") + "_attention" for f in flags]


def _rope_freqs(info, head_dim: int, path: Path) -> np.ndarray:
    if info.tensor_type != GGMLType.F32 or int(info.n_elements) != head_dim // 2:
        raise CheckpointError(
            f"{path}: rope_freqs is {info.tensor_type.name}[{info.n_elements}], not F32[{head_dim // 2}]",
            "re-convert the model",
        )
    f = np.asarray(info.data, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(f)) or np.any(f < 1.0):
        raise CheckpointError(f"{path}: rope_freqs holds divisors below 1 or not finite", "re-convert the model")
    return f


def _llama3_scaling(f: np.ndarray, theta: float, head_dim: int, orig: int, path: Path) -> dict | None:
    """llama3 rope_scaling fields that give the rope_freqs divisors f (as convert_hf_to_gguf computes them).

    With u = 1 / wavelength of each frequency, llama3's divisor is 1 where u >= u_h, `factor` where
    u <= u_l, and 1 / ((1 - s) / factor + s) with s = (u - u_l) / (u_h - u_l) between. Only factor, u_l and
    u_h matter (any original context length gives the same divisors for the same u_l, u_h), so u_l and u_h
    are fitted to the divisors: exactly through two or more interpolated ones, else placed strictly inside
    the gap the samples leave, which every pair of thresholds there reproduces exactly.
    """
    factor = float(f.max())
    if factor == 1.0:
        return None
    u = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    ones, full = s >= 1.0 - 1e-6, s <= 1e-6
    mid = ~(ones | full)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(u[mid], s[mid], 1)
        u_l, u_h = -intercept / slope, (1.0 - intercept) / slope
    else:
        above = u[ones].min() if ones.any() else None  # the smallest u kept at divisor 1
        below = u[full].max() if full.any() else 0.0  # the largest u divided by the full factor
        if mid.any():
            um, sm = float(u[mid][0]), float(s[mid][0])
            slope = 2 * max((1.0 - sm) / (above - um) if above is not None else 0.0, sm / (um - below))
            u_l = um - sm / slope
            u_h = u_l + 1.0 / slope
        else:
            top = above if above is not None else 3.0 * below
            u_l, u_h = below + (top - below) / 3, below + 2 * (top - below) / 3
    if not 0 < u_l < u_h:
        raise UnsupportedModelError(
            f"{path}: rope_freqs does not follow llama3 rope scaling",
            "llmc imports llama3 scaling as llama.cpp's converter writes it",
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": orig * u_l,
        "high_freq_factor": orig * u_h,
        "original_max_position_embeddings": orig,
    }


def _check_rope(config, freqs, path: Path) -> None:
    """The rebuilt llama3 fields must give the file's own frequencies (llama.cpp divides by rope_freqs)."""
    from .model import rope_inv_freq

    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None)).double().numpy()
    want = plain / np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    got = rope_inv_freq(config).double().numpy()
    if not np.allclose(got, want, rtol=1e-5, atol=0):
        raise UnsupportedModelError(
            f"{path}: rope_freqs does not follow llama3 rope scaling",
            "llmc imports llama3 scaling as llama.cpp's converter writes it",
        )


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
