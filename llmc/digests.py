"""sha256 of large files, remembered by file identity so each file is hashed once, not at every load.

An 8B artifact's weights are 16 GB: reading them back to check the manifest would cost more than a load.
The packed-weights writer hashes as it writes and records the digest here; `file_sha256` hashes anything
else once. A digest is kept under the file's identity (device, inode, size, mtime and ctime in ns, and a
hash of its first and last 64 KiB), which survives the artifact's rename into place but not a rewrite,
in this process and in `<cache>/digests.json` across processes. Only files of 256 MiB and more are
remembered: small ones hash in milliseconds, and the sampled bytes plus the size make a reused inode with
a coarse timestamp harmless for big ones. NOTE: a change inside a big file that keeps its size, times and
sampled ends (bit rot) goes unseen; llmc accepts that, as build systems keyed on mtime do.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

_CHUNK = 1 << 20
_SAMPLE = 64 << 10
_MIN_BYTES = 256 << 20
_MAX_ENTRIES = 512
_memory: dict[str, str] = {}


def _identity(path: Path) -> str:
    st = os.stat(path)
    ends = hashlib.sha256()
    with open(path, "rb") as f:
        ends.update(f.read(_SAMPLE))
        f.seek(max(0, st.st_size - _SAMPLE))
        ends.update(f.read(_SAMPLE))
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{ends.hexdigest()[:16]}"


def _store() -> Path:
    from .artifact import cache_root

    return cache_root() / "digests.json"


def _load_store() -> dict[str, str]:
    try:
        data = json.loads(_store().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def remember_sha256(path: Path, digest: str) -> None:
    if os.stat(path).st_size < _MIN_BYTES:
        return
    key = _identity(path)
    _memory[key] = digest
    store = _load_store()
    store[key] = digest
    store = dict(list(store.items())[-_MAX_ENTRIES:])
    target = _store()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}")
        tmp.write_text(json.dumps(store))
        os.replace(tmp, target)
    except OSError:
        pass  # a read-only cache only costs a re-hash next time


def known_sha256(path: Path) -> str | None:
    """The remembered sha256 of this very file (same identity), or None."""
    if os.stat(path).st_size < _MIN_BYTES:
        return None
    key = _identity(path)
    return _memory.get(key) or _load_store().get(key)


def file_sha256(path: Path) -> str:
    known = known_sha256(path)
    if known is not None:
        return known
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    digest = h.hexdigest()
    remember_sha256(path, digest)
    return digest
