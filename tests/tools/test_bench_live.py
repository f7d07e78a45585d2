"""`llmc bench` on a real compiled artifact (the tiny random Qwen2 checkpoint, compiled for this CPU)."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from llmc.tools import cli

ARGS = ("--concurrency", "1,4", "--prompt-len", "16", "--output-len", "8", "--kv-cache-memory", "16MiB")
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


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, checkpoint_dir):
    from llmc.compiler.compile import compile_checkpoint

    out = tmp_path_factory.mktemp("bench") / "tiny.cpu"
    return compile_checkpoint(checkpoint_dir("qwen2"), target="cpu", output=out)


def _bench(*args):
    r = CliRunner().invoke(cli.main, ["bench", *map(str, args)])
    assert r.exit_code == 0, (r.output, r.exception)
    return r.stdout


def test_bench_prints_its_table(artifact):
    out = _bench(artifact, *ARGS)
    lines = out.strip().splitlines()
    assert lines[0].startswith("workload: prompt 16 tokens, output 8 tokens (greedy, ignore_eos), seed 0"), out
    header = lines[1]
    positions = [header.index(c) for c in COLUMNS]  # every column, in this order
    assert positions == sorted(positions), header
    rows = [line.split() for line in lines[2:4]]
    assert [r[:2] for r in rows] == [["1", "4"], ["4", "8"]], out  # concurrency, requests (max(4, 2 x c))
    for row in rows:
        assert len(row) == len(COLUMNS), row
        ttft50, ttft99, tpot50, tpot99, req_s, tok_s = map(float, row[2:8])
        assert 0 < ttft50 <= ttft99 < 60_000 and 0 < tpot50 <= tpot99 < 60_000, row
        assert req_s > 0 and tok_s == pytest.approx(8 * req_s, rel=0.02), row  # 8 output tokens per request
        assert 0 <= float(row[8][:-1]) <= 100, row  # prefix hit: random prompts share little
        assert row[9].endswith("%") and float(row[9][:-1]) >= 0, row
    assert lines[4].startswith("roofline: ") and "GB/s (measured in-process" in lines[4], out
    assert lines[5].startswith("prefix cache hit rate: "), out
    assert len(lines) == 6, out


def test_bench_json(artifact):
    result = json.loads(_bench(artifact, *ARGS, "--memory-bandwidth", "2e10", "--json"))
    assert result["workload"] == {
        "prompt_len": 16,
        "output_len": 8,
        "seed": 0,
        "shared_prefix": 0,
        "sampling": "greedy, ignore_eos",
        "structured": None,
    }
    assert 0 <= result["prefix_cache_hit_rate"] <= 1
    levels = result["levels"]
    assert [(lv["concurrency"], lv["num_requests"], lv["max_num_seqs"]) for lv in levels] == [(1, 4, 4), (4, 8, 4)]
    for lv in levels:
        for key in (
            "duration_s",
            "ttft_p50_ms",
            "ttft_p99_ms",
            "tpot_p50_ms",
            "tpot_p99_ms",
            "request_throughput",
            "output_tokens_per_s",
            "roofline_fraction",
        ):
            assert isinstance(lv[key], float) and math.isfinite(lv[key]) and lv[key] > 0, (key, lv)
        assert lv["ttft_p50_ms"] <= lv["ttft_p99_ms"] and lv["tpot_p50_ms"] <= lv["tpot_p99_ms"]
        assert lv["request_throughput"] == pytest.approx(lv["num_requests"] / lv["duration_s"])
        assert lv["output_tokens_per_s"] == pytest.approx(8 * lv["request_throughput"])
    roof = result["roofline"]
    weights = (artifact / "weights.safetensors").stat().st_size
    assert 0 < roof["weight_bytes_per_decode_step"] <= weights
    assert roof["memory_bandwidth_bytes_per_s"] == 2e10 and roof["memory_bandwidth_source"] == "given"
    assert roof["tpot_ms"] == pytest.approx(1e3 * roof["weight_bytes_per_decode_step"] / 2e10)
    for lv in levels:
        assert lv["roofline_fraction"] == pytest.approx(roof["tpot_ms"] / lv["tpot_p50_ms"])
