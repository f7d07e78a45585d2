import subprocess
import sys

import numpy as np
import pytest

from llmc.compiler.export import to_relax
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.model import attention_scale, rope_inv_freq
from llmc.compiler.frontend.trace import trace
from llmc.compiler.lower import lower
from llmc.compiler.passes.pipeline import run_passes
from llmc.compiler.program import ModelGeometry
from llmc.errors import CompileError
from tests.compiler.passes.pass_helpers import imported, plain_module


def test_qwen3_launches_what_llama_launches(checkpoint_dir):
    """Its q / k head norms ride in the two rope launches (their weights as the launches' last argument)."""
    programs = {}
    for arch in ("llama", "qwen3"):
        mod, config = imported(checkpoint_dir, arch)
        programs[arch] = lower(run_passes(mod), trace(config).weight_names, weight_dtype="float32", block_size=16)
    assert [launch.op for launch in programs["qwen3"].launches] == [launch.op for launch in programs["llama"].launches]
    ropes = [launch for launch in programs["qwen3"].launches if launch.op == "rope"]
    assert all("norm_eps" in r.params and r.args[-1].startswith("W[") for r in ropes)
    assert [r.fused for r in ropes[:2]] == [["rms_norm(q_norm)", "rope"], ["rms_norm(k_norm)", "rope"]]
    assert all(
        "norm_eps" not in r.params and r.args[-1] == "nullptr" for r in programs["llama"].launches if r.op == "rope"
    )


def _program(checkpoint_dir, arch, **kw):
    mod, config = imported(checkpoint_dir, arch)
    return lower(run_passes(mod), trace(config).weight_names, block_size=16, **kw), config


def _layer_ops(program, num_layers: int) -> list[str]:
    """The launches of every layer, which must repeat, after the embedding and the first norm; the last layer's
    add and final norm run after the head's row gathers (of the residual stream and of the last branch)."""
    ops = [launch.op for launch in program.launches]
    assert ops[:2] == ["embedding", "rmsnorm"] and ops[-4:] == ["gather_rows", "gather_rows", "rmsnorm", "gemm"]
    layers = [*ops[2:-4], "rmsnorm"]
    per_layer = len(layers) // num_layers
    assert layers == layers[:per_layer] * num_layers
    return layers[:per_layer]


@pytest.mark.parametrize("weight_dtype,swiglu", [("float32", False), ("bfloat16", True)])
def test_gemma_and_granite_launch_what_llama_launches(checkpoint_dir, weight_dtype, swiglu):
    """Gemma's four norms a layer fold into Llama's two launches, its GeGLU into silu_mul (or the SwiGLU GEMM's
    epilogue on CUDA), its q / k norms into rope, Gemma 2's final soft-capping into the lm_head GEMM; Granite's
    multipliers into the embedding, the adds and the final norm's weight. Not one TVM fallback."""
    kw = dict(weight_dtype=weight_dtype, swiglu_epilogue=swiglu)
    llama, llama_config = _program(checkpoint_dir, "llama", **kw)
    for arch in ("gemma2", "gemma3", "granite"):
        program, config = _program(checkpoint_dir, arch, **kw)
        assert not program.tvm_funcs
        assert _layer_ops(program, config.num_layers) == _layer_ops(llama, llama_config.num_layers)
        head = program.launches[-1]
        assert head.params.get("softcap") == (config.final_softcap if arch == "gemma2" else None)


def test_gemma3_norm_weights_pack_as_one_plus_w(checkpoint_dir):
    program, config = _program(checkpoint_dir, "gemma3", weight_dtype="float32")
    norms = [w for w in program.weights if "norm" in w.name]
    assert len(norms) == 6 * config.num_layers + 1  # four a layer, q and k, and the final norm
    assert all(w.affine == (1.0, 1.0) and w.dtype == "float32" for w in norms)
    embedding = program.launches[0]
    assert embedding.op == "embedding" and embedding.params["scale"] == 8.0  # sqrt(64)
    gated = [launch for launch in program.launches if launch.op == "silu_mul"]
    assert len(gated) == config.num_layers and all(g.params["activation"] == "gelu_tanh" for g in gated)
    branch_normed = [launch for launch in program.launches if launch.params.get("residual_norm")]
    assert len(branch_normed) == 2 * config.num_layers and all(n.args[-1].startswith("W[") for n in branch_normed)


def test_granite_logits_scaling_folds_into_the_final_norm(checkpoint_dir):
    program, config = _program(checkpoint_dir, "granite", weight_dtype="float32")
    final = program.weights[int(program.launches[-2].args[3].removeprefix("W[").removesuffix("]"))]
    assert final.name == "model.norm.weight" and final.affine == (float(np.float32(1 / 3.5)), 0.0)
    assert program.launches[0].params["scale"] == 6.0
    assert [launch.params.get("residual_scale") for launch in program.launches if launch.op == "rmsnorm"][1:] == [
        float(np.float32(0.3))
    ] * (2 * config.num_layers)


def test_smollm3_nope_layers_launch_no_rope(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "smollm3")
    program = lower(run_passes(mod), trace(config).weight_names, weight_dtype="float32", block_size=16)
    ops = [launch.op for launch in program.launches]
    assert config.nope_layers == (1,) and ops.count("paged_attention") == 2 and ops.count("rope") == 2  # layer 0's


def test_kernel_program_of_a_fused_model(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "mistral")  # tied embeddings, 9 heads / 3 KV heads
    program = lower(run_passes(mod), trace(config).weight_names, weight_dtype="bfloat16", block_size=16)
    print(program)
    ops = [launch.op for launch in program.launches]
    per_layer = ["rmsnorm", "gemm", "rope", "rope", "paged_attention", "gemm", "rmsnorm", "gemm", "silu_mul", "gemm"]
    assert ops == ["embedding"] + per_layer * config.num_layers + ["gather_rows", "gather_rows", "rmsnorm", "gemm"]
    assert program.launches[-1].args[3] == "logits"  # the lm_head writes the ABI output directly
    # the rows behind the gather are the N logits rows asked for, sized apart from the T token rows
    gathers = [launch for launch in program.launches if launch.op == "gather_rows"]
    assert [launch.args[1:3] for launch in gathers] == [["logits_indices", "N"]] * 2
    assert program.launches[-1].args[-1] == "N" and {b.rows for b in program.buffers} == {"T", "N"}
    # the row kind is the only place N shows in the printed program; B stays attention's sequence count
    for line in str(program).splitlines():
        if " N" in line or "[N" in line:
            assert "float32[N," in line or line.lstrip().startswith(("gather_rows(", "rmsnorm(", "gemm(")), line
        if ", B," in line:
            assert line.lstrip().startswith("paged_attention("), line
    # liveness reuse: a handful of buffers whatever the depth
    assert len(program.buffers) <= 8
    # tied embeddings: one packed table serves the embedding and the lm_head; matrices bf16, norms fp32
    sources = [w.sources for w in program.weights]
    assert sources.count(("model.embed_tokens.weight",)) == 1
    assert {w.dtype for w in program.weights if len(w.shape) == 2} == {"bfloat16"}
    assert {w.dtype for w in program.weights if len(w.shape) == 1} == {"float32"}
    qkv = [w for w in program.weights if len(w.sources) == 3]
    assert len(qkv) == config.num_layers and qkv[0].shape == (config.q_size + 2 * config.kv_size, config.hidden_size)


@pytest.mark.parametrize(
    "arch, overrides",
    [
        ("qwen2", {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1}),
        ("qwen2", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}}),
        ("llama", {}),
    ],
    ids=["sliding_window", "yarn", "llama3"],
)
def test_kernels_take_rope_scale_window_and_geometry_from_the_ir(arch, overrides, checkpoint_dir):
    """What lowering reads off the fused ops equals what the frontend derives from the config."""
    config = load_checkpoint(checkpoint_dir(arch, **overrides)).config
    traced = trace(config)
    program = lower(run_passes(to_relax(traced)), traced.weight_names, block_size=16)
    attention = [launch.params for launch in program.launches if launch.op == "paged_attention"]
    assert [p["sliding_window"] for p in attention] == [config.attention_window(i) for i in range(config.num_layers)]
    assert [p["scale"] for p in attention] == [attention_scale(config)] * config.num_layers
    assert {(p["num_heads"], p["num_kv_heads"], p["head_dim"]) for p in attention} == {
        (config.num_heads, config.num_kv_heads, config.head_dim)
    }
    rope = [launch.params for launch in program.launches if launch.op == "rope"]
    assert len(rope) == 2 * config.num_layers
    assert all(p["inv_freq"] == rope_inv_freq(config).tolist() for p in rope)
    assert program.geometry == ModelGeometry(config.num_layers, config.num_kv_heads, config.head_dim, config.vocab_size)


def test_an_op_no_template_covers_is_a_compile_error(checkpoint_dir):
    _, config = imported(checkpoint_dir, "mistral")
    with pytest.raises(CompileError, match="no kernel template covers `relax.sigmoid`"):
        lower(plain_module(), ["x.weight", "p.weight"], block_size=16)
    with pytest.raises(CompileError, match="2 weight parameters but 0 weight names"):
        lower(plain_module(), [], block_size=16)


def test_ops_no_template_covers_fall_back_to_tvm(checkpoint_dir, monkeypatch):
    from llmc.compiler.passes import pipeline

    mod, config = imported(checkpoint_dir, "llama")
    monkeypatch.setattr(pipeline, "PASSES", [p for p in pipeline.PASSES if p.__name__ != "fuse_swiglu"])
    program = lower(pipeline.run_passes(mod), trace(config).weight_names, block_size=16)
    print(program)
    fallbacks = [launch for launch in program.launches if launch.op == "tvm_call"]
    # silu(gate) * up unfused: silu, then the multiply, per layer; both layers share the two TVM functions
    assert [launch.fused for launch in fallbacks] == [["relax.nn.silu"], ["relax.multiply"]] * 2
    assert sorted(program.tvm_funcs) == ["tvm_multiply_1", "tvm_nn_silu_0"]
    silu = fallbacks[0]
    assert silu.params["shapes"] == [[1, "T", config.intermediate_size]] * 2 and silu.args[-2:] == ["T", "N"]
    assert "TVM fallback tvm_nn_silu_0" in str(program)


@pytest.mark.parametrize(
    "arch,dtype,fused", [("llama", "bfloat16", True), ("llama", "float32", False), ("mistral", "bfloat16", False)]
)
def test_swiglu_epilogue(checkpoint_dir, arch, dtype, fused):
    """CUDA's lowering: a bf16 gate_up GEMM and its silu_mul become one gemm_swiglu, whose weight the packer
    interleaves, and the [T, 2 * inter] product needs no buffer. fp32 weights, or an intermediate size of no
    whole groups of 8 (mistral's 100), keep the two launches."""
    mod, config = imported(checkpoint_dir, arch)
    fused_mod = run_passes(mod)
    plain = lower(fused_mod, trace(config).weight_names, weight_dtype=dtype, block_size=16)
    program = lower(fused_mod, trace(config).weight_names, weight_dtype=dtype, block_size=16, swiglu_epilogue=True)
    print(program)
    ops = [launch.op for launch in program.launches]
    inter = config.intermediate_size
    if not fused:
        assert str(program) == str(plain)
        return
    swiglu = [launch for launch in program.launches if launch.op == "gemm_swiglu"]
    assert "silu_mul" not in ops and len(swiglu) == config.num_layers
    assert all(launch.params == {"inter": inter, "k": config.hidden_size, "wdtype": "bf16"} for launch in swiglu)
    gate_up = [w for w in program.weights if w.name.endswith("gate+up_proj.weight")]
    assert len(gate_up) == config.num_layers and all(w.interleave == 8 for w in gate_up)
    assert "(rows interleaved 8 at a time)" in str(program)
    # it writes what silu_mul wrote, and the down projection reads it; no buffer holds 2 * inter columns
    for launch in swiglu:
        down = program.launches[program.launches.index(launch) + 1]
        assert down.op == "gemm" and down.args[0] == launch.args[3]
    assert max(b.cols for b in program.buffers) < max(b.cols for b in plain.buffers) == 2 * inter


def test_activation_dtype_is_every_launchs_adtype(checkpoint_dir):
    """CUDA's lowering (act_dtype): every launch takes the activation element as `adtype`, and the buffers hold
    it; the CPU's (None) keeps float32 activations and gives its templates no such parameter."""
    mod, config = imported(checkpoint_dir, "llama")
    fused_mod, names = run_passes(mod), trace(config).weight_names
    cpu = lower(fused_mod, names, weight_dtype="bfloat16", block_size=16)
    cuda = lower(fused_mod, names, weight_dtype="bfloat16", block_size=16, act_dtype="bfloat16")
    assert cpu.act_dtype == "float32" and not any("adtype" in launch.params for launch in cpu.launches)
    assert cuda.act_dtype == "bfloat16" and all(launch.params["adtype"] == "bf16" for launch in cuda.launches)
    assert [(launch.op, launch.args) for launch in cuda.launches] == [
        (launch.op, launch.args) for launch in cpu.launches
    ]
    assert "bfloat16 activations" in str(cuda) and "  buf0: bfloat16[T, " in str(cuda)


def test_lowering_imports_no_torch():
    """Lowering reads the IR only. tvm_ffi imports torch whenever it can, so torch is blocked, not just looked for."""
    code = (
        "import importlib.abc, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ImportError(name + ' is blocked')\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import llmc.compiler.lower\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


def test_quantized_matmul_lowers_to_qgemm_over_packed_parts(checkpoint_dir):
    """qwen2 (qkv bias): q/k/v int4 g32 asym with fp32 scales (as GGUF Q4_K), o_proj int8 per channel with fp16
    scales; the bias joins the qgemm as float32."""
    from llmc.compiler.passes.quantize_linear import quantize_linear
    from llmc.compiler.quant import QuantScheme

    mod, config = imported(checkpoint_dir, "qwen2")
    names = trace(config).weight_names
    p = "model.layers.1.self_attn."
    asym = QuantScheme(4, 32, asymmetric=True, scale_dtype="float32")
    schemes = {
        p + "q_proj.weight": asym,
        p + "k_proj.weight": asym,
        p + "v_proj.weight": asym,
        p + "o_proj.weight": QuantScheme(8, config.q_size),
    }
    program = lower(
        run_passes(mod, quantize=[quantize_linear(schemes, names)]), names, weight_dtype="bfloat16", block_size=16
    )
    print(program)
    qgemms = [launch for launch in program.launches if launch.op == "qgemm"]

    def spec(arg):
        return program.weights[int(arg[2:-1])]

    assert [launch.fused for launch in qgemms] == [["q+k+v_proj + bias"], ["o_proj"]]
    qkv, o = qgemms
    rows = config.q_size + 2 * config.kv_size
    assert qkv.params == {
        "n": rows,
        "k": config.hidden_size,
        "bits": 4,
        "group_size": 32,
        "asymmetric": True,
        "scale_bits": 32,
        "has_bias": True,
    }
    assert o.params["bits"] == 8 and o.params["group_size"] == config.q_size and o.args[3] == o.args[4] == "nullptr"
    assert o.params["scale_bits"] == 16 and spec(o.args[2]).dtype == "float16"

    q, scales, mins, bias = (spec(a) for a in qkv.args[1:5])
    assert [(s.part, s.dtype) for s in (q, scales, mins)] == [
        ("qweight", "uint8"),
        ("scales", "float32"),
        ("mins", "float32"),
    ]
    assert q.stored_shape == (rows, config.hidden_size // 2) and scales.stored_shape == (rows, config.hidden_size // 32)
    assert q.sources == tuple(p + f"{n}_proj.weight" for n in "qkv") and q.quant == asym
    assert bias.quant is None and bias.dtype == "float32" and len(bias.sources) == 3
    # layer 0 stays float: its GEMMs are bf16 gemm launches
    assert sum(launch.op == "gemm" for launch in program.launches) == 4 * config.num_layers - 2 + 1


def test_a_split_fused_weight_writes_the_columns_of_one_buffer(checkpoint_dir):
    """qwen2, Q4_K_M's layer: q and k int4 asym, v int8 g16 (split_mixed): two qgemms, each with its bias slice,
    writing their columns of one buffer (ldy), which rope and attention read as the one fused q / k / v."""
    from llmc.compiler.passes.quantize_linear import quantize_linear
    from llmc.compiler.quant import QuantScheme

    mod, config = imported(checkpoint_dir, "qwen2")
    names = trace(config).weight_names
    p = "model.layers.1.self_attn."
    schemes = {p + f"{n}_proj.weight": QuantScheme(4, 32, asymmetric=True) for n in "qk"}
    schemes[p + "v_proj.weight"] = QuantScheme(8, 16)
    program = lower(
        run_passes(mod, quantize=[quantize_linear(schemes, names, split_mixed=True)]),
        names,
        weight_dtype="float32",
        block_size=16,
    )
    qk, v = (launch for launch in program.launches if launch.op == "qgemm")
    width = config.q_size + 2 * config.kv_size
    assert (qk.params["n"], qk.params["ldy"], qk.params["bits"]) == (config.q_size + config.kv_size, width, 4)
    assert (v.params["n"], v.params["ldy"], v.params["bits"]) == (config.kv_size, width, 8)
    assert qk.params["has_bias"] and v.params["has_bias"]
    out = qk.args[5]
    assert v.args[5] == f"{out} + {config.q_size + config.kv_size}"
    biases = [program.weights[int(launch.args[4][2:-1])].sources for launch in (qk, v)]
    assert biases == [(p + "q_proj.bias", p + "k_proj.bias"), (p + "v_proj.bias",)]
    after = program.launches[program.launches.index(v) + 1 :]
    rope, attention = after[0], after[2]
    assert rope.op == "rope" and rope.args[0] == out and rope.args[1] == str(width)
    assert attention.op == "paged_attention" and attention.args[0] == out and attention.args[3] == str(width)


@pytest.mark.parametrize("two_pass", [True, False])
def test_quantized_head_takes_two_pass_activations_on_the_cpu(checkpoint_dir, two_pass):
    """two_pass_head (the CPU's lowering): the lm_head's qgemm, and no other launch, carries act_passes 2."""
    from llmc.compiler.passes.quantize_linear import quantize_linear
    from llmc.compiler.quant import QuantScheme

    mod, config = imported(checkpoint_dir, "qwen2")
    names = trace(config).weight_names
    schemes = {n: QuantScheme(8, 32) for n in names if n == "lm_head.weight" or n.endswith("o_proj.weight")}
    mod = run_passes(mod, quantize=[quantize_linear(schemes, names)])
    program = lower(mod, names, weight_dtype="float32", block_size=16, two_pass_head=two_pass)
    passes = [(launch.fused, launch.params.get("act_passes")) for launch in program.launches if launch.op == "qgemm"]
    assert passes[-1] == (["lm_head"], 2 if two_pass else None)
    assert all(p is None for _, p in passes[:-1]) and len(passes) == config.num_layers + 1
