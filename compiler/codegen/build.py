"""Compile generated C++ into a shared library, cached by content.

`build_shared_library(sources, flags=CPU_FLAGS)` compiles with g++ into
`<cache>/<key>/lib.so`, where key = sha256(source names and texts, flags, compiler and its
`--version`, and for `-march=native` the ISA the compiler resolves it to on this host). A hit costs
one stat. The sources are kept next to the .so for reading. Every file is written to a temporary name
in its final folder and moved into place with `os.replace`, so concurrent builds of the same key never
see a half-written file (both produce the same bytes; the last rename wins).

A build killed half-way leaves its temporary files behind. Their names carry the writer's host and pid
(`.lib.<host>-<pid>.<random>.so.tmp`), so the next build that compiles removes those whose process is gone
from this host, and any temporary file of a day old (another host's, or one without a pid).
A full disk under the cache is a CompileError that names the cache.

Cache root: llmc.host.cache_root()/build (`$LLMC_CACHE_DIR/build`, else `$XDG_CACHE_HOME/llmc/build`, else
`~/.cache/llmc/build`).

`-march=native` binds the .so to this host's ISA; the artifact manifest records the cpu target's flags and
this host's ISA, and loading checks the machine has it.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from llmc.errors import CompileError
from llmc.host import cache_root, pid_alive
from llmc.targets import load_target

# targets/cpu.toml's flags: kernel tests and probes build exactly as compile builds model.so
CPU_FLAGS: tuple[str, ...] = tuple(load_target("cpu").build_flags)
DEFAULT_COMPILER = "g++"
_COMPILED_SUFFIXES = (".cc", ".cpp", ".cxx", ".cu")
_STDERR_TAIL_LINES = 40
_STALE_SECONDS = 24 * 3600  # no build runs a day; a temp file that old is a killed build's, whoever wrote it
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]  # a cache may be shared across hosts
_OWNED_TEMP = re.compile(r"\..+\.(?P<host>[0-9a-f]{8})-(?P<pid>\d+)\.[A-Za-z0-9_]+\.(?:so\.)?tmp")


def default_cache_dir() -> Path:
    """Where builds are cached."""
    return cache_root() / "build"


@functools.cache
def compiler_version(compiler: str = DEFAULT_COMPILER) -> str:
    """`<compiler> --version`, first line; CompileError if the compiler cannot run."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise CompileError(
            f"cannot run the C++ compiler {compiler!r}: {e}", "install g++ (Debian/Ubuntu: apt-get install g++)"
        ) from e
    return out.strip().splitlines()[0] if out.strip() else "unknown"


@functools.cache
def _native_isa(compiler: str) -> str:
    """What -march=native means here (g++ -Q --help=target), hashed: a cache shared across hosts
    must not hand a .so built for another ISA."""
    try:
        out = subprocess.run(
            [compiler, "-march=native", "-Q", "--help=target"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):  # fall back to the kernel's view of the CPU
        try:
            out = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
        except OSError:
            out = ""
    return hashlib.sha256(out.encode()).hexdigest()


def build_key(sources: Mapping[str, str], flags: Sequence[str], compiler: str = DEFAULT_COMPILER) -> str:
    """The cache key of a build: sha256 over everything that changes the produced .so."""
    ident = {
        "sources": sorted(sources.items()),
        "flags": list(flags),
        "compiler": compiler,
        "version": compiler_version(compiler),
        "native": _native_isa(compiler) if any("=native" in f for f in flags) else None,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()


def _temp_prefix(name: str) -> str:
    return f".{name}.{_HOST}-{os.getpid()}."


def _remove_stale_temps(cache: Path) -> None:
    """Delete the temporary files of killed builds under `cache` (see the module docstring)."""
    now = time.time()
    for temp in cache.glob("*/**/.*.tmp"):  # a build's folder and its subfolders (headers in sim/)
        owner = _OWNED_TEMP.fullmatch(temp.name)
        try:
            stale = (
                owner is not None
                and owner["host"] == _HOST
                and not pid_alive(int(owner["pid"]))
                or now - temp.lstat().st_mtime > _STALE_SECONDS
            )
            if stale:
                temp.unlink()
        except OSError:
            pass  # removed by another build meanwhile


def _write_atomic(path: Path, data: str) -> None:
    if path.is_file() and path.read_text() == data:
        return
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path.name), suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def build_shared_library(
    sources: Mapping[str, str] | str,
    *,
    flags: Sequence[str] = CPU_FLAGS,
    cache_dir: str | os.PathLike | None = None,
    compiler: str = DEFAULT_COMPILER,
) -> Path:
    """Compile `sources` ({file name: text}, or one C++ text) into a shared library; return its path.

    Files ending in .cc/.cpp/.cxx are compiled; the others (headers) sit next to them, so
    `#include "common.h"` finds them. A name may name a subfolder (`sim/llmc_sim.h`), relative to the others.
    Raises CompileError with the compiler's stderr tail on failure.
    """
    if isinstance(sources, str):
        sources = {"module.cc": sources}
    sources = dict(sources)
    for name in sources:
        if not name or "\\" in name or any(not part or part.startswith(".") for part in name.split("/")):
            raise CompileError(
                f"bad source file name {name!r}",
                "use a plain file name such as model.cc, or folder/name for a header in a subfolder",
            )
    units = sorted(n for n in sources if n.endswith(_COMPILED_SUFFIXES))
    if not units:
        raise CompileError(f"nothing to compile among {sorted(sources)}", "give at least one .cc file")

    key = build_key(sources, flags, compiler)
    out_dir = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    out_dir = out_dir / key
    lib = out_dir / "lib.so"
    if lib.is_file():
        return lib

    try:
        _remove_stale_temps(out_dir.parent)
        out_dir.mkdir(parents=True, exist_ok=True)
        for name, text in sources.items():
            (out_dir / name).parent.mkdir(parents=True, exist_ok=True)
            _write_atomic(out_dir / name, text)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=_temp_prefix("lib"), suffix=".so.tmp")
        os.close(fd)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise CompileError(
                f"{out_dir.parent}: the disk is full (no space left for the build cache)",
                "free space there, or set $LLMC_CACHE_DIR to a disk with room",
            ) from None
        raise
    objects = [f"{tmp[: -len('.so.tmp')]}.{i}.o.tmp" for i in range(len(units))] if len(units) > 1 else []
    try:
        if objects:  # each unit on its own core, then one link
            with ThreadPoolExecutor(min(len(units), os.cpu_count() or 1)) as pool:
                list(pool.map(lambda u, o: _run(compiler, [*flags, "-c", "-o", o, u], out_dir), units, objects))
            _run(compiler, [*flags, "-o", tmp, *objects], out_dir)
        else:
            _run(compiler, [*flags, "-o", tmp, *units], out_dir)
        os.replace(tmp, lib)
    finally:
        for path in [tmp, *objects]:
            Path(path).unlink(missing_ok=True)
    return lib


def _run(compiler: str, args: list[str], cwd: Path) -> None:
    cmd = [compiler, *args]
    try:
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    except OSError as e:
        raise CompileError(f"cannot run {compiler} in {cwd}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-_STDERR_TAIL_LINES:])
        sources = [a for a in args if a.endswith(_COMPILED_SUFFIXES)]
        raise CompileError(
            f"{compiler} failed (exit {proc.returncode}) building {', '.join(sources) or 'the library'}:\n{tail}",
            f"sources kept in {cwd}; command: {' '.join(cmd)}",
        )


def clear_cache(cache_dir: str | os.PathLike | None = None) -> None:
    """Remove every cached build (e.g. after a compiler upgrade left old ones behind)."""
    shutil.rmtree(Path(cache_dir) if cache_dir is not None else default_cache_dir(), ignore_errors=True)
