"""The traced graph as ONNX (for any ONNX tool) and as a TVM Relax IRModule (for the passes).

Relax import keeps attention as one node: the exported program is imported as torch.export traced it,
with `run_ep_decomposition=False`, so every layer's attention arrives as one
`R.nn.attention(..., causal_mask="TopLeft")`, SwiGLU's activation as `R.nn.silu` and each Linear as
permute_dims + matmul. TVM's importer takes these ops directly. Running torch's decompositions first
(with the sdpa entries removed) gives the same kernel program but re-traces the whole program through
AOT autograd: about 0.7 s per layer, 22 s of an 8B compile. The no-op casts the undecomposed graph keeps
(`x.float()` on float32) are removed by the fold pass. No weight is handed to the importer; the Relax
`main` takes `(input_ids, positions, *weights)`.

Attention goes through llmc's own converter (`_attention`): TVM's drops scaled_dot_product_attention's
`scale` and takes float masks only, so the imported graph would lose YaRN's attention factor and every
sliding window. Ours keeps the scale and turns the model's sliding-window mask into the op's
`window_size`, so the imported graph states what the model computes and the passes carry it on.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from llmc.errors import CompileError

from .frontend.checkpoint import Checkpoint
from .frontend.model import LlamaFamily, moe_reference, softcapped_attention_reference
from .frontend.trace import Traced, trace
from .passes.common import QUANT_ATTRS, llmc_call, prim

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _sliding_window(mask) -> int | None:
    """W if the fx node `mask` is LlamaFamily's window mask (d >= 0) & (d < W), d = p[:, None] - p[None, :].

    The traced forward runs one sequence at positions 0..T-1 (as is_causal assumes too), so this is
    R.nn.attention's window: key j is seen from query i when i - W < j <= i.
    """
    aten = torch.ops.aten
    if mask.target is not aten.__and__.Tensor:
        return None
    ge, lt = mask.args
    if ge.target is not aten.ge.Scalar or lt.target is not aten.lt.Scalar or ge.args != (lt.args[0], 0):
        return None
    delta = ge.args[0]
    if delta.target is not aten.sub.Tensor:
        return None
    rows, cols = delta.args
    if not (
        rows.target is cols.target is aten.unsqueeze.default
        and rows.args[1] == 1
        and cols.args[1] == 0
        and rows.args[0] is cols.args[0]
        and rows.args[0].name == "positions"
    ):
        return None
    return int(lt.args[1])


def _attention(node, importer):
    """scaled_dot_product_attention [1, H, T, D] -> R.nn.attention over [1, T, H, D], with its scale and window."""
    from tvm import relax

    args = dict(zip(_SDPA_ARGS, node.args, strict=False)) | node.kwargs
    mask = args.get("attn_mask")
    window = None if mask is None else _sliding_window(mask)
    if (mask is not None and window is None) or args.get("dropout_p", 0.0) or args.get("enable_gqa", False):
        raise CompileError(
            f"attention {node.name} has a mask, dropout or GQA flag llmc does not compile",
            "llmc compiles causal attention, with or without a sliding window",
        )
    bb = importer.block_builder

    def swap_heads_and_tokens(t):
        return bb.emit(relax.op.permute_dims(t, [0, 2, 1, 3]))

    q, k, v = (swap_heads_and_tokens(importer.env[args[n]]) for n in ("query", "key", "value"))
    causal = "TopLeft" if args.get("is_causal", False) or window is not None else None
    out = bb.emit(relax.op.nn.attention(q, k, v, scale=args.get("scale"), causal_mask=causal, window_size=window))
    return swap_heads_and_tokens(out)


def _softcapped_attention(node, importer):
    """llmc::softcapped_attention [1, H, T, D] -> llmc.softcapped_attention over [1, T, H, D] (R.nn.attention's
    layout; Relax has no soft-capped attention), which fuse_attention takes as it takes R.nn.attention."""
    from tvm import relax

    q, k, v = (importer.env[a] for a in node.args[:3])
    scale, softcap, window = node.args[3:]
    bb = importer.block_builder

    def swap_heads_and_tokens(t):
        return bb.emit(relax.op.permute_dims(t, [0, 2, 1, 3]))

    q, k, v = (swap_heads_and_tokens(t) for t in (q, k, v))
    out = bb.emit(
        llmc_call("softcapped_attention", [q, k, v, prim(float(scale)), prim(int(window)), prim(float(softcap))], q.ty)
    )
    return swap_heads_and_tokens(out)


def _moe(node, importer):
    """llmc::moe -> llmc.moe: the rows, the router and the experts' stacked weights (concats of weight parameters,
    which lowering packs as one tensor each), top_k and whether the chosen probabilities are renormalized; the
    experts float (quantize_linear gives them their scheme)."""
    x, router, gate_up, down = (importer.env[a] for a in node.args[:4])
    top_k, norm_topk = node.args[4:]
    return importer.block_builder.emit(
        llmc_call(
            "moe",
            [x, router, gate_up, down, prim(int(top_k)), prim(int(norm_topk)), *[prim(0)] * (2 * len(QUANT_ATTRS))],
            x.ty,
        )
    )


def to_relax(traced: Traced):
    """Relax IRModule whose main is (input_ids: [T] i64, positions: [T] i64, *weights) -> logits [T, vocab]."""
    from tvm.relax.frontend.torch import from_exported_program

    try:
        return from_exported_program(
            traced.program,
            run_ep_decomposition=False,
            unwrap_unit_return_tuple=True,
            custom_convert_map={
                "scaled_dot_product_attention.default": _attention,
                "softcapped_attention.default": _softcapped_attention,
                "moe.default": _moe,
            },
        )
    except CompileError:
        raise
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
        traced = torch.export.export(model, (ids, pos), dynamic_shapes=({0: tokens}, {0: tokens}))
        # ONNX has no soft-capped attention or mixture-of-experts: their bodies, in ONNX's ops (the entries leave
        # every other op as is)
        traced = traced.run_decompositions(
            {
                torch.ops.llmc.softcapped_attention.default: softcapped_attention_reference,
                torch.ops.llmc.moe.default: moe_reference,
            }
        )
        program = torch.onnx.export(
            traced,
            (ids, pos),
            input_names=["input_ids", "positions"],
            output_names=["logits"],
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    if program is None:
        raise CompileError("torch.onnx.export produced no program", "run with --debug")
    program.save(str(out), external_data=ckpt.config.num_parameters() * 4 > 1_500_000_000)
    return out
