"""benchmarks/vs_llama_server.py's measuring: the checkpoint whose every token is text, and a level of the closed
loop against a real `llmc serve` (llama-server itself is a 20-minute build: build_llama_server.sh)."""

import asyncio
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

pytest.importorskip("gguf")

import common  # noqa: E402
import vs_llama_server  # noqa: E402
from load_server import free_port  # noqa: E402

from llmc.compiler.compile import compile_checkpoint  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A random checkpoint whose vocabulary (448) is larger than its tokenizer's (384), as the benchmark's are."""
    config = {**common.SMOLLM_135M, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2}
    config.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=448, max_position_embeddings=256)
    return common.random_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt", config, log=lambda _: None)


def test_full_vocab_checkpoint_makes_every_token_text(tiny, tmp_path):
    from gguf import GGUFReader
    from tokenizers import Tokenizer

    from llmc.compiler.frontend.gguf_write import write_gguf

    ckpt = tiny
    out = vs_llama_server.full_vocab_checkpoint(ckpt, tmp_path)
    assert vs_llama_server.full_vocab_checkpoint(ckpt, tmp_path) == out  # made once
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.get_vocab_size(with_added_tokens=True) == 448
    assert [tok.decode([i]) for i in (384, 447)] == ["<t384>", "<t447>"]
    assert tok.decode([300]) == Tokenizer.from_file(str(ckpt / "tokenizer.json")).decode([300])
    assert (out / "config.json").resolve() == (ckpt / "config.json").resolve()
    # llama.cpp's file holds them as ordinary tokens: no [PAD] left
    write_gguf(out, tmp_path / "m.gguf", "F32")
    field = GGUFReader(tmp_path / "m.gguf").fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data]
    assert len(tokens) == 448 and tokens[400] == "<t400>" and not any(t.startswith("[PAD") for t in tokens)


@pytest.mark.slow
def test_run_level_against_llmc_serve(tiny, tmp_path):
    ckpt = vs_llama_server.full_vocab_checkpoint(tiny, tmp_path)
    artifact = compile_checkpoint(ckpt, target="cpu", output=tmp_path / "m.cpu", weight_dtype="float32")
    port = free_port()
    cmd = [sys.executable, "-m", "llmc.tools.cli", "serve", str(artifact), "--port", str(port)]
    server = vs_llama_server.Served("llmc serve", cmd + ["--kv-cache-memory", "16MiB"], port, tmp_path / "log")
    try:
        server.wait_up()
        prompts = [[400 + i, 17, 301, 5] for i in range(5)]
        level = asyncio.run(vs_llama_server.run_level(server.base, prompts, concurrency=2, output_len=6))
    finally:
        server.stop()
    assert level["requests"] == 5 and level["output_tok_s"] > 0
    assert 0 < level["ttft_ms"][0] <= level["ttft_ms"][1] and 0 < level["tpot_ms"][0] <= level["tpot_ms"][1]
    result = {
        "machine": {"cpu": "x", "cores": 1, "caches": [], "isa": [], "threads": 1},
        "model": "tiny",
        "prompt_len": 4,
        "output_len": 6,
        "rows": [{"row": "fp32", "levels": [{"concurrency": 2, "llmc serve": level, "llama-server": level}]}],
    }
    table = vs_llama_server.format_table(json.loads(json.dumps(result)))
    assert "1.00x" in table.splitlines()[-1]
