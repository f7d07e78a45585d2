"""Every path-taking option refuses a path of the wrong kind in one line, before any work, and leaves what is
there as it was: a directory where a file goes (or a directory that holds no model or artifact), a device, a
missing parent directory, and a symlink out of place (an output path that is a link; an input link that leads
nowhere). An input that is a symlink to a file of the right kind is fine."""

from __future__ import annotations

import os
import stat

import pytest
from click.testing import CliRunner

from llmc.tools.cli import main

SHAPE = "gemm:n=64,k=64,wdtype=f32,has_bias=0"


def _device(path):
    """A character device (/dev/null's numbers) where this user may make one, else a FIFO: either is a file
    that is not a regular file. Never a real /dev node: as root, writing over one replaces it."""
    try:
        os.mknod(path, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except PermissionError:
        os.mkfifo(path)
    return path


# option -> (its command line for a path P, what it takes: input, output file, output dir, model)
OPTIONS = {
    "--db": (lambda t, p: ["tune", "--shape", SHAPE, "--budget", "0", "--db", p], "output file"),
    "--tuning-db": (lambda t, p: ["compile", t["ckpt"], "-o", t["tmp"] / "out", "--tuning-db", p], "input"),
    "--calibration": (
        lambda t, p: ["compile", t["ckpt"], "-o", t["tmp"] / "out", "--quant", "int8", "--calibration", p],
        "input",
    ),
    "-o (compile)": (lambda t, p: ["compile", t["ckpt"], "-o", p], "output dir"),
    "-o (export)": (lambda t, p: ["export", t["ckpt"], "-o", p], "output file"),
    "--draft": (
        lambda t, p: ["run", t["tmp"] / "no-model", "--prompt", "hi", "--speculative", "draft", "--draft", p],
        "model",
    ),
    "--text": (lambda t, p: ["eval", "ppl", t["tmp"] / "no-model", "--text", p], "input"),
}


def _bad(kind: str, takes: str, tmp):
    """A path of the bad `kind` for an option that takes `takes`, and the words its error must hold."""
    if kind == "directory":
        d = tmp / "dir"
        d.mkdir()
        (d / "stray.txt").write_text("not a model")
        words = {"output dir": "not an llmc artifact", "model": "neither an llmc artifact"}.get(takes, "a directory")
        return d, words
    if kind == "device":
        return _device(tmp / "dev"), "not a regular file" if takes != "output dir" else "not a directory"
    if kind == "missing parent":
        return tmp / "nope" / "x", f"no such directory {tmp / 'nope'}"
    assert kind == "symlink"
    link = tmp / "link"
    if takes in ("output file", "output dir"):  # a link to the right kind of thing: still not replaced
        target = tmp / "target"
        target.mkdir() if takes == "output dir" else target.write_text("{}")
        link.symlink_to(target)
        return link, "is a symlink"
    link.symlink_to(tmp / "gone")
    return link, "which does not exist"


def _snapshot(path):
    """What is at `path` (not followed), to check that a refusal left it as it was."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    listing = sorted(os.listdir(path)) if stat.S_ISDIR(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_ino, link, listing


@pytest.mark.parametrize("kind", ["directory", "device", "missing parent", "symlink"])
@pytest.mark.parametrize("option", OPTIONS)
def test_a_path_of_the_wrong_kind_is_refused_in_one_line(option, kind, checkpoint_dir, tmp_path):
    command, takes = OPTIONS[option]
    path, words = _bad(kind, takes, tmp_path)
    before = _snapshot(path), sorted(os.listdir(tmp_path))
    t = {"ckpt": checkpoint_dir("llama"), "tmp": tmp_path}
    result = CliRunner().invoke(main, [str(a) for a in command(t, path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    flag = option.split()[0]
    assert flag in lines[0] and str(path) in lines[0] and words in lines[0], lines[0]
    assert (_snapshot(path), sorted(os.listdir(tmp_path))) == before, "nothing was written, created or replaced"


def test_an_input_symlink_to_a_file_is_followed(checkpoint_dir, tmp_path):
    """--tuning-db through a link to a database of another target: the error names what the file holds."""
    target = tmp_path / "real.json"
    target.write_text('{"version": 1, "target": "sm90", "entries": []}')
    link = tmp_path / "link.json"
    link.symlink_to(target)
    result = CliRunner().invoke(
        main, ["compile", str(checkpoint_dir("llama")), "-o", str(tmp_path / "out"), "--tuning-db", str(link)]
    )
    assert result.exit_code == 1 and "is for target 'sm90'" in result.output, result.output


def test_a_missing_input_file_is_refused(checkpoint_dir, tmp_path):
    for option in ("--tuning-db", "--calibration", "--text"):
        command, _ = OPTIONS[option]
        missing = tmp_path / "typo.json"
        result = CliRunner().invoke(
            main, [str(a) for a in command({"ckpt": checkpoint_dir("llama"), "tmp": tmp_path}, missing)]
        )
        lines = result.output.strip().splitlines()
        assert result.exit_code == 1 and len(lines) == 1, result.output
        assert f"{option} {missing}: no such file" in lines[0]
        assert not (tmp_path / "out").exists()
