"""quantize_linear: each GEMM whose weight has a quantization scheme becomes `llmc.quantized_matmul`.

`quantize_linear(schemes, weight_names)` makes the pass. `schemes` maps checkpoint tensor names to their
QuantScheme (compile builds it from `--quant`, or from a GGUF file's own tensor types); `weight_names` names
main's weight parameters in order (Traced.weight_names), which is how a parameter is traced back to its
checkpoint tensor. A matched GEMM is `matmul(x, permute_dims(W))` with W a weight parameter or, after
merge_qkv / fuse_swiglu, a concat of weight parameters: it is rewritten to

    llmc.quantized_matmul(x, W, bits, group_size, asymmetric, scale_bits, codebook)

with W as it was (the float [N, K] weight; lowering packs it quantized) and a bias add left where it is (it
joins the quantized GEMM in lowering, as it joins the float one). A fused weight whose sources share a scheme
stays fused. Where they differ (GGUF Q4_K_M: attn_v Q6_K beside q and k Q4_K):
  - `split_mixed` (the CPU): each run of sources with one scheme becomes its own quantized GEMM, at its own
    size, and their results are concatenated along the columns (each bias add goes with its run's GEMM).
    Lowering has each GEMM write its columns of one buffer (qgemm's ldy), so nothing is copied;
  - else: one scheme that holds each exactly (quant_widen.common_scheme), wider than the file.
A GEMM with any source lacking a scheme stays float, and so does every matmul whose weight is computed
(attention's). A mixture-of-experts MLP (`llmc.moe`) takes its experts' schemes as its attrs, gate_up's and
down's, the same way (the router stays float).

Runs last: the GEMMs it reads are the fused ones lowering will launch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tvm
from tvm import relax

from ..quant import QuantScheme
from ..quant_widen import common_scheme
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
    scheme_attrs,
    users,
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
    """The scheme attrs (QUANT_ATTRS) of a GEMM whose weight (a bound var) has sources of schemes `found`."""
    return _scheme_attrs(found, int(weight.ty.shape.values[1]))


def _scheme_attrs(found: list[QuantScheme], k: int) -> list[relax.Expr]:
    return scheme_attrs(common_scheme(found, k))


def _runs(found: list[QuantScheme]) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive sources with one scheme."""
    runs: list[tuple[int, int]] = []
    for i, scheme in enumerate(found):
        if runs and found[runs[-1][0]] == scheme:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _fields(expr: relax.Expr, var2val) -> list[relax.Expr]:
    """The tensors a concat along dim 0 joins (`expr` alone if it is none)."""
    value = var2val.get(expr)
    return list(value.args[0].fields) if calls(value, "relax.concat") else [expr]


def _joined(fields: list[relax.Expr]) -> relax.Expr:
    return fields[0] if len(fields) == 1 else relax.op.concat(fields, axis=0)


def _split_by_scheme(
    x: relax.Expr, weight: relax.Expr, found: list[QuantScheme], ty, var2val, bias: relax.Expr | None = None
) -> relax.Expr:
    """One quantized GEMM (plus its bias slice) for each run of `weight`'s sources with one scheme, concatenated
    along the columns: what `x @ weight^T (+ bias)` is, each part at its own scheme."""
    fields, bias_fields = _fields(weight, var2val), _fields(bias, var2val) if bias is not None else None
    dims, k = list(ty.shape.values), int(weight.ty.shape.values[1])
    parts = []
    for a, b in _runs(found):
        w = _joined(fields[a:b])
        cols = sum(int(f.ty.shape.values[0]) for f in fields[a:b])
        out = relax.TensorType([*dims[:-1], cols], ty.dtype)
        y = llmc_call("quantized_matmul", [x, w, *_scheme_attrs(found[a:b], k)], out)
        parts.append(y if bias_fields is None else relax.op.add(y, _joined(bias_fields[a:b])))
    return relax.op.concat(parts, axis=len(dims) - 1)


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


def _bias_adds(func: relax.Function, var2val, names: dict) -> dict:
    """{GEMM result var: (its bias add's binding var, the bias)} for each result that one add of a weight
    parameter, or a concat of them (merged_linear's bias), alone reads."""
    uses = users(func)
    adds = {}
    for b in bindings(func):
        if calls(b.value, "relax.add"):
            y, bias = b.value.args
            if uses.get(y) == 1 and _sources(bias, var2val, names) is not None:
                adds[y] = (b.var, bias)
    return adds


def quantize_linear(
    schemes: Mapping[str, QuantScheme], weight_names: list[str], split_mixed: bool = False
) -> Callable[[tvm.IRModule], tvm.IRModule]:
    def quantize_linear(mod: tvm.IRModule) -> tvm.IRModule:
        func = main_function(mod)
        var2val = relax.analysis.get_var2val(func)
        names = dict(zip(weight_params(func), weight_names, strict=True))
        bias_adds = _bias_adds(func, var2val, names) if split_mixed else {}
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
            if split_mixed and len(set(found)) > 1:
                add, bias = bias_adds.get(b.var, (None, None))
                if add is not None and len(_sources(bias, var2val, names)) == len(found):
                    edits[add] = _split_by_scheme(x, weight, found, b.var.ty, var2val, bias)  # the GEMM goes unused
                else:
                    edits[b.var] = _split_by_scheme(x, weight, found, b.var.ty, var2val)
            else:
                edits[b.var] = llmc_call("quantized_matmul", [x, weight, *_attrs(found, weight)], b.var.ty)
            count += 1
        return rewrite(mod, edits, pass_name="quantize_linear", count=count)

    return quantize_linear
