"""Packed weights: the artifact's `weights.safetensors`, written by streaming one tensor at a time.

A packed tensor (`WeightSpec`) is the concatenation along dim 0 of one or more checkpoint tensors (q/k/v
merged into one qkv weight, gate/up into one), stored as float32 or bfloat16. The file is a plain
safetensors file (`safetensors.safe_open` reads it), laid out for the generated module, which mmaps it and
finds each tensor at a byte offset fixed at compile time:

    [8-byte header length][JSON header, space-padded][data: tensor, pad, tensor, pad, ...]

- The header is computed from the specs alone (every size is known), so it is written first and the data
  follows in one sequential pass. Each source tensor is read (mmapped, `Checkpoint.tensor`), converted in
  row chunks and written, then dropped: the model is never held in memory twice, and a 2 GB embedding
  converts through a ~64 MiB buffer.
- The data region starts at a 64-byte boundary, and so does every tensor: safetensors allows no gaps
  between tensors, so a gap is filled by a small uint8 tensor named `__pad__.<n>` (ignored by llmc; not in
  the returned offsets). 64 bytes is a cache line and one AVX-512 vector.
- A quantized linear (WeightSpec.quant) is two or three packed tensors, its `part`s: qweight (uint8), scales
  and, for asymmetric schemes, mins (float16 or float32, the scheme's scale_dtype), in the layout of the target's kernel (`layout`: cpu or cuda,
  compiler/quant_pack.py; both keep rows independent, so fused sources concatenate row-wise). Each source
  is quantized once, by rows, or taken as the checkpoint holds it
  quantized (GGUF); the packed parts of the current fused weight's sources are kept until its last part is
  written, so memory stays near one packed fused weight.
- A spec with an `affine` (scale, offset) other than (1, 0) holds source * scale + offset, in float32 (never a
  quantized one).
- A spec with `interleave` g holds two sources of as many rows, their rows interleaved g at a time (g of the
  first, g of the second, ...): the CUDA SwiGLU GEMM's gate and up projections (llmc::Gemm's SWIGLU), so
  that the rows of one output's gate and up meet in one tile.
- The sha256 of the written file is computed while writing and remembered (llmc/digests.py), so
  neither the artifact writer nor a later load reads the weights back to hash them.
- A weight that is not finite (NaN or an infinity) is a CompileError naming the checkpoint tensor and its
  first row at fault. Each slab is checked as it is converted (a min/max reduction: no copy, no second pass
  over the checkpoint); a tensor held quantized, through its scales and mins (its codes are integers).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from llmc.digests import remember_sha256
from llmc.dtypes import DTYPES, ELEMENT_DTYPES
from llmc.errors import CompileError

from .quant import QuantScheme, quantize
from .quant_widen import widen_exactly

ALIGN = 64
_CHUNK_BYTES = 64 << 20  # conversion buffer for one slab of rows
# what a packed tensor may be: float weights (ELEMENT_DTYPES) and the quantized parts (uint8 codes; float16
# holds only quantization scales)
_PACKED_DTYPES = (*ELEMENT_DTYPES, "float16", "uint8")
PAD_PREFIX = "__pad__."
QUANT_PARTS = ("qweight", "scales", "mins")
SWIGLU_INTERLEAVE = 8  # the CUDA SwiGLU GEMM's gate / up row groups (llmc::Gemm's SWIGLU, an mma n8 tile)
LAYOUTS = ("cpu", "cuda")  # the packed layouts of a quantized linear: quant_pack.pack_cpu / pack_cuda


@dataclasses.dataclass(frozen=True)
class WeightSpec:
    name: str
    sources: tuple[str, ...]  # checkpoint tensor names, concatenated along dim 0 in this order
    dtype: str  # "float32" | "bfloat16"; a quantized part's: quant_part_dtype
    shape: tuple[int, ...]  # what the sources concatenate into (a quantized part: the float [N, K] it holds)
    quant: QuantScheme | None = None  # set for the parts of a quantized linear
    part: str | None = None  # "qweight" | "scales" | "mins", with quant
    interleave: int = 0  # two sources' rows interleaved this many at a time (0: concatenated)
    # (scale, offset): the values packed are source * scale + offset, computed in float32 before the dtype
    # conversion (Gemma's norms scale by 1 + w; Granite's logits_scaling folds into the final norm)
    affine: tuple[float, float] = (1.0, 0.0)

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """The shape in the file: a quantized part's is [N, K * bits / 8] (qweight), [N, record bytes] (kquant
        records) or [N, groups]."""
        if self.quant is None:
            return self.shape
        n, k = self.shape
        if self.part == "qweight":
            return (n, k * self.quant.bits // 8)
        if self.quant.scale_dtype == "kquant":
            return (n, self.quant.scale_row_bytes(k))
        return (n, -(-k // self.quant.group_size))

    @property
    def nbytes(self) -> int:
        return math.prod(self.stored_shape) * DTYPES[self.dtype].nbytes


def interleave_rows(a: np.ndarray, b: np.ndarray, group: int) -> np.ndarray:
    """Rows of a and b (as many, a multiple of group) interleaved group at a time: a[:g], b[:g], a[g:2g], ..."""
    if a.shape != b.shape or a.shape[0] % group:
        raise CompileError(f"cannot interleave rows of {list(a.shape)} and {list(b.shape)} {group} at a time")
    tail = a.shape[1:]
    return np.stack([a.reshape(-1, group, *tail), b.reshape(-1, group, *tail)], axis=1).reshape(-1, *tail)


def quant_part_dtype(scheme: QuantScheme, part: str) -> str:
    """The stored dtype of one part of a quantized linear: uint8 codes, scales and mins in the scheme's dtype
    (uint8 records for kquant)."""
    return "uint8" if part == "qweight" or scheme.scale_dtype == "kquant" else scheme.scale_dtype


def packed_name(sources: tuple[str, ...]) -> str:
    """q_proj, k_proj, v_proj of one layer -> model.layers.0.self_attn.q+k+v_proj.weight."""
    if len(sources) == 1:
        return sources[0]
    prefix = sources[0][: len(sources[0]) - len(sources[0].split(".")[-2]) - len(sources[0].split(".")[-1]) - 1]
    suffix = "." + sources[0].split(".")[-1]
    mids = [s[len(prefix) : -len(suffix)] for s in sources]
    tail = "_proj" if all(m.endswith("_proj") for m in mids) else ""
    return prefix + "+".join(m[: len(m) - len(tail)] for m in mids) + tail + suffix


def linear_name(sources: tuple[str, ...]) -> str:
    """The linear a packed weight serves, as a launch's `fused` names it: q+k+v_proj, lm_head."""
    return packed_name(sources).rsplit(".", 1)[0].split(".")[-1]


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _source_shapes(ckpt, spec: WeightSpec) -> list[tuple[int, ...]]:
    """Shapes of the spec's sources, from the config (no file is read); checks they pack into spec.shape."""
    if spec.dtype not in _PACKED_DTYPES or (spec.quant is None and spec.dtype not in ELEMENT_DTYPES):
        raise CompileError(f"packed weight {spec.name!r}: dtype {spec.dtype!r}", "use float32 or bfloat16")
    if (spec.quant is None) != (spec.part is None) or (
        spec.quant is not None
        and (
            spec.part not in QUANT_PARTS
            or quant_part_dtype(spec.quant, spec.part) != spec.dtype
            or len(spec.shape) != 2
        )
    ):
        raise CompileError(
            f"packed weight {spec.name!r}: part {spec.part!r} of {spec.dtype}{list(spec.shape)} "
            "is not a part of a quantized [N, K] weight"
        )
    if not spec.sources:
        raise CompileError(f"packed weight {spec.name!r} has no sources")
    expected = ckpt.config.weight_shapes()
    shapes = []
    for src in spec.sources:
        if src not in ckpt.tensor_files:
            raise CompileError(f"packed weight {spec.name!r}: the checkpoint has no tensor {src!r}")
        shapes.append(tuple(expected[src]) if src in expected else None)
    known = [s for s in shapes if s is not None]
    if len(known) == len(shapes):
        rows = sum(s[0] for s in known)
        if any(s[1:] != known[0][1:] for s in known) or (rows, *known[0][1:]) != tuple(spec.shape):
            raise CompileError(
                f"packed weight {spec.name!r}: sources {list(spec.sources)} have shapes {[list(s) for s in known]}, "
                f"which do not concatenate along dim 0 into {list(spec.shape)}"
            )
    return shapes


def plan_layout(specs: list[WeightSpec]) -> tuple[bytes, dict[str, tuple[int, int]], list[tuple[str | None, int]]]:
    """The header bytes (length prefix included), name -> (absolute offset, nbytes), and the write order.

    The write order is a list of (spec name or None for padding, nbytes).
    """
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise CompileError(f"packed weights: duplicate names {dup}")
    entries: dict[str, dict] = {}
    rel: dict[str, tuple[int, int]] = {}
    order: list[tuple[str | None, int]] = []
    pos = 0
    for spec in specs:
        if spec.name.startswith(PAD_PREFIX) or spec.name == "__metadata__":
            raise CompileError(f"packed weight name {spec.name!r} is reserved")
        gap = _align(pos) - pos
        if gap:
            entries[f"{PAD_PREFIX}{len(order)}"] = {"dtype": "U8", "shape": [gap], "data_offsets": [pos, pos + gap]}
            order.append((None, gap))
            pos += gap
        n = spec.nbytes
        entries[spec.name] = {
            "dtype": DTYPES[spec.dtype].safetensors,
            "shape": list(spec.stored_shape),
            "data_offsets": [pos, pos + n],
        }
        rel[spec.name] = (pos, n)
        order.append((spec.name, n))
        pos += n
    meta = {"__metadata__": {"format": "llmc-packed", "alignment": str(ALIGN)}}
    header = json.dumps({**meta, **entries}, separators=(",", ":")).encode()
    header += b" " * (_align(8 + len(header)) - 8 - len(header))
    prefix = len(header).to_bytes(8, "little") + header
    data_start = len(prefix)
    assert data_start % ALIGN == 0
    return prefix, {k: (data_start + off, n) for k, (off, n) in rel.items()}, order


def write_packed_weights(
    ckpt,
    specs: list[WeightSpec],
    path: Path,
    progress: Callable[[int], None] | None = None,
    layout: str = "cpu",
    importance: Mapping[str, np.ndarray] | None = None,
) -> dict[str, tuple[int, int]]:
    """Stream the packed weights to `path`; returns name -> (absolute byte offset of the data, nbytes).

    progress(n_bytes) is called as data is written (the sum over the calls is the data size). layout: the
    quantized linears' packed layout, the target's (LAYOUTS). importance: checkpoint name -> its input
    channels' importance (compiler/importance.py), which quantizing that tensor from float weighs its error by.
    """
    if layout not in LAYOUTS:
        raise CompileError(f"no packed layout {layout!r} for quantized weights", f"use one of {', '.join(LAYOUTS)}")
    path = Path(path)
    shapes = {spec.name: _source_shapes(ckpt, spec) for spec in specs}
    prefix, offsets, order = plan_layout(specs)
    by_name = {s.name: s for s in specs}
    quantized = _QuantizedSources(ckpt, layout, importance or {})
    digest = hashlib.sha256(prefix)
    tmp = path.with_name(path.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(prefix)
            for name, nbytes in order:
                if name is None:
                    pad = bytes(nbytes)
                    f.write(pad)
                    digest.update(pad)
                    continue
                spec = by_name[name]
                if spec.quant is None:
                    written = _write_spec(ckpt, spec, shapes[name], f, digest, progress)
                else:
                    written = _write_part(quantized.packed(spec), spec.part, f, digest, progress)
                if written != nbytes:  # shapes unknown to the config that did not add up
                    raise CompileError(
                        f"packed weight {name!r}: sources {list(by_name[name].sources)} hold {written} bytes "
                        f"as {by_name[name].dtype}, but shape {list(by_name[name].stored_shape)} needs {nbytes}"
                    )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    remember_sha256(path, digest.hexdigest())
    return offsets


def _write_spec(ckpt, spec: WeightSpec, shapes, f, digest, progress) -> int:
    import torch  # here, not at the top: lowering imports WeightSpec and must not pull in torch

    torch_dtype, width = getattr(torch, spec.dtype), DTYPES[spec.dtype].nbytes
    if spec.interleave:
        return _write_interleaved(ckpt, spec, torch_dtype, f, digest, progress)
    total = 0
    for src, shape in zip(spec.sources, shapes, strict=True):
        t = ckpt.tensor(src)
        if shape is None and tuple(t.shape[1:]) != tuple(spec.shape[1:]):
            raise CompileError(
                f"packed weight {spec.name!r}: source {src!r} has shape {list(t.shape)}, "
                f"which does not stack into {list(spec.shape)}"
            )
        if t.dim() == 0:
            t = t.reshape(1)
        row_bytes = max(1, math.prod(t.shape[1:]) * width)
        step = max(1, _CHUNK_BYTES // row_bytes)
        for start in range(0, t.shape[0], step):
            rows = t[start : start + step]
            if spec.affine != (1.0, 0.0):
                rows = rows.float() * spec.affine[0] + spec.affine[1]
            total += _emit(_converted(rows, torch_dtype, (ckpt, src, start)), f, digest, progress)
        del t
    return total


def _write_interleaved(ckpt, spec: WeightSpec, torch_dtype, f, digest, progress) -> int:
    """A spec of two sources interleaved `spec.interleave` rows at a time, converted and written in slabs."""
    a, b = (ckpt.tensor(src) for src in spec.sources)
    if tuple(a.shape) != tuple(b.shape) or tuple(a.shape[1:]) != tuple(spec.shape[1:]):
        raise CompileError(
            f"packed weight {spec.name!r}: sources {list(spec.sources)} of shapes {list(a.shape)} "
            f"and {list(b.shape)} do not interleave into {list(spec.shape)}"
        )
    g = spec.interleave
    step = max(g, _CHUNK_BYTES // max(1, 2 * math.prod(a.shape[1:]) * DTYPES[spec.dtype].nbytes) // g * g)

    total = 0
    for start in range(0, a.shape[0], step):
        rows = (
            _converted(t[start : start + step], torch_dtype, (ckpt, src, start))
            for t, src in zip((a, b), spec.sources, strict=True)
        )
        total += _emit(interleave_rows(*rows, g), f, digest, progress)
    return total


def _converted(rows, torch_dtype, where) -> np.ndarray:
    """A slab of a source tensor in the packed dtype, as numpy (bf16 as its 16-bit patterns), checked finite.
    where: (checkpoint, source name, the slab's first row), for the error."""
    import torch

    chunk = rows.to(torch_dtype).contiguous()
    _check_finite(chunk, *where)
    return (chunk.view(torch.int16) if torch_dtype == torch.bfloat16 else chunk).numpy()


def _check_finite(values, ckpt, src: str, first_row: int = 0, part: str | None = None) -> None:
    """CompileError when `values` (a slab of the rows of checkpoint tensor `src` from first_row, or its `part`,
    scales or mins; a torch tensor or a numpy array) holds a NaN or an infinity. One min/max reduction, which
    NaN propagates through: no copy of the slab."""
    import torch

    if values.size == 0 if isinstance(values, np.ndarray) else values.numel() == 0:
        return
    if isinstance(values, np.ndarray):
        low, high = float(values.min()), float(values.max())
    else:
        low, high = (float(v) for v in torch.aminmax(values))
    if math.isfinite(low) and math.isfinite(high):
        return
    values = torch.as_tensor(values)  # the error path: find the first value at fault
    bad = (~torch.isfinite(values)).nonzero()[0]
    kind = "NaN" if math.isnan(float(values[tuple(bad)])) else "an infinity"
    gguf = getattr(ckpt, "gguf_names", {}).get(src)
    name = f"{src!r}" + (f" (GGUF {gguf!r})" if gguf else "")
    raise CompileError(
        f"checkpoint tensor {name} holds {kind}"
        + (f" in its {part}" if part else "")
        + f" (row {first_row + int(bad[0])}); llmc does not compile weights that are not finite",
        "the checkpoint is damaged, or overflowed when it was saved: re-export it",
    )


def _write_part(packed: list[dict], part: str, f, digest, progress) -> int:
    """One part of a quantized linear: each source's rows of it, in order (row-major, so they concatenate)."""
    total = 0
    for arrays in packed:
        total += _emit(arrays[part], f, digest, progress)
    return total


def _emit(array: np.ndarray, f, digest, progress) -> int:
    """Write an array's bytes to the file and the digest; returns how many."""
    buf = memoryview(np.ascontiguousarray(array)).cast("B")
    f.write(buf)
    digest.update(buf)
    if progress is not None:
        progress(len(buf))
    return len(buf)


class _QuantizedSources:
    """The packed parts of one quantized weight's sources, made once for its two or three parts."""

    def __init__(self, ckpt, layout: str, importance: Mapping[str, np.ndarray]):
        self.ckpt, self.layout, self.importance = ckpt, layout, importance
        self.key = None
        self.value: list[dict] = []

    def packed(self, spec: WeightSpec) -> list[dict]:
        key = (spec.sources, spec.quant)
        if key != self.key:
            self.key, self.value = None, []  # drop the previous weight's before making this one's
            self.value = [
                _pack_source(self.ckpt, src, spec.quant, self.layout, self.importance.get(src)) for src in spec.sources
            ]
            self.key = key
        return self.value


def _pack_source(ckpt, src: str, scheme: QuantScheme, layout: str, importance: np.ndarray | None) -> dict:
    """{part: array} of one source tensor in `scheme` and `layout`: widened exactly (widen_exactly) if the checkpoint holds it
    quantized, else quantized from float32 a slab of rows at a time."""
    from .quant_pack import pack_cpu, pack_cuda

    pack = pack_cuda if layout == "cuda" else pack_cpu

    held = ckpt.quantized_tensor(src)
    if held is not None:
        _check_finite(held.scales, ckpt, src, part="scales")
        if held.mins is not None:
            _check_finite(held.mins, ckpt, src, part="mins")
        pieces = [pack(widen_exactly(held, scheme))]
    else:
        t = ckpt.tensor(src)
        if t.dim() != 2:
            raise CompileError(f"quantized weight {src!r} has shape {list(t.shape)}; only 2-D weights are quantized")
        step = max(1, _CHUNK_BYTES // (4 * max(1, t.shape[1])))
        pieces = []
        for i in range(0, t.shape[0], step):
            rows = t[i : i + step].float()
            _check_finite(rows, ckpt, src, i)
            pieces.append(pack(quantize(rows.numpy(), scheme, importance)))
        del t
    parts = dict(zip(QUANT_PARTS, zip(*pieces, strict=True), strict=True))
    return {part: np.concatenate(arrays) for part, arrays in parts.items() if arrays[0] is not None}
