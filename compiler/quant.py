"""Quantized weights: the one form every source (llmc's own quantizer, a GGUF file) produces and every
target's packer reads.

A weight matrix w[N, K] (HF Linear layout, one row per output) is quantized along K in groups of
`group_size` consecutive elements of a row:

    w[n, k] = q[n, k] * scales[n, k // group_size] - mins[n, k // group_size]      (mins: asymmetric only)

- `q` is int8 [N, K], one value per element whatever the width: bits=8 holds -128..127, bits=6 -32..31
  (llama.cpp's Q6_K: symmetric groups of 16 under its superblock records, the one 6-bit scheme), bits=3 -4..3
  (llama.cpp's Q3_K, its scales held in Q6_K's records), bits=2 0..3 with mins (Q2_K), bits=5 and
  bits=4 hold -16..15 / -8..7 when symmetric and 0..31 / 0..15 when asymmetric (5 bits: llama.cpp's Q5_0, Q5_1
  and Q5_K, groups of 32). A codebook scheme (llama.cpp's IQ4_NL and IQ4_XS: 4 bits an element, each an index into
  IQ4_LEVELS) holds the levels themselves in q, -127..113.
- `scales` and `mins` are float32 arrays [N, ceil(K / group_size)]. The last group of a row may be shorter
  than `group_size` when it does not divide K. The scheme's `scale_dtype` says how they are stored: float16
  (the default: llmc's quantizer picks fp16 values, and GGUF Q8_0 / Q4_0 hold fp16 scales), float32 (GGUF
  Q2_K / Q3_K / IQ4_XS, whose fp16 x 4- or 6-bit sub-scale products need it) or kquant (Q4_K / Q5_K / Q6_K's own
  superblock records, compiler/kquant.py). All are exact, so an imported tensor keeps its values bit for bit.
  At int4 g32, fp16 scales are 0.5625 bytes a weight against 0.625.
- The dequantized value is computed in float32 as written above, one rounding (`dequantize`), which is how
  gguf.quants.dequantize computes Q8_0, Q4_0, Q4_K and Q6_K.

llmc's own quantizer (`quantize`): symmetric groups take the scale that minimises their squared error, searched
as llama.cpp's make_qx_quants does (quant_search.searched_scales), with q = round(w / scale) clamped to the whole range
(int8 -128..127, int4 -8..7: a group's largest-magnitude value may map to -8, as in Q4_0, and the clamp may cut
an outlier when that lowers the group's error); asymmetric int4 is round-to-nearest with scale = (max - min) / 15
and mins = -min, so that q = round((w - min) / scale) lies in 0..15. With fp16 scales, the asymmetric mins and
scales are rounded up to the next fp16 value (no value leaves the range), the searched scales to the nearest,
and q is computed from the rounded values. Quantizing a quantized tensor's values gives them back. Given the
input channels' importance (compiler/importance.py), every search weighs each weight's error by it, and the
asymmetric scales and mins are searched too (quant_search.search_scale_min), stored at the nearest fp16 values.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np

from llmc.errors import CompileError

from . import kquant
from .quant_search import search_scale_min, searched_scales

QUANT_MODES = ("none", "int8", "int4", "q4_k", "q5_k", "q4_k_m", "q5_k_m", "q8_0")
RECIPES = ("q4_k_m", "q5_k_m", "q8_0")  # modes that choose each tensor's scheme, the lm_head's and the embedding's too
KQUANTS = {"q4_k": 4, "q5_k": 5, "q4_k_m": 4, "q5_k_m": 5}  # K-quant modes and types, by their bits
TENSOR_TYPES = ("float", "int8", "int4", "q4_k", "q5_k", "q6_k", "q8_0")  # what --tensor-quant gives one tensor
GROUP_SIZES = (32, 64, 128)
PER_CHANNEL = "channel"  # int8's --group-size for one scale per output channel (group_size K)
# IQ4_NL / IQ4_XS's 16 levels (llama.cpp's kvalues_iq4nl): what a codebook scheme's 4-bit indices stand for
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
K_MULTIPLE = 32  # a quantized weight's K is a multiple of this (the kernels' activation blocks); else it stays float
SCALE_DTYPES = ("float16", "float32", "kquant")  # kquant: compiler/kquant.py's superblock records (RECORD_KINDS)
_SCALE_BITS = {"float16": 16, "float32": 32, "kquant": 8}


def q_range(bits: int, asymmetric: bool, codebook: bool = False) -> tuple[int, int]:
    """The range q holds at `bits`: signed, but for asymmetric int4 and int5, whose q count up from the min; a
    codebook's, that of its levels."""
    if codebook:
        return int(IQ4_LEVELS[0]), int(IQ4_LEVELS[-1])
    top = 1 << bits
    return (0, top - 1) if asymmetric and bits in (2, 4, 5) else (-top // 2, top // 2 - 1)


@dataclasses.dataclass(frozen=True)
class QuantScheme:
    bits: int  # 8, 6 (Q6_K only), 5 (groups of 32: Q5_0, Q5_1, Q5_K), 4, 3 (Q3_K only) or 2 (Q2_K only)
    group_size: int  # elements of a row per scale; K for one scale per output channel
    asymmetric: bool = False  # per-group mins
    scale_dtype: str = "float16"  # how scales and mins are stored: SCALE_DTYPES
    codebook: bool = False  # 4-bit indices into IQ4_LEVELS (IQ4_NL, IQ4_XS): symmetric groups of 32

    def __post_init__(self):
        if self.bits not in (2, 3, 4, 5, 6, 8):
            raise CompileError(f"quantization to {self.bits} bits is not supported", "use int8 or int4")
        if self.group_size <= 0:
            raise CompileError(f"quantization group size {self.group_size} must be positive")
        if self.scale_dtype not in SCALE_DTYPES:
            raise CompileError(f"quantization scales in {self.scale_dtype} are not supported")
        if (
            self.scale_dtype == "kquant"
            and (self.group_size, self.asymmetric, self.codebook) not in kquant.RECORD_KINDS
        ):
            raise CompileError(
                "K-quant superblock scales are for asymmetric groups of 32 (Q4_K, Q5_K) or 16 (Q2_K), symmetric ones "
                "of 16 (Q6_K, Q3_K) or IQ4's groups of 32 (IQ4_XS)"
            )
        if self.bits in (3, 6) and (self.group_size, self.asymmetric, self.scale_dtype) != (16, False, "kquant"):
            raise CompileError(
                f"{self.bits}-bit weights are Q{self.bits}_K's: symmetric groups of 16 under K-quant records"
            )
        if self.bits == 2 and (self.group_size, self.asymmetric, self.scale_dtype) != (16, True, "kquant"):
            raise CompileError("2-bit weights are Q2_K's: groups of 16 with mins under K-quant records")
        if self.bits == 5 and self.group_size != 32:
            raise CompileError("5-bit weights are in groups of 32 (Q5_0, Q5_1, Q5_K)")
        if self.codebook and (self.bits, self.group_size, self.asymmetric) != (4, 32, False):
            raise CompileError("codebook weights are IQ4's: 4-bit indices in symmetric groups of 32")

    @property
    def qrange(self) -> tuple[int, int]:
        """The range q holds (q_range)."""
        return q_range(self.bits, self.asymmetric, self.codebook)

    @classmethod
    def of_kernel(cls, params) -> QuantScheme:
        """The scheme of a qgemm kernel's parameters (bits, group_size, asymmetric, scale_bits, codebook)."""
        dtype = {bits: dtype for dtype, bits in _SCALE_BITS.items()}[params["scale_bits"]]
        asymmetric, codebook = bool(params["asymmetric"]), bool(params.get("codebook", False))
        return cls(params["bits"], params["group_size"], asymmetric, dtype, codebook)

    def kernel_params(self) -> dict:
        """The quantized kernels' parameters of this scheme (of_kernel's inverse): bits, group_size, asymmetric,
        scale_bits, and codebook where it is one (so that the other kernels' names and tuning keys stay as they were)."""
        params = dict(
            bits=self.bits, group_size=self.group_size, asymmetric=self.asymmetric, scale_bits=self.scale_bits
        )
        return {**params, "codebook": True} if self.codebook else params

    @property
    def scale_bits(self) -> int:
        """16, 32 or 8 (kquant): how the IR and the kernels' parameters spell scale_dtype."""
        return _SCALE_BITS[self.scale_dtype]

    def scale_row_bytes(self, k: int) -> int:
        """Bytes of scales (and mins) that a row of K stores."""
        if self.scale_dtype == "kquant":
            return kquant.record_row_bytes(k, self.group_size, self.asymmetric, self.codebook)
        return -(-k // self.group_size) * (self.scale_bits // 8) * (2 if self.asymmetric else 1)

    @property
    def stores_mins(self) -> bool:
        """Whether the mins are a part of their own (a kquant record holds its mins beside its scales)."""
        return self.asymmetric and self.scale_dtype != "kquant"

    def describe(self) -> str:
        """`int4 g32 asym`, as `llmc inspect` shows it (`int8 g16 fp32-scales` where scales are not fp16,
        `int4 g32 asym k-scales` for the K-quants' superblocks, `iq4 g32` for the codebook)."""
        return (
            f"{'iq' if self.codebook else 'int'}{self.bits} g{self.group_size}"
            + (" asym" if self.asymmetric else "")
            + {"float16": "", "float32": " fp32-scales", "kquant": " k-scales"}[self.scale_dtype]
        )


@dataclasses.dataclass
class QuantizedTensor:
    q: np.ndarray  # int8 [N, K]
    scales: np.ndarray  # float32 [N, groups]
    mins: np.ndarray | None  # float32 [N, groups], asymmetric schemes only
    scheme: QuantScheme
    # kquant scales only: uint8 [N, kquant.record_row_bytes(K)], the stored form of scales and mins
    records: np.ndarray | None = None

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
        if self.scheme.scale_dtype == "float16" and not all(
            a is None or np.array_equal(a.astype(np.float16).astype(np.float32), a, equal_nan=True)
            for a in (self.scales, self.mins)
        ):  # NaN is an fp16 value too: packing the weights refuses it, naming the tensor (weights._check_finite)
            raise CompileError(
                f"quantized tensor: scales or mins are not fp16 values, as {self.scheme.describe()} needs"
            )
        if self.scheme.codebook:
            codebook_indices(self.q)
        if (self.records is not None) != (self.scheme.scale_dtype == "kquant"):
            raise CompileError(f"quantized tensor: K-quant records go with k-scales only, not {self.scheme.describe()}")
        if self.records is not None:
            asym = self.scheme.asymmetric
            if (
                k % kquant.SUPERBLOCK
                or self.records.dtype != np.uint8
                or self.records.shape != (n, self.scheme.scale_row_bytes(k))
            ):
                raise CompileError(f"quantized tensor: K-quant records do not fit [{n}, {k}] (K a multiple of 256)")
            held = kquant.decode_records(self.records, self.scheme.group_size, asym, self.scheme.codebook)
            if not all(a is b or np.array_equal(a, b) for a, b in zip(held, (self.scales, self.mins), strict=True)):
                raise CompileError("quantized tensor: the K-quant records do not hold its scales and mins")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape


_LEVEL_INDEX = np.full(256, -1, np.int8)
_LEVEL_INDEX[IQ4_LEVELS.view(np.uint8)] = np.arange(len(IQ4_LEVELS))


def codebook_indices(q: np.ndarray) -> np.ndarray:
    """A codebook tensor's q (IQ4_LEVELS values) -> uint8 indices into IQ4_LEVELS; a q that is no level is a
    CompileError."""
    index = _LEVEL_INDEX[np.asarray(q, np.int8).view(np.uint8)]
    if (index < 0).any():
        raise CompileError("quantized tensor: a codebook weight holds a value that is none of IQ4's levels")
    return index.view(np.uint8)


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


def quantize(w: np.ndarray, scheme: QuantScheme, importance: np.ndarray | None = None) -> QuantizedTensor:
    """float32 w[N, K] quantized to `scheme` (see the module docstring). importance: float32 [K], each input
    channel's mean squared activation (compiler/importance.py): every search weighs a weight's squared error by
    it, and asymmetric groups are searched instead of rounded to nearest."""
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise CompileError(f"only 2-D weights are quantized, got shape {list(w.shape)}")
    n, k = w.shape
    if importance is not None and np.shape(importance) != (k,):
        raise CompileError(f"importance of {np.shape(importance)} for a weight of K = {k}")
    if scheme.codebook:
        return _quantize_codebook(w, scheme)
    if scheme.scale_dtype == "kquant":
        if k % kquant.SUPERBLOCK:
            raise CompileError(
                f"llmc quantizes to K-quant scales with K a multiple of 256, not {scheme.describe()}, K={k}"
            )
        if scheme.bits in (2, 3):
            quantizer = kquant.quantize_q2k if scheme.bits == 2 else kquant.quantize_q3k
            q, scales, mins, records = quantizer(w)
            return QuantizedTensor(q, scales, mins, scheme, records)
        if scheme.bits == 6:
            return _quantize_q6k(w, scheme, importance)
        with np.errstate(over="ignore", invalid="ignore"):
            q, scales, mins, records = kquant.quantize_kquant(w, scheme.qrange[1], importance)
        if not (np.isfinite(scales).all() and np.isfinite(mins).all()):
            raise CompileError(
                "a K-quant superblock needs a scale past fp16's range (65504)",
                "such a weight cannot be quantized with fp16 scales; leave it unquantized",
            )
        return QuantizedTensor(q, scales, mins, scheme, records)
    g = scheme.group_size
    groups = -(-k // g)
    padded = np.zeros((n, groups * g), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, groups, g)
    lo, hi = scheme.qrange
    fp16 = scheme.scale_dtype == "float16"
    weight = None  # as blocks; a padded tail's weight is 0
    if importance is not None:  # llama.cpp's Q4_0 / Q4_1 with an imatrix: importance * sqrt(sigma2 + w^2), per row
        sigma2 = np.square(w).mean(axis=1)[:, None, None]
        imp = np.pad(np.asarray(importance, np.float32), (0, groups * g - k)).reshape(groups, g)
        weight = (imp * np.sqrt(sigma2 + blocks**2)).astype(np.float32)
    if scheme.asymmetric:
        if weight is None:  # round-to-nearest over each group's range, as llama.cpp's Q4_1 without an imatrix
            # A padded tail's zeros widen the last group's range by at most 0: min <= 0 <= max is not assumed
            # elsewhere, so take the real elements only.
            real = np.arange(groups * g).reshape(groups, g) < k
            wmin = np.where(real, blocks, np.inf).min(axis=2)
            wmax = np.where(real, blocks, -np.inf).max(axis=2)
            mins = _stored(-wmin, fp16, up=True)  # >= -min: w + mins >= 0
            scales = _stored((wmax + mins) / hi, fp16, up=True)
        else:  # with one: make_qkx2's weighted search (q may clip)
            scale, mn = search_scale_min(blocks, weight, hi)
            scales, mins = _stored(scale, fp16, up=False), _stored(mn, fp16, up=False)
        safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
        q = np.rint((blocks + mins[..., None]) / safe[..., None])
    else:
        # negative where a group's largest value is positive; the nearest fp16 value, not the next one up:
        # the least-squares scale of already-quantized weights is their scale to within float rounding, and
        # rounding that up would move it a whole fp16 step (quantize must be idempotent on its own output)
        scales = _stored(searched_scales(blocks, lo, hi, weight), fp16, up=False)
        safe = np.where(scales != 0, scales, 1.0).astype(np.float32)
        q = np.rint(blocks / safe[..., None])
        mins = None
    q = np.clip(q, lo, hi).astype(np.int8).reshape(n, groups * g)[:, :k]
    return QuantizedTensor(np.ascontiguousarray(q), scales, mins, scheme)


def _quantize_codebook(w: np.ndarray, scheme: QuantScheme) -> QuantizedTensor:
    """IQ4 groups as llama.cpp's IQ4_NL starts its search: scale = m / -127 (m the group's largest-magnitude
    value, so it lands on the lowest level), each weight at its nearest level; under IQ4_XS's records (kquant) the
    scales coded in 6 bits as Q6_K's are (kquant.signed_codes), stored plus 32. llmc imports
    IQ4 files; this makes such tensors for the kernels' tests and the tuner."""
    n, k = w.shape
    blocks = w.reshape(n, k // 32, 32)
    m = kquant.largest_magnitude(blocks)
    records = None
    if scheme.scale_dtype == "kquant":
        if k % kquant.SUPERBLOCK:
            raise CompileError(f"IQ4_XS records need K a multiple of 256, not K={k}")
        d, codes = kquant.signed_codes((m / float(IQ4_LEVELS[0])).reshape(n, -1, kquant.GROUPS), 32)
        records = kquant.encode_iq4xs(d, codes + 32)
        scales = kquant.decode_iq4xs(records)
    else:
        scales = _stored(m / float(IQ4_LEVELS[0]), scheme.scale_dtype == "float16", up=False)
    safe = np.where(scales != 0, scales, 1.0).astype(np.float32)
    levels = IQ4_LEVELS.astype(np.float32)
    x = blocks / safe[..., None]
    q = IQ4_LEVELS[np.abs(x[..., None] - levels).argmin(axis=-1)]
    return QuantizedTensor(np.ascontiguousarray(q.reshape(n, k)), scales, None, scheme, records)


def _quantize_q6k(w: np.ndarray, scheme: QuantScheme, importance: np.ndarray | None) -> QuantizedTensor:
    """Q6_K (kquant.quantize_q6k), each group's scale searched as int8's and int4's are, weighted as llama.cpp's
    quantize_q6_K weighs it: w^2, or given an imatrix importance * sqrt(sigma2 + w^2), sigma2 = 2 mean(w^2) a row."""
    lo, hi = scheme.qrange
    n, k = w.shape
    weight = np.square(w)  # make_qx_quants' rmse_type 1, as quantize_row_q6_K_ref calls it: w^2
    if importance is not None:  # in place: a 128256 x 4096 head's weights are 2 GB of float32
        np.add(weight, 2 * weight.mean(axis=1)[:, None], out=weight)
        np.multiply(np.sqrt(weight, out=weight), np.asarray(importance, np.float32), out=weight)
    weight = weight.reshape(n, k // 16, 16)
    q, scales, records = kquant.quantize_q6k(
        w, lambda blocks: searched_scales(blocks, lo, hi, weight, llama_cpp_grid=True)
    )
    if not np.isfinite(scales).all():
        raise CompileError(
            "a Q6_K superblock needs a scale past fp16's range (65504)",
            "such a weight cannot be quantized with fp16 scales; leave it unquantized",
        )
    return QuantizedTensor(q, scales, None, scheme, records)


def _stored(a: np.ndarray, fp16: bool, up: bool) -> np.ndarray:
    """float32 a as stored: unchanged for fp32 scales; else each value replaced by the nearest fp16 value, or
    with `up` the smallest fp16 value >= it (finite: else a CompileError)."""
    a = np.asarray(a, np.float32)
    if not fp16:
        return a
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
        if up:
            low = np.isfinite(h) & (h.astype(np.float32) < a)  # not -inf: a negative scale past the range stays out
            h[low] = np.nextafter(h[low], np.float16(np.inf))
    if not np.isfinite(h).all():
        big = float(np.abs(a[~np.isfinite(h)]).max())
        raise CompileError(
            f"a quantization group needs a scale of {big:g}, past fp16's range (65504)",
            "such a weight cannot be quantized with fp16 scales; leave it unquantized",
        )
    return h.astype(np.float32)


Q8_0 = QuantScheme(8, 32)  # llama.cpp's Q8_0: symmetric int8 groups of 32, fp16 scales
Q6_K = QuantScheme(6, 16, scale_dtype="kquant")  # llama.cpp's Q6_K: int6 groups of 16 under superblock records


def more_bits(layer: int, num_layers: int) -> bool:
    """llama.cpp's use_more_bits: the layers whose attn_v and ffn_down its _M recipes quantize wider (the first
    and last eighth, and every third layer between)."""
    eighth = num_layers // 8
    return layer < eighth or layer >= 7 * num_layers // 8 or (layer - eighth) % 3 == 2


@dataclasses.dataclass(frozen=True)
class QuantConfig:
    """What `llmc compile --quant MODE [--group-size G] [--quant-lm-head]` asks of llmc's own quantizer.

    int8 and int4 default to groups of 32, symmetric (int8 as llama.cpp's Q8_0; group_size PER_CHANNEL gives int8
    one scale per output channel, fewer bytes but +1% perplexity on a trained 135M model against Q8_0's +0.4%). q4_k is
    llama.cpp's Q4_K: asymmetric int4 groups of 32 with K-quant superblock records (compiler/kquant.py), for a
    linear whose K is a multiple of 256, else asymmetric int4 g32 with fp16 scales and mins (llama.cpp's Q4_1
    fallback); q5_k is Q5_K the same way, at 5 bits (Q5_1 where K is no multiple of 256). These quantize the
    linears of the blocks, and the lm_head only with lm_head=True.

    The recipes choose per tensor, as llama.cpp's file types do (`tensor_scheme`):
    - q8_0: every linear, the lm_head and the embedding as Q8_0.
    - q4_k_m: q4_k, but the lm_head (a tied embedding with it) as Q6_K, and on the more_bits layers ffn_down and
      attn_v as Q6_K (Q8_0 where K is no multiple of 256, as llama.cpp falls back). An untied embedding is q4_k,
      as there. With one_scheme_qkv (CUDA, whose q, k and v GEMM reads one scheme) q and k go with v.
    - q5_k_m: the same with q5_k in place of q4_k, as llama.cpp's Q5_K_M.

    `overrides` ((pattern, type), ...; `--tensor-quant PATTERN=TYPE`, as llama-quantize's --tensor-type) give
    the tensors whose checkpoint name matches a regular expression (re.search) a TYPE of their own in place of
    the mode's choice: the first pattern that matches wins. int8 and int4 are g32 there (the mode's --group-size
    where the type is the mode); q6_k is Q8_0 where K is no multiple of 256; float leaves the tensor
    unquantized. The lm_head's name is
    "lm_head.weight" (a tied embedding's too), an untied embedding's "model.embed_tokens.weight".

    A linear whose K is not a multiple of K_MULTIPLE stays float.
    """

    mode: str = "none"
    group_size: int | str | None = None  # None: the mode's default; PER_CHANNEL (int8)
    lm_head: bool = False
    overrides: tuple[tuple[str, str], ...] = ()

    def __post_init__(self):
        if self.mode not in QUANT_MODES:
            raise CompileError(
                f"quantization mode {self.mode!r} is not supported", f"choose one of {', '.join(QUANT_MODES)}"
            )
        if self.group_size is not None and self.group_size not in (*GROUP_SIZES, PER_CHANNEL):
            raise CompileError(
                f"group size {self.group_size} is not supported",
                f"choose one of {', '.join(map(str, GROUP_SIZES))} or {PER_CHANNEL} (int8)",
            )
        if self.group_size == PER_CHANNEL and self.mode != "int8":
            raise CompileError(f"--group-size {PER_CHANNEL} is int8's", "give int4 groups of 32, 64 or 128")
        if self.mode == "none" and (self.group_size is not None or self.lm_head):
            raise CompileError(
                "--group-size and --quant-lm-head apply to a quantized build", "add --quant int8 or int4"
            )
        if self.mode in (*KQUANTS, *RECIPES) and self.group_size is not None:
            raise CompileError(f"{self.mode} chooses its own groups", "leave out --group-size")
        if self.mode in RECIPES and self.lm_head:
            raise CompileError(f"{self.mode} quantizes the lm_head itself (as Q8_0)", "leave out --quant-lm-head")
        if self.overrides and self.mode == "none":
            raise CompileError("--tensor-quant changes a quantized build's choice", "add --quant MODE")
        for pattern, kind in self.overrides:
            if kind not in TENSOR_TYPES:
                raise CompileError(
                    f"--tensor-quant {pattern}={kind}: no tensor type {kind!r}",
                    f"choose one of {', '.join(TENSOR_TYPES)}",
                )
            try:
                re.compile(pattern)
            except re.error as e:
                raise CompileError(f"--tensor-quant {pattern}={kind}: not a regular expression ({e})") from None

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    @property
    def quantizes_head(self) -> bool:
        kind = self._override("lm_head.weight")
        return kind != "float" if kind is not None else self.lm_head or self.mode in RECIPES

    def _override(self, name: str) -> str | None:
        """The type of the first override whose pattern matches tensor `name`, None where none does."""
        return next((kind for pattern, kind in self.overrides if re.search(pattern, name)), None)

    def scheme(self, k: int, kind: str | None = None) -> QuantScheme | None:
        """The scheme of a linear of the blocks with K = k inputs (of TENSOR_TYPES `kind` if given, else of the
        mode), None where it stays float."""
        kind = kind or self.mode
        if kind in ("none", "float") or k % K_MULTIPLE:
            return None
        if kind == "int8":
            group = (self.group_size if kind == self.mode else None) or 32
            return QuantScheme(8, k if group == PER_CHANNEL else group)
        if kind == "q8_0":
            return Q8_0
        if kind == "q6_k":
            return Q6_K if k % kquant.SUPERBLOCK == 0 else Q8_0
        if kind in KQUANTS:  # llama.cpp's fallback where K is no multiple of 256: Q4_1 / Q5_1 (fp16 scales, mins)
            return QuantScheme(KQUANTS[kind], 32, True, "kquant" if k % kquant.SUPERBLOCK == 0 else "float16")
        return QuantScheme(4, (self.group_size if kind == self.mode else None) or 32)

    def tensor_scheme(self, name: str, k: int, num_layers: int, one_scheme_qkv: bool = False) -> QuantScheme | None:
        """The scheme of checkpoint tensor `name` with K = k inputs, None where it stays float. `name` is a linear
        of the blocks, "lm_head.weight" (the head, a tied embedding's too) or "model.embed_tokens.weight" (an
        untied embedding's gather). one_scheme_qkv: a recipe gives q and k v's scheme."""
        kind = self._override(name)
        if kind is not None:
            return self.scheme(k, kind)
        if name == "model.embed_tokens.weight" and self.mode not in RECIPES:
            return None
        if name == "lm_head.weight" and not self.quantizes_head:
            return None
        if self.mode in ("q4_k_m", "q5_k_m") and k % K_MULTIPLE == 0:
            wide_attn = "qkv" if one_scheme_qkv else "v"
            wider = name.endswith(("mlp.down_proj.weight", *(f"self_attn.{p}_proj.weight" for p in wide_attn)))
            if name == "lm_head.weight" or (wider and more_bits(int(name.split(".")[2]), num_layers)):
                return self.scheme(k, "q6_k")
        return self.scheme(k)

    def describe(self) -> str:
        """`int8 g32`, `int8 per channel`, + `, lm_head` when it is quantized too: for the manifest and the cache key."""
        if not self.enabled:
            return "none"
        if self.mode in (*KQUANTS, *RECIPES):
            text = self.mode
        else:
            group = "per channel" if self.group_size == PER_CHANNEL else f"g{self.group_size or 32}"
            text = f"{self.mode} {group}"
        return text + (", lm_head" if self.lm_head else "") + "".join(f", {p}={t}" for p, t in self.overrides)
