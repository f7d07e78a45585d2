"""Quantized weights held exactly in a wider scheme (compiler/quant.py): `widen_exactly` for one tensor,
`common_scheme` for the sources fused into one GEMM, `held_on_cuda` for the schemes the CUDA kernels lack."""

from __future__ import annotations

import dataclasses

import numpy as np

from llmc.errors import CompileError

from .quant import QuantizedTensor, QuantScheme


def widen_exactly(t: QuantizedTensor, scheme: QuantScheme) -> QuantizedTensor:
    """t in `scheme`, exactly: the same q, each scale (and min) repeated over the smaller groups.

    Only widening is exact: scheme has at least t's bits, a group that divides t's, and mins if t has them
    (a symmetric t gains zero mins). A symmetric int4 q (-8..7) is a valid int8 q as it stands. K-quant scales
    widen to fp32 ones (their values are float32 products); into K-quant records, only q widens (the same records).
    """
    if scheme == t.scheme:
        return t
    k = t.q.shape[1]
    old = t.scheme
    if (
        scheme.bits < old.bits
        or (old.asymmetric and not scheme.asymmetric)
        # int4 / int5 q: -8..7 / -16..15 or 0..15 / 0..31; a codebook's levels are int8 values
        or (scheme.bits == old.bits and old.bits in (4, 5) and scheme.asymmetric != old.asymmetric)
        or (scheme.bits < 8 and scheme.codebook != old.codebook)
        or (old.group_size % scheme.group_size and -(-k // old.group_size) > 1)
        or (old.scale_dtype != "float16" and scheme.scale_dtype == "float16")
        or (scheme.scale_dtype == "kquant" and dataclasses.replace(old, bits=scheme.bits) != scheme)
    ):
        raise CompileError(f"a {old.describe()} weight cannot be stored exactly as {scheme.describe()}")
    if scheme.scale_dtype == "kquant":  # the same records, wider q (Q5_K's int5 as int8)
        return QuantizedTensor(t.q, t.scales, t.mins, scheme, t.records)
    groups = -(-k // scheme.group_size)

    def spread(a: np.ndarray) -> np.ndarray:  # per old group -> per new group: group j lies in old group j*g'//g
        return np.ascontiguousarray(a[:, (np.arange(groups) * scheme.group_size) // old.group_size])

    mins = spread(t.mins) if t.mins is not None else np.zeros((t.q.shape[0], groups), np.float32)
    return QuantizedTensor(t.q, spread(t.scales), mins if scheme.asymmetric else None, scheme)


def common_scheme(schemes: list[QuantScheme], k: int) -> QuantScheme:
    """One scheme that holds weights of each of `schemes` exactly (`widen_exactly`), for sources fused into one GEMM.

    Equal schemes stay as they are; different ones (GGUF Q4_K_M: attn_v Q6_K beside q/k Q4_K) become int8 with
    the smallest group, asymmetric if any is. Scales are fp32 if any source's are not fp16.
    """
    if len(set(schemes)) == 1:
        return schemes[0]
    scale_dtype = "float32" if any(s.scale_dtype != "float16" for s in schemes) else "float16"
    same_but_scales = {(s.bits, s.group_size, s.asymmetric, s.codebook) for s in schemes}
    if len(same_but_scales) == 1 and schemes[0].bits not in (2, 3, 6):
        return dataclasses.replace(schemes[0], scale_dtype=scale_dtype)
    group = min(s.group_size for s in schemes)
    if any(s.group_size % group and -(-k // s.group_size) > 1 for s in schemes):
        raise CompileError(
            f"fused weights quantized as {', '.join(s.describe() for s in schemes)} have no common group size"
        )
    return QuantScheme(8, group, asymmetric=any(s.asymmetric for s in schemes), scale_dtype=scale_dtype)


def held_on_cuda(scheme: QuantScheme) -> QuantScheme:
    """The scheme a CUDA build holds a weight of `scheme` in, exactly (widen_exactly): the CUDA kernels read int8
    and int4 layouts only, so int6 (Q6_K) becomes int8 g16 with fp32 scales, and int5 and the IQ4 codebook int8
    with their groups."""
    if scheme.bits in (2, 3, 6):
        return QuantScheme(8, 16, asymmetric=scheme.asymmetric, scale_dtype="float32")
    if scheme.codebook:  # IQ4_XS's records as fp32 scales
        return QuantScheme(8, 32, scale_dtype="float16" if scheme.scale_dtype == "float16" else "float32")
    if scheme.bits == 5:
        return dataclasses.replace(scheme, bits=8)
    return scheme
