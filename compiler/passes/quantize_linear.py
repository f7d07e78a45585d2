"""quantize_linear: each GEMM whose weight has a quantization scheme becomes `llmc.quantized_matmul`.

`quantize_linear(schemes, weight_names)` makes the pass. `schemes` maps checkpoint tensor names to their
QuantScheme (compile builds it from `--quant`, or from a GGUF file's own tensor types); `weight_names` names
main's weight parameters in order (Traced.weight_names), which is how a parameter is traced back to its
checkpoint tensor. A matched GEMM is `matmul(x, permute_dims(W))` with W a weight parameter or, after
merge_qkv / fuse_swiglu, a concat of weight parameters: it is rewritten to

    llmc.quantized_matmul(x, W, bits, group_size, asymmetric, scale_bits)

with W as it was (the float [N, K] weight; lowering packs it quantized) and a bias add left where it is (it
joins the quantized GEMM in lowering, as it joins the float one). A fused weight stays fused: its sources'
schemes, when they differ, become one scheme that holds each exactly (quant.common_scheme). A GEMM with any
source lacking a scheme stays float, and so does every matmul whose weight is computed (attention's). A
mixture-of-experts MLP (`llmc.moe`) takes its experts' schemes as its attrs, gate_up's and down's, the same
way (the router stays float).

Runs last: the GEMMs it reads are the fused ones lowering will launch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tvm
from tvm import relax

from ..quant import QuantScheme, common_scheme
from .common import (
    QUANT_ATTRS,
    bindings,
    calls,
    llmc_args,
    llmc_call,
    llmc_op_name,
    main_function,
    prim,
    prim_value,
    rewrite,
    weight_params,
)


def _sources(weight: relax.Expr, var2val, names: dict) -> tuple[str, ...] | None:
    """The checkpoint names a GEMM's weight concatenates (one for a plain Linear), None if it is computed."""
    if weight in names:
        return (names[weight],)
    value = var2val.get(weight)
    if calls(value, "relax.concat") and int(value.attrs.axis) == 0:
        fields = value.args[0].fields if isinstance(value.args[0], relax.Tuple) else []
        if fields and all(f in names for f in fields):
            return tuple(names[f] for f in fields)
    return None


def _attrs(found: list[QuantScheme], weight: relax.Expr) -> list[relax.Expr]:
    """The scheme attrs (QUANT_ATTRS) of a GEMM whose weight's sources have schemes `found`."""
    scheme = common_scheme(found, int(weight.ty.shape.values[1]))
    return [prim(scheme.bits), prim(scheme.group_size), prim(int(scheme.asymmetric)), prim(scheme.scale_bits)]


def _quantized_moe(call: relax.Call, schemes, var2val, names) -> relax.Call | None:
    """llmc.moe with its experts' scheme attrs, gate_up's and down's (zeros for one that stays float), or None
    where both stay float."""
    args = llmc_args(call)
    attrs = []
    for role in ("gate_up", "down"):
        found = [schemes.get(s) for s in _sources(args[role], var2val, names) or ()]
        attrs += [prim(0)] * len(QUANT_ATTRS) if not found or None in found else _attrs(found, args[role])
    if all(prim_value(a) == 0 for a in attrs):
        return None
    fixed = [args[a] for a in ("x", "router", "gate_up", "down", "top_k", "norm_topk")]
    return llmc_call("moe", [*fixed, *attrs], call.ty)


def quantize_linear(
    schemes: Mapping[str, QuantScheme], weight_names: list[str]
) -> Callable[[tvm.IRModule], tvm.IRModule]:
    def quantize_linear(mod: tvm.IRModule) -> tvm.IRModule:
        func = main_function(mod)
        var2val = relax.analysis.get_var2val(func)
        names = dict(zip(weight_params(func), weight_names, strict=True))
        edits, count = {}, 0
        for b in bindings(func):
            if llmc_op_name(b.value) == "moe":
                moe = _quantized_moe(b.value, schemes, var2val, names)
                if moe is not None:
                    edits[b.var] = moe
                    count += 1
                continue
            if not calls(b.value, "relax.matmul"):
                continue
            x, wt = b.value.args
            wt_value = var2val.get(wt)
            if not calls(wt_value, "relax.permute_dims"):
                continue
            weight = wt_value.args[0]
            sources = _sources(weight, var2val, names)
            found = [schemes.get(s) for s in sources or ()]
            if not found or None in found:
                continue
            edits[b.var] = llmc_call("quantized_matmul", [x, weight, *_attrs(found, weight)], b.var.ty)
            count += 1
        return rewrite(mod, edits, pass_name="quantize_linear", count=count)

    return quantize_linear
