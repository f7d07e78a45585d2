"""The Relax import states what the traced model computes: each attention's softmax scale and sliding window."""

import pytest
import torch

from llmc.compiler.export import to_relax
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.model import attention_scale
from llmc.compiler.frontend.trace import Traced, trace
from llmc.compiler.passes.common import bindings, calls
from llmc.errors import CompileError


def _attention_attrs(mod):
    return [b.value.attrs for b in bindings(mod["main"]) if calls(b.value, "relax.nn.attention")]


@pytest.mark.parametrize(
    "overrides",
    [
        {"use_sliding_window": True, "sliding_window": 5, "max_window_layers": 1},
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}},
    ],
    ids=["sliding_window", "yarn"],
)
def test_attention_keeps_its_scale_and_window(overrides, checkpoint_dir):
    config = load_checkpoint(checkpoint_dir("qwen2", **overrides)).config
    attrs = _attention_attrs(to_relax(trace(config)))
    assert [a.causal_mask for a in attrs] == ["TopLeft"] * config.num_layers
    assert [int(a.window_size or 0) for a in attrs] == [config.attention_window(i) for i in range(config.num_layers)]
    # TVM's own converter would drop the scale, and with it YaRN's attention factor
    assert [float(a.scale.value) for a in attrs] == [attention_scale(config)] * config.num_layers


class _MaskedAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


def test_a_mask_other_than_a_sliding_window_is_refused():
    program = torch.export.export(_MaskedAttention(), (torch.randn(1, 2, 3, 4), torch.ones(3, 3, dtype=torch.bool)))
    with pytest.raises(CompileError, match="has a mask, dropout or GQA flag llmc does not compile"):
        to_relax(Traced(program, []))
