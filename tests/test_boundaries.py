"""The layers and their boundaries (README "Layout", docs/contracts.md "Layers"), checked by an AST walk over every
module the package map (pyproject.toml's package-dir) installs, with the imports inside functions counted too.

Three floors, arrows pointing down only:
- the ground: the neutral modules both sides stand on (llmc/*.py, llmc.targets, llmc.templates, llmc.examples);
- the middle: llmc.compiler and llmc.runtime, neither of which imports the other;
- the top: llmc.tools, the work that needs both (the quality gate, the compile cache, profile, the tuner's
  measuring) and the CLI, which nothing else imports.
Inside the compiler the stages point down too (COMPILER_STAGES), and there is no import cycle anywhere.
"""

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUND = ("llmc", "llmc.targets", "llmc.templates", "llmc.examples")
# A compiler module may import its own stage and those before it: the checkpoint comes in (frontend), becomes
# fused Relax (passes), a kernel program (lower), sources (codegen), and compile drives them all.
COMPILER_STAGES = (
    (
        "llmc.compiler.kquant",
        "llmc.compiler.quant",
        "llmc.compiler.quant_pack",
        "llmc.compiler.quant_search",
        "llmc.compiler.quant_widen",
        "llmc.compiler.weights",
    ),
    ("llmc.compiler.frontend", "llmc.compiler.importance"),  # importance runs the frontend's model
    ("llmc.compiler.export", "llmc.compiler.passes"),
    (
        "llmc.compiler.legalize",
        "llmc.compiler.lower",
        "llmc.compiler.lower_llmc_ops",
        "llmc.compiler.launches",
        "llmc.compiler.program",
        "llmc.compiler.tuning",
    ),
    ("llmc.compiler.codegen",),
    ("llmc.compiler.compile",),
)


def package_map() -> dict[str, Path]:
    """Every module llmc installs, by name, from the package map in pyproject.toml."""
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    modules = {}
    for package, folder in tool["package-dir"].items():
        for path in sorted((ROOT / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            modules[name] = path
    return modules


MODULES = package_map()


def imports(name: str) -> set[str]:
    """The llmc modules that module `name` imports (relative imports resolved, `from pkg import mod` as mod)."""
    path = MODULES[name]
    package = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `.` is the file's own package, each further dot one package up
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: imports(name) for name in MODULES}


def floor(name: str) -> str:
    if name.startswith("llmc.tools"):
        return "top"
    if name.startswith(("llmc.compiler", "llmc.runtime")):
        return name.split(".")[1]
    in_ground = name.rsplit(".", 1)[0] == "llmc" or any(name == g or name.startswith(g + ".") for g in GROUND[1:])
    assert name in GROUND or in_ground, f"{name}: on no floor; place it in a layer"
    return "ground"


ALLOWED = {"ground": {"ground"}, "compiler": {"ground", "compiler"}, "runtime": {"ground", "runtime"}}


def _stage(name: str) -> int:
    for rank, prefixes in enumerate(COMPILER_STAGES):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return rank
    raise AssertionError(f"{name}: in no compiler stage; add it to COMPILER_STAGES")


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that points up a floor, to a later compiler stage, or into the CLI from outside it."""
    found = []
    for name, deps in sorted(graph.items()):
        where = floor(name)
        for dep in sorted(deps):
            if where != "top" and floor(dep) not in ALLOWED[where]:
                found.append(f"{name} ({where}) imports {dep} ({floor(dep)})")
            if where == floor(dep) == "compiler" and name != "llmc.compiler" and _stage(dep) > _stage(name):
                found.append(f"{name} imports {dep}, a later compiler stage")
            if dep.startswith("llmc.tools.cli") and not name.startswith("llmc.tools.cli"):
                found.append(f"{name} imports the CLI ({dep})")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_arrows_point_down():
    assert violations(GRAPH) == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_every_compiler_module_has_a_stage():
    for name in MODULES:
        if floor(name) == "compiler" and name != "llmc.compiler":
            _stage(name)


def test_the_walk_sees_every_kind_of_import():
    """Relative imports, `from package import module`, and imports inside functions all count."""
    assert {"llmc.tools.quality", "llmc.compiler.compile", "llmc.manifest"} <= GRAPH["llmc.tools.build"]
    assert {"llmc.compiler.frontend.checkpoint", "llmc.compiler.frontend.gguf"} <= GRAPH["llmc.compiler.frontend.load"]


def test_the_checks_catch_each_kind_of_violation():
    bad = {
        "llmc.artifact": {"llmc.runtime.engine"},  # the ground reaching up
        "llmc.runtime.engine": {"llmc.compiler.lower"},  # runtime -> compiler
        "llmc.compiler.quant": {"llmc.runtime.sampling"},  # compiler -> runtime
        "llmc.compiler.lower": {"llmc.compiler.codegen.render"},  # a later stage
        "llmc.compiler.codegen.render": {"llmc.tools.build"},  # the middle reaching up
        "llmc.tools.build": {"llmc.tools.cli"},  # below the CLI
        "llmc.runtime.sampling": set(),
        "llmc.tools.cli": {"llmc.tools.build"},
    }
    assert len(violations(bad)) == 6
    assert cycles(bad) == [["llmc.tools.build", "llmc.tools.cli"]]


def test_loading_the_runtime_loads_no_compiler():
    """Beyond the import lines: importing the runtime pulls in neither llmc.compiler, nor torch, nor TVM."""
    code = (
        "import sys, llmc.runtime.module, llmc.runtime.engine, llmc.runtime.server, llmc.artifact, llmc.artifact_writer\n"
        "print(sorted(m for m in sys.modules if m.startswith(('llmc.compiler', 'torch', 'tvm'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
