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
the output path. `load_artifact` checks the manifest versions, the manifest's own digests, every file's
sha256, and that a CPU target is this machine; each mismatch is an ArtifactError that says what to run.

The manifest's `manifest_sha256` maps each of its other top-level fields to the sha256 of that field's
canonical JSON, so an edit names the field it touched (model_config, block_size, tokenizer, ...). It
guards against edits and damage, not against someone who recomputes the digests on purpose.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llmc import __version__
from llmc.digests import file_sha256
from llmc.errors import ArtifactError, CompileError
from llmc.host import host_cpu_isa, host_cpu_target
from llmc.model_config import ModelConfig
from llmc.targets import KINDS, SOURCE_FILE, load_target

MAGIC = "llmc-artifact"
FORMAT_VERSION = 2  # 2: the target's kind, block_size and manifest_sha256 are required
ABI_VERSION = 1  # docs/contracts.md LLMC_ABI_VERSION

MANIFEST = "manifest.json"
MANIFEST_DIGESTS = "manifest_sha256"
LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

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
    leaves `output` as it was.
    """
    output = Path(output).absolute()
    if output.exists() and not (output / MANIFEST).is_file() and not _is_empty_dir(output):
        raise ArtifactError(
            f"{output}: exists and is not an llmc artifact", "choose another output path, or remove it first"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.tmp-", dir=output.parent))
    old = None
    try:
        fields = populate(tmp)
        (tmp / MANIFEST).unlink(missing_ok=True)
        manifest = _complete_manifest(fields, _hash_tree(tmp))
        _check_manifest(manifest, tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if output.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{output.name}.old-", dir=output.parent))
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
    return output


def _is_empty_dir(p: Path) -> bool:
    return p.is_dir() and not any(p.iterdir())


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
    def weight_bytes(self) -> int:
        """Bytes of tensor data in weights.safetensors (the file less its header)."""
        return safetensors_data_bytes(self.weights_path)


def safetensors_data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


def recompile_hint(path: Path, target: str = "cpu") -> str:
    return f"recompile it: llmc compile CHECKPOINT --target {target} -o {path}"


def _recorded_target_name(m: dict) -> str:
    """The target a (possibly damaged) manifest names, for the recompile hint."""
    target = m.get("target")
    return str(target.get("name", "cpu")) if isinstance(target, dict) else "cpu"


def _check_manifest(m: dict, path: Path) -> None:
    """Structure and consistency (no hashing): the target's name and kind, block_size, required files listed."""
    target = m.get("target")
    if not isinstance(target, dict) or not isinstance(target.get("name"), str) or target.get("kind") not in KINDS:
        raise ArtifactError(f"{path}: manifest target {target!r} has no name or no kind of {', '.join(KINDS)}",
                            "the manifest is damaged; recompile the artifact")  # fmt: skip
    block_size = m.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise ArtifactError(f"{path}: manifest block_size {block_size!r} is not a positive integer",
                            recompile_hint(path, target["name"]))  # fmt: skip
    files = m.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: manifest lists no files", "the manifest is damaged; recompile the artifact")
    for required in (LIBRARY, WEIGHTS, TOKENIZER, SOURCE_FILE[target["kind"]]):
        if required not in files:
            raise ArtifactError(
                f"{path}: the manifest lists no {required}", recompile_hint(path, target["name"])
            )


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
        raise ArtifactError(f"{path / MANIFEST}: field {', '.join(changed)} was edited or damaged after compile "
                            f"(its sha256 does not match {MANIFEST_DIGESTS})", hint)  # fmt: skip


def _parse_config(m: dict, path: Path) -> ModelConfig:
    try:
        return ModelConfig.from_dict(m["model_config"])
    except (KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: manifest model_config is unreadable ({e})",
                            recompile_hint(path, m["target"]["name"])) from None  # fmt: skip


def read_manifest(path: str | Path) -> dict:
    """manifest.json of an artifact dir, with magic and versions checked (no file hashing)."""
    path = Path(path)
    if not path.exists():
        raise ArtifactError(f"{path}: no such artifact", "compile one: llmc compile CHECKPOINT --target cpu -o " + str(path))
    if not path.is_dir():
        raise ArtifactError(f"{path}: not an artifact directory", "pass the directory llmc compile -o wrote")
    mpath = path / MANIFEST
    if not mpath.is_file():
        if (path / "config.json").is_file():
            raise ArtifactError(f"{path}: is a checkpoint, not a compiled artifact",
                                f"compile it first: llmc compile {path} --target cpu -o OUT")  # fmt: skip
        raise ArtifactError(f"{path}: not an llmc artifact (no {MANIFEST})", "compile one with llmc compile")
    try:
        m = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{mpath}: corrupt manifest ({e})", "recompile the artifact") from None
    if not isinstance(m, dict) or m.get("magic") != MAGIC:
        raise ArtifactError(f"{path}: {MANIFEST} is not an llmc artifact manifest", "recompile the artifact")
    target_name = _recorded_target_name(m)
    for key, want in (("format_version", FORMAT_VERSION), ("abi_version", ABI_VERSION)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: artifact {key.replace('_', ' ')} {m.get(key)!r} (compiled by llmc "
                f"{m.get('compiler_version', '?')}), but llmc {__version__} reads version {want}",
                recompile_hint(path, target_name),
            )
    return m


def load_artifact(path: str | Path, *, verify: bool = True, check_target: bool = True) -> Artifact:
    """Open an artifact: versions, the manifest's and every file's sha256 (verify), a CPU target against this host."""
    path = Path(path)
    m = read_manifest(path)
    if verify:
        _check_seal(m, path)
    _check_manifest(m, path)
    config = _parse_config(m, path)
    target_name = m["target"]["name"]
    if verify:
        for rel, digest in m["files"].items():
            f = path / rel
            if not f.is_file():
                raise ArtifactError(f"{path}: file {rel} is missing", recompile_hint(path, target_name))
            if file_sha256(f) != digest:
                raise ArtifactError(f"{path}: file {rel} is corrupt (its sha256 does not match the manifest)",
                                    recompile_hint(path, target_name))  # fmt: skip
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
