"""Targets are data: everything a target is lives in targets/<name>.toml, read by `load_target` alone.

A TOML gives `name` (its file stem), `kind` ("cpu" or "cuda": how the module is built and run), the
`compiler` ("g++" or "nvcc") and its `flags`, a CUDA target's `gencode` and limits, `template_dir`
(templates/<dir>/), and `[defaults]` with `block_size` (KV cache block, tokens), the one default of it.
The whole table is recorded in the artifact's manifest, so the runtime learns a target from the manifest,
never from a list of names. A new GPU generation is a new TOML (plus templates where it needs new ones).

Directories in $LLMC_TARGET_PATH (os.pathsep-separated) are searched before the built-in one, so a target
can be added, or a built-in one overridden, without touching the package.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

from llmc.errors import CompileError

BUILTIN_DIR = Path(__file__).resolve().parent
KINDS = ("cpu", "cuda")
# The generated module's source file, by kind: nvcc compiles .cu, g++ .cc
SOURCE_FILE = {"cpu": "model.cc", "cuda": "model.cu"}


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    kind: str  # one of KINDS
    raw: dict  # the whole TOML, recorded in the manifest

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def template_dir(self) -> str:
        return self.raw["template_dir"]

    @property
    def compiler(self) -> str:
        return self.raw["compiler"]

    @property
    def gencode(self) -> str | None:
        return self.raw.get("gencode")

    @property
    def build_flags(self) -> list[str]:
        """The compiler's flags for model.so: the TOML's `flags`, plus `-gencode` for a GPU target."""
        return list(self.raw["flags"]) + (["-gencode", self.gencode] if self.gencode else [])

    @property
    def compute_capability(self) -> int | None:
        return self.raw.get("compute_capability")

    @property
    def defaults(self) -> dict:
        return self.raw["defaults"]

    @property
    def block_size(self) -> int:
        return self.defaults["block_size"]

    @property
    def source_file(self) -> str:
        return SOURCE_FILE[self.kind]


def target_dirs() -> list[Path]:
    """Where target TOMLs are looked up, in order: $LLMC_TARGET_PATH's directories, then the built-in one."""
    extra = [Path(d).expanduser() for d in os.environ.get("LLMC_TARGET_PATH", "").split(os.pathsep) if d]
    return extra + [BUILTIN_DIR]


def target_names() -> list[str]:
    return sorted({p.stem for d in target_dirs() for p in d.glob("*.toml")})


def target_file(name: str) -> Path:
    path = next((d / f"{name}.toml" for d in target_dirs() if (d / f"{name}.toml").is_file()), None)
    if path is None:
        raise CompileError(
            f"unknown target {name!r}",
            f"choose one of {', '.join(target_names())}, or add {name}.toml to a directory in $LLMC_TARGET_PATH",
        )
    return path


def tuning_db_path(name: str) -> Path:
    """The target's tuning database (`llmc tune` writes it, compile reads it): beside its TOML."""
    return target_file(name).with_suffix(".tuning.json")


def load_target(name: str) -> Target:
    path = target_file(name)
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CompileError(f"{path}: cannot be read ({e})", "fix the target file") from None
    _check(raw, name, path)
    return Target(raw["name"], raw["kind"], raw)


def _check(raw: dict, name: str, path: Path) -> None:
    def bad(what: str) -> CompileError:
        return CompileError(f"{path}: {what}", "see targets/sm90.toml for a complete GPU target")

    if raw.get("name") != name:
        raise bad(f"name = {raw.get('name')!r}, but the file is named for {name!r}")
    if raw.get("kind") not in KINDS:
        raise bad(f"kind = {raw.get('kind')!r} is not one of {', '.join(KINDS)}")
    for key in ("compiler", "template_dir"):
        if not isinstance(raw.get(key), str):
            raise bad(f"{key} is missing")
    if not isinstance(raw.get("flags"), list) or not all(isinstance(f, str) for f in raw["flags"]):
        raise bad("flags must be a list of strings")
    if raw["kind"] == "cuda" and not isinstance(raw.get("gencode"), str):
        raise bad('a cuda target needs gencode (e.g. "arch=compute_90,code=sm_90")')
    block_size = raw.get("defaults", {}).get("block_size")
    if not isinstance(block_size, int) or block_size < 1:
        raise bad(f"[defaults] block_size = {block_size!r}; it must be an integer >= 1")
