"""Trace the Llama-family module with torch.export: weights are explicit inputs, token count is symbolic.

The model is built on the meta device and called through `torch.func.functional_call`, so tracing never
touches weight values and an 8B model traces in seconds with no memory. The resulting ExportedProgram
has user inputs `(input_ids [T], positions [T], *weights)` in `weight_names` order and no parameters or
buffers, which is what TVM's importer needs to stay weight-free.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from .config import ModelConfig
from .model import LlamaFamily

MAX_TRACE_TOKENS = 1 << 20


class _WeightsAsInputs(nn.Module):
    def __init__(self, model: LlamaFamily, names: list[str]):
        super().__init__()
        # Not a registered submodule: its meta parameters must not become parameters of the program.
        self.__dict__["model"] = model
        self.names = names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, *weights: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(
            self.model, dict(zip(self.names, weights, strict=True)), (input_ids, positions)
        )


@dataclasses.dataclass
class Traced:
    program: ExportedProgram
    weight_names: list[str]  # HF names, in the order of the program's weight inputs


def trace(config: ModelConfig, dtype: torch.dtype = torch.float32, device: str = "meta") -> Traced:
    """device="meta" for compiling; "cpu" gives a program that can also be run eagerly (tests)."""
    with torch.device("meta"):
        model = LlamaFamily(config).eval()
    shapes = config.weight_shapes()
    names = list(shapes)
    weights = tuple(torch.empty(shapes[n], dtype=dtype, device=device) for n in names)
    example_tokens = 7
    ids = torch.zeros(example_tokens, dtype=torch.int64, device=device)
    pos = torch.arange(example_tokens, dtype=torch.int64, device=device)
    tokens = Dim("T", min=1, max=min(config.max_position_embeddings, MAX_TRACE_TOKENS))
    dynamic = ({0: tokens}, {0: tokens}, (None,) * len(weights))
    with torch.no_grad():
        program = torch.export.export(_WeightsAsInputs(model, names), (ids, pos, *weights), dynamic_shapes=dynamic)
    return Traced(program, names)
