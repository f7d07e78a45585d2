"""The CPU packed layout of a quantized linear: what templates/cpu/qgemm.cc.j2 reads.

For a QuantizedTensor of w[N, K] (K a multiple of 32, see compiler/quant.py):

- qweight: uint8, row-major, one row per output n.
  * bits 8: K bytes per row, q as int8 (two's complement bytes).
  * bits 4: K/2 bytes per row; chunk c (32 elements of the row) is 16 bytes where
    byte j = u[32c + j] | (u[32c + j + 16] << 4), j < 16, with u = q + 8 (symmetric) or u = q
    (asymmetric), so u is 0..15. This is llama.cpp's Q4_0 nibble order: one 16-byte load, `& 0xF` and
    `>> 4` give elements 0..15 and 16..31 of the chunk in order.
- scales: float32 [N, G], mins: float32 [N, G] (asymmetric) or None; G = ceil(K / group_size), the last
  group may be short. Copied as they are (C-contiguous).
"""

from __future__ import annotations

import numpy as np

from llmc.errors import CompileError

from .quant import QuantizedTensor


def pack_cpu(t: QuantizedTensor) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(qweight uint8 [N, K] or [N, K/2], scales float32 [N, G], mins float32 [N, G] | None)."""
    n, k = t.shape
    if k % 32:
        raise CompileError(f"a quantized weight needs K a multiple of 32, got K={k}")
    scales = np.ascontiguousarray(t.scales, dtype=np.float32)
    mins = None if t.mins is None else np.ascontiguousarray(t.mins, dtype=np.float32)
    if t.scheme.bits == 8:
        return np.ascontiguousarray(t.q).view(np.uint8), scales, mins
    lo, _ = t.scheme.qrange  # -8 (symmetric) or 0 (asymmetric)
    u = (t.q.astype(np.int16) - lo).astype(np.uint8).reshape(n, k // 32, 2, 16)
    packed = u[:, :, 0, :] | (u[:, :, 1, :] << 4)
    return np.ascontiguousarray(packed.reshape(n, k // 2)), scales, mins


def unpack_cpu(qweight: np.ndarray, t_shape: tuple[int, int], bits: int, asymmetric: bool) -> np.ndarray:
    """The inverse of pack_cpu's qweight: int8 q [N, K] (for tests and inspection)."""
    n, k = t_shape
    if bits == 8:
        return np.ascontiguousarray(qweight).view(np.int8).reshape(n, k)
    b = np.asarray(qweight, np.uint8).reshape(n, k // 32, 16)
    u = np.stack([b & 0xF, b >> 4], axis=2).reshape(n, k)
    return (u.astype(np.int16) - (0 if asymmetric else 8)).astype(np.int8)
