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
from tests.cpu_activations import int8_per_32


def test_cuda_target_refuses_experts(checkpoint_dir, tmp_path):
    with pytest.raises(UnsupportedModelError, match="cpu target only"):
        compile_checkpoint(checkpoint_dir("mixtral"), target="sm90", output=tmp_path / "m")


def _experts_as_cpu_kernels(x, router, gate_up, down, top_k, norm_topk):
    """moe_reference with each expert GEMM's input rounded as the CPU qgemm rounds it (int8 per 32)."""
    experts, hidden = router.shape
    inter = down.shape[1]
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top)
    out = torch.zeros_like(x)
    for e in range(experts):
        gate, up = torch.nn.functional.linear(int8_per_32(x), gate_up[2 * inter * e : 2 * inter * (e + 1)]).chunk(2, -1)
        act = torch.nn.functional.silu(gate) * up
        out = out + weights[:, e : e + 1] * torch.nn.functional.linear(
            int8_per_32(act), down[hidden * e : hidden * (e + 1)]
        )
    return out


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
    monkeypatch.setattr(family, "moe", _experts_as_cpu_kernels)
    ids = [int(i) for i in np.random.default_rng(5).integers(2, 384, 29)]
    with torch.no_grad():
        want = model(torch.tensor(ids), torch.arange(len(ids))).numpy()
    with CompiledModel.load(artifact, max_num_seqs=1, max_num_logits=len(ids)) as m:
        table = list(range(m.num_blocks))[: -(-len(ids) // m.block_size)]
        got = m.step(StepBatch.build([ids], [0], [table], m.block_size, num_logits=[len(ids)]))
    rel = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 1e-2 and np.mean(rel <= 1e-3) >= 0.75, f"relative logit errors per row {np.round(rel, 4)}"
