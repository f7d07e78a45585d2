"""The compiled artifact: the boundary between compiler and runtime, written atomically and checked when loaded.

The compiler writes artifacts through this module and the runtime reads them through it; it imports
nothing from either side (the model-config schema is llmc/model_config.py, digests llmc/digests.py, the
cache directory and host ISA llmc/host.py, targets llmc.targets).

Layout:
    manifest.json          what was built, for which target, the sha256 of every other file, and of its own fields
    model.so               the module (C ABI of docs/contracts.md)
    model.cc | model.cu    its generated source (.cu for targets of kind "cuda"), kept to be read
    weights.safetensors    packed weights (compiler/weights.py)
    tokenizer.json         and tokenizer_config.json when the checkpoint has one

`write_artifact` builds the directory under a temporary name next to the output and renames it into place
(an existing artifact is renamed away first and deleted last), so a half-written artifact never exists at
the output path. It holds `.<name>.llmc-lock` (flock) next to the output for the whole write: a second writer
of the same output fails at once, and leftovers of a killed writer (`.<name>.llmc-tmp-*`, `-old-*`) are
provably stale when their lock is free, so the next write into that directory removes them (a renamed-away
artifact whose replacement never arrived goes back to its name). A full disk is an ArtifactError that names
the output. `load_artifact` checks the manifest versions, the manifest's own digests, every file's sha256,
and that a CPU target is this machine; each mismatch is an ArtifactError that says what to run.

The manifest is untrusted input: any text either loads or is one ArtifactError of one line. Its `files`
are plain relative names inside the artifact (no "..", no absolute path, nothing a symlink leads outside
to), checked before anything is opened, and every field the runtime reads is type-checked.

The manifest's `manifest_sha256` maps each of its other top-level fields to the sha256 of that field's
canonical JSON, so an edit names the field it touched (model_config, block_size, tokenizer, ...). It
guards against edits and damage, not against someone who recomputes the digests on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import json
import math
import os
import platform
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from llmc import __version__
from llmc.digests import file_sha256
from llmc.dtypes import ELEMENT_DTYPES
from llmc.errors import ArtifactError, CompileError
from llmc.host import host_cpu_isa, host_cpu_target
from llmc.kernel_program import decode_weight_bytes, schema_problem
from llmc.model_config import ModelConfig
from llmc.targets import KINDS, SOURCE_FILE, load_target

MAGIC = "llmc-artifact"
FORMAT_VERSION = 3  # 2: the target's kind, block_size and manifest_sha256 are required; 3: kernel_program is JSON
ABI_VERSION = 2  # docs/contracts.md LLMC_ABI_VERSION
MANIFEST = "manifest.json"
MANIFEST_DIGESTS = "manifest_sha256"
LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# The SamplingParams fields a checkpoint's generation_config.json may set (compiler/frontend/checkpoint.py),
# every request's defaults: the runtime passes them on as keyword arguments.
GENERATION_DEFAULT_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")

_MAX_MANIFEST_BYTES = 64 << 20  # an 8B model's manifest is well under 1 MiB; more is not one llmc wrote
_FILE_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")  # one component of a `files` name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
_ISA_NAME = re.compile(r"[A-Za-z0-9_.]{1,64}")
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.llmc-(?P<kind>tmp|old)-[a-z0-9_]{8}")  # write_artifact's mkdtemp names

# ----------------------------------------------------------------------------------------------------------
# Hashing


def _hash_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST:
            out[p.relative_to(root).as_posix()] = file_sha256(p)
    return out


def _canonical_sha256(value) -> str:
    """sha256 of a JSON value's canonical text: key order and whitespace do not change it."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Writing


def seal_manifest(m: dict) -> dict:
    """The manifest with `manifest_sha256` (re)computed over its other fields."""
    fields = {k: v for k, v in m.items() if k != MANIFEST_DIGESTS}
    return {**fields, MANIFEST_DIGESTS: {k: _canonical_sha256(v) for k, v in fields.items()}}


def _complete_target(target) -> dict:
    """A target name, or a dict with "name": completed from its TOML unless it already says its kind."""
    if isinstance(target, str):
        target = {"name": target}
    if not isinstance(target, dict) or not isinstance(target.get("name"), str):
        raise ArtifactError(f"manifest: target {target!r} has no name")
    if "kind" not in target:
        try:
            target = {**load_target(target["name"]).raw, **target}
        except CompileError as e:
            raise ArtifactError(f"manifest: target {target['name']!r}: {e.what}", e.hint) from None
    if target["kind"] == "cpu":
        target = {**host_cpu_target(), **target}
    return target


def _complete_manifest(fields: dict, files: dict[str, str]) -> dict:
    if not isinstance(fields, dict):
        raise TypeError(f"populate must return the manifest fields as a dict, got {type(fields).__name__}")
    fields = dict(fields)
    target = _complete_target(fields.pop("target", None))
    block_size = fields.pop("block_size", None) or (target.get("defaults") or {}).get("block_size")
    config = fields.pop("model_config", None)
    if isinstance(config, ModelConfig):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ArtifactError("manifest: model_config is missing")
    for reserved in ("magic", "format_version", "abi_version", "compiler_version", "files", MANIFEST_DIGESTS):
        fields.pop(reserved, None)
    manifest = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "abi_version": ABI_VERSION,
        "compiler_version": __version__,
        "target": target,
        "model_config": config,
        "weight_dtype": fields.pop("weight_dtype", None),
        "quantization": fields.pop("quantization", "none"),
        "block_size": block_size,
        "kv_cache_dtype": fields.pop("kv_cache_dtype", "float32"),
        "kernels": fields.pop("kernels", []),
        "passes": fields.pop("passes", {}),
        "buffer_plan": fields.pop("buffer_plan", {}),
        "tokenizer": {"chat_template": None, "bos_token": None, "eos_token": None, **fields.pop("tokenizer", {})},
        **fields,
        "files": files,
    }
    return seal_manifest(json.loads(json.dumps(manifest)))  # digests over what a reader will parse


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
            raise ArtifactError(f"{output}: the disk is full (no space left on the device of {output.parent}); "
                                "nothing was written", "free space there, or choose another output path"
                                ) from None  # fmt: skip
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
    manifest = _complete_manifest(fields, _hash_tree(directory))
    _check_manifest(manifest, directory)
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
                raise ArtifactError(f"{output}: another llmc compile{f' (pid {writer})' if writer else ''} is "
                                    "writing it right now", "wait for it to finish, or choose another output path")  # fmt: skip
            time.sleep(0.05)
    except OSError as e:
        raise ArtifactError(f"{output}: cannot write in {output.parent} ({e.strerror})",
                            "choose another output path, or make that directory writable") from None  # fmt: skip
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


# ----------------------------------------------------------------------------------------------------------
# Loading


@dataclasses.dataclass
class Artifact:
    path: Path
    manifest: dict
    config: ModelConfig

    @property
    def target(self) -> dict:
        return self.manifest["target"]

    @property
    def target_name(self) -> str:
        return self.manifest["target"]["name"]

    @property
    def kind(self) -> str:
        """How the module runs: "cpu" or "cuda" (llmc.targets.KINDS), as the manifest's target records it."""
        return self.manifest["target"]["kind"]

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def block_size(self) -> int:
        """The KV cache block size (tokens) the module is built for."""
        return self.manifest["block_size"]

    @property
    def library_path(self) -> Path:
        return self.path / LIBRARY

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS

    @property
    def source_path(self) -> Path:
        return self.path / SOURCE_FILE[self.kind]

    @property
    def tokenizer_path(self) -> Path:
        return self.path / TOKENIZER

    @property
    def tokenizer_info(self) -> dict:
        return self.manifest.get("tokenizer") or {}

    @property
    def chat_template(self) -> str | None:
        return self.tokenizer_info.get("chat_template")

    @property
    def bos_token(self) -> str | None:
        return self.tokenizer_info.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.tokenizer_info.get("eos_token")

    @property
    def weight_dtype(self) -> str | None:
        return self.manifest.get("weight_dtype")

    @property
    def kv_dtype(self) -> str:
        """What the module's KV cache stores (the manifest's kv_cache_dtype), one of ELEMENT_DTYPES. A manifest
        without the field was written before it existed, by modules whose cache was float32."""
        return self.manifest.get("kv_cache_dtype", "float32")

    @property
    def weight_bytes(self) -> int:
        """Bytes of tensor data in weights.safetensors (the file less its header)."""
        return safetensors_data_bytes(self.weights_path)

    @property
    def decode_weight_bytes(self) -> int:
        """Bytes of weights a one-token decode step reads (`decode_weight_bytes` of the kernel program: one row of
        the embedding table, every other weight in full); all of weight_bytes for a manifest without a program."""
        if "kernel_program" not in self.manifest:
            return self.weight_bytes
        return sum(decode_weight_bytes(self.manifest["kernel_program"]).values())


def safetensors_data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


def recompile_hint(path: Path, target: str = "cpu") -> str:
    return f"recompile it: llmc compile CHECKPOINT --target {target} -o {path}"


def _show(value, limit: int = 60) -> str:
    """A manifest value in a message: its repr, which is one line, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _recorded_target_name(m: dict) -> str:
    """The target a (possibly damaged) manifest names, for the recompile hint."""
    target = m.get("target")
    name = target.get("name") if isinstance(target, dict) else None
    return name if isinstance(name, str) and _TARGET_NAME.fullmatch(name) else "cpu"


def _is_file_name(rel) -> bool:
    """A name llmc writes into `files`: relative, inside the artifact, of plain parts (no "", ".", "..")."""
    return (isinstance(rel, str) and rel != MANIFEST and len(rel) <= 255
            and all(_FILE_PART.fullmatch(part) for part in rel.split("/")))  # fmt: skip


def _is_int(value, low: int = 1, high: int = 2**31 - 1) -> bool:
    return type(value) is int and low <= value <= high  # bool is no int here; the C ABI takes int32


def _check_manifest(m: dict, path: Path) -> None:
    """Structure and types (no hashing) of every field the runtime reads: target, block_size, files (plain
    names inside the artifact, the required ones listed), tokenizer, weight_dtype, kv_cache_dtype,
    kernel_program (llmc/kernel_program.py's schema) and generation_defaults."""
    damaged = "the manifest is damaged; recompile the artifact"
    target = m.get("target")
    name = target.get("name") if isinstance(target, dict) else None
    if not isinstance(name, str) or not _TARGET_NAME.fullmatch(name) or target.get("kind") not in KINDS:
        raise ArtifactError(f"{path}: manifest target {_show(target)} has no name or no kind of {', '.join(KINDS)}",
                            damaged)  # fmt: skip
    hint = recompile_hint(path, name)
    machine, isa = target.get("machine"), target.get("isa")
    if not (machine is None or isinstance(machine, str) and _ISA_NAME.fullmatch(machine)) or not (
        isa is None or isinstance(isa, list) and all(isinstance(f, str) and _ISA_NAME.fullmatch(f) for f in isa)
    ):
        raise ArtifactError(f"{path}: manifest target machine {_show(machine)} or isa {_show(isa)} is not a name "
                            "or a list of names", damaged)  # fmt: skip
    block_size = m.get("block_size")
    if not _is_int(block_size):
        raise ArtifactError(f"{path}: manifest block_size {_show(block_size)} is not a positive integer", hint)
    files = m.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: manifest lists no files", damaged)
    for rel, digest in files.items():
        if not _is_file_name(rel):
            raise ArtifactError(f"{path}: the manifest lists a file {_show(rel)}, which is not a plain name inside "
                                "the artifact; nothing was read", damaged)  # fmt: skip
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ArtifactError(f"{path}: the manifest's sha256 of {rel} is {_show(digest)}, not 64 hex digits", hint)
    for required in (LIBRARY, WEIGHTS, TOKENIZER, SOURCE_FILE[target["kind"]]):
        if required not in files:
            raise ArtifactError(f"{path}: the manifest lists no {required}", hint)
    tokenizer = m.get("tokenizer")
    if not isinstance(tokenizer, dict) or not all(
        isinstance(tokenizer.get(k), str | None) for k in ("chat_template", "bos_token", "eos_token")
    ):
        raise ArtifactError(f"{path}: manifest tokenizer {_show(tokenizer)} is not an object of strings", hint)
    if not isinstance(m.get("weight_dtype"), str | None):
        raise ArtifactError(f"{path}: manifest weight_dtype {_show(m['weight_dtype'])} is not a name", hint)
    kv_dtype = m.get("kv_cache_dtype", "float32")
    if not isinstance(kv_dtype, str) or kv_dtype not in ELEMENT_DTYPES:
        raise ArtifactError(f"{path}: manifest kv_cache_dtype {_show(kv_dtype)} is not one of "
                            f"{', '.join(ELEMENT_DTYPES)}", hint)  # fmt: skip
    if "kernel_program" in m and (problem := schema_problem(m["kernel_program"])):
        raise ArtifactError(f"{path}: manifest kernel_program {problem}", hint)
    defaults = m.get("generation_defaults")
    if not (defaults is None or isinstance(defaults, dict) and all(
        k in GENERATION_DEFAULT_KEYS and type(v) in (int, float) for k, v in defaults.items()
    )):  # fmt: skip
        raise ArtifactError(f"{path}: manifest generation_defaults {_show(defaults)} are not sampling parameters "
                            f"(numbers for {', '.join(GENERATION_DEFAULT_KEYS)})", hint)  # fmt: skip


def _check_seal(m: dict, path: Path) -> None:
    """Every field of the manifest still has the sha256 recorded when it was written."""
    recorded = m.get(MANIFEST_DIGESTS)
    hint = recompile_hint(path, _recorded_target_name(m))
    if not isinstance(recorded, dict):
        raise ArtifactError(f"{path / MANIFEST}: no {MANIFEST_DIGESTS} (the manifest's own digests)", hint)
    fields = {k: v for k, v in m.items() if k != MANIFEST_DIGESTS}
    changed = sorted(k for k in fields.keys() | recorded.keys()
                     if k not in recorded or k not in fields or _canonical_sha256(fields[k]) != recorded[k])  # fmt: skip
    if changed:
        named = ", ".join(k if k.isidentifier() else _show(k) for k in changed[:8])
        raise ArtifactError(f"{path / MANIFEST}: field {named} was edited or damaged after compile "
                            f"(its sha256 does not match {MANIFEST_DIGESTS})", hint)  # fmt: skip


def _check_config(d, path: Path, hint: str) -> None:
    """model_config has every ModelConfig field, of its type, in range: the runtime sizes buffers from it."""
    if not isinstance(d, dict):
        raise ArtifactError(f"{path}: manifest model_config {_show(d)} is not an object", hint)
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(k for k in d if k not in fields)
    missing = sorted(k for k, f in fields.items() if k not in d and f.default is dataclasses.MISSING)
    if unknown or missing:
        odd = ", ".join(_show(k) for k in unknown[:4])
        raise ArtifactError(f"{path}: manifest model_config " + (f"has unknown fields {odd}" if unknown else
                            f"lacks {', '.join(missing)}"), hint)  # fmt: skip
    for key, value in d.items():
        if not _CONFIG_TYPES[fields[key].type](value):
            raise ArtifactError(f"{path}: manifest model_config {key} {_show(value)} is not a {fields[key].type} "
                                "in range", hint)  # fmt: skip
    problem = ModelConfig.from_dict(d).inconsistency()
    if problem:
        raise ArtifactError(f"{path}: manifest model_config is inconsistent: {problem}", hint)


def _finite_positive(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


# ModelConfig's field types (as annotated) -> what a manifest value of that type must be
_CONFIG_TYPES: dict[str, Callable[[object], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": _finite_positive,
    "bool": lambda v: isinstance(v, bool),
    "dict | None": lambda v: v is None or isinstance(v, dict),
    "int | None": lambda v: v is None or _is_int(v, 0),
    "tuple[int, ...]": lambda v: isinstance(v, list) and all(_is_int(i, 0) for i in v),
}


def _parse_manifest(path: Path) -> dict:
    """manifest.json of an artifact dir, parsed (with limits on size and nesting) and its magic checked."""
    if not path.exists():
        raise ArtifactError(
            f"{path}: no such artifact", "compile one: llmc compile CHECKPOINT --target cpu -o " + str(path)
        )
    if not path.is_dir():
        raise ArtifactError(f"{path}: not an artifact directory", "pass the directory llmc compile -o wrote")
    mpath = path / MANIFEST
    if not mpath.is_file():
        if (path / "config.json").is_file():
            raise ArtifactError(f"{path}: is a checkpoint, not a compiled artifact",
                                f"compile it first: llmc compile {path} --target cpu -o OUT")  # fmt: skip
        raise ArtifactError(f"{path}: not an llmc artifact (no {MANIFEST})", "compile one with llmc compile")
    try:
        with open(mpath, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"more than {_MAX_MANIFEST_BYTES >> 20} MiB")
        m = json.loads(raw.decode())
        if _nesting_exceeds(m, 32):
            raise ValueError("nested more than 32 levels deep")
    except OSError as e:
        raise ArtifactError(f"{mpath}: cannot be read ({e.strerror})", "check its permissions") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArtifactError(
            f"{mpath}: corrupt manifest ({_show(str(e), 120)[1:-1]})", "recompile the artifact"
        ) from None
    if not isinstance(m, dict) or m.get("magic") != MAGIC:
        raise ArtifactError(f"{path}: {MANIFEST} is not an llmc artifact manifest", "recompile the artifact")
    return m


def _nesting_exceeds(value, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (hashing it again must not exhaust the stack)."""
    level = [value]
    for _ in range(limit):
        level = [v for c in level if isinstance(c, dict | list) for v in (c.values() if isinstance(c, dict) else c)]
        if not level:
            return False
    return True


def _check_versions(m: dict, path: Path) -> None:
    version = m.get("compiler_version")
    by = version if isinstance(version, str) and re.fullmatch(r"[\w.+-]{1,40}", version) else "?"
    for key, want in (("format_version", FORMAT_VERSION), ("abi_version", ABI_VERSION)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: artifact {key.replace('_', ' ')} {_show(m.get(key))} (compiled by llmc {by}), but llmc "
                f"{__version__} reads version {want}",
                recompile_hint(path, _recorded_target_name(m)),
            )


def read_manifest(path: str | Path) -> dict:
    """manifest.json of an artifact dir, with magic and versions checked (no file hashing)."""
    path = Path(path)
    m = _parse_manifest(path)
    _check_versions(m, path)
    return m


def load_artifact(path: str | Path, *, verify: bool = True, check_target: bool = True) -> Artifact:
    """Open an artifact: versions, the manifest's and every file's sha256 (verify), the manifest's structure and
    types, a CPU target against this host. Every failure is one ArtifactError; no file outside `path` is read."""
    path = Path(path)
    m = _parse_manifest(path)
    sealed = isinstance(m.get(MANIFEST_DIGESTS), dict)
    if verify and sealed:  # first: a damaged version field is damage, not an artifact of another llmc
        _check_seal(m, path)
    _check_versions(m, path)
    if verify and not sealed:
        _check_seal(m, path)
    _check_manifest(m, path)
    target_name = m["target"]["name"]
    hint = recompile_hint(path, target_name)
    _check_config(m.get("model_config"), path, hint)
    config = ModelConfig.from_dict(m["model_config"])
    if verify:
        root = os.path.realpath(path)
        for rel, digest in m["files"].items():
            f = path / rel
            if os.path.commonpath([root, os.path.realpath(f)]) != root:
                raise ArtifactError(f"{path}: file {rel} is a symlink out of the artifact; nothing was read", hint)
            if not f.is_file():
                raise ArtifactError(f"{path}: file {rel} is missing (or not a regular file)", hint)
            try:
                actual = file_sha256(f)
            except OSError as e:
                raise ArtifactError(f"{path}: file {rel} cannot be read ({e.strerror})", hint) from None
            if actual != digest:
                raise ArtifactError(f"{path}: file {rel} is corrupt (its sha256 does not match the manifest)", hint)
    if check_target and m["target"]["kind"] == "cpu":
        check_cpu_target(m["target"], path)
    return Artifact(path=path, manifest=m, config=config)


def check_cpu_target(target: dict, path: Path) -> None:
    """A CPU artifact (built with -march=native) runs only where the CPU has every ISA extension it recorded."""
    machine = platform.machine()
    if target.get("machine") and target["machine"] != machine:
        raise ArtifactError(f"{path}: built for another CPU ({target['machine']}; this machine is {machine})",
                            recompile_hint(path))  # fmt: skip
    host = set(host_cpu_isa())
    missing = sorted(set(target.get("isa") or ()) - host) if host else []
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ArtifactError(f"{path}: built for another CPU (it uses {shown}, which this CPU lacks)",
                            recompile_hint(path))  # fmt: skip
