"""Quantized weights: the one form every source (llmc's own quantizer, a GGUF file) produces and every
target's packer reads.

A weight matrix w[N, K] (HF Linear layout, one row per output) is quantized along K in groups of
`group_size` consecutive elements of a row:

    w[n, k] = q[n, k] * scales[n, k // group_size] - mins[n, k // group_size]      (mins: asymmetric only)

- `q` is int8 [N, K], one value per element whatever the width: bits=8 holds -128..127 (GGUF Q6_K's
  -32..31 fits too), bits=4 holds -8..7 when symmetric and 0..15 when asymmetric.
- `scales` and `mins` are float32 [N, ceil(K / group_size)]. The last group of a row may be shorter than
  `group_size` when it does not divide K. GGUF's scales (fp16, or fp16 x 6-bit sub-scales) are exact in
  float32, so an imported tensor keeps its values bit for bit.
- The dequantized value is computed in float32 as written above, one rounding (`dequantize`), which is how
  gguf.quants.dequantize computes Q8_0, Q4_0, Q4_K and Q6_K.

llmc's own quantizer (`quantize`) is round-to-nearest: symmetric with scale = absmax / qmax (int8 qmax 127,
int4 qmax 7, q clamped to [-qmax - 1, qmax]); asymmetric int4 with scale = (max - min) / 15 and
mins = -min, so that q = round((w - min) / scale) lies in 0..15.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmc.errors import CompileError

QUANT_MODES = ("none", "int8", "int4")
GROUP_SIZES = (32, 64, 128)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    bits: int  # 8 or 4
    group_size: int  # elements of a row per scale; K for one scale per output channel
    asymmetric: bool = False  # per-group mins

    def __post_init__(self):
        if self.bits not in (4, 8):
            raise CompileError(f"quantization to {self.bits} bits is not supported", "use int8 or int4")
        if self.group_size <= 0:
            raise CompileError(f"quantization group size {self.group_size} must be positive")

    @property
    def qrange(self) -> tuple[int, int]:
        """The range q holds."""
        if self.bits == 8:
            return -128, 127
        return (0, 15) if self.asymmetric else (-8, 7)

    def describe(self) -> str:
        """`int4 g32 asym`, as `llmc inspect` shows it."""
        return f"int{self.bits} g{self.group_size}" + (" asym" if self.asymmetric else "")


@dataclasses.dataclass
class QuantizedTensor:
    q: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # float32 [N, groups]
    mins: np.ndarray | None  # float32 [N, groups], asymmetric schemes only
    scheme: QuantScheme

    def __post_init__(self):
        n, k = self.q.shape
        groups = -(-k // self.scheme.group_size)
        if self.q.dtype != np.int8 or self.scales.dtype != np.float32 or self.scales.shape != (n, groups):
            raise CompileError(
                f"quantized tensor: q {self.q.dtype}{list(self.q.shape)}, scales "
                f"{self.scales.dtype}{list(self.scales.shape)} do not fit {self.scheme.describe()}"
            )
        if (self.mins is not None) != self.scheme.asymmetric or (
            self.mins is not None and (self.mins.dtype != np.float32 or self.mins.shape != (n, groups))
        ):
            raise CompileError(f"quantized tensor: mins do not fit {self.scheme.describe()}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


def _per_element(a: np.ndarray, k: int, group_size: int) -> np.ndarray:
    """[N, groups] -> [N, K]: each group's value repeated over its elements."""
    return np.repeat(a, group_size, axis=1)[:, :k]


def dequantize(t: QuantizedTensor) -> np.ndarray:
    """float32 [N, K], w = q * scale - min, one rounding per element."""
    k, g = t.q.shape[1], t.scheme.group_size
    w = t.q.astype(np.float32) * _per_element(t.scales, k, g)
    if t.mins is not None:
        w = w - _per_element(t.mins, k, g)
    return w


def quantize(w: np.ndarray, scheme: QuantScheme) -> QuantizedTensor:
    """Round-to-nearest quantization of float32 w[N, K] (see the module docstring)."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise CompileError(f"only 2-D weights are quantized, got shape {list(w.shape)}")
    n, k = w.shape
    g = scheme.group_size
    groups = -(-k // g)
    padded = np.zeros((n, groups * g), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, g)
    lo, hi = scheme.qrange
    if scheme.asymmetric:
        # A padded tail's zeros widen the last group's range by at most 0: min <= 0 <= max is not assumed
        # elsewhere, so take the real elements only.
        real = np.arange(groups * g).reshape(groups, g) < k
        wmin = np.where(real, blocks, np.inf).min(axis=2)
        wmax = np.where(real, blocks, -np.inf).max(axis=2)
        scales = ((wmax - wmin) / hi).astype(np.float32)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint((blocks - wmin[..., None]) / safe[..., None])
        mins = (-wmin).astype(np.float32)
    else:
        qmax = hi
        scales = (np.abs(blocks).max(axis=2) / qmax).astype(np.float32)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint(blocks / safe[..., None])
        mins = None
    q = np.clip(q, lo, hi).astype(np.int8).reshape(n, groups * g)[:, :k]
    return QuantizedTensor(np.ascontiguousarray(q), scales, mins, scheme)
