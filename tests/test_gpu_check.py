"""benchmarks/gpu_check.py's dry run (--simulate): the whole check but the GPU-only parts (tests on the GPU,
measured ceilings, torch.compile) on a tiny layer shape, the model steps under the CUDA simulator."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import gpu_check  # noqa: E402


@pytest.mark.slow
def test_dry_run(tmp_path, capsys):
    out = tmp_path / "check.json"
    rc = gpu_check.main(
        [
            "--simulate",
            "--no-compile",
            "--repeats",
            "1",
            "--context",
            "100",
            "--prompt-len",
            "40",
            "--cache",
            str(tmp_path / "cache"),
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert [c["ok"] for c in report["checks"]] == [True]  # the logits check against the torch reference
    rows = {t["row"]: t for t in report["timings"]}
    labels = ("decode b1 ctx 100", "prefill 40")
    assert set(rows) == {f"torch eager {label}" for label in labels} | {
        f"llmc {label} ({part})" for label in labels for part in ("kernels", "whole step")
    }
    assert all(t["us"] > 0 and t["floor_us"] > 0 for t in rows.values())
    assert report["llmc_decode"]["step"]["floor_bytes"] > 0 and report["llmc_prefill"]["step"]["flops"] > 0
    assert "floor/time" in capsys.readouterr().out
