"""Quantized CUDA builds (`llmc compile --target sm90 --quant ...`), run under the CUDA simulator against
transformers on a checkpoint whose quantized weights ARE quant.dequantize(quantize(w)): the fp32 model of
exactly the weights the build packs (pack_cuda), so what remains is the kernels' arithmetic.

- One token per step (T = 1 everywhere: the qgemm GEMV, fp32 dequantization and accumulation): logits within
  the fp32 parity tolerance (tests/logits_rows.py's 1e-3 of the row's largest logit).
- A 37-token prefill (the tensor-core GEMM: x rounded to bf16, weights exact): within test_cuda_parity's bf16
  tolerance, and the same argmax wherever the reference's top-2 margin is clear of twice that bound.
"""

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.compile import CUDA_QGEMM_ACTIVATIONS
from llmc.compiler.quant import QuantConfig, dequantize, quantize
from llmc.manifest import read_manifest
from llmc.runtime.batch import StepBatch
from llmc.runtime.module import CompiledModel
from llmc.tools.build import compile_checkpoint
from tests.checkpoints import hf_model, make_checkpoint
from tests.cuda_mode import cuda_library

REL = 1e-3
BF16_REL = 3e-2
# qwen2's qkv bias joins the quantized GEMM; llama's down_proj (K = 136) stays float; llama's embedding is tied,
# so its head's qgemm and the qembedding gather read one packed table
# olmoe: its experts quantized too (moe_qgemm), intermediate 64 so that every expert's down projection packs
BUILDS = [
    ("llama", QuantConfig("int4", lm_head=True)),
    ("qwen2", QuantConfig("int8", group_size=32)),
    ("olmoe", QuantConfig("int4")),
]
OVERRIDES = {"olmoe": dict(intermediate_size=64)}


def _dequantized_checkpoint(root, arch, quant):
    ckpt = make_checkpoint(root / "ckpt", arch, seed=3, tie_word_embeddings=arch == "llama", **OVERRIDES.get(arch, {}))
    (weights,) = ckpt.glob("*.safetensors")
    state = load_file(weights)
    head = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    quantized = 0
    for name, t in state.items():
        linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
        if t.dim() == 2 and (linear or (quant.lm_head and name == head)):
            scheme = quant.scheme(t.shape[1])
            if scheme is not None:
                state[name] = torch.from_numpy(dequantize(quantize(t.numpy(), scheme)))
                quantized += 1
    assert quantized, "the build must quantize something"
    save_file(state, str(weights), metadata={"format": "pt"})
    return ckpt


@pytest.mark.slow
@pytest.mark.parametrize("arch,quant", BUILDS, ids=lambda v: v if isinstance(v, str) else v.describe())
def test_simulated_quantized_sm90_matches_the_dequantized_weights(arch, quant, tmp_path):
    ckpt = _dequantized_checkpoint(tmp_path, arch, quant)
    artifact = compile_checkpoint(ckpt, target="sm90", output=tmp_path / "model.sm90", quant=quant)
    manifest = read_manifest(artifact)
    assert manifest["quant"]["activations"] == CUDA_QGEMM_ACTIVATIONS["float32"] and manifest["quant"]["weights"]
    ids = [int(i) for i in np.random.default_rng(1).integers(2, 384, 37)]
    with CompiledModel.load(artifact, library=cuda_library(artifact), max_num_logits=64) as model:
        table = list(range(model.num_blocks))[::-1][: -(-len(ids) // model.block_size)]
        prefill = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
        one_by_one = np.concatenate(
            [model.step(StepBatch.build([[tok]], [pos], [table], model.block_size)) for pos, tok in enumerate(ids)]
        )
    with torch.no_grad():
        want = hf_model(ckpt)(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(want).max(axis=1)
    decode_rel = np.abs(one_by_one - want).max(axis=1) / scale
    assert decode_rel.max() <= REL, f"relative logit errors per row {np.round(decode_rel, 5)}"
    prefill_rel = np.abs(prefill - want).max(axis=1) / scale
    assert prefill_rel.max() <= BF16_REL, f"relative logit errors per row {np.round(prefill_rel, 4)}"
    top2 = np.sort(want, axis=1)[:, -2:]
    clear = top2[:, 1] - top2[:, 0] > 2 * BF16_REL * scale
    assert np.array_equal(prefill.argmax(axis=1)[clear], want.argmax(axis=1)[clear])
