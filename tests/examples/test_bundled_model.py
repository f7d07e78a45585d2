"""The bundled model (examples/pystdlib-5m): its provenance, the default `llmc run`, and its perplexity."""

import hashlib
import json
import re
import subprocess
import sys

import numpy as np
import pytest
from tokenizers import Tokenizer

from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.quant import QuantConfig
from llmc.examples import EXAMPLES_DIR

BUNDLED = EXAMPLES_DIR / "pystdlib-5m"


def test_checkpoint_is_the_one_the_readme_describes():
    readme = (BUNDLED / "README.md").read_text()
    digest = hashlib.sha256((BUNDLED / "model.safetensors").read_bytes()).hexdigest()
    assert digest in readme
    ckpt = load_checkpoint(BUNDLED)
    assert 5e6 <= ckpt.config.num_parameters() <= 20e6
    assert ckpt.chat_template and ckpt.generation_defaults["temperature"] > 0


def test_default_run_compiles_once_and_writes_english_about_python(tmp_path):
    env = {"LLMC_CACHE_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "llmc.tools.cli", "run", "--json", "--seed", "0"]
    first = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    out = json.loads(first.stdout)
    assert len(out["token_ids"]) == 64
    words = re.findall(r"[A-Za-z]+", out["text"])
    assert len(words) >= 15, out["text"]  # text, not byte soup
    assert len([p for p in (tmp_path / "artifacts").iterdir() if p.is_dir()]) == 1
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert json.loads(again.stdout)["token_ids"] == out["token_ids"]  # cached artifact, same seed, same text
    assert "compiling" not in again.stderr


def test_heldout_perplexity_is_far_below_unigram(tmp_path):
    """Perplexity of the compiled model on held-out text, against a unigram model of the same tokens."""
    from click.testing import CliRunner

    from llmc.tools.cli import main

    text = (BUNDLED / "heldout.txt").read_text()[:6000]
    (tmp_path / "heldout.txt").write_text(text)
    art = tmp_path / "art"
    assert CliRunner().invoke(main, ["compile", str(BUNDLED), "-o", str(art)]).exit_code == 0
    r = CliRunner().invoke(main, ["eval", "ppl", str(art), "--text", str(tmp_path / "heldout.txt"), "--json"])
    assert r.exit_code == 0, r.output
    ppl = json.loads(r.stdout)["perplexity"]
    ids = Tokenizer.from_file(str(BUNDLED / "tokenizer.json")).encode(text).ids
    counts = np.bincount(ids, minlength=4096) + 1.0  # add-one unigram fit on this very text: a generous baseline
    unigram = float(np.exp(-np.mean(np.log(counts[ids] / counts.sum()))))
    assert ppl < unigram / 3, (ppl, unigram)
    (tmp_path / "binary.bin").write_bytes(b"\x7fELF\x02\x01\x01\x00" + bytes(range(128, 256)))
    r = CliRunner().invoke(main, ["eval", "ppl", str(art), "--text", str(tmp_path / "binary.bin")])
    assert r.exit_code == 1 and "not UTF-8 text" in r.stderr and r.stderr.count("\n") == 1, r.output


def repetition_loop(ids: list[int], max_period: int = 16, repeats: int = 3) -> bool:
    """Whether ids end in a loop: their last period-long run repeated `repeats` times, for some period."""
    return any(
        len(ids) >= repeats * p
        and all(ids[-p:] == ids[len(ids) - (r + 1) * p : len(ids) - r * p] for r in range(repeats))
        for p in range(1, max_period + 1)
    )


def test_repetition_loop_finds_loops():
    assert repetition_loop([1, 2, 3, 4, 5, 6, 7, 8, 9, 7, 8, 9, 7, 8, 9])
    assert repetition_loop([4] * 6)
    assert not repetition_loop([1, 2, 3, 1, 2, 3, 1, 2, 4])
    assert not repetition_loop(list(range(64)))


@pytest.mark.slow
def test_recipe_builds_chat_without_repetition_loops(tmp_path):
    """Greedy chat replies, 64 tokens each: where the unquantized build's reply has no repetition loop, the
    q4_k_m and q8_0 builds' replies have none either."""
    from llmc.runtime.chat_template import chat_prompt_ids, special_tokens
    from llmc.runtime.engine import LLMEngine
    from llmc.runtime.module import CompiledModel
    from llmc.sampling_params import SamplingParams
    from llmc.tools.build import compile_checkpoint

    questions = ["What does os.path.join do?", "How do I read a file line by line?", "What is a generator?"]
    ckpt = load_checkpoint(BUNDLED)
    tok = Tokenizer.from_file(str(BUNDLED / "tokenizer.json"))
    bos, eos = special_tokens(tok, ckpt.config.bos_token_id, ckpt.config.eos_token_ids)
    prompts = [chat_prompt_ids(tok, ckpt.chat_template, [{"role": "user", "content": q}], bos, eos) for q in questions]
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    replies = {}
    for quant in ("none", "q4_k_m", "q8_0"):
        art = compile_checkpoint(BUNDLED, target="cpu", output=tmp_path / quant, quant=QuantConfig(quant))
        model = CompiledModel.load(art)
        replies[quant] = [r.outputs[0].token_ids for r in LLMEngine(model, tok).generate(prompts, params)]
        model.close()
    looping = [repetition_loop(ids) for ids in replies["none"]]
    assert not all(looping), "the unquantized build loops on every question: the test shows nothing"
    for quant in ("q4_k_m", "q8_0"):
        for question, ids, base in zip(questions, replies[quant], looping, strict=True):
            assert base or not repetition_loop(ids), f"{quant} loops on {question!r}: {tok.decode(ids)!r}"
