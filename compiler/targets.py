"""Targets are data: targets/<name>.toml records the compiler, flags or gencode, limits and defaults."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

from llmc.errors import CompileError

TARGET_DIR = Path(__file__).resolve().parents[1] / "targets"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    kind: str  # "cpu" | "cuda"
    template_dir: str  # templates/<template_dir>/
    raw: dict  # the whole TOML, recorded in the manifest

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def gencode(self) -> str | None:
        return self.raw.get("gencode")

    @property
    def compute_capability(self) -> int | None:
        return self.raw.get("compute_capability")

    @property
    def defaults(self) -> dict:
        return self.raw.get("defaults", {})


def target_names() -> list[str]:
    return sorted(p.stem for p in TARGET_DIR.glob("*.toml"))


def load_target(name: str) -> Target:
    path = TARGET_DIR / f"{name}.toml"
    if not path.is_file():
        raise CompileError(f"unknown target {name!r}", f"choose one of {', '.join(target_names())}")
    raw = tomllib.loads(path.read_text())
    return Target(raw["name"], raw["kind"], raw["template_dir"], raw)
