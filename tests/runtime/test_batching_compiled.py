"""Batching changes nothing, on a real compiled module: N greedy requests with random arrival times and
lengths, through the scheduler with chunked prefill and a cache so small that it must preempt, give each
request exactly the tokens it gets alone."""

import numpy as np
import pytest
from runtime_fakes import run_with_arrivals

from llmc.compiler.compile import compile_checkpoint
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.runtime.sampling import SamplingParams


@pytest.fixture(scope="module")
def artifact(checkpoint_dir, tmp_path_factory):
    return compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path_factory.mktemp("art") / "m")


def test_concurrent_requests_equal_each_alone_under_preemption(artifact):
    rng = np.random.default_rng(7)
    requests = [([int(t) for t in rng.integers(2, 380, rng.integers(1, 40))],
                 SamplingParams(temperature=0, max_tokens=int(rng.integers(1, 24)), ignore_eos=True))
                for _ in range(10)]
    arrivals = [int(a) for a in rng.integers(0, 12, len(requests))]
    with CompiledModel.load(artifact, max_num_seqs=8) as roomy:
        alone = [LLMEngine(roomy).generate([p], [sp])[0].outputs[0].token_ids for p, sp in requests]
    # 12 blocks of 16 tokens for up to 8 sequences of up to 63 tokens: preemption is certain.
    with CompiledModel.load(artifact, kv_cache_memory=12 * 4096, max_num_seqs=8) as tight:
        engine = LLMEngine(tight, max_num_batched_tokens=24)
        together = run_with_arrivals(engine, requests, arrivals)
        assert engine.scheduler.num_preemptions > 0, "the cache was not small enough to force preemption"
        assert tight.num_blocks == 12
    for i, tokens in enumerate(alone):
        assert together[i][0] == tokens, f"request {i} changed when batched"
