"""Artifacts compiled from checkpoints on demand and kept in llmc's cache (`llmc run CHECKPOINT`, the bundled
model): compiled once per checkpoint, compiler version and host CPU, then reused while the checkpoint is
unchanged.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import sys
from pathlib import Path

from llmc import __version__
from llmc.artifact import ABI_VERSION, FORMAT_VERSION, resolve_kv_cache_dtype
from llmc.digests import checkpoint_hash, file_sha256
from llmc.host import cache_root, host_cpu_target


def cached_artifact(
    ckpt: Path, *, progress: bool = True, quant=None, weight_dtype: str = "auto", kv_cache_dtype: str = "auto"
) -> Path:
    """A CPU artifact of checkpoint `ckpt`, from the cache, compiled into it first if it is not there.

    Key: the checkpoint's content hash (a .gguf file's own sha256; digests.py remembers the hashes of big
    files), the compiler version, the artifact format and ABI versions (they change between releases during
    development), this host's
    CPU, so a cache shared across hosts or llmc builds never hands out an artifact another one cannot load,
    and the quantization asked for (quant, a QuantConfig; None is none), weight dtype and KV cache dtype.
    Processes that ask for the same key at once compile it once: the others wait on its lock, then reuse it.
    """
    kv_cache_dtype = resolve_kv_cache_dtype(kv_cache_dtype, cuda=False, weight_dtype=weight_dtype)
    isa = hashlib.sha256(json.dumps(host_cpu_target(), sort_keys=True).encode()).hexdigest()[:8]
    content = file_sha256(ckpt) if ckpt.is_file() else checkpoint_hash(ckpt)  # a GGUF file holds all of it
    key = f"{content[:24]}-llmc{__version__}-f{FORMAT_VERSION}-abi{ABI_VERSION}-cpu-{isa}"
    if quant is not None and quant.enabled:
        key += "-" + re.sub(r"[^a-z0-9]+", "-", quant.describe()).strip("-")  # int8-per-channel, int4-g32-lm-head
    key += (f"-{weight_dtype}" if weight_dtype != "auto" else "") + (
        f"-kv-{kv_cache_dtype}" if kv_cache_dtype != "float32" else ""
    )
    root = cache_root() / "artifacts"
    out = root / key
    if (out / "manifest.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            from llmc.compiler.compile import compile_checkpoint  # torch and TVM load only when it compiles

            if progress:
                print(f"compiling {ckpt} for this CPU (once; cached in {out})", file=sys.stderr)
            compile_checkpoint(ckpt, target="cpu", output=out, weight_dtype=weight_dtype, progress=progress,
                               quant=quant, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
    return out
