"""The traced graph as ONNX (for any ONNX tool) and as a TVM Relax IRModule (for the passes).

Relax import keeps attention as one node: the exported program is imported as torch.export traced it,
with `run_ep_decomposition=False`, so every layer's attention arrives as one
`R.nn.attention(..., causal_mask="TopLeft")`, SwiGLU's activation as `R.nn.silu` and each Linear as
permute_dims + matmul. TVM's importer takes these ops directly. Running torch's decompositions first
(with the sdpa entries removed) gives the same kernel program but re-traces the whole program through
AOT autograd: about 0.7 s per layer, 22 s of an 8B compile. The no-op casts the undecomposed graph keeps
(`x.float()` on float32) are removed by the fold pass. No weight is handed to the importer; the Relax
`main` takes `(input_ids, positions, *weights)`.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from llmc.errors import CompileError

from .frontend.checkpoint import Checkpoint
from .frontend.model import LlamaFamily
from .frontend.trace import Traced, trace


def to_relax(traced: Traced):
    """Relax IRModule whose main is (input_ids: [T] i64, positions: [T] i64, *weights) -> logits [T, vocab].

    The compile graph: attention stays plainly causal in sliding-window layers (the kernels apply the window).
    """
    from tvm.relax.frontend.torch import from_exported_program

    try:
        return from_exported_program(traced.program, run_ep_decomposition=False, unwrap_unit_return_tuple=True)
    except Exception as e:  # the importer raises bare AssertionError/KeyError on ops it lacks
        raise CompileError(f"TVM Relax import failed: {type(e).__name__}: {e}", "run with --debug for the trace") from e


def relax_for_checkpoint(ckpt: Checkpoint):
    return to_relax(trace(ckpt.config))


def build_eager_model(ckpt: Checkpoint) -> LlamaFamily:
    """The reference torch module with the checkpoint's weights, upcast to fp32."""
    model = LlamaFamily(ckpt.config).eval()
    state = {name: t.float() for name, t in ckpt.tensors()}
    model.load_state_dict(state, strict=True, assign=True)
    return model


def export_onnx(ckpt: Checkpoint, out: Path) -> Path:
    """ONNX graph with a dynamic token count: inputs input_ids [T] and positions [T], output logits [T, vocab]."""
    model = build_eager_model(ckpt)
    n = 5
    ids = torch.zeros(n, dtype=torch.int64)
    pos = torch.arange(n, dtype=torch.int64)
    tokens = torch.export.Dim("T", min=1, max=ckpt.config.max_position_embeddings)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter warns about its own axis renaming
        program = torch.onnx.export(
            model,
            (ids, pos),
            input_names=["input_ids", "positions"],
            output_names=["logits"],
            dynamic_shapes=({0: tokens}, {0: tokens}),
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise CompileError("torch.onnx.export produced no program", "run with --debug")
    program.save(str(out), external_data=ckpt.config.num_parameters() * 4 > 1_500_000_000)
    return out
