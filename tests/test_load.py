"""benchmarks/load_test.py for 10 s: `llmc serve` on the bundled model under 64 concurrent clients, with
cancellations, requests past the limits and a KV cache small enough to force preemption.

It asserts correctness only, never timings: every valid request got its whole answer (exactly max_tokens
tokens per choice, across preemptions), every limit was enforced, the engine drained with every KV block
free, and the server still answered /health and exited 0 on SIGTERM.
"""

import importlib.util
import sys
from pathlib import Path

LOAD_TEST = Path(__file__).resolve().parents[1] / "benchmarks" / "load_test.py"


def load_test_module():
    spec = importlib.util.spec_from_file_location("load_test", LOAD_TEST)
    module = importlib.util.module_from_spec(spec)
    sys.modules["load_test"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_64_clients_for_10_s_lose_no_request_and_leave_every_kv_block_free(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))  # the bundled model, compiled by this tree
    load_test = load_test_module()
    report = load_test.run_load(load_test.LoadConfig(duration_s=10.0, warmup_s=2.0), tmp_path)
    print(report)  # the figures, for whoever reads the log; not asserted

    assert report["valid_ok"] > 0 and report["valid_failed"] == 0, report["failures"]
    assert report["limits_enforced"] > 0 and not report["limits_not_enforced"], report["limits_not_enforced"]
    assert report["cancelled"] > 0
    assert report["preemptions"] > 0, "the KV cache was meant to be small enough to force preemption"
    assert (report["running_end"], report["waiting_end"]) == (0, 0)
    assert report["kv_free_blocks_end"] == report["kv_blocks"] == load_test.LoadConfig().kv_blocks
    assert report["health_end"] == 200 and report["exit_code"] == 0
