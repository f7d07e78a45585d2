"""Mixture-of-experts builds beyond fp32 parity (test_cpu_parity.py runs the three families against transformers):
quantized experts compute what their packed weights say, and a bf16 CUDA build refuses more experts than its
bf16 expert ids hold."""

import pytest
import torch

from llmc.compiler.compile import compile_checkpoint
from llmc.compiler.export import build_eager_model
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.quant import QuantConfig, dequantize, quantize
from llmc.errors import UnsupportedModelError
from llmc.runtime.module import CompiledModel
from tests.cpu_activations import assert_quantized_experts_match


def test_bf16_cuda_build_refuses_more_experts_than_bf16_ids_hold(checkpoint_dir, tmp_path):
    path = checkpoint_dir("olmoe", num_experts=257)
    with pytest.raises(UnsupportedModelError, match="257 experts"):
        compile_checkpoint(path, target="sm90", output=tmp_path / "m", weight_dtype="bfloat16")


@pytest.mark.parametrize("mode", ["int8", "int4", "q4_k_m"])
def test_quantized_experts_match_their_dequantized_weights(mode, checkpoint_dir, tmp_path, monkeypatch):
    """OLMoE's experts packed (hidden and intermediate 64, so every one quantizes): the build's logits against the
    family's module on the dequantized weights, its experts' inputs rounded as the kernels round them; attention,
    the embedding and the head stay float (--tensor-quant keeps them so)."""
    path = checkpoint_dir("olmoe", intermediate_size=64)
    quant = QuantConfig(mode, overrides=((r"self_attn|lm_head|embed_tokens", "float"),))
    artifact = compile_checkpoint(path, target="cpu", output=tmp_path / "m", quant=quant)
    ckpt = load_checkpoint(path)
    model = build_eager_model(ckpt)
    layers = ckpt.config.num_layers
    with torch.no_grad():
        for name, p in model.named_parameters():
            scheme = quant.tensor_scheme(name, p.shape[-1], layers) if ".experts." in name else None
            if scheme is not None:
                p.copy_(torch.from_numpy(dequantize(quantize(p.numpy(), scheme))))
    assert_quantized_experts_match(artifact, model, monkeypatch, 29)


def test_bench_reports_the_experts_each_step_activates(checkpoint_dir, tmp_path):
    """`llmc bench`'s levels count the (layer, expert) pairs the module's steps read: at concurrency 1, 2 a layer
    for a decode step, more for the prefill that starts each request; at concurrency 8, more a step, at most all 6;
    the bytes per step are that many experts' weights (Qwen3-MoE's: gate/up 80 x 64 and down 64 x 40, fp32)."""
    from llmc.runtime.bench import format_bench_table, run_bench
    from llmc.runtime.engine import LLMEngine

    artifact = compile_checkpoint(checkpoint_dir("qwen3_moe"), target="cpu", output=tmp_path / "m")
    with CompiledModel.load(artifact, max_num_seqs=8) as model:
        assert model.artifact.expert_bytes == (80 * 64 + 64 * 40) * 4
        result = run_bench(
            lambda: LLMEngine(model),
            concurrency=(1, 8),
            num_requests=8,
            prompt_len=8,
            output_len=24,
            memory_bandwidth=1e10,
            progress=False,
        )
    one, eight = result["levels"]
    assert 2 < one["experts_per_layer_step"] < 2.5 and 2 < eight["experts_per_layer_step"] <= 6
    assert one["experts_per_layer_step"] < eight["experts_per_layer_step"]
    for level in (one, eight):
        assert level["expert_bytes_per_step"] == pytest.approx(
            level["experts_per_layer_step"] * 2 * (80 * 64 + 64 * 40) * 4
        )
    assert "a layer per step" in format_bench_table(result)


def test_a_cuda_module_counts_the_experts_its_steps_read(checkpoint_dir, tmp_path):
    """sm90 under the simulator: the device-side count that `llmc bench` reads (llmc_experts_activated), 2 experts
    in each of Qwen3-MoE's 2 sparse layers for one token, and at most all 6 for a 7-token prefill; a module loaded
    again (the same library, its device arrays kept) counts from 0."""
    from llmc.runtime.batch import StepBatch
    from tests.cuda_mode import cuda_library

    artifact = compile_checkpoint(checkpoint_dir("qwen3_moe"), target="sm90", output=tmp_path / "m")
    with CompiledModel.load(artifact, library=cuda_library(artifact), max_num_seqs=1) as model:
        assert model.experts_activated() == 0
        model.step(StepBatch.build([[5]], [0], [[0]], model.block_size))
        assert model.experts_activated() == 2 * 2
        model.step(StepBatch.build([[7, 8, 9, 10, 11, 12, 13]], [0], [[1]], model.block_size))
        assert 2 * 2 + 2 * 2 < model.experts_activated() <= 2 * 2 + 2 * 6
    with CompiledModel.load(artifact, library=cuda_library(artifact), max_num_seqs=1) as again:  # the same library
        assert again.experts_activated() == 0
