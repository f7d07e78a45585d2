"""Lower the fused Relax module to a kernel program (compiler/program.py): one pass over main's bindings.

Lowering reads the IR and nothing else: each fused `llmc.*` op carries its facts (RoPE inverse frequencies,
softmax scale, sliding window, head counts), and the KV cache geometry and vocabulary come from main's
signature. It needs no model config and imports no torch.

Activations are float32 unless act_dtype says otherwise (the CUDA targets: bf16 for a bf16 build); then
every launch carries it as its `adtype` parameter, and the templates round what they store to it.

With swiglu_epilogue (the CUDA targets), a bf16 gate_up GEMM and the silu_mul that alone reads its product
lower to one `gemm_swiglu` launch (compiler/launches.py). The buffer plan follows there too.

A `llmc.quantized_matmul` lowers to a `qgemm` launch whose weight is two or three packed tensors (qweight,
scales, mins: WeightSpec parts), which the packer quantizes from the float sources named here; a
`llmc.quantized_take` to a `qembedding` launch reading the same parts (a tied head's, when it is one).

Every binding of the fused main lowers to a template or is a free view (reshape, expand_dims, split into
columns, a weight concat evaluated at pack time, a concat of qgemm results along the columns, which those
qgemms write into one buffer). Any other op falls back to TVM's own codegen: its
PrimFunc joins `tvm_funcs`, and a `tvm_call` launch runs it (compiler/codegen/tvm_fallback.py).
"""

from __future__ import annotations

import dataclasses
import math

import tvm
import tvm_ffi
from tvm import relax

from llmc.dtypes import DTYPES
from llmc.errors import CompileError

from .launches import PendingLaunch, View, WeightRef, fuse_gemm_swiglu, plan_buffers
from .legalize import legalize_call
from .lower_llmc_ops import LlmcOpLowering
from .passes.common import (
    ABI_PARAMS,
    bindings,
    calls,
    last_dim,
    llmc_op_name,
    main_function,
    rewrite_counts,
    scalar,
    static_dim,
    tensor_args,
    users,
    weight_params,
)
from .program import KernelProgram, ModelGeometry
from .quant import QuantScheme
from .weights import WeightSpec, linear_name, packed_name, quant_part_dtype

_BIAS_ARG = {"gemm": 2, "qgemm": 4}  # where a GEMM launch takes its bias (nullptr until an add joins it)


class _Unlowered(Exception):
    """A handler's op form that no template covers: the binding falls back to TVM."""


class _Lowering(LlmcOpLowering):
    def __init__(
        self, func: relax.Function, weight_names: list[str], weight_dtype: str, block_size: int, kv_dtype: str
    ):
        self.weight_dtype = weight_dtype
        self.block_size = block_size
        self.kv_dtype = kv_dtype
        self.env: dict = {}  # relax var -> View | WeightRef | str (an ABI argument) | tuple
        self.value_cols: list[int] = []
        self.value_rows: list[str] = []
        self.launches: list[PendingLaunch] = []
        self.weight_specs: dict[tuple, int] = {}  # sources (+ part, quantized) -> index
        self.weight_list: list[WeightSpec] = []
        self.tvm_funcs: dict[str, tvm.tirx.PrimFunc] = {}
        # per layer, (kv_heads, head_dim) of its cache [2, blocks, size, kv_heads, head_dim]
        self.kv_cache_heads: list[tuple[int, int]] = []
        self.var2val = relax.analysis.get_var2val(func)
        # the symbolic row counts: tokens (input_ids: [T]) and logits rows (logits_indices: [N])
        self.row_vars = {
            str(p.ty.shape.values[0]): {"input_ids": "T", "logits_indices": "N"}[p.name]
            for p in func.params
            if p.name in ("input_ids", "logits_indices")
        }
        self.uses = users(func)
        num_weights = len(weight_params(func))
        if num_weights != len(weight_names):
            raise CompileError(f"main has {num_weights} weight parameters but {len(weight_names)} weight names")
        weights = iter(weight_names)
        for p in func.params:
            if p.name == "input_ids":
                self.env[p] = "token_ids"  # the ABI's name; it passes int32 ids, so casts of them are free
            elif p.name in ABI_PARAMS:
                self.env[p] = p.name
            elif p.name.startswith("kv_cache_"):
                self.env[p] = ("kv_cache", int(p.name[len("kv_cache_") :]))
                self.kv_cache_heads.append(tuple(static_dim(d) for d in p.ty.shape.values[3:]))
            else:
                name = next(weights)
                self.env[p] = WeightRef((name,), tuple(static_dim(d) for d in p.ty.shape.values))
        self.output = func.body.body

    # --- values ---------------------------------------------------------------------------------

    def new_value(self, cols: int, rows: str) -> View:
        self.value_cols.append(cols)
        self.value_rows.append(rows)
        return View(len(self.value_cols) - 1, 0, cols, cols, rows)

    def view(self, var) -> View:
        v = self.env.get(var)
        if not isinstance(v, View):
            raise CompileError(f"expected an activation tensor, got {v!r} for {var}")
        return v

    def weight(self, expr) -> int:
        w = self.env.get(expr) if isinstance(expr, relax.Var) else None
        if not isinstance(w, WeightRef):
            raise CompileError(f"expected a weight, got {expr}")
        return self.weight_index(w)

    def weight_index(self, w: WeightRef, dtype: str | None = None) -> int:
        if w.key not in self.weight_specs:
            dtype = dtype or (self.weight_dtype if len(w.shape) == 2 else "float32")
            name = packed_name(w.sources)
            if any(spec.name == name for spec in self.weight_list):
                raise CompileError(f"{name} is packed twice, with different scales or offsets")
            self.weight_specs[w.key] = len(self.weight_list)
            self.weight_list.append(WeightSpec(name, w.sources, dtype, w.shape, affine=w.affine))
        return self.weight_specs[w.key]

    def quant_index(self, w: WeightRef, scheme: QuantScheme, part: str) -> int:
        if w.affine != (1.0, 0.0):
            raise CompileError(f"{packed_name(w.sources)} is scaled when packed, and cannot also be quantized")
        key = (w.sources, part)
        if key not in self.weight_specs:
            self.weight_specs[key] = len(self.weight_list)
            name = f"{packed_name(w.sources)}.{part}"
            self.weight_list.append(WeightSpec(name, w.sources, quant_part_dtype(scheme, part), w.shape, scheme, part))
        spec = self.weight_list[self.weight_specs[key]]
        if spec.quant != scheme:
            raise CompileError(f"{spec.name} is quantized as {spec.quant.describe()} and as {scheme.describe()}")
        return self.weight_specs[key]

    def wdtype(self, index: int) -> str:
        return DTYPES[self.weight_list[index].dtype].short

    def emit(self, op: str, params: dict, args: list, fused: list[str], defs: list[View], weight=None) -> None:
        self.launches.append(PendingLaunch(op, params, args, fused, [d.value for d in defs], weight))

    # --- bindings -------------------------------------------------------------------------------

    def lower(self, func: relax.Function) -> None:
        for b in bindings(func):
            self.binding(b.var, b.value)

    def binding(self, var, value) -> None:
        env = self.env
        if isinstance(value, relax.Var):
            env[var] = env[value]
            return
        if isinstance(value, relax.TupleGetItem):
            env[var] = env[value.tuple_value][value.index]
            return
        name = llmc_op_name(value)
        if name is not None:
            return getattr(self, f"op_{name}")(var, value)
        op = value.op.name if isinstance(value, relax.Call) and hasattr(value.op, "name") else type(value).__name__
        handler = getattr(self, "relax_" + op.replace("relax.", "").replace(".", "_"), None)
        try:
            if handler is None:
                raise _Unlowered
            handler(var, value)
        except _Unlowered:
            self.tvm_fallback(var, value, op)

    def tvm_fallback(self, var, value, op: str) -> None:
        """One launch of TVM's lowering of `value`: float32 tensors in, one float32 [rows, ...] tensor out."""
        where = f"`{op}` (binding {var.name}: {var.ty})"
        if not isinstance(value, relax.Call) or not isinstance(var.ty, relax.TensorType):
            raise CompileError(f"no kernel template covers {where}, and TVM's fallback takes one tensor call")
        inputs = list(dict.fromkeys(a for a in tensor_args(value)))
        if any(v.ty.dtype != "float32" for v in [*inputs, var]):
            raise CompileError(f"no kernel template covers {where}; TVM's fallback here takes float32 only")
        args, shapes = [], []
        for v in inputs:
            src = self.env.get(v)
            shapes.append(self.dims(v, where, rows=not isinstance(src, WeightRef)))
            if isinstance(src, WeightRef) and not src.transposed:
                w = self.weight_index(src, dtype="float32")
                if self.weight_list[w].dtype != "float32":
                    raise CompileError(
                        f"{where} reads {src.sources[0]}, packed as {self.weight_list[w].dtype}",
                        "compile with --weight-dtype float32",
                    )
                args.append(f"W[{w}]")
            elif isinstance(src, View) and src.stride == src.cols:
                args.append(src)
            else:
                raise CompileError(
                    f"no kernel template covers {where}, and its input {v.name} is not a whole "
                    "tensor that TVM's fallback can read"
                )
        shapes.append(self.dims(var, where, rows=True))
        func = legalize_call(value, inputs)
        name = next((n for n, f in self.tvm_funcs.items() if tvm_ffi.structural_equal(f, func)), None)
        if name is None:
            name = f"tvm_{op.replace('relax.', '').replace('.', '_')}_{len(self.tvm_funcs)}"
            self.tvm_funcs[name] = func
        rows = next(d for d in shapes[-1] if isinstance(d, str))
        out = self.new_value(math.prod(d for d in shapes[-1] if isinstance(d, int)), rows)
        self.emit(
            "tvm_call", {"func": name, "shapes": shapes, "num_inputs": len(inputs)}, [*args, out, "T", "N"], [op], [out]
        )
        self.env[var] = out

    def dims(self, v, where: str, rows: bool) -> list:
        """v's shape: static dims as ints, the token / logits row count as "T" / "N" (once in an activation)."""
        dims = [int(d) if isinstance(d, tvm.tirx.IntImm) else self.row_vars.get(str(d), d) for d in v.ty.shape.values]
        if sum(isinstance(d, str) for d in dims) != int(rows) or not all(isinstance(d, (int, str)) for d in dims):
            raise CompileError(
                f"no kernel template covers {where}, and {v.name}: {v.ty} has a shape that "
                "TVM's fallback does not take (static but for one dimension of T or N rows)"
            )
        return dims

    def relax_astype(self, var, value):
        if self.env[value.args[0]] != "token_ids":
            raise _Unlowered
        self.env[var] = "token_ids"

    def relax_reshape(self, var, value):
        # Reshapes here add or drop the leading batch 1 or split a row into heads: the rows stay put.
        src = self.env[value.args[0]]
        if isinstance(src, View) and src.stride != src.cols and last_dim(var.ty) != src.cols:
            raise CompileError(f"reshape {var.name} of a column slice is not a view")
        self.env[var] = src

    relax_expand_dims = relax_reshape

    def relax_concat(self, var, value):
        fields = value.args[0].fields if isinstance(value.args[0], relax.Tuple) else value.args[0]
        parts = [self.env[f] for f in fields]
        if all(isinstance(p, View) for p in parts) and int(value.attrs.axis) == len(var.ty.shape.values) - 1:
            self.env[var] = self._columns_of_one_value(parts)
            return
        if not all(isinstance(p, WeightRef) for p in parts) or int(value.attrs.axis) != 0:
            raise _Unlowered
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        self.env[var] = WeightRef(tuple(s for p in parts for s in p.sources), shape)

    def _columns_of_one_value(self, parts: list[View]) -> View:
        """Activations joined along the columns, each the whole output of a qgemm (quantize_linear's split of a
        fused weight by scheme): those qgemms write their columns of one new value (ldy), so the join is free."""
        producers = [self._sole_writer(p) for p in parts]
        if any(launch is None or launch.op != "qgemm" for launch in producers):
            raise _Unlowered
        rows = parts[0].rows
        out = self.new_value(sum(p.cols for p in parts), rows)
        offset = 0
        for p, launch in zip(parts, producers, strict=True):
            column = View(out.value, offset, p.cols, out.cols, rows)
            launch.args = [column if a == p else a for a in launch.args]
            launch.defs = [out.value]
            launch.params["ldy"] = out.cols
            # a later use of the qgemm's own result reads its columns
            self.env.update({v: column for v, view in self.env.items() if view == p})
            offset += p.cols
        return out

    def relax_permute_dims(self, var, value):
        src = self.env[value.args[0]]
        if not isinstance(src, WeightRef) or len(src.shape) != 2:
            raise _Unlowered
        self.env[var] = dataclasses.replace(src, transposed=True)

    def relax_take(self, var, value):
        table, indices = (self.env.get(a) for a in value.args)
        if isinstance(table, WeightRef) and indices == "token_ids":
            w = self.weight_index(table)
            out = self.new_value(table.shape[1], "T")
            self.emit(
                "embedding",
                {"hidden": table.shape[1], "wdtype": self.wdtype(w)},
                ["token_ids", "T", f"W[{w}]", out],
                ["take(embed_tokens)"],
                [out],
            )
            self.env[var] = out
        elif isinstance(table, View) and indices == "logits_indices":
            if table.stride != table.cols:
                raise CompileError(f"gather of a column slice ({var.name}) is not lowered")
            out = self.new_value(table.cols, "N")
            self.emit(
                "gather_rows",
                {"cols": table.cols},
                [table, "logits_indices", "N", out],
                ["take(logits_indices)"],
                [out],
            )
            self.env[var] = out
        else:
            raise _Unlowered

    def relax_matmul(self, var, value):
        x, wt = (self.env.get(a) for a in value.args)
        if not (isinstance(x, View) and isinstance(wt, WeightRef) and wt.transposed) or x.stride != x.cols:
            raise _Unlowered
        w = self.weight_index(WeightRef(wt.sources, wt.shape))
        n, k = wt.shape
        out = self.new_value(n, x.rows)
        self.emit(
            "gemm",
            {"n": n, "k": k, "wdtype": self.wdtype(w), "has_bias": False},
            [x, f"W[{w}]", "nullptr", out, x.rows],
            [linear_name(wt.sources)],
            [out],
            weight=w,
        )
        self.env[var] = out

    def _affine_weight(self, var, value, op: str) -> bool:
        """A weight times or plus a scalar constant (Gemma's 1 + w, a folded logits scale) is a weight, packed
        with that affine map."""
        w, c = self.env.get(value.args[0]), scalar(value.args[1])
        if not isinstance(w, WeightRef) or w.transposed or c is None:
            return False
        scale, offset = w.affine
        self.env[var] = dataclasses.replace(
            w, affine=(scale * c, offset * c) if op == "multiply" else (scale, offset + c)
        )
        return True

    def relax_multiply(self, var, value):
        if self._affine_weight(var, value, "multiply"):
            return
        x, c = self.env.get(value.args[0]), scalar(value.args[1])
        last = self.launches[-1] if self.launches else None
        if (
            isinstance(x, View)
            and c is not None
            and last is not None
            and last.op in ("embedding", "qembedding")
            and last.defs == [x.value]
            and self._read_once(value.args[0])
            and "scale" not in last.params
        ):
            # the embedding's scale (Granite, Gemma) joins the gather that made the rows, alone read here
            last.params["scale"] = c
            last.fused[0] += " * scale"
            self.env[var] = x
            return
        raise _Unlowered

    def _read_once(self, var) -> bool:
        """Whether `var`, and every view (reshape, expand_dims) it is of, has one reader."""
        while self.uses.get(var) == 1:
            value = self.var2val.get(var)
            if not calls(value, "relax.reshape", "relax.expand_dims"):
                return True
            var = value.args[0]
        return False

    def relax_add(self, var, value):
        if self._affine_weight(var, value, "add"):
            return
        a, b = (self.env.get(x) for x in value.args)
        if isinstance(a, WeightRef):
            a, b = b, a
        gemm = self._sole_writer(a) if isinstance(a, View) and isinstance(b, WeightRef) else None
        if gemm is not None and gemm.op in _BIAS_ARG and not gemm.params["has_bias"]:
            # The bias add of the GEMM that made a joins it (gemm reads bias in the weight dtype, qgemm float32).
            dtype = self.weight_list[gemm.weight].dtype if gemm.op == "gemm" else "float32"
            bias = self.weight_index(b, dtype=dtype)
            if self.weight_list[bias].dtype != dtype:
                raise CompileError(f"bias {b.sources[0]} is read as {dtype} and as {self.weight_list[bias].dtype}")
            gemm.params["has_bias"] = True
            gemm.args[_BIAS_ARG[gemm.op]] = f"W[{bias}]"
            gemm.fused[0] += " + bias"
            self.env[var] = a
            return
        raise _Unlowered

    def _sole_writer(self, view: View) -> PendingLaunch | None:
        """The launch that alone wrote the whole of `view`, its one output, if no launch has read it since: an
        epilogue may join it."""
        writers = [i for i, launch in enumerate(self.launches) if view.value in launch.defs]
        if len(writers) != 1 or view.col_offset != 0 or not view.stride == view.cols == self.value_cols[view.value]:
            return None
        launch = self.launches[writers[0]]
        later = self.launches[writers[0] + 1 :]
        if launch.defs != [view.value] or any(
            isinstance(x, View) and x.value == view.value for y in later for x in y.args
        ):
            return None
        return launch

    def relax_split(self, var, value):
        src = self.view(value.args[0])
        bounds = [0, *(int(i) for i in value.attrs.indices_or_sections), src.cols]
        self.env[var] = tuple(
            View(src.value, src.col_offset + lo, hi - lo, src.stride, src.rows)
            for lo, hi in zip(bounds, bounds[1:], strict=False)
        )

    # --- buffer plan ----------------------------------------------------------------------------

    def finish(self, rewrites: dict) -> KernelProgram:
        final = self.env[self.output]
        if not isinstance(final, View) or final.rows != "N":
            raise CompileError("main must return logits [N, vocab]; select_logits_rows did not apply")
        if len(set(self.kv_cache_heads)) != 1:
            raise CompileError(
                "main must take one KV cache per layer, all with the same heads and head_dim; "
                "fuse_attention did not apply"
            )
        geometry = ModelGeometry(len(self.kv_cache_heads), *self.kv_cache_heads[0], vocab_size=final.cols)
        buffers, launches = plan_buffers(self.launches, self.value_cols, self.value_rows, final)
        return KernelProgram(
            geometry, self.weight_list, buffers, launches, rewrites, self.block_size, self.tvm_funcs, self.kv_dtype
        )


def lower(
    mod: tvm.IRModule,
    weight_names: list[str],
    *,
    block_size: int,
    weight_dtype: str = "float32",
    kv_dtype: str = "float32",
    act_dtype: str | None = None,
    swiglu_epilogue: bool = False,
    two_pass_head: bool = False,
) -> KernelProgram:
    """weight_names: the HF names of main's weight parameters, in order (Traced.weight_names); kv_dtype: the
    KV cache element, one of llmc.dtypes.ELEMENT_DTYPES; act_dtype: the activation element (one of them too),
    given to every launch as `adtype`, for targets whose templates take it (CUDA); None: float32, and no
    parameter;
    swiglu_epilogue: lower gate_up + silu_mul to gemm_swiglu where it applies (the target has that template:
    CUDA); two_pass_head: a quantized lm_head takes its int8 activations in two passes (qgemm's act_passes, CPU:
    the logits are what int8 activations move most, and it is one GEMM of the step)."""
    func = main_function(mod)
    lowering = _Lowering(func, weight_names, weight_dtype, block_size, kv_dtype)
    lowering.lower(func)
    if two_pass_head:
        logits = lowering.env[lowering.output]
        for launch in lowering.launches:
            if launch.op == "qgemm" and getattr(logits, "value", None) in launch.defs:
                launch.params["act_passes"] = 2
    if swiglu_epilogue:
        lowering.launches = fuse_gemm_swiglu(lowering.launches, lowering.weight_list)
    program = lowering.finish(rewrite_counts(mod))
    if act_dtype is None:
        return program
    for launch in program.launches:
        launch.params["adtype"] = DTYPES[act_dtype].short
    return dataclasses.replace(program, act_dtype=act_dtype)
