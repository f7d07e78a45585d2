"""The pass pipeline, in order. Each entry is one IRModule -> IRModule function (see its docstring).

A quantized build adds quantize_linear and quantize_embedding (made for its checkpoint's schemes) after them
all: quantize_linear reads the GEMMs as the fusions left them (merged qkv and gate/up), which is how lowering
launches them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import tvm

from .fold import fold
from .fuse_attention import fuse_attention
from .fuse_rmsnorm import fuse_rmsnorm
from .fuse_rope import fuse_rope
from .fuse_softcap import fuse_softcap
from .fuse_swiglu import fuse_swiglu
from .merge_qkv import merge_qkv
from .select_logits_rows import select_logits_rows

PASSES: list[Callable[[tvm.IRModule], tvm.IRModule]] = [
    fold,  # the imported graph's no-op casts (x.float() on float32) would hide the patterns below
    fuse_rmsnorm,  # before select_logits_rows and the attention match, which read its fused ops
    fuse_rope,
    fuse_attention,  # needs llmc.rope
    merge_qkv,  # needs llmc.paged_attention to find q, k, v
    fuse_swiglu,
    fuse_softcap,
    select_logits_rows,  # needs the fused final norm, and llmc.softcap to carry onto the rows it selects
    fold,
]


def run_passes(
    mod: tvm.IRModule,
    after_each: Callable[[str, tvm.IRModule], None] | None = None,
    quantize: Sequence[Callable[[tvm.IRModule], tvm.IRModule]] = (),
) -> tvm.IRModule:
    """quantize: a quantized build's quantize_linear and quantize_embedding passes."""
    for p in [*PASSES, *quantize]:
        mod = p(mod)
        if after_each is not None:
            after_each(p.__name__, mod)
    return mod
