"""The compiled artifact: the boundary between compiler and runtime, and loading it.

The compiler writes artifacts (llmc/artifact_writer.py) and the runtime reads them (here); what the manifest
holds and how it is checked is llmc/manifest.py. None of them imports anything from either side (the
model-config schema is llmc/model_config.py, digests llmc/digests.py, the cache directory and host ISA
llmc/host.py, targets llmc.targets).

Layout:
    manifest.json          what was built, for which target, the sha256 of every other file, and of its own fields
    model.so               the module (C ABI of docs/contracts.md)
    model.cc | model.cu    its generated source (.cu for targets of kind "cuda"), kept to be read
    weights.safetensors    packed weights (compiler/weights.py)
    tokenizer.json         and tokenizer_config.json when the checkpoint has one

`load_artifact` checks the manifest versions, the manifest's own digests, every file's sha256, and that a
CPU target is this machine; each mismatch is an ArtifactError that says what to run. Nothing outside the
artifact is read.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from pathlib import Path

from llmc.digests import file_sha256
from llmc.errors import ArtifactError
from llmc.host import host_cpu_isa
from llmc.kernel_program import decode_weight_bytes, expert_bytes
from llmc.manifest import (
    LIBRARY,
    MANIFEST_DIGESTS,
    TOKENIZER,
    WEIGHTS,
    check_config,
    check_manifest,
    check_seal,
    check_versions,
    parse_manifest,
    recompile_hint,
)
from llmc.model_config import ModelConfig
from llmc.targets import SOURCE_FILE


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
        """What the module's KV cache stores (the manifest's kv_cache_dtype), one of KV_DTYPES. A manifest
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

    @property
    def expert_bytes(self) -> int:
        """Bytes of one expert's weights in one mixture-of-experts layer (kernel_program.expert_bytes); 0 without
        experts or a kernel program."""
        return expert_bytes(self.manifest["kernel_program"]) if "kernel_program" in self.manifest else 0


def safetensors_data_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
    return os.path.getsize(path) - 8 - n


def load_artifact(path: str | Path, *, verify: bool = True, check_target: bool = True) -> Artifact:
    """Open an artifact: versions, the manifest's and every file's sha256 (verify), the manifest's structure and
    types, a CPU target against this host. Every failure is one ArtifactError; no file outside `path` is read."""
    path = Path(path)
    m = parse_manifest(path)
    sealed = isinstance(m.get(MANIFEST_DIGESTS), dict)
    if verify and sealed:  # first: a damaged version field is damage, not an artifact of another llmc
        check_seal(m, path)
    check_versions(m, path)
    if verify and not sealed:
        check_seal(m, path)
    check_manifest(m, path)
    target_name = m["target"]["name"]
    hint = recompile_hint(path, target_name)
    check_config(m.get("model_config"), path, hint)
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
        raise ArtifactError(
            f"{path}: built for another CPU ({target['machine']}; this machine is {machine})", recompile_hint(path)
        )
    host = set(host_cpu_isa())
    missing = sorted(set(target.get("isa") or ()) - host) if host else []
    if missing:
        shown = ", ".join(missing[:6]) + (f" and {len(missing) - 6} more" if len(missing) > 6 else "")
        raise ArtifactError(
            f"{path}: built for another CPU (it uses {shown}, which this CPU lacks)", recompile_hint(path)
        )
