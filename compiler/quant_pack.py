"""The packed layouts of a quantized linear: what templates/cpu/qgemm.cc.j2 (pack_cpu) and
templates/cuda/qgemm.cu.j2 (pack_cuda) read.

For a QuantizedTensor of w[N, K] (K a multiple of 32, see compiler/quant.py):

- qweight: uint8, row-major, one row per output n.
  * bits 8: K bytes per row, u = q + 128 (0..255): unsigned, as VNNI's vpdpbusd multiplies them against
    the signed int8 activations in one instruction (the kernel subtracts 128 x the activations' sums).
  * bits 4: K/2 bytes per row; chunk c (32 elements of the row) is 16 bytes where
    byte j = u[32c + j] | (u[32c + j + 16] << 4), j < 16, with u = q + 8 (symmetric) or u = q
    (asymmetric), so u is 0..15. This is llama.cpp's Q4_0 nibble order: one 16-byte load, `& 0xF` and
    `>> 4` give elements 0..15 and 16..31 of the chunk in order.
  * bits 4, codebook (IQ4_NL, IQ4_XS): int4's layout with u the index of q in quant.IQ4_LEVELS, as the GGUF blocks
    hold it.
- scales: [N, G], mins: [N, G] (asymmetric) or None, in the scheme's scale_dtype (float16 or float32,
  both exact); G = ceil(K / group_size), the last group may be short. Copied as they are (C-contiguous).
  * bits 6 (Q6_K): K * 3/4 bytes per row; chunk c (32 elements) is 24 bytes: int4's 16 bytes of low nibbles of
    u = q + 32 (0..63), then 8 bytes of the top 2 bits, byte j holding those of elements 32c + j + 8i at bits
    2i..2i+1 (i < 4): one 8-byte broadcast and a shift per 64-bit lane give all 32 in order.
  * bits 5 (Q5_0, Q5_1, Q5_K): K * 5/8 bytes per row; chunk c is 20 bytes: int4's 16 bytes of low nibbles of u =
    q + 16 (symmetric) or q (asymmetric), 0..31, then 4 bytes of the fifth bits, bit i of byte r element
    32c + 4i + r's: a variable right shift of each 32-bit lane i of the broadcast word puts its elements' at bit 0.
  * bits 3 (Q3_K): K * 3/8 bytes per row; chunk c is 12 bytes: 8 bytes of the low 2 bits of u = q + 4 (0..7), byte j
    holding elements 32c + j + 8i's at bits 2i..2i+1 (i < 4, as int6's top bits), then 4 bytes of the third bits,
    as int5's fifth.
  * bits 2 (Q2_K): K / 4 bytes per row; chunk c is 8 bytes, byte j holding u = q (0..3) of elements 32c + j + 8i at
    bits 2i..2i+1 (as int3's low bits).
  K-quant scales (compiler/kquant.py): scales are the records, uint8 [N, kquant.record_row_bytes(K)], and there are
  no mins.

The CUDA layout (pack_cuda) is in the same shapes and keeps rows independent, so the packed rows of fused
sources (q/k/v, gate/up) concatenate like the CPU's; only the byte order inside a row differs.

- qweight: uint8 [N, K * bits / 8]; every element stored biased, u = q - lo (lo = -128 for int8, -8 for
  symmetric int4, 0 for asymmetric int4), so u is unsigned (0..255 / 0..15).
- A "word" is 32 bits holding the 8 (int4) or 4 (int8) elements one lane of an mma.m16n8k16 B fragment needs
  (PTX: b[r] = B(k = 2t + h + 8r, n)) for two k16 steps (int4: 32 k, a "chunk") or one (int8: 16 k), with
  t = 0..3 the lane's threadID_in_group. Its elements e_i, i = 4s + 2r + h, are k = 16s + 8r + 2t + h of the
  word's k range; e_2j and e_2j+1 (one 32-bit B register) sit at bits [bits*j, +bits) and [16 + bits*j, +bits),
  so `(word >> bits*j) & 0x000f000f` (int4) or `& 0x00ff00ff` (int8) is register j as two u16 halves, which a
  magic-number OR turns into a bf16x2 pair (int4: `| 0x43004300` = 128 + u) or two floats
  (`0x4b000000 | u` = 2^23 + u).
- A row is blocks of 64 bytes (int4: 128 k, int8: 64 k), the last one shorter where K is no multiple of it.
  A block of nw words per lane (4, or K's tail / word) holds lane t's words at byte 4 * (t * nw + w): a full
  block is four 16-byte pieces, one per lane t, each that lane's B registers for the block's k range, so
  a warp reads whole 64-byte row blocks with one 16-byte load per lane.
- scales, mins: as pack_cpu ([N, G] in the scheme's scale_dtype; exact, so GGUF's values pass through unchanged).
"""

from __future__ import annotations

import numpy as np

from llmc.errors import CompileError

from .quant import IQ4_LEVELS, QuantizedTensor, codebook_indices, q_range


def _stored_scales(t: QuantizedTensor) -> tuple[np.ndarray, np.ndarray | None]:
    """(scales, mins | None) in the scheme's scale_dtype: the values are exact in it (QuantizedTensor checks);
    for kquant, (the superblock records, None): the records hold the mins too."""
    if t.records is not None:
        return np.ascontiguousarray(t.records), None
    dtype = np.dtype(t.scheme.scale_dtype)
    return np.ascontiguousarray(t.scales, dtype), None if t.mins is None else np.ascontiguousarray(t.mins, dtype)


def _pack_planes(bits: np.ndarray) -> np.ndarray:
    """[..., 32] of 0 / 1 -> [..., 4] bytes: element 4i + r's at bit i of byte r."""
    by_r = bits.reshape(*bits.shape[:-1], 8, 4).swapaxes(-1, -2)
    return np.packbits(by_r, axis=-1, bitorder="little").reshape(*bits.shape[:-1], 4)


def _unpack_planes(b: np.ndarray) -> np.ndarray:
    """The inverse of _pack_planes."""
    by_r = np.unpackbits(b, axis=-1, bitorder="little").reshape(*b.shape[:-1], 4, 8)
    return by_r.swapaxes(-1, -2).reshape(*b.shape[:-1], 32)


def pack_cpu(t: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(qweight uint8 [N, K] or [N, K/2], scales [N, G], mins [N, G] | None)."""
    n, k = t.shape
    if k % 32:
        raise CompileError(f"a quantized weight needs K a multiple of 32, got K={k}")
    scales, mins = _stored_scales(t)
    lo, _ = t.scheme.qrange  # stored as u = 0
    u = codebook_indices(t.q) if t.scheme.codebook else (t.q.astype(np.int16) - lo).astype(np.uint8)
    if t.scheme.bits == 8:
        return np.ascontiguousarray(u), scales, mins
    if t.scheme.bits in (2, 3):
        c = u.reshape(n, k // 32, 4, 8)
        low = np.bitwise_or.reduce((c & 3) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2)
        if t.scheme.bits == 2:
            return np.ascontiguousarray(low.reshape(n, k // 4)), scales, mins
        third = _pack_planes(c.reshape(n, k // 32, 32) >> 2)
        return np.ascontiguousarray(np.concatenate([low, third], axis=-1).reshape(n, k * 3 // 8)), scales, mins
    if t.scheme.bits in (5, 6):
        c = u.reshape(n, k // 32, 32)
        low = (c[..., :16] & 0xF) | ((c[..., 16:] & 0xF) << 4)
        if t.scheme.bits == 6:
            top = (c >> 4).reshape(n, k // 32, 4, 8) << (2 * np.arange(4, dtype=np.uint8))[:, None]
            packed = np.concatenate([low, np.bitwise_or.reduce(top, axis=2)], axis=-1)
        else:
            packed = np.concatenate([low, _pack_planes(c >> 4)], axis=-1)
        return np.ascontiguousarray(packed.reshape(n, k * t.scheme.bits // 8)), scales, mins
    u = u.reshape(n, k // 32, 2, 16)
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(n, k // 2)), scales, mins


def unpack_cpu(
    qweight: np.ndarray, t_shape: tuple[int, int], bits: int, asymmetric: bool, codebook: bool = False
) -> np.ndarray:
    """The inverse of pack_cpu's qweight: int8 q [N, K] (for tests and inspection)."""
    n, k = t_shape
    b = np.asarray(qweight, np.uint8)
    if bits == 8:
        u = b.reshape(n, k)
    elif bits in (2, 3):
        c = b.reshape(n, k // 32, 4 * bits)
        u = ((c[..., None, :8] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(n, k // 32, 32)
        if bits == 3:
            u = u | (_unpack_planes(c[..., 8:]) << 2)
        u = u.reshape(n, k)
    elif bits in (5, 6):
        c = b.reshape(n, k // 32, 4 * bits)
        low = np.concatenate([c[..., :16] & 0xF, c[..., :16] >> 4], axis=-1)
        if bits == 6:
            top = (c[..., None, 16:] >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
        else:
            top = _unpack_planes(c[..., 16:])
        u = (low | (top.reshape(n, k // 32, 32) << 4)).reshape(n, k)
    else:
        b = b.reshape(n, k // 32, 16)
        u = np.stack([b & 0xF, b >> 4], axis=2).reshape(n, k)
        if codebook:
            return IQ4_LEVELS[u]
    return (u.astype(np.int16) + q_range(bits, asymmetric)[0]).astype(np.int8)


_CUDA_BLOCK_WORDS = 4  # words per lane in a full 64-byte block


def _cuda_word_order(k: int, bits: int) -> np.ndarray:
    """perm[d] = the k of the element stored d-th in a row: element i of each word in turn, the words in row
    order (before the bytes / nibbles inside a word are arranged)."""
    per_word = 32 // bits  # elements per word
    units = k // (32 if bits == 4 else 16)  # words per lane in the row
    # Lane t's word for unit u holds e_i, i = 4s + 2r + h, at k = 32u (int4) / 16u (int8) + 16s + 8r + 2t + h.
    i = np.arange(per_word)
    s, r, h = i // 4, (i // 2) % 2, i % 2
    t = np.arange(4)
    ks = np.arange(units)[:, None, None] * (4 * per_word) + (16 * s + 8 * r + h)[None, None, :] + 2 * t[None, :, None]
    # unit u of lane t goes to word 16 * block + t * nw + w of the row (block = u // 4, w = u % 4).
    block, w = np.arange(units) // _CUDA_BLOCK_WORDS, np.arange(units) % _CUDA_BLOCK_WORDS
    nw = np.minimum(_CUDA_BLOCK_WORDS, units - _CUDA_BLOCK_WORDS * block)
    dest = 4 * _CUDA_BLOCK_WORDS * block[:, None] + t[None, :] * nw[:, None] + w[:, None]  # [units, 4]
    perm = np.empty((units * 4, per_word), np.int64)
    perm[dest.reshape(-1)] = ks.reshape(units * 4, per_word)
    return perm.reshape(-1)


def pack_cuda(t: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(qweight uint8 [N, K * bits / 8], scales [N, G], mins [N, G] | None): the CUDA layout."""
    n, k = t.shape
    if k % 32:
        raise CompileError(f"a quantized weight needs K a multiple of 32, got K={k}")
    if t.scheme.codebook:
        raise CompileError(f"the CUDA kernels hold {t.scheme.describe()} weights in int8 (quant_widen.held_on_cuda)")
    scales, mins = _stored_scales(t)
    bits = t.scheme.bits
    lo, _ = t.scheme.qrange
    perm = _cuda_word_order(k, bits)
    u = (t.q.astype(np.int16) - lo).astype(np.uint8)[:, perm]  # [N, K] in storage order, element i of each word
    if bits == 8:  # bytes of a word: e0, e2, e1, e3 (register j = bytes j and j + 2)
        words = u.reshape(n, k // 4, 4)[:, :, [0, 2, 1, 3]]
        return np.ascontiguousarray(words.reshape(n, k)), scales, mins
    # int4: nibble p of a word holds e_[0, 2, 4, 6, 1, 3, 5, 7][p]; byte j = nibbles 2j (low) and 2j + 1
    e = u.reshape(n, k // 8, 8)
    nib = e[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]
    packed = nib[:, :, 0::2] | (nib[:, :, 1::2] << 4)
    return np.ascontiguousarray(packed.reshape(n, k // 2)), scales, mins


def unpack_cuda(qweight: np.ndarray, t_shape: tuple[int, int], bits: int, asymmetric: bool) -> np.ndarray:
    """The inverse of pack_cuda's qweight: int8 q [N, K] (for tests and inspection)."""
    n, k = t_shape
    lo, _ = q_range(bits, asymmetric)  # stored as u = 0
    b = np.asarray(qweight, np.uint8).reshape(n, -1)
    if bits == 8:
        u = b.reshape(n, k // 4, 4)[:, :, [0, 2, 1, 3]].reshape(n, k)
    else:
        nib = np.stack([b & 0xF, b >> 4], axis=2).reshape(n, k // 8, 8)
        u = nib[:, :, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(n, k)
    perm = _cuda_word_order(k, bits)
    q = np.empty((n, k), np.int16)
    q[:, perm] = u.astype(np.int16) + lo
    return q.astype(np.int8)
