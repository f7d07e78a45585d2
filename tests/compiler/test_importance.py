"""compiler/importance.py: each linear's mean squared input per channel, measured through the family's module one
layer at a time, against transformers' model with hooks on its Linears."""

import numpy as np
import pytest
import torch

from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.importance import input_importance
from tests.checkpoints import ARCHS, MOE_ARCHS, hf_model

# transformers' fused Phi-3 Linears, and the checkpoint names llmc reads them as (their row ranges)
UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@pytest.mark.parametrize("arch", ARCHS)
def test_matches_transformers_inputs(arch, checkpoint_dir):
    path = checkpoint_dir(arch)
    ckpt = load_checkpoint(path)
    ids = [int(i) for i in np.random.default_rng(0).integers(2, ckpt.config.vocab_size, 29)]
    model = hf_model(path)
    want: dict[str, torch.Tensor] = {}

    def hook(targets):
        def record(module, args):
            for name in targets:
                want[name] = args[0][0].double().square().mean(0)

        return record

    head = "model.embed_tokens.weight" if ckpt.config.tie_word_embeddings else "lm_head.weight"
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            parent, _, proj = name.rpartition(".")
            parts = [f"{parent}.{p}.weight" for p in UNFUSED.get(proj, (proj,))]
            module.register_forward_pre_hook(hook([head] if name == "lm_head" else parts))
    with torch.no_grad():
        model(torch.tensor([ids]))
    names = [n for n in want if n != "model.layers.0.mlp.up_proj.weight"]  # only the names asked for come back
    got = input_importance(ckpt, ids, names)
    assert sorted(got) == sorted(names)
    for name in names:
        np.testing.assert_allclose(got[name], want[name].numpy(), rtol=2e-4, atol=1e-7, err_msg=name)


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_experts_measure_their_routed_tokens(arch, checkpoint_dir):
    """An expert's gate / up importance is the mean square of the rows routed to it, its down's of their SwiGLU:
    against transformers' experts module, fed its own routing."""
    path = checkpoint_dir(arch)
    ckpt = load_checkpoint(path)
    c = ckpt.config
    ids = [int(i) for i in np.random.default_rng(1).integers(2, c.vocab_size, 31)]
    model = hf_model(path)
    want: dict[str, torch.Tensor] = {}

    def record(layer):
        def hook(module, args):
            x, chosen = args[0].double(), args[1]
            _, prefix, linears = c.moe_names(layer)
            for e in range(c.num_experts):
                rows = x[(chosen == e).any(dim=-1)]
                if not len(rows):
                    continue
                gate, up = (rows @ w.double().T for w in module.gate_up_proj[e].chunk(2, dim=0))
                act = torch.nn.functional.silu(gate) * up
                for linear, inputs in zip(linears, (rows, rows, act), strict=True):
                    want[f"{prefix}{e}.{linear}.weight"] = inputs.square().mean(0)

        return hook

    for layer in c.moe_layers:
        block = model.model.layers[layer]
        (getattr(block, "block_sparse_moe", None) or block.mlp).experts.register_forward_pre_hook(record(layer))
    with torch.no_grad():
        model(torch.tensor([ids]))
    got = input_importance(ckpt, ids, list(want))
    assert sorted(got) == sorted(want) and len(want) >= 3 * c.num_experts
    for name in want:
        np.testing.assert_allclose(got[name], want[name].numpy(), rtol=2e-4, atol=1e-7, err_msg=name)
