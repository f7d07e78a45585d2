"""Every bad checkpoint gives one line that names the file or tensor, and a non-zero exit code."""

import json
import shutil

import pytest
from click.testing import CliRunner

from llmc.tools.cli import main


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _truncate(path):
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])


def _garble(path):
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")


CASES = {
    "missing_dir": (lambda p: shutil.rmtree(p), "no such directory"),
    "missing_config": (lambda p: (p / "config.json").unlink(), "config.json is missing"),
    "missing_weights": (lambda p: (p / "model.safetensors").unlink(), "no model.safetensors"),
    "truncated_weights": (_truncate, "truncated"),
    "corrupt_weights": (_garble, "corrupt safetensors"),
    "shape_mismatch": (lambda p: _edit_config(p, intermediate_size=100), "mlp.gate_proj.weight"),
    "missing_layer": (lambda p: _edit_config(p, num_hidden_layers=3), "model.layers.2"),
    "unsupported_arch": (lambda p: _edit_config(p, architectures=["GPT2LMHeadModel"]), "GPT2LMHeadModel"),
    "unsupported_rope": (
        lambda p: _edit_config(p, rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}),
        "dynamic",
    ),
    "missing_tokenizer": (lambda p: (p / "tokenizer.json").unlink(), "tokenizer.json"),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("command", ["inspect", "export"])
def test_bad_checkpoint_is_one_line(case, command, checkpoint_dir, tmp_path):
    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), broken)
    damage, expected = CASES[case]
    damage(broken)
    args = [command, str(broken)] + (["-o", str(tmp_path / "out.onnx")] if command == "export" else [])
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0]
    assert "Traceback" not in result.output


def test_debug_shows_traceback(tmp_path):
    result = CliRunner().invoke(main, ["--debug", "inspect", str(tmp_path / "nope")])
    assert result.exit_code != 0
    assert result.exception is not None and "no such directory" in str(result.exception)
