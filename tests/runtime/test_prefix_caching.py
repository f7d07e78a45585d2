"""Prefix caching changes no output: greedy tokens with caching on equal those with it off (and the cacheless
reference), with random arrivals, shared prefixes, a cache small enough that cached blocks are evicted and
requests preempted, on the fake model, a compiled module and a sliding-window (Mistral) module. And the hit
rate is counted (engine stats, /metrics)."""

import numpy as np
import pytest
from fastapi.testclient import TestClient

from llmc.compiler.compile import compile_checkpoint
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe, reference_greedy, run_with_arrivals
from tests.runtime.test_metrics import new_app, scrape


def shared_prefix_workload(
    seed: int, num_requests: int, vocab: int, base_len: int, max_suffix: int, max_tokens: int, ignore_eos: bool = True
):
    """Requests that start with a random-length piece of one base prompt, then go their own way; and arrivals."""
    rng = np.random.default_rng(seed)
    base = [int(t) for t in rng.integers(2, vocab, base_len)]
    requests = []
    for _ in range(num_requests):
        suffix = rng.integers(2, vocab, rng.integers(1, max_suffix))
        prompt = base[: rng.integers(0, base_len + 1)] + [int(t) for t in suffix]
        params = SamplingParams(temperature=0, max_tokens=int(rng.integers(1, max_tokens)), ignore_eos=ignore_eos)
        requests.append((prompt, params))
    return requests, [int(a) for a in rng.integers(0, num_requests, num_requests)]


@pytest.mark.parametrize("seed", range(6))
def test_fake_model_outputs_equal_with_caching_on_and_off_under_eviction_and_preemption(seed):
    config = FakeConfig()
    requests, arrivals = shared_prefix_workload(seed, 24, config.vocab_size, 40, 30, 20, ignore_eos=False)
    got, engines = {}, {}
    for caching in (True, False):
        engine = LLMEngine(
            FakeModel(config, num_blocks=24, block_size=4, max_num_tokens=16),
            max_num_batched_tokens=16,
            enable_prefix_caching=caching,
        )
        got[caching] = run_with_arrivals(engine, requests, arrivals)
        engines[caching] = engine
        assert engine.kv_cache.num_free_blocks == 24
    for i, (prompt, params) in enumerate(requests):
        assert got[True][i] == got[False][i], f"request {i} changed with prefix caching"
        assert got[True][i][0] == reference_greedy(prompt, params.max_tokens, config, engines[True].max_model_len)
    on, off = engines[True], engines[False]
    assert on.stats().prefix_cache_hits > 0 and off.stats().prefix_cache_hits == 0
    assert on.kv_cache.pool.num_evictions > 0 and on.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def llama_artifact(checkpoint_dir, tmp_path_factory):
    return compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path_factory.mktemp("art") / "m")


def test_compiled_outputs_equal_with_caching_on_and_off_under_eviction_and_preemption(llama_artifact):
    requests, arrivals = shared_prefix_workload(11, 12, 380, 48, 24, 24)
    got, stats = {}, {}
    # 12 blocks of 16 tokens for up to 8 sequences of up to 94 tokens: eviction and preemption are certain
    with CompiledModel.load(llama_artifact, kv_cache_memory=12 * 4096, max_num_seqs=8) as tight:
        assert tight.num_blocks == 12
        for caching in (True, False):
            engine = LLMEngine(tight, max_num_batched_tokens=24, enable_prefix_caching=caching)
            got[caching] = run_with_arrivals(engine, requests, arrivals)
            stats[caching] = (engine.stats(), engine.kv_cache.pool.num_evictions, engine.scheduler.num_preemptions)
    for i in range(len(requests)):
        assert got[True][i] == got[False][i], f"request {i} changed with prefix caching"
    (on, evictions, preemptions), (off, _, _) = stats[True], stats[False]
    assert on.prefix_cache_hits > 0 and off.prefix_cache_hits == 0
    assert evictions > 0 and preemptions > 0, "the cache was not small enough to force eviction and preemption"


def test_sliding_window_outputs_equal_with_caching_on_and_off(checkpoint_dir, tmp_path):
    """Mistral, window 6: blocks behind the window are let go (and stay cached while free) in a 4-block cache."""
    path = checkpoint_dir("mistral", sliding_window=6)
    out = compile_checkpoint(path, target="cpu", output=tmp_path / "m")
    rng = np.random.default_rng(5)
    base = [int(t) for t in rng.integers(2, 380, 36)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    requests = [(base[:n] + [int(t) for t in rng.integers(2, 380, 3)], params) for n in (36, 20, 36, 33)]
    arrivals = [0, 4, 8, 30]
    per_block = 2 * 2 * 16 * 3 * 8 * 4  # k and v, 2 layers, 16 slots of 3 kv heads x 8 dims, fp32
    got, hits = {}, {}
    with CompiledModel.load(out, kv_cache_memory=6 * per_block, max_num_seqs=2) as model:
        assert model.num_blocks == 6
        for caching in (True, False):
            engine = LLMEngine(model, max_num_batched_tokens=8, enable_prefix_caching=caching)
            got[caching] = run_with_arrivals(engine, requests, arrivals)
            hits[caching] = engine.stats().prefix_cache_hits
            assert engine.kv_cache.num_free_blocks == 6
            if caching:
                evictions = engine.kv_cache.pool.num_evictions
    assert got[True] == got[False]
    assert hits[True] > 0 and hits[False] == 0 and evictions > 0


def test_metrics_show_prefix_cache_queries_and_hits():
    tok = byte_level_bpe()
    app, _ = new_app(tok)
    prompt = "the quick brown fox jumps over the lazy dog " * 4
    n = len(tok.encode(prompt).ids)
    with TestClient(app) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
        samples = scrape(http)
    assert samples[("llmc:prefix_cache_queries_total", ())] == 2 * n
    assert samples[("llmc:prefix_cache_hits_total", ())] == (n - 1) // 16 * 16  # the second found the full blocks


class FailOnceModel(FakeModel):
    """Writes the step's k/v (tokens) into its cache, then fails: the first step only."""

    failed = False

    def step(self, batch):
        logits = super().step(batch)
        if not self.failed:
            self.failed = True
            self.cache[self.cache >= 0] = 0  # what a step that died half-way may leave behind
            raise RuntimeError("model failure")
        return logits


def test_a_failed_step_caches_nothing():
    """Blocks enter the prefix cache only once their step succeeded: a later request must not reuse k/v that a
    failed step may have left half-written."""
    model = FailOnceModel(block_size=4)
    engine = LLMEngine(model)
    prompt = list(range(2, 14))
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=3))
    outputs = engine.step()
    assert [o.finish_reason for o in outputs] == ["error"] and engine.kv_cache.pool.num_cached_blocks == 0
    result = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=3))[0]
    assert result.outputs[0].token_ids == reference_greedy(prompt, 3, model.config)
    assert engine.stats().prefix_cache_hits == 0 and engine.kv_cache.pool.num_cached_blocks == 3
