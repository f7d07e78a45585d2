"""Writing an artifact atomically: built under a temporary name while holding the output's lock, then renamed.

`write_artifact` builds the directory under a temporary name next to the output and renames it into place
(an existing artifact is renamed away first and deleted last), so a half-written artifact never exists at
the output path. It holds `.<name>.llmc-lock` (flock) next to the output for the whole write: a second writer
of the same output fails at once, and leftovers of a killed writer (`.<name>.llmc-tmp-*`, `-old-*`) are
provably stale when their lock is free, so the next write into that directory removes them (a renamed-away
artifact whose replacement never arrived goes back to its name). A full disk is an ArtifactError that names
the output. The manifest it writes is completed and checked by llmc/manifest.py.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmc.digests import file_sha256
from llmc.errors import ArtifactError
from llmc.manifest import MANIFEST, check_manifest, complete_manifest

_LEFTOVER = re.compile(r"\.(?P<name>.+)\.llmc-(?P<kind>tmp|old)-[a-z0-9_]{8}")  # write_artifact's mkdtemp names


def _hash_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST:
            out[p.relative_to(root).as_posix()] = file_sha256(p)
    return out


def write_artifact(output: str | Path, populate: Callable[[Path], dict]) -> Path:
    """Build an artifact atomically: populate(tmp_dir) fills the files and returns the manifest fields.

    The fields are those of the manifest except magic, versions, files and manifest_sha256, which this adds:
    target (a name, completed from targets/<name>.toml, or a dict with "name" and "kind"; a cpu target gains
    this host's machine and ISA unless given), model_config (a ModelConfig or its dict), weight_dtype,
    quantization, block_size (default: the target's), kernels, passes, buffer_plan, tokenizer, and any extra
    key. Every file is hashed, manifest.json is written, and the directory is renamed into place,
    replacing an existing artifact. Any failure (populate raising included) removes the temporary dir and
    leaves `output` as it was. The output's lock is held throughout, populate included: a second writer of
    the same output gets an ArtifactError before it starts any work.
    """
    output = Path(output).absolute()
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ArtifactError(
            f"{output}: cannot create its directory ({e.strerror})", "choose another output path"
        ) from None
    with _output_lock(output):
        _remove_stale_leftovers(output.parent, held=output.name)
        if output.exists() and not (output / MANIFEST).is_file() and not _is_empty_dir(output):
            raise ArtifactError(
                f"{output}: exists and is not an llmc artifact", "choose another output path, or remove it first"
            )
        try:
            _write_into_place(output, populate)
        except OSError as e:
            if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            raise ArtifactError(
                f"{output}: the disk is full (no space left on the device of {output.parent}); nothing was written",
                "free space there, or choose another output path",
            ) from None
    return output


def _write_into_place(output: Path, populate: Callable[[Path], dict]) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.llmc-tmp-", dir=output.parent))
    old = None
    try:
        write_manifest(tmp, populate(tmp))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.llmc-old-", dir=output.parent))
            old.rmdir()
            os.rename(output, old)
        try:
            os.rename(tmp, output)
        except BaseException:
            if old is not None:
                os.rename(old, output)  # put the previous artifact back
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def write_manifest(directory: Path, fields: dict) -> dict:
    """Complete `fields` (as write_artifact does), hash every file of `directory` and write its manifest.json.

    write_artifact's last step; populate may call it too, to load what it has built so far (the quality gate
    runs the model it is building): write_artifact writes the manifest again over the final files and fields.
    """
    (directory / MANIFEST).unlink(missing_ok=True)
    manifest = complete_manifest(fields, _hash_tree(directory))
    check_manifest(manifest, directory)
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return manifest


def _is_empty_dir(p: Path) -> bool:
    return p.is_dir() and not any(p.iterdir())


@contextlib.contextmanager
def _output_lock(output: Path) -> Iterator[None]:
    """Hold the output's lock, or raise if a writer holds it. A holder that has not written its pid is another
    writer's sweep of leftovers (or a writer an instant after it locked): both let go within moments."""
    lock = _lock_path(output.parent, output.name)
    deadline = time.monotonic() + 2
    try:
        while (fd := _try_lock(lock)) is None:
            writer = _lock_holder(lock)
            if writer is not None or time.monotonic() > deadline:
                raise ArtifactError(
                    f"{output}: another llmc compile{f' (pid {writer})' if writer else ''} is writing it right now",
                    "wait for it to finish, or choose another output path",
                )
            time.sleep(0.05)
    except OSError as e:
        raise ArtifactError(
            f"{output}: cannot write in {output.parent} ({e.strerror})",
            "choose another output path, or make that directory writable",
        ) from None
    try:
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        _unlock(lock, fd)


def _lock_holder(lock: Path) -> int | None:
    """The pid a writer holding `lock` wrote into it, if any."""
    try:
        return int(lock.read_text())
    except (OSError, ValueError):
        return None


def _lock_path(parent: Path, name: str) -> Path:
    return parent / f".{name}.llmc-lock"


def _try_lock(lock: Path) -> int | None:
    """An fd holding the flock on `lock` (created if need be), or None while another process holds it.

    The lock file is removed on release, under the lock; an fd opened on a file that its holder has since
    removed locks nothing, so it is dropped and the path opened again.
    """
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        opened = os.fstat(fd)
        try:
            current = os.stat(lock)
            if (current.st_dev, current.st_ino) == (opened.st_dev, opened.st_ino):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _unlock(lock: Path, fd: int) -> None:
    lock.unlink(missing_ok=True)
    os.close(fd)


def _remove_stale_leftovers(parent: Path, held: str) -> None:
    """Remove what killed writers left in `parent`: temporary dirs, and renamed-away artifacts (put back under
    their name when nothing replaced them). A leftover is stale when the lock of its output name is free;
    `held` is the name whose lock this process holds."""
    leftovers: dict[str, list[tuple[str, Path]]] = {}
    with os.scandir(parent) as entries:
        for entry in entries:
            match = _LEFTOVER.fullmatch(entry.name)
            if match and entry.is_dir(follow_symlinks=False):
                leftovers.setdefault(match["name"], []).append((match["kind"], Path(entry.path)))
    stale = []
    for name, dirs in leftovers.items():
        lock = _lock_path(parent, name)
        fd = None if name == held else _try_lock(lock)
        if fd is None and name != held:
            continue  # a live writer's
        try:
            for kind, d in sorted(dirs, key=lambda kd: kd[1].stat().st_mtime, reverse=True):
                if kind == "old" and not (parent / name).exists():
                    os.rename(d, parent / name)
                else:
                    stale.append(d)
        finally:
            if fd is not None:
                _unlock(lock, fd)
    for d in stale:  # after the locks are free (no writer makes these random names again): a big rmtree is slow
        shutil.rmtree(d, ignore_errors=True)
