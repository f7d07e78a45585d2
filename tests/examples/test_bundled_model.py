"""The bundled model (examples/pystdlib-5m): its provenance, the default `llmc run`, and its perplexity."""

import hashlib
import json
import re
import subprocess
import sys

import numpy as np
from tokenizers import Tokenizer

from llmc.compiler.frontend.load import load_checkpoint
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
