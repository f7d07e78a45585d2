"""The CPU qgemm's activation rounding (templates/cpu/include/llmc_qgemm.h; the manifest's "activations": int8
per 32), for references that run transformers on a quantized build's weights."""

from __future__ import annotations

from collections.abc import Callable

import torch


def int8_per_32(x: torch.Tensor) -> torch.Tensor:
    """Per block of 32 of a row: round-half-even(x * 127 / amax) * amax / 127."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(x.shape)


def int8_two_pass(x: torch.Tensor) -> torch.Tensor:
    """qgemm_two_pass (the lm_head): x's rounding, plus its residual's."""
    hi = int8_per_32(x)
    return hi + int8_per_32(x - hi)


def round_as_cpu_qgemm(model: torch.nn.Module, quantized: Callable[[str], bool]) -> torch.nn.Module:
    """model, each Linear whose module name `quantized` accepts rounding its input as the CPU qgemm does: the
    lm_head in two passes, the others in one."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and quantized(name):
            rounding = int8_two_pass if name == "lm_head" else int8_per_32
            module.register_forward_pre_hook(lambda _, args, rounding=rounding: rounding(args[0]))
    return model


def moe_as_cpu_qgemm(x, router, gate_up, down, top_k, norm_topk):
    """frontend/model.py's moe_reference with each expert GEMM's input rounded as the CPU qgemm rounds it (int8 per
    32): what a build with quantized experts computes, for its weights' values (monkeypatch it over the family
    module's `moe`)."""
    experts, hidden = router.shape
    inter = down.shape[1]
    probs = torch.softmax(torch.nn.functional.linear(x, router).float(), dim=-1)
    top, chosen = torch.topk(probs, top_k, dim=-1)
    if norm_topk:
        top = top / top.sum(dim=-1, keepdim=True)
    weights = torch.zeros_like(probs).scatter(1, chosen, top)
    out = torch.zeros_like(x)
    for e in range(experts):
        gate_up_e, down_e = gate_up[2 * inter * e : 2 * inter * (e + 1)], down[hidden * e : hidden * (e + 1)]
        gate, up = torch.nn.functional.linear(int8_per_32(x), gate_up_e).chunk(2, -1)
        act = torch.nn.functional.silu(gate) * up
        out = out + weights[:, e : e + 1] * torch.nn.functional.linear(int8_per_32(act), down_e)
    return out


def assert_quantized_experts_match(artifact, model: torch.nn.Module, monkeypatch, num_tokens: int) -> None:
    """A build with quantized experts against the family module `model` holding its weights' values: one prefill
    of random ids, its experts' inputs rounded as the kernels round them (moe_as_cpu_qgemm); within the fp32
    tolerance but for rows where an activation sits at a rounding midpoint (tests/tools/test_quantized_build.py)."""
    import numpy as np

    from llmc.compiler.frontend import model as family
    from llmc.runtime.batch import StepBatch
    from llmc.runtime.module import CompiledModel

    monkeypatch.setattr(family, "moe", moe_as_cpu_qgemm)
    ids = [int(i) for i in np.random.default_rng(5).integers(2, 384, num_tokens)]
    with torch.no_grad():
        want = model(torch.tensor(ids), torch.arange(len(ids))).numpy()
    with CompiledModel.load(artifact, max_num_seqs=1, max_num_logits=len(ids)) as m:
        table = list(range(m.num_blocks))[: -(-len(ids) // m.block_size)]
        got = m.step(StepBatch.build([ids], [0], [table], m.block_size, num_logits=[len(ids)]))
    rel = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 1e-2 and np.mean(rel <= 1e-3) >= 0.75, f"relative logit errors per row {np.round(rel, 4)}"
