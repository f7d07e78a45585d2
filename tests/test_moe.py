"""Mixture-of-experts builds beyond fp32 parity (test_cpu_parity.py runs the three families against transformers):
quantized experts compute what their packed weights say, and a CUDA target refuses them plainly."""

import numpy as np
import pytest
import torch

from llmc.compiler.compile import compile_checkpoint
from llmc.compiler.export import build_eager_model
from llmc.compiler.frontend import model as family
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.quant import QuantConfig, dequantize, quantize
from llmc.errors import UnsupportedModelError
from llmc.runtime.batch import StepBatch
from llmc.runtime.module import CompiledModel
from tests.cpu_activations import moe_as_cpu_qgemm


def test_cuda_target_refuses_experts(checkpoint_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match="cpu target only"):
        compile_checkpoint(checkpoint_dir("mixtral"), target="sm90", output=tmp_path / "m")


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
    monkeypatch.setattr(family, "moe", moe_as_cpu_qgemm)
    ids = [int(i) for i in np.random.default_rng(5).integers(2, 384, 29)]
    with torch.no_grad():
        want = model(torch.tensor(ids), torch.arange(len(ids))).numpy()
    with CompiledModel.load(artifact, max_num_seqs=1, max_num_logits=len(ids)) as m:
        table = list(range(m.num_blocks))[: -(-len(ids) // m.block_size)]
        got = m.step(StepBatch.build([ids], [0], [table], m.block_size, num_logits=[len(ids)]))
    rel = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 1e-2 and np.mean(rel <= 1e-3) >= 0.75, f"relative logit errors per row {np.round(rel, 4)}"
