"""llmc bench on the fake model: the numbers are sane and the table has its columns (no timed assertions)."""

import json

import pytest

from llmc.errors import LlmcError
from llmc.runtime.bench import format_bench_table, make_workload, measure_memory_bandwidth, run_bench
from llmc.runtime.engine import LLMEngine
from tests.runtime.runtime_fakes import FakeModel

COLUMNS = [
    "concurrency",
    "requests",
    "TTFT p50 ms",
    "TTFT p99 ms",
    "TPOT p50 ms",
    "TPOT p99 ms",
    "req/s",
    "output tok/s",
    "prefix hit",
    "% of roofline",
]


class CountingModel(FakeModel):
    """Records the prompts each step sees first, to check the workload."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.tokens_seen = 0

    def step(self, batch):
        self.tokens_seen += batch.num_tokens
        return super().step(batch)


def test_bench_levels_numbers_and_table(capsys):
    models = []

    def factory():
        models.append(CountingModel(num_blocks=64, block_size=8, max_num_tokens=64, max_num_seqs=4))
        return LLMEngine(models[-1])

    result = run_bench(
        factory, concurrency=(1, 3), num_requests=5, prompt_len=12, output_len=6, seed=3, weight_bytes=10**6
    )
    assert "bench" in capsys.readouterr().err  # the tqdm bar goes to stderr
    json.dumps(result)  # JSON-ready (llmc bench --json)

    assert [lv["concurrency"] for lv in result["levels"]] == [1, 3]
    for level, model in zip(result["levels"], models[1:], strict=True):  # models[0] ran the warm-up
        assert level["num_requests"] == 5
        # every request: its whole prompt once, then exactly output_len - 1 decode tokens (the last is not fed)
        assert model.tokens_seen == 5 * (12 + 6 - 1)
        assert 0 < level["ttft_p50_ms"] <= level["ttft_p99_ms"]
        assert 0 < level["tpot_p50_ms"] <= level["tpot_p99_ms"]
        assert level["output_tokens_per_s"] == pytest.approx(level["request_throughput"] * 6)
        assert level["request_throughput"] == pytest.approx(5 / level["duration_s"])
        assert 0 < level["roofline_fraction"]
    assert models[1].max_batch_seen == 1 and models[2].max_batch_seen == 3  # concurrency is what it says

    roof = result["roofline"]
    assert roof["weight_bytes_per_decode_step"] == 10**6 and roof["memory_bandwidth_bytes_per_s"] > 1e8
    assert roof["tpot_ms"] == pytest.approx(1e3 * 10**6 / roof["memory_bandwidth_bytes_per_s"])

    table = format_bench_table(result)
    lines = table.splitlines()
    header = next(line for line in lines if line.strip().startswith("concurrency"))
    for col in COLUMNS:
        assert col in header
    rows = [line.split() for line in lines if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "3"] and all(len(r) == 10 and r[-1].endswith("%") for r in rows)
    assert "roofline:" in table and "GB/s" in table and "prompt 12 tokens, output 6 tokens" in table


def test_bench_without_roofline_and_workload_is_fixed():
    result = run_bench(
        lambda: LLMEngine(FakeModel()), concurrency=(2,), num_requests=2, prompt_len=4, output_len=1, progress=False
    )
    assert result["roofline"] is None
    level = result["levels"][0]
    assert level["tpot_p50_ms"] is None and level["ttft_p50_ms"] > 0  # one output token: no TPOT
    table = format_bench_table(result)
    assert "not computed" in table and " - " in table

    assert make_workload(3, 5, 64, 7) == make_workload(3, 5, 64, 7) != make_workload(3, 5, 64, 8)
    assert all(len(p) == 5 and all(0 <= t < 64 for t in p) for p in make_workload(3, 5, 64, 7))
    assert measure_memory_bandwidth(nbytes=2**20, repeats=2) > 0

    with pytest.raises(LlmcError, match="max_model_len"):
        run_bench(lambda: LLMEngine(FakeModel()), prompt_len=500, output_len=100, progress=False)


@pytest.mark.parametrize("caching", [True, False])
def test_bench_shared_prefix_is_computed_once_per_level_with_prefix_caching(caching):
    models = []

    def factory():
        models.append(CountingModel(num_blocks=64, block_size=8, max_num_tokens=64, max_num_seqs=4))
        return LLMEngine(models[-1], enable_prefix_caching=caching)

    result = run_bench(
        factory, concurrency=(1,), num_requests=4, prompt_len=20, output_len=3, shared_prefix=16, progress=False
    )
    json.dumps(result)
    prompts = make_workload(4, 20, 64, 1, shared_prefix=16)
    assert all(p[:16] == prompts[0][:16] for p in prompts) and len({tuple(p[16:]) for p in prompts}) == 4
    level = result["levels"][0]
    # one request at a time: the first computes the 2 shared blocks, the 3 others find them (16 of 20 tokens)
    hits = 3 * 16 if caching else 0
    assert (level["prefix_cache_queries"], level["prefix_cache_hits"]) == (4 * 20 if caching else 0, hits)
    assert result["prefix_cache_hit_rate"] == level["prefix_cache_hit_rate"] == hits / 80
    assert models[1].tokens_seen == 4 * (20 + 3 - 1) - hits
    assert f"prefix cache hit rate: {hits / 80:.1%}" in format_bench_table(result)
    assert "(the first 16 shared)" in format_bench_table(result)
    with pytest.raises(LlmcError, match="shared prefix"):
        run_bench(factory, prompt_len=4, output_len=1, shared_prefix=5, progress=False)
