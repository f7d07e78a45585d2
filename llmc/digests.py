"""sha256 of files: an artifact's files (remembered by identity when large) and a checkpoint's (a cache key).

Large files are remembered by file identity so each is hashed once, not at every load.

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

from llmc.errors import LlmcError
from llmc.host import cache_root, pid_alive

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
        for left in target.parent.glob(f".{target.name}.*"):  # a killed writer's
            if left.suffix[1:].isdigit() and not pid_alive(int(left.suffix[1:])):
                left.unlink(missing_ok=True)
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


def checkpoint_hash(ckpt_dir: str | Path) -> str:
    """sha256 over a checkpoint's config, generation config, tokenizer files and weights (for cache keys).

    Each file contributes its name, size and sha256 (remembered for big files, above).
    """
    ckpt_dir = Path(ckpt_dir)
    names = [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "model.safetensors.index.json",
    ]
    files = [ckpt_dir / n for n in names if (ckpt_dir / n).is_file()]
    files += sorted(p for p in ckpt_dir.glob("*.safetensors") if p.is_file())
    if not (ckpt_dir / "config.json").is_file():
        raise LlmcError(f"{ckpt_dir}: no config.json", "is this a Hugging Face checkpoint directory?")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\0{file_sha256(p)}\0".encode())
    return h.hexdigest()
