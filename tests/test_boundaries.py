"""The artifact is the boundary: the runtime imports nothing from the compiler, and neither do the neutral
modules both sides stand on (llmc.artifact, llmc.digests, llmc.host, llmc.model_config, llmc.targets)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NEUTRAL = [ROOT / "llmc" / f for f in ("artifact.py", "digests.py", "host.py", "model_config.py", "errors.py")]
NEUTRAL.append(ROOT / "targets" / "__init__.py")


def _imports(path: Path) -> set[str]:
    """Every module a file imports, as an absolute name (relative imports resolved against its package)."""
    package = {"runtime": "llmc.runtime", "llmc": "llmc", "targets": "llmc.targets"}[path.parent.name].split(".")
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `.` is the file's own package, each further dot one package up
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            names |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return names


@pytest.mark.parametrize("path", sorted((ROOT / "runtime").glob("*.py")) + NEUTRAL, ids=lambda p: p.name)
def test_no_compiler_import(path):
    bad = sorted(n for n in _imports(path) if n == "llmc.compiler" or n.startswith("llmc.compiler."))
    assert not bad, (
        f"{path.relative_to(ROOT)} imports {bad}: the runtime reaches the compiler only through the artifact"
    )


def test_import_resolution_sees_relative_imports(tmp_path):
    (tmp_path / "runtime").mkdir()
    f = tmp_path / "runtime" / "x.py"
    f.write_text("from ..compiler import artifact\nfrom . import batch\n")
    assert {"llmc.compiler", "llmc.compiler.artifact", "llmc.runtime.batch"} <= _imports(f)


def test_loading_the_runtime_loads_no_compiler():
    """Beyond the import lines: importing the runtime pulls in neither llmc.compiler, nor torch, nor TVM."""
    code = ("import sys, llmc.runtime.module, llmc.runtime.engine, llmc.runtime.server, llmc.artifact\n"
            "print(sorted(m for m in sys.modules if m.startswith(('llmc.compiler', 'torch', 'tvm'))))")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
