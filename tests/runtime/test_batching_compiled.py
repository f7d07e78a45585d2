"""Batching changes nothing, on a real compiled module: N greedy requests with random arrival times and
lengths, through the scheduler with chunked prefill and a cache so small that it must preempt, give each
request exactly the tokens it gets alone. Dense and mixture-of-experts (whose experts see other tokens beside a
request's when batched), the latter on the CPU and on sm90 under the simulator (fp32); and an int8 KV cache."""

import numpy as np
import pytest

from llmc.artifact import load_artifact
from llmc.compiler.compile import compile_checkpoint
from llmc.runtime.engine import LLMEngine
from llmc.runtime.kv_cache import kv_bytes_per_block
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from tests.cuda_mode import cuda_library
from tests.runtime.runtime_fakes import run_with_arrivals


@pytest.fixture(
    scope="module",
    params=[
        ("llama", "cpu", "auto"),
        ("llama", "cpu", "int8"),  # an int8 KV cache: each row quantized alone as it is written
        ("qwen3_moe", "cpu", "auto"),
        pytest.param(("qwen3_moe", "sm90", "auto"), marks=pytest.mark.slow),  # about a minute of simulated steps
    ],
    ids=lambda p: "-".join(p),
)
def artifact(request, checkpoint_dir, tmp_path_factory):
    arch, target, kv_dtype = request.param
    out = tmp_path_factory.mktemp("art") / "m"
    return compile_checkpoint(checkpoint_dir(arch), target=target, output=out, kv_dtype=kv_dtype)


def _load(artifact, **kw):
    """The artifact's module: a CUDA one under the simulator (or on the GPU, tests/cuda_mode.py)."""
    cuda = load_artifact(artifact, verify=False).is_cuda
    return CompiledModel.load(artifact, library=cuda_library(artifact) if cuda else None, **kw)


def test_concurrent_requests_equal_each_alone_under_preemption(artifact):
    rng = np.random.default_rng(7)
    requests = [
        (
            [int(t) for t in rng.integers(2, 380, rng.integers(1, 40))],
            SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True),
        )
        for _ in range(10)
    ]
    arrivals = [int(a) for a in rng.integers(0, 12, len(requests))]
    with _load(artifact, max_num_seqs=8) as roomy:
        alone = [LLMEngine(roomy).generate([p], [sp])[0].outputs[0].token_ids for p, sp in requests]
        c = roomy.config
        per_block = kv_bytes_per_block(
            c.num_layers, c.num_kv_heads, c.head_dim, roomy.block_size, roomy.artifact.kv_dtype
        )
    # 12 blocks of 16 tokens for up to 8 sequences of up to 63 tokens: preemption is certain.
    with _load(artifact, kv_cache_memory=12 * per_block, max_num_seqs=8) as tight:
        engine = LLMEngine(tight, max_num_batched_tokens=24)
        together = run_with_arrivals(engine, requests, arrivals)
        assert engine.scheduler.num_preemptions > 0, "the cache was not small enough to force preemption"
        assert tight.num_blocks == 12
    for i, tokens in enumerate(alone):
        assert together[i][0] == tokens, f"request {i} changed when batched"


def test_sliding_window_releases_blocks_and_runs_past_the_cache(checkpoint_dir, tmp_path):
    """Every Mistral layer attends to the last 6 positions, so blocks behind the window go back to the pool:
    a cache of 4 blocks (64 tokens) serves sequences of 96 tokens, batched, with transformers' tokens."""
    import torch

    from tests.checkpoints import hf_model

    path = checkpoint_dir("mistral", sliding_window=6)
    out = compile_checkpoint(path, target="cpu", output=tmp_path / "m")
    rng = np.random.default_rng(3)
    prompts = [[int(t) for t in rng.integers(2, 380, n)] for n in (20, 9)]
    params = SamplingParams(temperature=0, max_tokens=76, ignore_eos=True)
    per_block = 2 * 2 * 16 * 3 * 8 * 4  # k and v, 2 layers, 16 slots of 3 kv heads x 8 dims, fp32
    with CompiledModel.load(out, kv_cache_memory=4 * per_block, max_num_seqs=2) as model:
        assert model.num_blocks == 4
        engine = LLMEngine(model, max_num_batched_tokens=8)
        assert engine.max_model_len == model.config.max_context  # the cache no longer caps the length
        results = engine.generate(prompts, params)
        assert engine.kv_cache.num_free_blocks == 4
    reference = hf_model(path)
    for ids, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = reference.generate(torch.tensor([ids]), max_new_tokens=76, min_new_tokens=76, do_sample=False)[
                0, len(ids) :
            ].tolist()
        assert result.outputs[0].token_ids == expected
