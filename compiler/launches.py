"""Launches between lowering and the kernel program: their pending form, the SwiGLU epilogue, the buffer plan.

Lowering (compiler/lower.py) binds each Relax variable to a `View` of an activation value or a `WeightRef` of
checkpoint tensors, and emits `PendingLaunch`es whose tensor arguments are `View`s of values, not yet
of buffers. Two steps follow, in this order:
  - `fuse_gemm_swiglu` (CUDA targets): a bf16 gate_up GEMM and the silu_mul that alone reads its product
    become one `gemm_swiglu` launch, whose weight the packer interleaves (WeightSpec.interleave), so the
    [T, 2 * inter] product is never stored;
  - `plan_buffers`: values take buffers by liveness, and every argument becomes its C expression.
"""

from __future__ import annotations

import dataclasses

from .program import Buffer, Launch
from .weights import SWIGLU_INTERLEAVE, WeightSpec


@dataclasses.dataclass(frozen=True)
class View:
    """A [rows, cols] float tensor inside a buffer, possibly a column slice (row stride > cols)."""

    value: int  # the producing value id (before buffer assignment)
    col_offset: int
    cols: int
    stride: int
    rows: str


@dataclasses.dataclass(frozen=True)
class WeightRef:
    """A weight as lowering reads it: checkpoint tensors, concatenated along dim 0 when the packer writes them."""

    sources: tuple[str, ...]  # HF tensor names, concatenated along dim 0
    shape: tuple[int, ...]
    transposed: bool = False
    affine: tuple[float, float] = (1.0, 0.0)  # (scale, offset) applied when packed (WeightSpec.affine)

    @property
    def key(self) -> tuple:
        return self.sources if self.affine == (1.0, 0.0) else (self.sources, self.affine)


@dataclasses.dataclass
class PendingLaunch:
    """A launch before buffer assignment: args may hold Views; defs are the value ids it writes."""

    op: str
    params: dict
    args: list
    fused: list[str]
    defs: list[int]
    weight: int | None = None  # the packed weight of a gemm, so its bias can join it


def fuse_gemm_swiglu(launches: list[PendingLaunch], weights: list[WeightSpec]) -> list[PendingLaunch]:
    """Each gemm of bf16 gate and up weights (two sources, no bias, 16-byte rows) whose product only the next
    launch, a silu_mul, reads -> one gemm_swiglu launch writing silu_mul's output; its weight is marked for
    interleaving (in place in `weights`). Other GEMMs stay as they are."""
    reads: dict[int, int] = {}  # launches that read each value (its own launch passes it too, to write it)
    for p in launches:
        for a in p.args:
            if isinstance(a, View) and a.value not in p.defs:
                reads[a.value] = reads.get(a.value, 0) + 1
    out: list[PendingLaunch] = []
    for p in launches:
        g = out[-1] if out else None
        src = p.args[0] if p.op == "silu_mul" else None
        if (
            g is not None
            and g.op == "gemm"
            and isinstance(src, View)
            and g.defs == [src.value]
            and reads[src.value] == 1
            and src.col_offset == 0
            and src.stride == src.cols
            and g.params["wdtype"] == "bf16"
            and not g.params["has_bias"]
            and g.params["k"] % 8 == 0
            and g.params["n"] == 2 * p.params["inter"]
            and p.params["inter"] % SWIGLU_INTERLEAVE == 0
            and len(weights[g.weight].sources) == 2
        ):
            x, w, _, _, rows = g.args
            params = {"inter": p.params["inter"], "k": g.params["k"], "wdtype": "bf16"}
            if "activation" in p.params:  # GeGLU
                params["activation"] = p.params["activation"]
            out[-1] = PendingLaunch(
                "gemm_swiglu", params, [x, w, "nullptr", p.args[1], rows], g.fused + p.fused, p.defs, g.weight
            )
            weights[g.weight] = dataclasses.replace(weights[g.weight], interleave=SWIGLU_INTERLEAVE)
        else:
            out.append(p)
    return out


def plan_buffers(
    launches: list[PendingLaunch], value_cols: list[int], value_rows: list[str], output: View
) -> tuple[list[Buffer], list[Launch]]:
    """The buffer plan and the launches over it. Greedy reuse by liveness: a value takes a free buffer of its
    row kind (widening it if needed); a buffer frees after the last launch that reads its value. The output
    (logits) goes straight to the ABI's `logits`."""
    last_use: dict[int, int] = {}
    for i, launch in enumerate(launches):
        for a in launch.args:
            if isinstance(a, View):
                last_use[a.value] = i
    assignment: dict[int, int] = {output.value: -1}
    buffers: list[Buffer] = []
    free: list[int] = []
    for i, launch in enumerate(launches):
        for d in launch.defs:
            if d in assignment:
                continue
            pick = next((b for b in free if buffers[b].rows == value_rows[d]), None)
            if pick is None:
                buffers.append(Buffer(value_cols[d], value_rows[d]))
                pick = len(buffers) - 1
            else:
                free.remove(pick)
                buffers[pick].cols = max(buffers[pick].cols, value_cols[d])
            assignment[d] = pick
        free += [assignment[v] for v, last in last_use.items() if last == i and assignment.get(v, -1) >= 0]
    return buffers, [Launch(p.op, p.params, [_c_arg(a, assignment) for a in p.args], p.fused) for p in launches]


def _c_arg(arg, assignment: dict[int, int]) -> str:
    if isinstance(arg, View):
        base = "logits" if assignment[arg.value] == -1 else f"buf{assignment[arg.value]}"
        return base if arg.col_offset == 0 else f"{base} + {arg.col_offset}"
    return str(arg)
