"""quantize_embedding: the token embedding's gather becomes llmc.quantized_take when its table has a scheme,
and a tied head's qgemm and the gather then read one packed table."""

import pytest

from llmc.compiler.compile import quant_schemes
from llmc.compiler.export import to_relax
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.trace import trace
from llmc.compiler.lower import lower
from llmc.compiler.passes.common import bindings, llmc_args, llmc_op_name, prim_value
from llmc.compiler.passes.pipeline import run_passes
from llmc.compiler.passes.quantize_embedding import quantize_embedding
from llmc.compiler.passes.quantize_linear import quantize_linear
from llmc.compiler.quant import QuantConfig, QuantScheme
from tests.compiler.passes.pass_helpers import apply, count_ops, plain_module


def _fused(checkpoint_dir, tied: bool):
    ckpt = load_checkpoint(checkpoint_dir("llama", tie_word_embeddings=tied))
    traced = trace(ckpt.config)
    return ckpt, run_passes(to_relax(traced)), traced.weight_names


@pytest.mark.parametrize("tied", [False, True])
def test_rewrites_the_gather_of_a_table_with_a_scheme(checkpoint_dir, tied):
    _, mod, names = _fused(checkpoint_dir, tied)
    scheme = QuantScheme(4, 32, asymmetric=True, scale_dtype="float32")  # a GGUF Q4_K token_embd
    out, count = apply(quantize_embedding({"model.embed_tokens.weight": scheme}, names), mod)
    assert count == 1 and count_ops(out, "take") == count_ops(mod, "take") - 1
    (call,) = [b.value for b in bindings(out["main"]) if llmc_op_name(b.value) == "quantized_take"]
    args = llmc_args(call)
    assert [prim_value(args[a]) for a in ("bits", "group_size", "asymmetric", "scale_bits")] == [4, 32, 1, 32]


def test_leaves_a_float_table_and_other_modules_alone(checkpoint_dir):
    _, mod, names = _fused(checkpoint_dir, tied=False)
    schemes = {n: QuantScheme(8, 32) for n in names if n != "model.embed_tokens.weight"}
    assert apply(quantize_embedding(schemes, names), mod)[1] == 0
    assert apply(quantize_embedding({"x": QuantScheme(8, 32)}, ["x", "p"]), plain_module())[1] == 0


def test_a_tied_table_is_packed_once_for_the_gather_and_the_head(checkpoint_dir):
    """--quant-lm-head on tied embeddings: the qgemm of the head and the qembedding read the same packed parts,
    and no float copy of the table is stored."""
    ckpt, mod, names = _fused(checkpoint_dir, tied=True)
    schemes = quant_schemes(ckpt, QuantConfig("int8", lm_head=True))
    assert "model.embed_tokens.weight" in schemes
    program = lower(
        run_passes(mod, quantize=[quantize_linear(schemes, names), quantize_embedding(schemes, names)]),
        names,
        block_size=16,
    )
    table = [i for i, w in enumerate(program.weights) if w.sources == ("model.embed_tokens.weight",)]
    assert sorted((program.weights[i].part, program.weights[i].dtype) for i in table) == [
        ("qweight", "uint8"),
        ("scales", "float16"),
    ]
    first, last = program.launches[0], program.launches[-1]
    assert first.op == "qembedding" and last.op == "qgemm"
    assert [a for a in first.args if a.startswith("W[")] == [a for a in last.args if str(a).startswith("W[")]
