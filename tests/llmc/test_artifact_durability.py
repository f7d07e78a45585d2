"""Artifacts survive crashes: kill -9 at every stage of a compile and at every step of the write leaves no
partial artifact at the output, and the next compile cleans up and succeeds; two compiles of one output:
one wins, the other fails in one line; a full disk names the output; a flipped byte in any file of a
compiled artifact is refused at load, naming the file; a killed build's temporary files leave the cache.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from llmc import artifact as art
from llmc import artifact_writer as writer
from llmc import digests
from llmc.compiler.codegen import build
from llmc.compiler.compile import SIGNAL_AT_ENV, STAGES, compile_checkpoint
from llmc.errors import ArtifactError, CompileError

# One fresh interpreter imports the compiler once, then forks a child per stage that compiles with the
# test hook set; the parent never runs torch, so each child starts from a clean fork.
KILL_AT_EACH_STAGE = r"""
import json, os, sys
from llmc.compiler.compile import SIGNAL_AT_ENV, STAGES, compile_checkpoint
ckpt, out = sys.argv[1], sys.argv[2]
report = []
for stage in STAGES:
    pid = os.fork()
    if pid == 0:
        os.environ[SIGNAL_AT_ENV] = stage
        try:
            compile_checkpoint(ckpt, target="cpu", output=out)
        finally:
            os._exit(3)  # reached only when the hook did not fire
    _, status = os.waitpid(pid, 0)
    signal = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    report.append({"stage": stage, "signal": signal, "left": sorted(os.listdir(os.path.dirname(out)))})
print(json.dumps(report))
"""

# Rewrites OUT from the files and fields of the artifact SRC, and kills itself at POINT of write_artifact.
KILL_IN_WRITE = r"""
import json, os, shutil, signal, sys
from pathlib import Path
from llmc import artifact_writer as artifact

point, src, out = sys.argv[1], Path(sys.argv[2]), sys.argv[3]

def die(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGKILL)

def populate(tmp):
    for f in src.iterdir():
        if f.name != "manifest.json":
            shutil.copyfile(f, tmp / f.name)
    return json.loads((src / "manifest.json").read_text())

real_rename = os.rename
renames = []
def rename(a, b):
    if point == f"rename{len(renames)}":
        die()
    renames.append(b)
    real_rename(a, b)

if point == "hash":
    artifact._hash_tree = die
elif point == "manifest written":
    artifact.os.chmod = die
elif point == "old removed":
    artifact.shutil.rmtree = die
artifact.os.rename = rename
artifact.write_artifact(out, populate)
"""
WRITE_POINTS = ("hash", "manifest written", "rename0", "rename1", "old removed")


def _python(script: str, *args, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        check=False,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def compiled(checkpoint_dir, tmp_path_factory) -> Path:
    return compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path_factory.mktemp("art") / "m.cpu")


def test_kill_at_every_compile_stage(checkpoint_dir, tmp_path):
    out = tmp_path / "out" / "m.cpu"
    out.parent.mkdir()
    run = _python(KILL_AT_EACH_STAGE, checkpoint_dir("llama"), out)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout.splitlines()[-1])
    assert [r["stage"] for r in report] == list(STAGES)
    for r in report:
        assert r["signal"] == signal.SIGKILL, f"compile was not killed at {r['stage']}"
        assert "m.cpu" not in r["left"], f"killed at {r['stage']}, a partial artifact is at the output"
        # what this kill left (its lock and temporary dir); the earlier kills' leftovers were cleaned up
        assert [n[:16] for n in r["left"]] in ([".m.cpu.llmc-lock"], [".m.cpu.llmc-lock", ".m.cpu.llmc-tmp-"]), r
    compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=out)
    assert os.listdir(out.parent) == ["m.cpu"], "the re-run cleans up every leftover, its own lock included"
    art.load_artifact(out)


@pytest.mark.parametrize("point", WRITE_POINTS)
def test_kill_at_every_step_of_the_write(compiled, tmp_path, point):
    """Killed while replacing an artifact: the output is the old one or the new one, whole, or (killed between
    the two renames) absent until the next write puts the old one back; the next write succeeds."""
    out = tmp_path / "m.cpu"
    shutil.copytree(compiled, out)
    before = (out / "manifest.json").read_text()
    run = _python(KILL_IN_WRITE, point, compiled, out)
    assert run.returncode == -signal.SIGKILL, run.stderr[-2000:]
    if point == "rename1":
        assert not out.exists()
        writer._remove_stale_leftovers(tmp_path, held="")
        assert (out / "manifest.json").read_text() == before, "the renamed-away artifact is put back"
    art.load_artifact(out)
    _python(KILL_IN_WRITE, "none", compiled, out).check_returncode()
    assert os.listdir(tmp_path) == ["m.cpu"]
    art.load_artifact(out)


def _stopped(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


def test_two_compiles_into_one_output(checkpoint_dir, tmp_path):
    out = tmp_path / "m.cpu"
    cmd = [Path(sys.executable).with_name("llmc"), "compile", checkpoint_dir("llama"), "--target", "cpu", "-o", out]
    first = subprocess.Popen(
        cmd,
        env={**os.environ, SIGNAL_AT_ENV: "fuse:SIGSTOP"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not _stopped(first.pid):  # it holds the output's lock, stopped in the middle of its compile
            assert first.poll() is None and time.monotonic() < deadline, "the first compile never reached fuse"
            time.sleep(0.1)
        second = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)
        assert second.returncode == 1
        assert f"another llmc compile (pid {first.pid}) is writing it" in second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGCONT)
    assert first.wait(timeout=120) == 0, first.communicate()[1][-2000:]
    assert os.listdir(tmp_path) == ["m.cpu"]
    art.load_artifact(out)


def test_second_writer_fails_before_populating(compiled, tmp_path):
    out = tmp_path / "m.cpu"
    lock = writer._lock_path(tmp_path, "m.cpu")
    fd = writer._try_lock(lock)  # a live writer: it holds the lock and has written its pid
    os.write(fd, b"4242")
    try:
        with pytest.raises(ArtifactError, match=r"another llmc compile \(pid 4242\) is writing it"):
            writer.write_artifact(out, lambda tmp: pytest.fail("populate ran without the lock"))
    finally:
        writer._unlock(lock, fd)
    assert os.listdir(tmp_path) == []


def test_a_sweep_holding_the_lock_only_delays_a_writer(compiled, tmp_path):
    """Another write's sweep of leftovers holds a name's lock for a moment, with no pid in it: a writer of that
    name waits for it rather than failing."""
    lock = writer._lock_path(tmp_path, "m.cpu")
    fd = writer._try_lock(lock)
    threading.Timer(0.3, writer._unlock, (lock, fd)).start()
    writer.write_artifact(tmp_path / "m.cpu", _copy_populate(compiled))
    assert os.listdir(tmp_path) == ["m.cpu"]


def test_unwritable_output_directory_is_one_error(tmp_path):
    (tmp_path / "file").write_text("not a directory")
    with pytest.raises(ArtifactError, match="cannot create its directory"):
        writer.write_artifact(tmp_path / "file" / "m.cpu", lambda tmp: pytest.fail("populate ran"))
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", "-o", "ro", str(ro), str(ro)], check=False, capture_output=True)
    if os.access(ro, os.W_OK) and not os.statvfs(ro).f_flag & os.ST_RDONLY:
        return  # neither a read-only mount nor a permission denied here (root)
    try:
        with pytest.raises(ArtifactError, match=rf"cannot write in {ro}"):
            writer.write_artifact(ro / "m.cpu", lambda tmp: pytest.fail("populate ran"))
    finally:
        subprocess.run(["umount", str(ro)], check=False, capture_output=True)


def test_leftovers_of_a_live_writer_are_kept(compiled, tmp_path):
    (tmp_path / ".a.cpu.llmc-tmp-abcd1234").mkdir()  # a's writer is alive: it holds a's lock
    (tmp_path / ".b.cpu.llmc-tmp-abcd1234").mkdir()  # b's was killed: nobody holds b's lock
    (tmp_path / ".c.tmp-abcd1234").mkdir()  # not llmc's
    fd = writer._try_lock(writer._lock_path(tmp_path, "a.cpu"))
    try:
        _python(KILL_IN_WRITE, "none", compiled, tmp_path / "c.cpu").check_returncode()
        assert sorted(os.listdir(tmp_path)) == [
            ".a.cpu.llmc-lock",
            ".a.cpu.llmc-tmp-abcd1234",
            ".c.tmp-abcd1234",
            "c.cpu",
        ]
    finally:
        writer._unlock(writer._lock_path(tmp_path, "a.cpu"), fd)


def _copy_populate(src: Path, fail_after: str | None = None):
    def populate(tmp: Path) -> dict:
        for f in sorted(src.iterdir()):
            if f.name != "manifest.json":
                shutil.copyfile(f, tmp / f.name)
            if f.name == fail_after:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp / f.name))
        return json.loads((src / "manifest.json").read_text())

    return populate


def test_full_disk_names_the_output(compiled, tmp_path):
    out = tmp_path / "m.cpu"
    with pytest.raises(ArtifactError, match=rf"{out}: the disk is full.*nothing was written"):
        writer.write_artifact(out, _copy_populate(compiled, fail_after="model.so"))
    assert os.listdir(tmp_path) == []


def test_full_disk_keeps_the_old_artifact(compiled, tmp_path):
    out = writer.write_artifact(tmp_path / "m.cpu", _copy_populate(compiled))
    with pytest.raises(ArtifactError, match="the disk is full"):
        writer.write_artifact(out, _copy_populate(compiled, fail_after="weights.safetensors"))
    assert os.listdir(tmp_path) == ["m.cpu"]
    art.load_artifact(out)


def test_full_tmpfs(compiled, tmp_path):
    """A real full disk: a tmpfs smaller than the weights (needs root to mount; skipped otherwise)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)]
    if subprocess.run(mount, check=False, capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        with pytest.raises(ArtifactError, match=rf"{mnt / 'm.cpu'}: the disk is full"):
            writer.write_artifact(mnt / "m.cpu", _copy_populate(compiled))
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_full_build_cache_is_a_compile_error(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(build.tempfile, "mkstemp", full)
    with pytest.raises(CompileError, match=rf"{tmp_path}: the disk is full"):
        build.build_shared_library("int f() { return 1; }\n", cache_dir=tmp_path)


ARTIFACT_FILES = [
    "manifest.json",
    "model.cc",
    "model.so",
    "tokenizer.json",
    "tokenizer_config.json",
    "weights.safetensors",
]


def test_artifact_files_are_those_flipped(compiled):
    assert sorted(os.listdir(compiled)) == ARTIFACT_FILES, "a new file: add it to ARTIFACT_FILES"


@pytest.mark.parametrize("where", ["first", "middle", "last"])
@pytest.mark.parametrize("name", ARTIFACT_FILES)
def test_flipped_byte_is_refused_naming_the_file(compiled, tmp_path, name, where):
    out = tmp_path / "m.cpu"
    shutil.copytree(compiled, out)
    size = (out / name).stat().st_size
    offset = {"first": 0, "middle": size // 2, "last": size - 1}[where]
    with open(out / name, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 1]))
    with pytest.raises(ArtifactError, match=name):
        art.load_artifact(out)


def _dead_pid() -> int:
    dead = subprocess.Popen(["true"])
    dead.wait()
    return dead.pid


def test_killed_builds_temporary_files_are_removed(tmp_path):
    dead = _dead_pid()
    key_dir = tmp_path / ("0" * 64)
    key_dir.mkdir()
    killed = key_dir / f".lib.{build._HOST}-{dead}.abc_123.so.tmp"  # its build was killed
    live = key_dir / f".lib.{build._HOST}-{os.getpid()}.abc_123.so.tmp"  # a build in progress
    other_host = key_dir / f".model.cc.00000000-{dead}.abc_123.tmp"  # can't tell from here: kept a day
    old = key_dir / ".x.so.tmp"  # no owner in the name, a day old
    for p in (killed, live, other_host, old):
        p.write_bytes(b"partial")
    os.utime(old, (time.time() - 2 * 86400,) * 2)
    build.build_shared_library("int f() { return 1; }\n", cache_dir=tmp_path)
    assert not killed.exists() and not old.exists()
    assert live.exists() and other_host.exists()


def test_killed_digest_writers_temporary_files_are_removed(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    cache.mkdir()
    monkeypatch.setenv("LLMC_CACHE_DIR", str(cache))
    monkeypatch.setattr(digests, "_MIN_BYTES", 0)  # remember even a small file's digest
    killed, live = cache / f".digests.json.{_dead_pid()}", cache / f".digests.json.{os.getppid()}"
    for p in (killed, live):
        p.write_text("{")
    (tmp_path / "w").write_bytes(b"weights")
    digests.file_sha256(tmp_path / "w")
    assert not killed.exists() and live.exists() and (cache / "digests.json").is_file()
