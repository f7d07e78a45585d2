"""benchmarks/vs_llamacpp.py's measuring (and its peer, llamacpp_peer.py): on a tiny checkpoint, llmc and llama.cpp (its F32 GGUF) decode the same
greedy tokens from the same prompt ids, and read the same weight bytes per decode token."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytest.importorskip("gguf")
pytest.importorskip("llama_cpp")

import llamacpp_peer  # noqa: E402
import vs_llamacpp  # noqa: E402

from llmc.compiler.compile import compile_checkpoint  # noqa: E402


@pytest.mark.slow
def test_measure_row_peers_agree(checkpoint_dir, tmp_path):
    ckpt = checkpoint_dir("llama", rope_scaling=None, intermediate_size=96)  # untied lm_head, GQA 4
    llmc_path = compile_checkpoint(ckpt, target="cpu", output=tmp_path / "m.cpu", weight_dtype="float32")
    gguf_path = llamacpp_peer.gguf_file(ckpt, tmp_path, "tiny", "F32", log=lambda _: None)
    prompt = np.random.default_rng(3).integers(2, 384, 13).tolist()
    m = vs_llamacpp.measure_row(llmc_path, gguf_path, prompt, tokens=20, rounds=2, threads=1, log=lambda _: None)
    assert m["tokens"]["llmc"] == m["tokens"]["llama.cpp"]
    assert len(m["tokens"]["llmc"]) == 21 and len(set(m["tokens"]["llmc"])) > 5
    # the same tensors at 4 bytes: every matrix and norm, the lm_head, one embedding row
    assert m["weight_bytes_per_token"]["llmc"] == m["weight_bytes_per_token"]["llama.cpp"]
    row = vs_llamacpp.summarize("fp32", m, len(prompt), 20, read_GBps=10.0)
    assert row["tokens_agree"] == 21
    for peer in ("llmc", "llama.cpp"):
        assert len(m["decode_s"][peer]) == 2 and row[peer]["decode_tokens_per_s"] > 0
    assert row["decode_ratio"] == pytest.approx(
        row["llmc"]["decode_tokens_per_s"] / row["llama.cpp"]["decode_tokens_per_s"]
    )


def test_llamacpp_only_row(checkpoint_dir, tmp_path):
    """A row with no llmc build (llmc options None) measures llama.cpp alone and prints no ratio."""
    ckpt = checkpoint_dir("llama", rope_scaling=None, intermediate_size=96)
    gguf_path = llamacpp_peer.gguf_file(ckpt, tmp_path, "tiny", "F32", log=lambda _: None)
    prompt = np.random.default_rng(3).integers(2, 384, 13).tolist()
    m = vs_llamacpp.measure_row(None, gguf_path, prompt, tokens=6, rounds=1, threads=1, log=lambda _: None)
    assert set(m["tokens"]) == {"llama.cpp"} and len(m["tokens"]["llama.cpp"]) == 7
    row = vs_llamacpp.summarize("fp32", m, len(prompt), 6, read_GBps=10.0)
    assert row["llmc"] is None and row["decode_ratio"] is None and row["tokens_agree"] is None
    result = {
        "machine": {
            "cpu": "x",
            "cores": 1,
            "caches": [],
            "isa": [],
            "read_GBps": 10.0,
            "read_GBps_samples": [10.0],
            "threads": 1,
        },
        "prompt_len": 13,
        "decode_tokens": 6,
        "rounds": 1,
        "kv_cache_dtype": "bfloat16",
        "shapes": [{"shape": "tiny", "model": "tiny", "rows": [row]}],
    }
    line = next(x for x in vs_llamacpp.format_table(result).splitlines() if x.startswith("tiny"))
    cells = line.split()
    assert cells[:5] == ["tiny", "fp32", "—", f"{row['llama.cpp']['decode_tokens_per_s']:.1f}", "—"]


def test_a_peer_that_dies_is_reported_not_measured(tmp_path):
    """llama.cpp runs a file in a child process first, so a crash (or a refusal) is an error naming the file."""
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(llamacpp_peer.PeerCrashed, match="bad.gguf"):
        llamacpp_peer.check_llamacpp_runs(bad, threads=1)
