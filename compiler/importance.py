"""Activation importance for llmc's quantizer: each linear's mean squared input per input channel over
calibration tokens, what llama.cpp's imatrix measures. The quantizer weighs each weight's rounding error by its
input channel's importance (quant.quantize), so the channels that carry large activations keep their precision.

The model runs in float32 through the family's own module (frontend/model.py), one decoder layer's weights in
memory at a time: the module is built on the meta device, each layer is loaded from the checkpoint just
before it runs and dropped after, and the embedding holds only the rows of the tokens. A compile stays
streaming; each layer's weights are read twice (here, then to pack them).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import numpy as np
import torch
from torch import nn

from .frontend.model import LlamaFamily, SparseMoE


class _HeadInputMeasured(Exception):
    """Stops the forward once the final norm's output is measured: the logits are not needed."""


def input_importance(ckpt, token_ids: Sequence[int], names: Collection[str]) -> dict[str, np.ndarray]:
    """Checkpoint weight name -> float32 [K]: the mean over `token_ids` (one sequence) of the square of the input
    of each linear named in `names`, per input channel (an expert's: over the tokens routed to it; one that no
    token chose has no entry). The lm_head's name (a tied embedding's, for the head) gets the final norm's
    output."""
    c = ckpt.config
    with torch.device("meta"):
        model = LlamaFamily(c).eval()
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
    rows, local = torch.unique(ids, return_inverse=True)
    embed = ckpt.tensor("model.embed_tokens.weight")
    model.model.embed_tokens = nn.Embedding.from_pretrained(embed[rows].float())
    del embed
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def add(name: str, x: torch.Tensor) -> None:
        sums[name] = sums.get(name, 0) + x.double().square().sum(0)
        counts[name] = counts.get(name, 0) + len(x)

    def measure(name: str):
        def hook(module, args):
            add(name, args[0].detach().reshape(-1, args[0].shape[-1]))

        return hook

    def measure_experts(prefix: str):
        """Each expert's inputs over the tokens routed to it (its gate and up: those rows of x; its down: their
        SwiGLU), as llama.cpp's imatrix counts an expert's tokens only."""

        def hook(module, args):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            probs = torch.softmax(x @ module.gate.weight.float().T, dim=-1)
            chosen = torch.topk(probs, c.experts_per_token, dim=-1).indices
            for e, expert in enumerate(module.experts):
                rows = x[(chosen == e).any(dim=-1)]
                gate, up, down = (f"{prefix}{e}.{n}.weight" for n in expert.names)
                if not len(rows) or not {gate, up, down} & set(names):
                    continue
                wg, wu, _ = (w.float() for w in expert.weights())
                act = torch.nn.functional.silu(rows @ wg.T) * (rows @ wu.T)
                for name, inputs in ((gate, rows), (up, rows), (down, act)):
                    if name in names:
                        add(name, inputs)

        return hook

    def load(prefix: str):
        def hook(module, args):
            module.to_empty(device="cpu")
            with torch.no_grad():
                for n, p in module.named_parameters():
                    p.copy_(ckpt.tensor(prefix + n).float())

        return hook

    def drop(module, args, out):
        module.to("meta")

    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}."
        layer.register_forward_pre_hook(load(prefix))
        layer.register_forward_hook(drop)
        for n, m in layer.named_modules():
            if isinstance(m, nn.Linear) and f"{prefix}{n}.weight" in names:
                m.register_forward_pre_hook(measure(f"{prefix}{n}.weight"))
            elif isinstance(m, SparseMoE):
                m.register_forward_pre_hook(measure_experts(f"{prefix}{n}.experts."))
    head = "lm_head.weight" if not c.tie_word_embeddings else "model.embed_tokens.weight"

    def head_input(module, args, out):
        if head in names:
            measure(head)(module, (out,))
        raise _HeadInputMeasured

    model.model.norm.register_forward_pre_hook(load("model.norm."))
    model.model.norm.register_forward_hook(head_input)
    with torch.no_grad():
        try:
            model(local, torch.arange(len(ids)))
        except _HeadInputMeasured:
            pass
    return {name: (s / counts[name]).float().numpy() for name, s in sums.items()}
