"""What a tuning candidate is checked against: a kernel shape, its random inputs and the numpy reference.

A candidate must match x @ w.T (+ bias), or the SwiGLU GEMM's silu(x @ gate.T) * (x @ up.T), in float64 within
the kernel's rounding (bf16 activations for the CPU bf16 dot and CUDA's tensor cores, int8 activations for the
quantized GEMM, and the output's own rounding where the kernel's activations are bf16: adtype) before it is
timed; one that does not is rejected.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from llmc.compiler.codegen.render import kernel_id
from llmc.compiler.quant import QuantScheme, dequantize, quantize
from llmc.compiler.quant_pack import pack_cpu
from llmc.compiler.weights import SWIGLU_INTERLEAVE, interleave_rows
from llmc.errors import CompileError


@dataclasses.dataclass(frozen=True)
class KernelShape:
    op: str
    params: tuple[tuple[str, object], ...]  # the kernel's parameters (no name, no tunables), sorted

    @classmethod
    def of(cls, op: str, params: dict) -> KernelShape:
        return cls(op, tuple(sorted((k, v) for k, v in params.items() if k != "name")))

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    def __str__(self) -> str:
        return kernel_id("", self.op, self.kwargs).lstrip("_")


@dataclasses.dataclass
class Inputs:
    x: np.ndarray  # as the kernel takes it: float32, or bf16 bits (uint16) where its activations are bf16
    weights: list[np.ndarray]  # the kernel's weight arguments in contract order (gemm: w; qgemm: q, scales, mins)
    bias: np.ndarray | None
    reference: np.ndarray  # float64 [T, n]
    tolerance: np.ndarray  # float64 [T, n]: |y - reference| must stay within it

    def poisoned_output(self) -> np.ndarray:
        """y as the kernel writes it (x's type), all NaN: what it leaves unwritten shows."""
        if self.x.dtype == np.uint16:
            return np.full(self.reference.shape, 0x7FC0, np.uint16)
        return np.full(self.reference.shape, np.nan, np.float32)

    def mismatch(self, y: np.ndarray) -> str | None:
        """Why `y` is not the reference's output, or None."""
        if y.dtype == np.uint16:
            y = _widen(y)
        err = np.abs(y - self.reference)
        bad = ~(err <= self.tolerance)
        return (
            f"{int(bad.sum())} of {y.size} outputs off the reference (worst {np.nanmax(err):.3g})"
            if bad.any()
            else None
        )


def _bf16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rounded to bf16 (nearest even): the uint16 bits and their float32 values."""
    bits = ((a.view(np.uint32) + 0x7FFF + ((a.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
    return bits, _widen(bits)


def _widen(bits: np.ndarray) -> np.ndarray:
    """bf16 bits (uint16) as the float32 values they hold."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


# Bytes per weight element at the peak of make_inputs: the float32 weights, their float64 copy and the float64
# |w| of the tolerance, and the packed copy (measured: 16 for an f32 gemm, 22.5 for bf16 or a qgemm)
_PEAK_BYTES_PER_WEIGHT = 24
_PEAK_BYTES_PER_ROW_ELEMENT = 48  # x, and the float64 reference, magnitude and tolerance of each output row


def input_bytes(shape: KernelShape, rows: tuple[int, ...]) -> int:
    """About the peak memory of checking `shape` at each T in `rows` (make_inputs's inputs for every T are
    kept together, as measure_cuda keeps them), computed from the parameters alone: a shape too big for the
    machine is refused before anything is allocated. 0 for an op make_inputs has no reference for."""
    names = {"gemm": ("n", "k"), "qgemm": ("n", "k"), "gemm_swiglu": ("inter", "k")}.get(shape.op)
    if names is None:
        return 0
    p = shape.kwargs
    for name in names:
        if type(p.get(name)) is not int or p[name] <= 0:
            raise CompileError(
                f"{shape}: {name} must be a positive integer, not {p.get(name)!r}", "e.g. gemm:n=576,k=576,wdtype=bf16"
            )
    n, k = p[names[0]] * (2 if shape.op == "gemm_swiglu" else 1), p["k"]
    held = 4 * n * k * (len(rows) - 1)  # the weights of each other T's inputs
    return _PEAK_BYTES_PER_WEIGHT * n * k + held + _PEAK_BYTES_PER_ROW_ELEMENT * sum(rows) * (n + k)


def make_inputs(shape: KernelShape, rows: int, seed: int = 0) -> Inputs:
    inputs = (_swiglu_inputs if shape.op == "gemm_swiglu" else _gemm_inputs)(shape, rows, seed)
    if shape.kwargs.get("adtype") == "bf16":  # x was drawn bf16-exact; y is rounded once more
        inputs.x = _bf16(inputs.x)[0]
        inputs.tolerance += 2.0**-8 * np.abs(inputs.reference)
    return inputs


def _activations(shape: KernelShape, rows: int, k: int, rng) -> np.ndarray:
    """x [rows, k] float32; values bf16 holds exactly where the kernel's activations are bf16."""
    x = rng.standard_normal((rows, k), dtype=np.float32)
    return _bf16(x)[1] if shape.kwargs.get("adtype") == "bf16" else x


def _gemm_inputs(shape: KernelShape, rows: int, seed: int) -> Inputs:
    p = shape.kwargs
    n, k = p["n"], p["k"]
    rng = np.random.default_rng(seed)
    x = _activations(shape, rows, k, rng)
    w32 = rng.standard_normal((n, k), dtype=np.float32) / np.float32(np.sqrt(k))
    b32 = rng.standard_normal(n, dtype=np.float32) if p.get("has_bias") else None
    if shape.op == "gemm":
        w, wf, bias, bf = w32, w32, b32, b32
        if p["wdtype"] == "bf16":
            w, wf = _bf16(w32)
            bias, bf = _bf16(b32) if b32 is not None else (None, None)
        weights, rel = [w], (2.0**-7 if p["wdtype"] == "bf16" else 1e-5)  # bf16: x may be rounded to bf16
    elif shape.op == "qgemm":
        t = quantize(w32, QuantScheme.of_kernel(p))
        q, scales, mins = pack_cpu(t)
        wf, bias, bf = dequantize(t), b32, b32
        weights, rel = [q, scales, mins if mins is not None else np.zeros(1, np.float32)], 2.0**-5  # int8 x
    else:
        raise CompileError(f"llmc tune has no reference for op {shape.op!r}")
    ref = x.astype(np.float64) @ wf.astype(np.float64).T
    mag = np.abs(x).astype(np.float64) @ np.abs(wf).astype(np.float64).T
    if bf is not None:
        ref, mag = ref + bf, mag + np.abs(bf)
    return Inputs(x, weights, bias, ref, rel * mag + 1e-6)


def _swiglu_inputs(shape: KernelShape, rows: int, seed: int) -> Inputs:
    """gemm_swiglu: bf16 gate and up rows, passed interleaved as the packer lays them out."""
    inter, k = shape.kwargs["inter"], shape.kwargs["k"]
    rng = np.random.default_rng(seed)
    x = _activations(shape, rows, k, rng)
    w, wf = _bf16(rng.standard_normal((2 * inter, k), dtype=np.float32) / np.float32(np.sqrt(k)))
    x64, wg, wu = x.astype(np.float64), wf[:inter].astype(np.float64), wf[inter:].astype(np.float64)
    g, u = x64 @ wg.T, x64 @ wu.T
    mg, mu = np.abs(x64) @ np.abs(wg).T, np.abs(x64) @ np.abs(wu).T
    # d(silu(g) u) = silu'(g) u dg + silu(g) du with |silu'| < 1.1 and |silu(g)| <= |g|; x may be rounded to bf16
    tolerance = 2.0**-7 * (1.1 * np.abs(u) * mg + np.abs(g) * mu) + 1e-6
    w = interleave_rows(w[:inter], w[inter:], SWIGLU_INTERLEAVE)
    return Inputs(x, [w], None, g / (1 + np.exp(-g)) * u, tolerance)


@dataclasses.dataclass
class Candidate:
    """One configuration of a shape's tunables: built, checked, then timed (seconds per call, by round or, for
    a simulated one, the single prediction) unless rejected."""

    config: dict
    kid: str = ""
    times: list[float] = dataclasses.field(default_factory=list)
    rejected: str | None = None
    figures: dict = dataclasses.field(default_factory=dict)
