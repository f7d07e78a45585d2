"""A kernel template's tunable parameters: `templates/<family>/<op>.tune.toml`, next to the template.

The file gives, per parameter, its `default` (the value the template used before it was tunable), its
`domain` (the values `llmc tune` tries), a `doc` and optionally a `group`; optionally `constraints`,
arithmetic comparisons over the kernel's shape parameters (n, k, ...), the tunables and the target's limits
(`max_shared_memory_per_block`, ...) that a candidate must meet before it is built, and `ptxas_constraints`,
over the same names plus what `ptxas -v` reports for the built candidate (`registers`, `spill_bytes`); and
`rows`, the T (or list of T) the tuner runs a candidate at.

Parameters of one group are searched together (their product); groups are searched one at a time with the
other groups at their defaults, for templates whose groups tune separate kernels (a GEMV and a tiled GEMM).
A template with no such file has nothing to tune. render_kernel fills each tunable that is not passed with its
default, so a kernel rendered without tuning is the kernel it always was.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import itertools
import operator
import tomllib
from collections.abc import Mapping
from typing import Any

from llmc.errors import CompileError
from llmc.templates import TEMPLATE_DIR

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Lt: operator.lt,
    ast.LtE: operator.le,
    ast.Gt: operator.gt,
    ast.GtE: operator.ge,
    ast.Eq: operator.eq,
    ast.NotEq: operator.ne,
}


def evaluate(expr: str, names: Mapping[str, Any]) -> Any:
    """An arithmetic comparison such as `bm * bk % threads == 0` over `names`; nothing else parses."""

    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
            return node.value
        if isinstance(node, ast.Name):
            if node.id not in names:
                raise CompileError(
                    f"tuning constraint {expr!r} names {node.id!r}, which is not defined",
                    f"it may use: {', '.join(sorted(names))}",
                )
            return names[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.BoolOp):
            values = [ev(v) for v in node.values]
            return all(values) if isinstance(node.op, ast.And) else any(values)
        if isinstance(node, ast.Compare):
            left = ev(node.left)
            for op, right in zip(node.ops, node.comparators, strict=True):
                if type(op) not in _OPS or not _OPS[type(op)](left, r := ev(right)):
                    return False
                left = r
            return True
        raise CompileError(
            f"tuning constraint {expr!r}: {ast.dump(node)[:60]} is not allowed",
            "use numbers, strings, names, + - * // %, comparisons, and, or",
        )

    return ev(ast.parse(expr, mode="eval"))


@dataclasses.dataclass(frozen=True)
class Tunable:
    name: str
    default: int
    domain: tuple[int, ...]
    doc: str
    group: str = ""


@dataclasses.dataclass(frozen=True)
class TuneSpace:
    template: str  # "cpu/gemm"
    params: tuple[Tunable, ...]
    constraints: tuple[str, ...] = ()
    rows: tuple[int, ...] = (1,)
    ptxas_constraints: tuple[str, ...] = ()

    @property
    def names(self) -> set[str]:
        return {p.name for p in self.params}

    def defaults(self) -> dict[str, int]:
        return {p.name: p.default for p in self.params}

    def admits(
        self,
        config: Mapping[str, int],
        shape: Mapping[str, Any],
        limits: Mapping[str, Any],
        ptxas: Mapping[str, int] | None = None,
    ) -> bool:
        """Whether `config` meets the constraints (with `ptxas`'s report, the ptxas constraints too)."""
        names = {**limits, **shape, **config, **(ptxas or {})}
        checks = self.constraints + (self.ptxas_constraints if ptxas is not None else ())
        return all(evaluate(c, names) for c in checks)

    @property
    def groups(self) -> dict[str, list[Tunable]]:
        out: dict[str, list[Tunable]] = {}
        for p in self.params:
            out.setdefault(p.group, []).append(p)
        return out

    def candidates(self, shape: Mapping[str, Any], limits: Mapping[str, Any]) -> list[dict[str, int]]:
        """The configurations that meet the constraints, the defaults first: per group, the product of its
        domains with the other groups at their defaults."""
        out = [self.defaults()]
        for group in self.groups.values():
            for values in itertools.product(*(p.domain for p in group)):
                config = {**self.defaults(), **dict(zip((p.name for p in group), values, strict=True))}
                if config not in out:
                    out.append(config)
        return [c for c in out if self.admits(c, shape, limits)]

    def group_of(self, config: Mapping[str, int]) -> str | None:
        """The group whose parameters `config` moves off their defaults (None: the defaults)."""
        moved = {p.group for p in self.params if config[p.name] != p.default}
        return moved.pop() if moved else None

    def check(self, config: Mapping[str, Any]) -> None:
        """A tuned configuration names this space's parameters, each with a value of its domain."""
        for p in self.params:
            if config.get(p.name) not in p.domain and config.get(p.name) != p.default:
                raise CompileError(
                    f"{self.template}: tuned {p.name}={config.get(p.name)!r} is outside its domain {list(p.domain)}",
                    "retune, or fix the entry in the tuning database",
                )
        if set(config) != self.names:
            raise CompileError(
                f"{self.template}: a tuned configuration names {sorted(config)}, the template's "
                f"tunables are {sorted(self.names)}",
                "retune this shape",
            )


@functools.cache
def tune_space(family: str, op: str) -> TuneSpace | None:
    """The tunables of `templates/<family>/<op>.*.j2`, or None where the op declares none."""
    path = TEMPLATE_DIR / family / f"{op}.tune.toml"
    if not path.is_file():
        return None
    try:
        raw = tomllib.loads(path.read_text())
        params = tuple(
            Tunable(name, int(p["default"]), tuple(int(v) for v in p["domain"]), p.get("doc", ""), p.get("group", ""))
            for name, p in raw["params"].items()
        )
        rows = raw.get("rows", 1)
        return TuneSpace(
            f"{family}/{op}",
            params,
            tuple(raw.get("constraints", ())),
            tuple(int(r) for r in (rows if isinstance(rows, list) else [rows])),
            tuple(raw.get("ptxas_constraints", ())),
        )
    except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as e:
        raise CompileError(
            f"{path}: not a tunable-parameter file ({type(e).__name__}: {e})",
            "see compiler/tuning/space.py for its fields",
        ) from e
