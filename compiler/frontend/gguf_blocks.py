"""GGUF's quantized block formats -> QuantizedTensor (compiler/quant.py): each of llama.cpp's legacy types, K-quants
and IQ4_NL / IQ4_XS as exactly its values (`SCHEMES`, `UNPACK`), used by the GGUF importer (gguf.py)."""

from __future__ import annotations

import gguf
import numpy as np

from .. import kquant
from ..kquant import fp16_values
from ..quant import IQ4_LEVELS, QuantizedTensor, QuantScheme

GGMLType = gguf.GGMLQuantizationType
FLOAT_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16)  # read as they are (GGML spells them as safetensors)


# ---------------------------------------------------------------------------------------------------------
# Block formats -> QuantizedTensor. Each takes the bytes of one tensor as [rows, blocks per row, block bytes]
# (layouts: ../shared/notes/gguf-formats.md, llama.cpp's ggml-common.h). fp16 fields are exact in float32,
# and scale = d * sub-scale is the same float32 product gguf.quants.dequantize forms, so values match exactly.


def _rows(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.reshape(a.shape[0], -1))


# What each imported type is in compiler/quant.py's terms: exactly its blocks' values. The legacy types' scales
# (and mins) are the blocks' fp16 d (and m). Q4_K's, Q5_K's and Q6_K's are their own superblock records (kquant,
# compiler/kquant.py), as are IQ4_XS's, and Q3_K's are held in Q6_K's (its 6-bit codes as int8: 18 bytes a
# superblock for the file's 14), and Q2_K's in a record of its own fields.
# Every type keeps the file's bytes per weight, Q3_K but for 4 bytes a superblock (a CUDA build holds the 2-, 3-,
# 5- and 6-bit ones and the IQ4 codebook in int8: compile.quant_schemes).
SCHEMES = {
    GGMLType.Q8_0: QuantScheme(8, 32),
    GGMLType.Q4_0: QuantScheme(4, 32),
    GGMLType.Q4_1: QuantScheme(4, 32, asymmetric=True),
    GGMLType.Q5_0: QuantScheme(5, 32),
    GGMLType.Q5_1: QuantScheme(5, 32, asymmetric=True),
    GGMLType.Q2_K: QuantScheme(2, 16, asymmetric=True, scale_dtype="kquant"),
    GGMLType.Q3_K: QuantScheme(3, 16, scale_dtype="kquant"),
    GGMLType.Q4_K: QuantScheme(4, 32, asymmetric=True, scale_dtype="kquant"),
    GGMLType.Q5_K: QuantScheme(5, 32, asymmetric=True, scale_dtype="kquant"),
    GGMLType.Q6_K: QuantScheme(6, 16, scale_dtype="kquant"),
    GGMLType.IQ4_NL: QuantScheme(4, 32, codebook=True),
    GGMLType.IQ4_XS: QuantScheme(4, 32, scale_dtype="kquant", codebook=True),
}


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] values: the low nibbles are the first 16, the high ones the next 16."""
    return np.concatenate([qs & 0xF, qs >> 4], axis=-1)


def _bits(b: np.ndarray, n: int) -> np.ndarray:
    """[..., m] bytes -> [..., n, m]: bit i of each byte in row i (Q5's and Q3_K's high-bit planes)."""
    return (b[..., None, :] >> np.arange(n, dtype=np.uint8)[:, None]) & 1


def _legacy(t, d: np.ndarray, q: np.ndarray, m: np.ndarray | None = None) -> QuantizedTensor:
    """A 32-value block type: value = d * q (+ m, which QuantizedTensor holds as a min to subtract)."""
    mins = None if m is None else _rows(-m)
    return QuantizedTensor(_rows(q.astype(np.int8)), _rows(d), mins, SCHEMES[t])


def _q8_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: int8[32]
    return _legacy(GGMLType.Q8_0, fp16_values(b[..., :2]), np.ascontiguousarray(b[..., 2:]).view(np.int8))


def _q4_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: uint8[16]
    return _legacy(GGMLType.Q4_0, fp16_values(b[..., :2]), _nibbles(b[..., 2:18]).astype(np.int8) - 8)


def _q4_1(b: np.ndarray) -> QuantizedTensor:  # d: f16 | m: f16 | qs: uint8[16]
    return _legacy(GGMLType.Q4_1, fp16_values(b[..., :2]), _nibbles(b[..., 4:20]), fp16_values(b[..., 2:4]))


def _q5(b: np.ndarray, at: int) -> np.ndarray:
    """Q5_0 / Q5_1's 5-bit values: qh (a little-endian uint32, bit i for value i) at `at`, then qs."""
    high = _bits(b[..., at : at + 4], 8).swapaxes(-1, -2).reshape(*b.shape[:-1], 32)
    return _nibbles(b[..., at + 4 : at + 20]) | (high << 4)


def _q5_0(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qh: uint8[4] | qs: uint8[16]
    return _legacy(GGMLType.Q5_0, fp16_values(b[..., :2]), _q5(b, 2).astype(np.int8) - 16)


def _q5_1(b: np.ndarray) -> QuantizedTensor:  # d: f16 | m: f16 | qh: uint8[4] | qs: uint8[16]
    return _legacy(GGMLType.Q5_1, fp16_values(b[..., :2]), _q5(b, 4), fp16_values(b[..., 2:4]))


def _iq4_nl(b: np.ndarray) -> QuantizedTensor:  # d: f16 | qs: uint8[16], indices into _IQ4_LEVELS
    return _legacy(GGMLType.IQ4_NL, fp16_values(b[..., :2]), IQ4_LEVELS[_nibbles(b[..., 2:18])])


def _q2_k(b: np.ndarray) -> QuantizedTensor:
    """scales: uint8[16] (4-bit scale, 4-bit min) | qs: uint8[64] | d: f16 | dmin: f16; 16 groups of 16 2-bit
    values: half h, shift s, byte l is value 128h + 32s + l."""
    qs = b[..., 16:80].reshape(*b.shape[:2], 2, 1, 32)
    q = (qs >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    records = _rows(np.concatenate([b[..., 0:16], b[..., 80:84]], axis=-1))  # compiler/kquant.py's Q2_K record
    return QuantizedTensor(_rows(q.astype(np.int8)), *kquant.decode_q2k(records), SCHEMES[GGMLType.Q2_K], records)


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
    records = kquant.encode6(fp16_values(b[..., 108:110]), sc)  # Q6_K's record holds them exactly
    return QuantizedTensor(_rows(q), kquant.decode6(records), None, SCHEMES[GGMLType.Q3_K], records)


def _q4_k(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | dmin: f16 | scales: uint8[12] (eight 6-bit scales and mins) | qs: uint8[128]; 8 groups of 32.
    The first 16 bytes are kept as they are: compiler/kquant.py's record."""
    records = _rows(b[..., 0:16])
    qs = b[..., 16:144].reshape(*b.shape[:2], 4, 32)  # chunk c: groups 2c (low nibbles) and 2c + 1 (high)
    q = np.stack([qs & 0xF, qs >> 4], axis=3).astype(np.int8)
    return QuantizedTensor(_rows(q), *kquant.decode(records), SCHEMES[GGMLType.Q4_K], records)


def _q5_k(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | dmin: f16 | scales: uint8[12] | qh: uint8[32] | qs: uint8[128]; 8 groups of 32: Q4_K's low
    nibbles, and bit g of qh[l] as the fifth bit of value l of group g."""
    records = _rows(b[..., 0:16])
    qs = b[..., 48:176].reshape(*b.shape[:2], 4, 32)
    low = np.stack([qs & 0xF, qs >> 4], axis=3).reshape(*b.shape[:2], 8, 32)
    q = (low | (_bits(b[..., 16:48], 8) << 4)).astype(np.int8)
    return QuantizedTensor(_rows(q), *kquant.decode(records), SCHEMES[GGMLType.Q5_K], records)


def _q6_k(b: np.ndarray) -> QuantizedTensor:
    """ql: uint8[128] | qh: uint8[64] | scales: int8[16] | d: f16; 16 groups of 16 signed 6-bit values."""
    ql = b[..., 0:128].reshape(*b.shape[:2], 2, 2, 32)  # [half, first or second 32 bytes, l]
    qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
    low = np.stack([ql & 0xF, ql >> 4], axis=3).reshape(*b.shape[:2], 2, 4, 32)
    high = (qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    q = (low | (high << 4)).astype(np.int8) - 32
    records = _rows(b[..., 192:210])  # scales and d: compiler/kquant.py's Q6_K record as it is
    return QuantizedTensor(_rows(q), kquant.decode6(records), None, SCHEMES[GGMLType.Q6_K], records)


def _iq4_xs(b: np.ndarray) -> QuantizedTensor:
    """d: f16 | scales_h: uint16 | scales_l: uint8[4] | qs: uint8[128]; 8 groups of 32 of IQ4_NL's levels under
    the first 8 bytes, compiler/kquant.py's IQ4_XS record as it is."""
    q = IQ4_LEVELS[_nibbles(b[..., 8:136].reshape(*b.shape[:2], 8, 16))]
    records = _rows(b[..., 0:8])
    return QuantizedTensor(_rows(q), kquant.decode_iq4xs(records), None, SCHEMES[GGMLType.IQ4_XS], records)


UNPACK = {
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
SUPPORTED_TYPES = tuple(t.name for t in (*FLOAT_TYPES, *UNPACK))
