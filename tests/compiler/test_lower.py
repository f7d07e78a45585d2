import pytest
from pass_helpers import imported, plain_module

from llmc.compiler.frontend.trace import trace
from llmc.compiler.lower import lower
from llmc.compiler.passes.pipeline import run_passes
from llmc.errors import CompileError


def test_kernel_program_of_a_fused_model(checkpoint_dir):
    mod, config = imported(checkpoint_dir, "mistral")  # tied embeddings, 9 heads / 3 KV heads
    program = lower(run_passes(mod), config, trace(config).weight_names, weight_dtype="bfloat16")
    print(program)
    ops = [launch.op for launch in program.launches]
    per_layer = ["rmsnorm", "gemm", "rope", "rope", "paged_attention", "gemm", "rmsnorm", "gemm", "silu_mul", "gemm"]
    assert ops == ["embedding"] + per_layer * config.num_layers + ["gather_rows", "gather_rows", "rmsnorm", "gemm"]
    assert program.launches[-1].args[3] == "logits"  # the lm_head writes the ABI output directly
    # liveness reuse: a handful of buffers whatever the depth
    assert len(program.buffers) <= 8
    # tied embeddings: one packed table serves the embedding and the lm_head; matrices bf16, norms fp32
    sources = [w.sources for w in program.weights]
    assert sources.count(("model.embed_tokens.weight",)) == 1
    assert {w.dtype for w in program.weights if len(w.shape) == 2} == {"bfloat16"}
    assert {w.dtype for w in program.weights if len(w.shape) == 1} == {"float32"}
    qkv = [w for w in program.weights if len(w.sources) == 3]
    assert len(qkv) == config.num_layers and qkv[0].shape == (config.q_size + 2 * config.kv_size, config.hidden_size)


def test_an_op_no_template_covers_is_a_compile_error(checkpoint_dir):
    _, config = imported(checkpoint_dir, "mistral")
    with pytest.raises(CompileError, match="no kernel template covers `relax.sigmoid`"):
        lower(plain_module(), config, ["x.weight", "p.weight"])
    with pytest.raises(CompileError, match="2 weight parameters but 0 weight names"):
        lower(plain_module(), config, [])


def test_ops_no_template_covers_fall_back_to_tvm(checkpoint_dir, monkeypatch):
    from llmc.compiler.passes import pipeline

    mod, config = imported(checkpoint_dir, "llama")
    monkeypatch.setattr(pipeline, "PASSES", [p for p in pipeline.PASSES if p.__name__ != "fuse_swiglu"])
    program = lower(pipeline.run_passes(mod), config, trace(config).weight_names)
    print(program)
    fallbacks = [launch for launch in program.launches if launch.op == "tvm_call"]
    # silu(gate) * up unfused: silu, then the multiply, per layer; both layers share the two TVM functions
    assert [launch.fused for launch in fallbacks] == [["relax.nn.silu"], ["relax.multiply"]] * 2
    assert sorted(program.tvm_funcs) == ["tvm_multiply_1", "tvm_nn_silu_0"]
    silu = fallbacks[0]
    assert silu.params["shapes"] == [[1, "T", config.intermediate_size]] * 2 and silu.args[-2:] == ["T", "B"]
    assert "TVM fallback tvm_nn_silu_0" in str(program)
