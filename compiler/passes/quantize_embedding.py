"""quantize_embedding: the token embedding's gather reads the table quantized when it has a scheme.

`quantize_embedding(schemes, weight_names)` makes the pass, with quantize_linear's arguments. The gather
`take(W, input_ids, axis=0)` (of the ids or their int32 cast) of a weight parameter W with a scheme becomes

    llmc.quantized_take(W, input_ids, bits, group_size, asymmetric, scale_bits, codebook)

with W as it was (the float [vocab, hidden] table; lowering packs it quantized). A tied head's GEMM reads the
same parameter, so with quantize_linear both read one packed table: a tied model stores it once, at the
head's scheme, and a GGUF file's quantized `token_embd` stays at its own type.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import tvm
from tvm import relax

from ..quant import QuantScheme
from .common import bindings, calls, llmc_call, main_function, rewrite, scheme_attrs, weight_params


def quantize_embedding(
    schemes: Mapping[str, QuantScheme], weight_names: list[str]
) -> Callable[[tvm.IRModule], tvm.IRModule]:
    def quantize_embedding(mod: tvm.IRModule) -> tvm.IRModule:
        func = main_function(mod)
        names = dict(zip(weight_params(func), weight_names, strict=True))
        var2val = relax.analysis.get_var2val(func)
        input_ids = [p for p in func.params if p.name == "input_ids"]
        edits = {}
        for b in bindings(func):
            if not calls(b.value, "relax.take") or int(b.value.attrs.axis) != 0:
                continue
            table, ids = b.value.args
            cast = var2val.get(ids)
            source = cast.args[0] if calls(cast, "relax.astype") else ids  # the import casts the ids to int32
            scheme = schemes.get(names.get(table))
            if scheme is None or not any(source.same_as(p) for p in input_ids):
                continue
            edits[b.var] = llmc_call("quantized_take", [table, ids, *scheme_attrs(scheme)], b.var.ty)
        return rewrite(mod, edits, pass_name="quantize_embedding", count=len(edits))

    return quantize_embedding
