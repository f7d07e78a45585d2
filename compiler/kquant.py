"""The K-quants' superblock scales (llama.cpp's Q4_K and Q5_K), as llmc's scale storage `kquant`.

A row's groups of 32 come in superblocks of 8 (256 elements). A superblock's scales and mins are one 16-byte
record, as a GGUF Q4_K / Q5_K block begins:

    d: fp16 | dmin: fp16 | codes: uint8[12], eight 6-bit scale codes sc and eight 6-bit min codes m

with group j's scale d * sc[j] and min dmin * m[j] (w = q * scale - min, q in 0..15 for Q4_K, 0..31 for Q5_K),
each product exact in float32. Codes j < 4 are the low 6 bits of bytes j (sc) and j + 4 (m); codes j >= 4 keep
their low 4 bits in byte j + 8 (sc low nibble, m high nibble) and their top 2 bits in the top bits of bytes
j - 4 (sc) and j (m). That is 2 bytes per group for a scale and a min: 4.5 bits a weight at int4, as llama.cpp.

`quantize_kquant` is llmc's own quantizer to it (Q4_K's): each group's scale and min from a weighted
least-squares search over roundings, as llama.cpp's make_qkx2_quants, then the superblock's 6-bit codes.

Q6_K's superblock (symmetric groups of 16, no mins) has a record of its own, 18 bytes as the GGUF block ends:

    sc: int8[16] | d: fp16

with group j's scale d * sc[j] (exact in float32): 0.5625 bits a weight. `quantize_q6k` is llama.cpp's Q6_K
quantizer: each group's scale searched (make_qx_quants), then the superblock's int8 codes. Q3_K's scales (fp16 d,
sixteen 6-bit codes less 32, packed in 14 bytes) are held in the same record.

Q2_K's superblock (asymmetric groups of 16) is 20 bytes, its GGUF block's fields but for the 2-bit values:

    codes: uint8[16], group j's 4-bit scale code (low nibble) and min code (high) | d: fp16 | dmin: fp16

with group j's scale d * sc[j] and min dmin * m[j], exact in float32.

IQ4_XS's superblock (symmetric groups of 32 of IQ4's levels, no mins) is 8 bytes, as its GGUF block begins:

    d: fp16 | scales_h: uint16 | scales_l: uint8[4]

with group j's 6-bit code ls (low 4 bits in nibble j % 2 of scales_l[j / 2], high 2 at bits 2j of scales_h) and
scale d * (ls - 32), exact in float32: 0.25 bits a weight.
"""

from __future__ import annotations

import numpy as np

from .quant_search import search_scale_min, searched_scales

GROUP = 32
GROUPS = 8  # groups per superblock
SUPERBLOCK = GROUP * GROUPS
RECORD_BYTES = 16
GROUP6, GROUPS6 = 16, 16  # Q6_K: groups of 16, 16 a superblock
RECORD6_BYTES = 18
RECORD_IQ4_BYTES = 8
RECORD2_BYTES = 20
# The records, by the groups they scale (group size, asymmetric, codebook): their bytes a superblock
RECORD_KINDS = {
    (32, True, False): RECORD_BYTES,  # Q4_K, Q5_K
    (16, False, False): RECORD6_BYTES,  # Q6_K (Q3_K's scales too)
    (32, False, True): RECORD_IQ4_BYTES,  # IQ4_XS
    (16, True, False): RECORD2_BYTES,  # Q2_K
}


def record_row_bytes(k: int, group_size: int, asymmetric: bool, codebook: bool = False) -> int:
    """Bytes of records in a row of K (a multiple of 256) for groups of that kind (RECORD_KINDS)."""
    return k // SUPERBLOCK * RECORD_KINDS[group_size, asymmetric, codebook]


def decode_records(
    records: np.ndarray, group_size: int, asymmetric: bool, codebook: bool = False
) -> tuple[np.ndarray, np.ndarray | None]:
    """Records of any kind (RECORD_KINDS) -> (scales, mins or None) float32, exactly."""
    if asymmetric:
        return decode(records) if group_size == GROUP else decode_q2k(records)
    return (decode_iq4xs(records) if codebook else decode6(records)), None


def scale_min_codes(codes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [..., 12] -> (sc, m) float32 [..., 8]: the eight 6-bit scale and min codes."""
    lo, mid, hi = codes[..., 0:4], codes[..., 4:8], codes[..., 8:12]
    sc = np.concatenate([lo & 63, (hi & 0xF) | ((lo >> 6) << 4)], axis=-1).astype(np.float32)
    m = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1).astype(np.float32)
    return sc, m


def fp16_values(b: np.ndarray) -> np.ndarray:
    """[..., 2] little-endian half bytes -> float32 [...]."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def decode(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, S * 16] (S superblocks a row) -> (scales, mins) float32 [N, S * 8], exactly."""
    n = records.shape[0]
    r = records.reshape(n, -1, RECORD_BYTES)
    sc, m = scale_min_codes(r[..., 4:16])
    d, dmin = fp16_values(r[..., 0:2]), fp16_values(r[..., 2:4])
    return (d[..., None] * sc).reshape(n, -1), (dmin[..., None] * m).reshape(n, -1)


def decode6(records: np.ndarray) -> np.ndarray:
    """uint8 [N, S * 18] (Q6_K records) -> scales float32 [N, S * 16], exactly."""
    n = records.shape[0]
    r = records.reshape(n, -1, RECORD6_BYTES)
    sc = np.ascontiguousarray(r[..., :16]).view(np.int8).astype(np.float32)
    return (fp16_values(r[..., 16:18])[..., None] * sc).reshape(n, -1)


def decode_q2k(records: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """uint8 [N, S * 20] (Q2_K records) -> (scales, mins) float32 [N, S * 16], exactly."""
    n = records.shape[0]
    r = records.reshape(n, -1, RECORD2_BYTES)
    codes, d, dmin = r[..., :16], fp16_values(r[..., 16:18]), fp16_values(r[..., 18:20])
    scales = d[..., None] * (codes & 0xF).astype(np.float32)
    return scales.reshape(n, -1), (dmin[..., None] * (codes >> 4).astype(np.float32)).reshape(n, -1)


def decode_iq4xs(records: np.ndarray) -> np.ndarray:
    """uint8 [N, S * 8] (IQ4_XS records) -> scales float32 [N, S * 8], exactly."""
    n = records.shape[0]
    r = records.reshape(n, -1, RECORD_IQ4_BYTES)
    low = np.stack([r[..., 4:8] & 0xF, r[..., 4:8] >> 4], axis=-1).reshape(*r.shape[:2], GROUPS)
    high = (np.ascontiguousarray(r[..., 2:4]).view("<u2") >> np.arange(0, 16, 2, dtype=np.uint16)) & 3
    ls = (low | (high.astype(np.uint8) << 4)).astype(np.float32) - 32
    return (fp16_values(r[..., 0:2])[..., None] * ls).reshape(n, -1)


def encode_iq4xs(d: np.ndarray, ls: np.ndarray) -> np.ndarray:
    """d float16 [N, S], ls integers [N, S, 8] in 0..63 -> IQ4_XS records uint8 [N, S * 8]."""
    ls = ls.astype(np.uint16)
    high = np.bitwise_or.reduce((ls >> 4) << np.arange(0, 16, 2, dtype=np.uint16), axis=-1).astype("<u2")
    low = (ls[..., 0::2] & 0xF) | ((ls[..., 1::2] & 0xF) << 4)
    parts = [d.astype(np.float16)[..., None].view(np.uint8), high[..., None].view(np.uint8), low.astype(np.uint8)]
    return np.ascontiguousarray(np.concatenate(parts, axis=-1).reshape(d.shape[0], -1))


def encode6(d: np.ndarray, sc: np.ndarray) -> np.ndarray:
    """d float16 [N, S], sc integers [N, S, 16] in -128..127 -> Q6_K records uint8 [N, S * 18]."""
    codes = sc.astype(np.int8).view(np.uint8)
    halves = d.astype(np.float16)[..., None].view(np.uint8)
    return np.ascontiguousarray(np.concatenate([codes, halves], axis=-1).reshape(d.shape[0], -1))


def encode(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """d, dmin float16 [N, S]; sc, m integers [N, S, 8] in 0..63 -> records uint8 [N, S * 16]."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    codes = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            m[..., :4] | ((m[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4),
        ],
        axis=-1,
    )
    halves = np.stack([d.astype(np.float16), dmin.astype(np.float16)], axis=-1).view(np.uint8)
    return np.ascontiguousarray(np.concatenate([halves, codes], axis=-1).reshape(d.shape[0], -1))


def quantize_kquant(
    w: np.ndarray, nmax: int = 15, importance: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 w [N, K] (K a multiple of 256) -> (q int8 [N, K] in 0..nmax: 15 for Q4_K, 31 for Q5_K, scales, mins
    float32 [N, K / 32], records uint8 [N, K / 16]): the groups' searched scales and mins, coded to 6 bits per superblock (d =
    largest scale / 63, dmin = largest min / 63, in fp16), q rounded against the coded values."""
    n, k = w.shape
    x = w.reshape(n, k // SUPERBLOCK, GROUPS, GROUP)
    # in place: a matrix's weights are as large as it is
    if importance is None:  # llama.cpp's Q4_K and Q5_K: rms(x) + |x| per group
        weight = np.abs(x)
        weight += np.sqrt(np.square(x).mean(-1, keepdims=True))
    else:  # with an imatrix: importance * sqrt(sigma2 + x^2), sigma2 = 2 mean(x^2) per superblock
        weight = np.square(x)
        weight += 2 * weight.mean((-2, -1), keepdims=True)
        np.multiply(np.sqrt(weight, out=weight), np.asarray(importance, np.float32).reshape(x.shape[1:]), out=weight)
    scale, mn = search_scale_min(x, weight, nmax)
    d = (scale.max(-1) / 63).astype(np.float16)
    dmin = (mn.max(-1) / 63).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1).astype(np.float32)[..., None]), 0, 63)
    m = np.clip(np.rint(mn / np.where(dmin > 0, dmin, 1).astype(np.float32)[..., None]), 0, 63)
    records = encode(d, dmin, sc, m)
    scales, mins = decode(records)
    s = scales.reshape(x.shape[:3])[..., None]
    q = _rounded(x, s, 0, nmax, s <= 0, offset=mins.reshape(x.shape[:3])[..., None], zero_unscaled=False)
    return q.reshape(n, k), scales, mins, records


def largest_magnitude(a: np.ndarray) -> np.ndarray:
    """The value of largest magnitude along the last axis, with its sign."""
    return np.take_along_axis(a, np.abs(a).argmax(-1)[..., None], -1)[..., 0]


def signed_codes(scale: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """A superblock's scales [..., groups] -> (d float16 [...], codes in -levels..levels - 1), as llama.cpp's
    quantize_row_q6_K codes them (levels 128): iscale = -levels / (the largest-magnitude scale), d = 1 / iscale,
    codes round(iscale * scale)."""
    big = largest_magnitude(scale)
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        iscale = np.where(big != 0, -levels / big, 0).astype(np.float32)
        d = np.where(big != 0, 1.0 / iscale, 0).astype(np.float16)
    return d, np.clip(np.rint(iscale[..., None] * scale), -levels, levels - 1)


def _quantize_signed16(w: np.ndarray, group_scales, levels: int, lo: int, hi: int):
    """Symmetric groups of 16 under Q6_K's records: group_scales(blocks [N, K / 16, 16]) gives each group's scale,
    coded per superblock by signed_codes(levels); q in lo..hi rounded against the coded values."""
    n, k = w.shape
    x = w.reshape(n, k // SUPERBLOCK, GROUPS6, GROUP6)
    scale = np.asarray(group_scales(x.reshape(n, -1, GROUP6)), np.float32).reshape(x.shape[:3])
    records = encode6(*signed_codes(scale, levels))
    scales = decode6(records)
    s = scales.reshape(x.shape[:3])[..., None]
    return _rounded(x, s, lo, hi, s == 0).reshape(n, k), scales, records


def quantize_q6k(w: np.ndarray, group_scales) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float32 w [N, K] (K a multiple of 256) -> (q int8 [N, K] in -32..31, scales float32 [N, K / 16], records
    uint8 [N, K / 256 * 18]), as llama.cpp's quantize_row_q6_K: group_scales(blocks [N, K / 16, 16]) gives each
    group's searched scale; the superblock's d = -(its largest-magnitude scale) / 128 in fp16, each group's code
    round(scale / d) clamped to int8, and q rounded against d * code."""
    return _quantize_signed16(w, group_scales, 128, -32, 31)


def quantize_q3k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, None, np.ndarray]:
    """float32 w [N, K] (K a multiple of 256) -> (q int8 in -4..3, scales float32 [N, K / 16], None, Q6_K-style
    records): each group of 16's scale searched as Q6_K's are, coded as Q6_K's in 6 bits (-32..31, Q3_K's), q
    rounded against the coded values. For the kernels' tests and the tuner: llmc imports Q3_K files, it does not
    offer the type as a --quant."""
    q, scales, records = _quantize_signed16(w, lambda blocks: searched_scales(blocks, -4, 3), 32, -4, 3)
    return q, scales, None, records


def quantize_q2k(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """float32 w [N, K] (K a multiple of 256) -> (q int8 in 0..3, scales, mins float32 [N, K / 16], Q2_K records):
    each group of 16 rounded to nearest over its range (min <= 0), the superblock's d and dmin the largest scale and
    min / 15 and each group's 4-bit codes, q rounded against the coded values. For the kernels' tests and the tuner,
    as quantize_q3k."""
    n, k = w.shape
    x = w.reshape(n, k // SUPERBLOCK, GROUPS6, GROUP6)
    lo = np.minimum(x.min(-1), 0)
    scale, mn = (x.max(-1) - lo) / 3, -lo
    d, dmin = (scale.max(-1) / 15).astype(np.float16), (mn.max(-1) / 15).astype(np.float16)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1).astype(np.float32)[..., None]), 0, 15).astype(np.uint8)
    m = np.clip(np.rint(mn / np.where(dmin > 0, dmin, 1).astype(np.float32)[..., None]), 0, 15).astype(np.uint8)
    halves = np.stack([d, dmin], axis=-1).view(np.uint8)
    records = np.ascontiguousarray(np.concatenate([sc | (m << 4), halves], axis=-1).reshape(n, -1))
    scales, mins = decode_q2k(records)
    s, offset = scales.reshape(x.shape[:3])[..., None], mins.reshape(x.shape[:3])[..., None]
    return _rounded(x, s, 0, 3, s <= 0, offset=offset, zero_unscaled=False).reshape(n, k), scales, mins, records


def _rounded(x, s, lo: int, hi: int, unscaled, offset=None, zero_unscaled: bool = True) -> np.ndarray:
    """int8 clip(rint((x + offset) / s), lo, hi), s taken as 1 where `unscaled` (and q 0 there with zero_unscaled):
    in place and on every core (torch), each value as numpy gives it (correctly rounded adds and divisions, then
    round half to even)."""
    import torch

    q = torch.from_numpy(x) if offset is None else torch.from_numpy(x) + torch.from_numpy(offset)
    q = q / torch.from_numpy(np.where(unscaled, 1, s).astype(np.float32))
    q.round_().clamp_(lo, hi)
    if zero_unscaled:
        q.masked_fill_(torch.from_numpy(unscaled), 0)
    return q.to(torch.int8).numpy()
