"""What every llmc pass shares: the fused-op call form, binding-level matching, and the rewriter.

A fused op is `R.call_pure_packed("llmc.<op>", *args, ty_args=...)`: pure, printable, and named, so
the kernel-program lowering can find it by name. It carries every fact its kernels need, so lowering
reads the IR and nothing else: scalar attributes (eps, layer index, head counts, softmax scale, window)
are trailing `R.prim_value` arguments, the RoPE inverse frequencies a float32 constant tensor. OPS lists
each op's argument names, which is the op's whole contract.

Each pass works in two phases (as TVM's own Python passes do): match dpl patterns against every binding
of `main` and collect a replacement map {var: new value}, then rebuild `main` with `rewrite`. Bindings
that become unused disappear. Each pass records how many patterns it rewrote in the module attribute
`llmc.rewrites`, so tests and `llmc inspect` can say what fused and what did not.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import tvm
from tvm import relax
from tvm.relax.dpl import DFPattern

from llmc.errors import CompileError

# main's step arguments, as the C ABI passes them (docs/contracts.md); its other parameters are the KV caches
# (kv_cache_<layer>) and the weights.
ABI_PARAMS = ("input_ids", "positions", "logits_indices", "seq_lens", "query_start_loc", "block_tables", "slot_mapping")


def weight_params(func: relax.Function) -> list[relax.Var]:
    """main's weight parameters, in order: every parameter but the step arguments and the KV caches."""
    return [p for p in func.params if p.name not in ABI_PARAMS and not p.name.startswith("kv_cache_")]


# a quantized weight's scheme (compiler/quant.py)
QUANT_ATTRS = ("bits", "group_size", "asymmetric", "scale_bits", "codebook")
OPS = {
    "rms_norm": ("x", "weight", "eps"),
    # -> (h, rms_norm(h)), h = x + residual_scale * r, where r is rms_norm(residual) by residual_weight (Gemma's
    # normed branch) or, when residual_weight is an empty constant, residual itself
    "add_rms_norm": ("x", "residual", "weight", "eps", "residual_scale", "residual_weight"),
    # x: [1, heads, T, head_dim], rotate-half RoPE of each head's leading 2 * len(inv_freq) dims (all of them but
    # for a partial rotary, Phi-4-mini's); inv_freq: a float32 constant
    # LongRoPE (Phi-3; else long_inv_freq empty, original_max 0, attention_factor 1): a token whose sequence holds
    # more than original_max tokens after this step rotates by long_inv_freq, and cos and sin scale by the factor
    "rope": ("x", "positions", "inv_freq", "long_inv_freq", "original_max", "attention_factor"),
    # Gemma 2's attention as the Relax import states it (compiler/export.py): R.nn.attention's [1, T, H, D] layout,
    # causal mask and window (0: none), the scores soft-capped, softcap * tanh(s / softcap), after the scale
    "softcapped_attention": ("q", "k", "v", "scale", "sliding_window", "softcap"),
    "paged_attention": (  # -> [T, num_heads * head_dim]; RoPE by inv_freq on q and k applied inside
        "q",
        "k",
        "v",
        "positions",
        "inv_freq",
        "kv_cache",
        "slot_mapping",
        "query_start_loc",
        "seq_lens",
        "block_tables",
        "layer",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "scale",
        "sliding_window",
        "q_norm",
        "k_norm",
        "norm_eps",
        "softcap",
        "long_inv_freq",
        "original_max",
        "attention_factor",
    ),  # sliding_window 0: plain causal; else key j is seen from query i when i - window < j <= i. norm_eps > 0:
    # q and k are RMS-normalized before RoPE, each head (weights q_norm, k_norm: [head_dim]; Qwen3) or the whole of
    # each ([num_heads * head_dim], [num_kv_heads * head_dim]; OLMo 2); else q_norm and k_norm are empty constants.
    # softcap > 0: the scores soft-capped as in softcapped_attention (Gemma 2); 0: not. long_inv_freq,
    # original_max, attention_factor: the rope's LongRoPE
    # x + rms_norm(residual) by residual_weight: OLMo 2's normed branch added, with no norm after the sum
    "add_normed": ("x", "residual", "residual_weight", "eps"),
    "silu_mul": ("gate_up",),  # [rows, 2 * inter] -> [rows, inter]: silu(gate) * up
    "gelu_tanh_mul": ("gate_up",),  # the same with gelu(gate, approximate="tanh") (Gemma's GeGLU)
    "softcap": ("x", "cap"),  # cap * tanh(x / cap), elementwise (Gemma 2's final logits)
    # x @ W.T with W (float [N, K], sources as traced) packed quantized: compiler/quant.py's scheme as attrs
    "quantized_matmul": ("x", "weight", *QUANT_ATTRS),
    # a mixture-of-experts MLP over rows x [T, H] (frontend/model.py moe_reference): router [E, H]; gate_up
    # [E * 2I, H], each expert's gate rows then up rows; down [E * H, I]; norm_topk 1: the top_k probabilities
    # renormalized. quant_*: the experts' scheme (quantized_matmul's attrs, bits 0: float), gate_up's then down's
    "moe": (
        "x",
        "router",
        "gate_up",
        "down",
        "top_k",
        "norm_topk",
        *(f"{w}_{a}" for w in ("gate_up", "down") for a in QUANT_ATTRS),
    ),
    # take(table, ids, axis=0) with the table (float [vocab, hidden], as traced) packed quantized, as above
    "quantized_take": ("table", "ids", *QUANT_ATTRS),
}


def llmc_call(op: str, args: Iterable[relax.Expr], out: relax.Type) -> relax.Call:
    args = list(args)
    assert len(args) == len(OPS[op]), f"llmc.{op} takes {OPS[op]}, got {len(args)} args"
    return relax.op.call_pure_packed(f"llmc.{op}", *args, ty_args=out)


def llmc_op_name(expr: relax.Expr) -> str | None:
    """'rms_norm' for a call to llmc.rms_norm, else None."""
    if not isinstance(expr, relax.Call) or expr.op != tvm.ir.Op.get("relax.call_pure_packed"):
        return None
    callee = expr.args[0]
    if isinstance(callee, relax.ExternFunc) and callee.global_symbol.startswith("llmc."):
        return callee.global_symbol[len("llmc.") :]
    return None


def llmc_args(call: relax.Call) -> dict[str, relax.Expr]:
    name = llmc_op_name(call)
    return dict(zip(OPS[name], call.args[1:], strict=True))


NO_WEIGHT = relax.const(np.zeros(0, dtype="float32"))  # an optional weight argument that is absent


def prim(value: int | float) -> relax.Expr:
    dtype = "int64" if isinstance(value, int) else "float64"  # a Python float is a double: keep every bit
    return relax.prim_value(tvm.tirx.const(value, dtype))


def scheme_attrs(scheme) -> list[relax.Expr]:
    """A compiler/quant.py QuantScheme as the values of QUANT_ATTRS (QuantScheme.of_kernel reads them back)."""
    return [prim(int(getattr(scheme, a))) for a in QUANT_ATTRS]


def prim_value(expr: relax.Expr) -> int | float:
    return expr.value


def scalar(expr: relax.Expr) -> float | None:
    """The value of a float32 scalar constant, else None."""
    if isinstance(expr, tvm.ir.Constant) and expr.ty.ndim == 0 and expr.ty.dtype == "float32":
        return float(expr.value.numpy())
    return None


def main_function(mod: tvm.IRModule) -> relax.Function:
    return mod["main"]


def bindings(func: relax.Function) -> list[relax.VarBinding]:
    return [b for block in func.body.blocks for b in block.bindings]


def match(pattern: DFPattern, expr: relax.Expr, var2val) -> dict | None:
    return pattern.extract_matched_expr(expr, var2val)


def shape_of(expr: relax.Expr) -> list:
    return list(expr.ty.shape.values)


def users(func: relax.Function) -> dict[relax.Var, int]:
    """How many bindings (and the function output) use each var."""
    count: dict[relax.Var, int] = {}

    def visit(e):
        if isinstance(e, relax.Var):
            count[e] = count.get(e, 0) + 1

    for b in bindings(func):
        relax.analysis.post_order_visit(b.value, visit)
    relax.analysis.post_order_visit(func.body.body, visit)
    return count


@relax.expr_functor.mutator
class _Rewriter(relax.PyExprMutator):
    def __init__(self, edits: dict, mod: tvm.IRModule):
        super().__init__(mod)
        self.edits = edits
        self.emitted: list[tuple[relax.Expr, relax.Var]] = []  # multi-output fused calls, emitted once

    def _emit_shared(self, call: relax.Expr) -> relax.Var:
        for seen, var in self.emitted:
            if seen.same_as(call):
                return var
        var = self.builder_.emit(self.visit_expr(call))
        self.emitted.append((call, var))
        return var

    def visit_var_binding_(self, binding: relax.VarBinding) -> None:
        value = self.edits.get(binding.var)
        if value is None:
            return super().visit_var_binding_(binding)
        if isinstance(value, relax.TupleGetItem):
            new_value = relax.TupleGetItem(self._emit_shared(value.tuple_value), value.index)
        else:
            new_value = self.visit_expr(value)
        if isinstance(new_value, relax.Var) and isinstance(binding.var, relax.DataflowVar):
            self.set_var_remap(binding.var, new_value)  # a pure alias: uses read the source directly
            return
        if isinstance(binding.var, relax.DataflowVar):
            new_var = self.builder_.emit(new_value, name_hint=binding.var.name)
        else:
            new_var = self.builder_.emit_output(new_value, name_hint=binding.var.name)
        self.set_var_remap(binding.var, new_var)


def rewrite(mod: tvm.IRModule, edits: dict, *, pass_name: str, count: int, params: list | None = None) -> tvm.IRModule:
    """Apply {var: new value} to main, drop what became unused, and record the rewrite count.

    `params` replaces main's parameter list (a pass that adds batch-state inputs passes it).
    """
    func = main_function(mod)
    if edits:
        new_body = _Rewriter(edits, mod).visit_expr(func.body)
        # ret_ty None: re-inferred, since a pass may change what main returns (select_logits_rows).
        func = relax.Function(
            params if params is not None else func.params, new_body, None, func.is_pure, func.attrs, func.span
        )
        func = relax.analysis.remove_all_unused(func)
    mod = tvm.IRModule(dict(mod.functions_items()), attrs=mod.attrs)
    mod["main"] = func
    return record(mod, pass_name, count)


def record(mod: tvm.IRModule, pass_name: str, count: int) -> tvm.IRModule:
    rewrites = dict(rewrite_counts(mod))
    rewrites[pass_name] = count
    return mod.with_attr("llmc.rewrites", rewrites)


def rewrite_counts(mod: tvm.IRModule) -> dict[str, int]:
    attrs = mod.attrs
    if attrs is None or "llmc.rewrites" not in attrs:
        return {}
    return {str(k): int(v) for k, v in attrs["llmc.rewrites"].items()}


def calls(expr: relax.Expr, *op_names: str) -> bool:
    """Whether expr is a call to one of the Relax ops named (`relax.reshape`, ...)."""
    return isinstance(expr, relax.Call) and any(expr.op == tvm.ir.Op.get(n) for n in op_names)


def matching_bindings(func: relax.Function, pattern: DFPattern):
    """(binding, var2val) for every binding of main whose value matches the dpl pattern."""
    var2val = relax.analysis.get_var2val(func)
    for b in bindings(func):
        if pattern.match(b.value, var2val):
            yield b, var2val


def source_of(expr: relax.Expr, var2val, through=("relax.reshape", "relax.expand_dims")) -> relax.Expr:
    """Follow aliases and the view ops in `through` back to the tensor they view (a constant, if bound to one)."""
    while True:
        value = var2val.get(expr)
        if isinstance(value, (relax.Var, tvm.ir.Constant)):
            expr = value
        elif calls(value, *through):
            expr = value.args[0]
        else:
            return expr


class Linear:
    """y = x @ W.T (+ bias), as traced from nn.Linear: matmul(x, permute_dims(W)) [+ add(., bias)]."""

    def __init__(self, x, weight, bias):
        self.x, self.weight, self.bias = x, weight, bias

    @classmethod
    def match(cls, var: relax.Expr, var2val) -> Linear | None:
        value = var2val.get(var)
        bias = None
        if calls(value, "relax.add"):  # the bias is a parameter; the traced add takes it on either side
            a, b = value.args
            if isinstance(a, relax.Var) and a not in var2val:
                a, b = b, a
            if not (isinstance(b, relax.Var) and b not in var2val):
                return None
            bias, value = b, var2val.get(a)
        if not calls(value, "relax.matmul"):
            return None
        x, wt = value.args
        wt_value = var2val.get(wt)
        if not calls(wt_value, "relax.permute_dims"):
            return None
        weight = wt_value.args[0]
        if not isinstance(weight, relax.Var) or weight in var2val:  # a parameter, not a computed tensor
            return None
        return cls(x, weight, bias)


def merged_linear(x: relax.Expr, parts: list[Linear]) -> relax.Expr:
    """One GEMM for several Linears on the same input: weights (and biases) concatenated along out."""
    weight = relax.op.concat([p.weight for p in parts], axis=0)
    y = relax.op.matmul(x, relax.op.permute_dims(weight, [1, 0]))
    if parts[0].bias is not None:
        y = relax.op.add(y, relax.op.concat([p.bias for p in parts], axis=0))
    return y


def static_dim(expr) -> int:
    """A dimension that must be static (an IntImm), as an int."""
    if isinstance(expr, tvm.tirx.IntImm):
        return int(expr)
    raise CompileError(f"expected a static dimension, got {expr}")


def last_dim(ty) -> int:
    """The static size of a tensor type's last dimension."""
    return static_dim(ty.shape.values[-1])


def tensor_args(call: relax.Call):
    """The Var arguments of `call`, those inside a Tuple argument included."""
    for a in call.args:
        if isinstance(a, relax.Var):
            yield a
        elif isinstance(a, relax.Tuple):
            yield from (f for f in a.fields if isinstance(f, relax.Var))
