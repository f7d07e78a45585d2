"""quantize_linear: the GEMMs whose weights have a scheme become llmc.quantized_matmul, and only those."""

import pytest
from tvm import relax

from llmc.compiler.compile import quant_schemes
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.trace import trace
from llmc.compiler.passes.common import bindings, calls, llmc_args, llmc_op_name, prim_value
from llmc.compiler.passes.pipeline import PASSES, run_passes
from llmc.compiler.passes.quantize_embedding import quantize_embedding
from llmc.compiler.passes.quantize_linear import quantize_linear
from llmc.compiler.quant import QuantConfig, QuantScheme
from tests.checkpoints import ARCHS
from tests.compiler.passes.pass_helpers import apply, count_ops, imported, plain_module

_fused_modules = {}


def _fused(checkpoint_dir, arch):
    """(module as the pipeline leaves it, config, weight names), once per arch."""
    if arch not in _fused_modules:
        mod, config = imported(checkpoint_dir, arch)
        _fused_modules[arch] = run_passes(mod), config, trace(config).weight_names
    return _fused_modules[arch]


def _quantized_calls(mod):
    return [b.value for b in bindings(mod["main"]) if llmc_op_name(b.value) == "quantized_matmul"]


def _expected_count(config, lm_head: bool) -> int:
    """GEMMs per layer with K a multiple of 32: qkv and gate/up read hidden, o_proj heads x head_dim, down inter."""
    per_layer = 2 * (config.hidden_size % 32 == 0) + (config.q_size % 32 == 0) + (config.intermediate_size % 32 == 0)
    return config.num_layers * per_layer + (lm_head and config.hidden_size % 32 == 0)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("quant", [QuantConfig("int8"), QuantConfig("int4", group_size=64, lm_head=True)])
def test_rewrites_exactly_the_linears_with_a_scheme(arch, quant, checkpoint_dir):
    mod, config, names = _fused(checkpoint_dir, arch)
    schemes = quant_schemes(load_checkpoint(checkpoint_dir(arch)), quant)
    matmuls = count_ops(mod, "matmul")
    out, count = apply(quantize_linear(schemes, names), mod)
    expected = _expected_count(config, quant.lm_head)
    assert count == expected == len(_quantized_calls(out))
    assert count_ops(out, "matmul") == matmuls - expected  # the rest (and attention's) stay float
    for call in _quantized_calls(out):
        args = llmc_args(call)
        k = int(args["weight"].ty.shape.values[1])
        want = quant.scheme(k)
        assert (prim_value(args["bits"]), prim_value(args["group_size"]), prim_value(args["asymmetric"])) == (
            want.bits,
            want.group_size,
            0,
        )


def test_fused_weights_stay_fused(checkpoint_dir):
    mod, config, names = _fused(checkpoint_dir, "llama")
    schemes = quant_schemes(load_checkpoint(checkpoint_dir("llama")), QuantConfig("int4"))
    out, _ = apply(quantize_linear(schemes, names), mod)
    var2val = relax.analysis.get_var2val(out["main"])
    widths = sorted(
        len(var2val[llmc_args(c)["weight"]].args[0].fields)
        for c in _quantized_calls(out)
        if llmc_args(c)["weight"] in var2val
    )
    assert widths == [2] * config.num_layers + [3] * config.num_layers  # gate/up and q/k/v, one GEMM each


def test_different_schemes_of_one_fused_weight_become_one_that_holds_both(checkpoint_dir):
    """GGUF Q4_K_M: q and k as Q4_K (int4 g32 asym), v as Q6_K (int8 g16) -> int8 g16 asym for the qkv GEMM."""
    mod, config, names = _fused(checkpoint_dir, "llama")
    p = "model.layers.0.self_attn."
    schemes = {
        p + "q_proj.weight": QuantScheme(4, 32, asymmetric=True),
        p + "k_proj.weight": QuantScheme(4, 32, asymmetric=True),
        p + "v_proj.weight": QuantScheme(8, 16),
        p + "o_proj.weight": QuantScheme(4, 32, asymmetric=True),
    }
    out, count = apply(quantize_linear(schemes, names), mod)
    assert count == 2
    got = sorted(
        tuple(int(prim_value(llmc_args(c)[n])) for n in ("bits", "group_size", "asymmetric"))
        for c in _quantized_calls(out)
    )
    assert got == [(4, 32, 1), (8, 16, 1)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_split_mixed_gives_each_scheme_its_own_gemm(arch, checkpoint_dir):
    """split_mixed (the CPU): the Q4_K_M layer's q and k stay one GEMM at their scheme, v is one at its own, and
    the results (with their bias slices, Qwen2) join along the columns in q, k, v order."""
    mod, config, names = _fused(checkpoint_dir, arch)
    p = "model.layers.0.self_attn."
    q4k, q6k = QuantScheme(4, 32, asymmetric=True), QuantScheme(8, 16)
    schemes = {p + f"{n}_proj.weight": q4k for n in "qko"} | {p + "v_proj.weight": q6k}
    out, count = apply(quantize_linear(schemes, names, split_mixed=True), mod)
    assert count == 2
    var2val = relax.analysis.get_var2val(out["main"])
    by_weight = {}
    for c in _quantized_calls(out):
        w = llmc_args(c)["weight"]
        fields = var2val[w].args[0].fields if w in var2val else [w]
        by_weight[tuple(f.name for f in fields)] = tuple(
            int(prim_value(llmc_args(c)[n])) for n in ("bits", "group_size", "asymmetric")
        )
    assert sorted(by_weight.values()) == [(4, 32, 1), (4, 32, 1), (8, 16, 0)]
    assert len([f for f in by_weight if len(f) == 2]) == 1  # q and k, one GEMM
    joins = [b.value for b in bindings(out["main"]) if calls(b.value, "relax.concat") and int(b.value.attrs.axis) > 0]
    assert len(joins) == 1
    widths = [int(f.ty.shape.values[-1]) for f in joins[0].args[0].fields]
    assert widths == [config.q_size + config.kv_size, config.kv_size]
    if arch == "qwen2":  # each part's bias add reads its own slice
        parts = [var2val[f] for f in joins[0].args[0].fields]
        assert all(calls(v, "relax.add") for v in parts)
    # the reference: the module computes what the unsplit one does (checked end to end in test_lower)


def test_a_fused_weight_with_a_float_source_stays_float(checkpoint_dir):
    mod, _, names = _fused(checkpoint_dir, "llama")
    p = "model.layers.0.self_attn."
    schemes = {p + "q_proj.weight": QuantScheme(8, 64), p + "k_proj.weight": QuantScheme(8, 64)}  # v: float
    _, count = apply(quantize_linear(schemes, names), mod)
    assert count == 0


def test_no_scheme_leaves_the_module_unchanged(checkpoint_dir):
    mod, _, names = _fused(checkpoint_dir, "qwen2")
    out, count = apply(quantize_linear({}, names), mod)
    assert count == 0 and out["main"].script() == mod["main"].script()
    plain = plain_module()
    out, count = apply(quantize_linear({"x": QuantScheme(8, 8)}, ["x", "p"]), plain)
    assert count == 0


def test_pipeline_runs_it_last_and_reports_it(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "llama")
    names = trace(config).weight_names
    seen = []
    schemes = quant_schemes(load_checkpoint(checkpoint_dir("llama")), QuantConfig("int8"))
    quantize = [quantize_linear(schemes, names), quantize_embedding(schemes, names)]
    run_passes(mod, after_each=lambda name, m: seen.append(name), quantize=quantize)
    assert seen == [p.__name__ for p in PASSES] + ["quantize_linear", "quantize_embedding"]
