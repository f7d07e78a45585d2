"""The compiled artifact: a directory with a manifest, written atomically and checked when loaded.

Layout:
    manifest.json          what was built, for which target, and the sha256 of every other file
    model.so               the module (C ABI of docs/contracts.md)
    model.cc | model.cu    its generated source (.cu for the CUDA targets), kept to be read
    weights.safetensors    packed weights (compiler/weights.py)
    tokenizer.json         and tokenizer_config.json when the checkpoint has one

`write_artifact` builds the directory under a temporary name next to the output and renames it into place
(an existing artifact is renamed away first and deleted last), so a half-written artifact never exists at
the output path. `load_artifact` checks the manifest versions, every file's sha256, and that the target is
this machine; each mismatch is an ArtifactError that says what to run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from llmc import __version__
from llmc.compiler.frontend.config import ModelConfig
from llmc.errors import ArtifactError, LlmcError

from .digests import file_sha256

MAGIC = "llmc-artifact"
FORMAT_VERSION = 1
ABI_VERSION = 1  # docs/contracts.md LLMC_ABI_VERSION
CPU_TARGETS = ("cpu",)
CUDA_TARGETS = ("sm80", "sm89", "sm90")
TARGETS = CPU_TARGETS + CUDA_TARGETS

MANIFEST = "manifest.json"
LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# Instruction-set extensions in /proc/cpuinfo that generated code built with -march=native may use
# (x86 "flags", Arm "Features"); kernel and virtualisation flags are left out so that two VMs of one CPU
# model agree.
_ISA_FLAG = re.compile(
    r"(sse\d?(_\d)?|ssse3|sse4a|avx.*|fma4?|f16c|amx.*|bmi\d|popcnt|movbe|abm|adx|aes|vaes|pclmulqdq|vpclmulqdq"
    r"|gfni|sha_ni|cx16|xsave|rdrand|rdseed|asimd.*|sve.*|sme.*|fphp|bf16|i8mm|dotprod|svebf16|svei8mm)"
)


# ----------------------------------------------------------------------------------------------------------
# The host


def host_cpu_isa(cpuinfo_path: str = "/proc/cpuinfo") -> list[str]:
    """This CPU's instruction-set extensions (sorted), from /proc/cpuinfo; [] where it cannot be read."""
    try:
        text = Path(cpuinfo_path).read_text()
    except OSError:
        return []
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if _ISA_FLAG.fullmatch(f)})
    return []


def host_cpu_target() -> dict:
    """What a CPU artifact built here records about the machine: architecture and ISA extensions."""
    return {"name": "cpu", "machine": platform.machine(), "isa": host_cpu_isa()}


def cache_root() -> Path:
    """llmc's cache directory: $LLMC_CACHE_DIR, else $XDG_CACHE_HOME/llmc, else ~/.cache/llmc."""
    root = os.environ.get("LLMC_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmc"


# ----------------------------------------------------------------------------------------------------------
# Hashing


def checkpoint_hash(ckpt_dir: str | Path) -> str:
    """sha256 over a checkpoint's config, generation config, tokenizer files and weights (for cache keys).

    Each file contributes its name, size and sha256 (remembered for big files: compiler/digests.py).
    """
    ckpt_dir = Path(ckpt_dir)
    names = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "chat_template.jinja", "model.safetensors.index.json"]  # fmt: skip
    files = [ckpt_dir / n for n in names if (ckpt_dir / n).is_file()]
    files += sorted(p for p in ckpt_dir.glob("*.safetensors") if p.is_file())
    if not (ckpt_dir / "config.json").is_file():
        raise LlmcError(f"{ckpt_dir}: no config.json", "is this a Hugging Face checkpoint directory?")
    h = hashlib.sha256()
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\0{file_sha256(p)}\0".encode())
    return h.hexdigest()


def _hash_tree(root: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.relative_to(root).as_posix() != MANIFEST:
            out[p.relative_to(root).as_posix()] = file_sha256(p)
    return out


# ----------------------------------------------------------------------------------------------------------
# Writing


def _source_file(target_name: str) -> str:
    return "model.cu" if target_name in CUDA_TARGETS else "model.cc"


def _complete_manifest(fields: dict, files: dict[str, str]) -> dict:
    if not isinstance(fields, dict):
        raise TypeError(f"populate must return the manifest fields as a dict, got {type(fields).__name__}")
    fields = dict(fields)
    target = fields.pop("target", None)
    if isinstance(target, str):
        target = {"name": target}
    if not isinstance(target, dict) or target.get("name") not in TARGETS:
        raise ArtifactError(f"manifest: target {target!r} is not one of {', '.join(TARGETS)}")
    if target["name"] == "cpu":
        target = {**host_cpu_target(), **target}
    config = fields.pop("model_config", None)
    if isinstance(config, ModelConfig):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ArtifactError("manifest: model_config is missing")
    for reserved in ("magic", "format_version", "abi_version", "compiler_version", "files"):
        fields.pop(reserved, None)
    return {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "abi_version": ABI_VERSION,
        "compiler_version": __version__,
        "target": target,
        "model_config": config,
        "weight_dtype": fields.pop("weight_dtype", None),
        "quantization": fields.pop("quantization", "none"),
        "kernels": fields.pop("kernels", []),
        "passes": fields.pop("passes", {}),
        "buffer_plan": fields.pop("buffer_plan", {}),
        "tokenizer": {"chat_template": None, "bos_token": None, "eos_token": None, **fields.pop("tokenizer", {})},
        **fields,
        "files": files,
    }


def write_artifact(output: str | Path, populate: Callable[[Path], dict]) -> Path:
    """Build an artifact atomically: populate(tmp_dir) fills the files and returns the manifest fields.

    The fields are those of the manifest except magic, versions and files, which this adds: target (a
    name or a dict with "name"; a cpu target gains this host's machine and ISA unless given), model_config
    (a ModelConfig or its dict), weight_dtype, quantization, kernels, passes, buffer_plan, tokenizer, and
    any extra key. Every file is hashed, manifest.json is written, and the directory is renamed into place,
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
    def is_cuda(self) -> bool:
        return self.target_name in CUDA_TARGETS

    @property
    def library_path(self) -> Path:
        return self.path / LIBRARY

    @property
    def weights_path(self) -> Path:
        return self.path / WEIGHTS

    @property
    def source_path(self) -> Path:
        return self.path / _source_file(self.target_name)

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


def _check_manifest(m: dict, path: Path) -> None:
    """Structure and consistency (no hashing): required files listed, the config parses."""
    target = m.get("target")
    if not isinstance(target, dict) or target.get("name") not in TARGETS:
        raise ArtifactError(f"{path}: manifest target {target!r} is not one of {', '.join(TARGETS)}",
                            "the manifest is damaged; recompile the artifact")  # fmt: skip
    files = m.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: manifest lists no files", "the manifest is damaged; recompile the artifact")
    for required in (LIBRARY, WEIGHTS, TOKENIZER, _source_file(target["name"])):
        if required not in files:
            raise ArtifactError(
                f"{path}: the manifest lists no {required}", recompile_hint(path, target["name"])
            )


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
    target_name = (m.get("target") or {}).get("name", "cpu") if isinstance(m.get("target"), dict) else "cpu"
    for key, want in (("format_version", FORMAT_VERSION), ("abi_version", ABI_VERSION)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: artifact {key.replace('_', ' ')} {m.get(key)!r} (compiled by llmc "
                f"{m.get('compiler_version', '?')}), but llmc {__version__} reads version {want}",
                recompile_hint(path, target_name),
            )
    return m


def load_artifact(path: str | Path, *, verify: bool = True, check_target: bool = True) -> Artifact:
    """Open an artifact: versions, every file's sha256 (verify) and the target against this host."""
    path = Path(path)
    m = read_manifest(path)
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
    if check_target and target_name == "cpu":
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
