"""benchmarks/load_test.py: `llmc serve` on the bundled model under 64 concurrent clients, with cancellations,
requests past the limits and a KV cache small enough to force preemption, and hostile clients mixed in:
template bombs, cross-site requests (a wrong Host, text/plain and form bodies) and slowloris connections.

It asserts correctness, and one timing: every valid request got its whole answer (exactly max_tokens tokens
per choice, across preemptions), every limit was enforced and every hostile request refused as it should be
(each slowloris connection closed by the server), the engine drained with every KV block free, the server
still answered /health and exited 0 on SIGTERM; and /health answered under 100 ms at p99 throughout.
The fast suite runs it for a few seconds; -m slow for 60 s.
"""

import importlib.util
import sys
from pathlib import Path

import pytest

LOAD_TEST = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"


def load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", LOAD_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # its dataclasses look their module up there (it imports its siblings)
    spec.loader.exec_module(module)
    return module


def run_and_check(tmp_path, monkeypatch, duration_s: float) -> dict:
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))  # the bundled model, compiled by this tree
    load_test = load_test_module()
    report = load_test.run_load(load_test.LoadConfig(duration_s=duration_s, warmup_s=2.0), tmp_path)
    print(report)  # the figures, for whoever reads the log

    assert report["valid_ok"] > 0 and report["valid_failed"] == 0, report["failures"]
    assert report["limits_enforced"] > 0 and not report["limits_not_enforced"], report["limits_not_enforced"]
    assert report["cancelled"] > 0
    assert report["preemptions"] > 0, "the KV cache was meant to be small enough to force preemption"
    assert (report["running_end"], report["waiting_end"]) == (0, 0)
    assert report["kv_free_blocks_end"] == report["kv_blocks"] == load_test.LoadConfig().kv_blocks
    assert report["health_end"] == 200 and report["exit_code"] == 0

    refused = report["hostile_refused"]
    assert not report["hostile_not_refused"], report["hostile_not_refused"]
    assert {"bomb_int", "bomb_concat", "wrong_host", "text_plain", "form", "preflight"} <= set(refused), refused
    assert report["slowloris_closed"] > 0, "no slowloris connection was closed by the server"
    assert not report["health_errors"], report["health_errors"]
    assert report["health_s"]["n"] > 0.5 * duration_s / sys.modules["load_hostile"].HEALTH_INTERVAL_S
    assert report["health_s"]["p99"] < 0.1, report["health_s"]
    return report


# Slow, though short: its latency bounds (health p99 < 100 ms) need the machine to itself (exclusive), where the
# fast suite and the rest of the slow one run two workers side by side (pyproject.toml, .ci/run); on a 2-core host
# the other worker's builds took p99 to 104 ms.
@pytest.mark.slow
@pytest.mark.exclusive
def test_64_clients_and_hostile_ones_for_a_few_seconds(tmp_path, monkeypatch):
    run_and_check(tmp_path, monkeypatch, duration_s=6.0)


@pytest.mark.slow
@pytest.mark.exclusive
@pytest.mark.timeout(600)
def test_64_clients_and_hostile_ones_for_60_s(tmp_path, monkeypatch):
    report = run_and_check(tmp_path, monkeypatch, duration_s=60.0)
    assert report["hostile_refused"].get("bomb_loop", 0) > 0  # a render that ran to its timeout, and was killed
    assert report["rss_growth_pct"] < 5, report["rss_mib"]
