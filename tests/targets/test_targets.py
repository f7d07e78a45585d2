"""llmc.targets: a target is its TOML. Adding one is data (a TOML in $LLMC_TARGET_PATH) and compiles."""

import pytest

from llmc.artifact import load_artifact
from llmc.errors import CompileError
from llmc.targets import BUILTIN_DIR, load_target, target_names


def test_builtin_targets():
    assert {"cpu", "sm80", "sm89", "sm90"} <= set(target_names())
    cpu, sm90 = load_target("cpu"), load_target("sm90")
    assert cpu.kind == "cpu" and not cpu.is_cuda and cpu.source_file == "model.cc" and cpu.compiler == "g++"
    assert sm90.is_cuda and sm90.source_file == "model.cu" and sm90.compiler == "nvcc"
    assert sm90.build_flags[-2:] == ["-gencode", "arch=compute_90,code=sm_90"], "the gencode comes from the TOML"
    assert all(load_target(n).block_size == 16 for n in ("cpu", "sm80", "sm89", "sm90"))


def _sm120(directory):
    """sm120 as a user would add it: sm90.toml with its numbers changed, in a directory of its own."""
    text = (BUILTIN_DIR / "sm90.toml").read_text()
    for old, new in (
        ('"sm90"', '"sm120"'),
        ("compute_90,code=sm_90", "compute_120,code=sm_120"),
        ("compute_capability = 90", "compute_capability = 120"),
        ("block_size = 16", "block_size = 32"),
    ):
        assert old in text
        text = text.replace(old, new)
    (directory / "sm120.toml").write_text(text)


def test_target_path_adds_and_overrides(tmp_path, monkeypatch):
    _sm120(tmp_path)
    (tmp_path / "cpu.toml").write_text(
        (BUILTIN_DIR / "cpu.toml").read_text().replace("block_size = 16", "block_size = 8")
    )
    monkeypatch.setenv("LLMC_TARGET_PATH", str(tmp_path))
    assert "sm120" in target_names()
    assert load_target("sm120").gencode == "arch=compute_120,code=sm_120"
    assert load_target("cpu").block_size == 8, "a directory in $LLMC_TARGET_PATH comes before the built-in one"
    monkeypatch.delenv("LLMC_TARGET_PATH")
    with pytest.raises(CompileError, match=r"unknown target 'sm120'.*cpu, sm80.*LLMC_TARGET_PATH"):
        load_target("sm120")


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.replace('kind = "cuda"', 'kind = "tpu"'), "kind = 'tpu' is not one of cpu, cuda"),
        (lambda t: t.replace('name = "sm90"', 'name = "sm91"'), "name = 'sm91', but the file is named for 'sm90'"),
        (lambda t: t.replace('gencode = "arch=compute_90,code=sm_90"', ""), "a cuda target needs gencode"),
        (lambda t: t.replace("block_size = 16", "block_size = 0"), "block_size = 0"),
        (lambda t: t + "\n[[", "cannot be read"),
    ],
)
def test_a_broken_target_file_is_named(tmp_path, monkeypatch, edit, message):
    (tmp_path / "sm90.toml").write_text(edit((BUILTIN_DIR / "sm90.toml").read_text()))
    monkeypatch.setenv("LLMC_TARGET_PATH", str(tmp_path))
    with pytest.raises(CompileError, match=rf"sm90.toml: .*{message}"):
        load_target("sm90")


def test_a_new_gpu_target_is_a_toml(tmp_path, monkeypatch, checkpoint_dir):
    """sm120 from a temporary TOML: compile builds model.so for it, and the artifact loads by its kind."""
    from llmc.compiler.compile import compile_checkpoint

    (tmp_path / "targets").mkdir()
    _sm120(tmp_path / "targets")
    monkeypatch.setenv("LLMC_TARGET_PATH", str(tmp_path / "targets"))
    out = compile_checkpoint(checkpoint_dir("llama"), target="sm120", output=tmp_path / "model.sm120")
    monkeypatch.delenv("LLMC_TARGET_PATH")  # loading needs no target file: the manifest has the target
    a = load_artifact(out)
    assert a.target_name == "sm120" and a.is_cuda and a.source_path.name == "model.cu"
    assert a.target["gencode"] == "arch=compute_120,code=sm_120" and a.block_size == 32
    device_code = a.library_path.read_bytes()  # the fatbin records the architecture its cubin was built for
    assert b"-arch sm_120" in device_code and b"sm_90" not in device_code


def test_cli_names_an_unknown_target(tmp_path, checkpoint_dir):
    from click.testing import CliRunner

    from llmc.tools import cli

    r = CliRunner().invoke(
        cli.main, ["compile", str(checkpoint_dir("llama")), "--target", "sm999", "-o", str(tmp_path / "out")]
    )
    assert r.exit_code == 1 and "unknown target 'sm999'" in r.output and "LLMC_TARGET_PATH" in r.output
    assert "Traceback" not in r.output and not (tmp_path / "out").exists()
