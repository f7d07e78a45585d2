"""Build CUDA sources for the simulator (g++) and check them with nvcc/ptxas, without a GPU.

- `build_simulated(sources, out_so)`: g++ -DLLMC_SIMULATOR -> a shared library whose kernels run on the CPU
  (templates/cuda/include/sim/llmc_sim.h). Load it with ctypes; `llmc_sim_set_seed(n)` sets the scheduling seed.
- `nvcc_compile(source, "sm_90", out)`: nvcc -cubin with `ptxas -v`; returns registers and spills per kernel.
- `build_profiled(sources, out_so)` / `build_profiled_library(artifact)`: the same with the counters of
  `llmc profile --simulate` (templates/cuda/include/sim/llmc_sim_profile.h), a build of its own.
- `asan_env()`: the environment a subprocess needs to load an `asan=True` build.
- `build_simulated_library(artifact)`: a CUDA artifact's model.cu as a simulated model.so, for
  `CompiledModel.load(artifact, library=...)` (`llmc run --simulate`); the runtime never builds it itself.

Outputs are cached under the build cache (llmc.host.cache_root()/build) by a hash of the preprocessed
source, the flags and the compiler version, and written to a temporary file first and renamed, so
concurrent builds never see a partial file.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

from llmc.artifact import Artifact, load_artifact
from llmc.errors import ArtifactError, CompileError
from llmc.host import cache_root
from llmc.manifest import recompile_hint

from .build import default_cache_dir

INCLUDE_DIR = Path(__file__).resolve().parents[2] / "templates" / "cuda" / "include"
CXX = "g++"


def cuda_home() -> Path:
    """The CUDA toolkit root: $CUDA_HOME / $CUDA_PATH, else found from nvcc, else /usr/local/cuda."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var) and (Path(os.environ[var]) / "include" / "cuda_fp16.h").exists():
            return Path(os.environ[var])
    nvcc = shutil.which("nvcc")
    if nvcc:
        root = Path(nvcc).resolve().parent.parent
        if (root / "include" / "cuda_fp16.h").exists():
            return root
    if Path("/usr/local/cuda/include/cuda_fp16.h").exists():
        return Path("/usr/local/cuda")
    if nvcc:  # a wrapper script: ask nvcc where it lives
        out = subprocess.run(
            [nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"], capture_output=True, text=True
        ).stderr
        m = re.search(r"#\$ TOP=(\S+)", out)
        if m and (Path(m.group(1)).resolve() / "include" / "cuda_fp16.h").exists():
            return Path(m.group(1)).resolve()
    raise CompileError(
        "cannot find the CUDA toolkit (cuda_fp16.h)", "install it, or set CUDA_HOME to its root directory"
    )


def cuda_include_dir() -> Path:
    """The directory with cuda_fp16.h, cuda_bf16.h and vector_types.h."""
    return cuda_home() / "include"


def nvcc_path() -> str:
    nvcc = cuda_home() / "bin" / "nvcc"
    return str(nvcc) if nvcc.exists() else (shutil.which("nvcc") or "nvcc")


def cache_dir() -> Path:
    d = default_cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    return d


@cache
def _tool_version(tool: str) -> str:
    try:
        return subprocess.run([tool, "--version"], capture_output=True, text=True).stdout
    except OSError as e:
        raise CompileError(f"cannot run {tool}: {e}", "install it and put it on PATH") from None


def _run(cmd: list[str], what: str) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        raise CompileError(f"{what}: cannot run {cmd[0]}: {e}", "install it and put it on PATH") from None
    if r.returncode != 0:
        raise CompileError(f"{what} failed:\n{r.stderr.strip()}", "the command was: " + " ".join(cmd))
    return r


def _atomic_copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dst.parent, prefix=f".{dst.name}.", suffix=".tmp")
    os.close(fd)
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, 0o755)
        os.replace(tmp, dst)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _sources(sources: list[Path] | Path | str, workdir: Path) -> list[Path]:
    """A str is CUDA source text; a Path or a list of Paths are files."""
    if isinstance(sources, str):
        p = workdir / "source.cu"
        p.write_text(sources)
        return [p]
    if isinstance(sources, Path):
        return [sources]
    return [Path(s) for s in sources]


def _key(parts: list[str | bytes]) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode() if isinstance(p, str) else p)
        h.update(b"\0")
    return h.hexdigest()[:32]


def _relative_markers(preprocessed: str, source: Path) -> str:
    """Line markers name the source's folder (an artifact's, holding the headers it carries): without it, the
    same files in another folder hit the cache."""
    return preprocessed.replace(str(source.parent) + os.sep, "")


def sim_flags(asan: bool = False, extra_flags=(), include_dir: Path = INCLUDE_DIR) -> list[str]:
    flags = [
        "-x",
        "c++",
        "-std=c++17",
        "-O1",
        "-DLLMC_SIMULATOR",
        f"-I{include_dir}",
        f"-I{cuda_include_dir()}",
        "-fPIC",
        "-fno-strict-aliasing",
    ]
    if asan:
        flags += ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"]
    return flags + list(extra_flags)


def build_simulated(
    sources: list[Path] | str, out_so: Path, *, asan: bool = False, extra_flags=(), include_dir: Path = INCLUDE_DIR
) -> Path:
    """Compile .cu source(s) with g++ against the simulator into the shared library `out_so`.

    `sources` is a list of files, or one string of source text; `include_dir` holds the device and simulator
    headers (a header next to a source file is found first). Raises CompileError with g++'s messages.
    """
    out_so = Path(out_so)
    flags = sim_flags(asan, extra_flags, include_dir)
    with tempfile.TemporaryDirectory(prefix="llmc-sim-") as tmp:
        srcs = _sources(sources, Path(tmp))
        parts: list[str | bytes] = [_tool_version(CXX), " ".join(flags)]
        for s in srcs:  # the preprocessed text covers every included header; its line markers, the lines
            pre = _run([CXX, *flags, "-E", str(s), "-o", "-"], f"preprocessing {s.name}").stdout
            parts.append(_relative_markers(pre, s))
        cached = cache_dir() / f"sim-{_key(parts)}.so"
        if not cached.exists():
            built = Path(tmp) / "out.so"
            _run([CXX, *flags, "-shared", *map(str, srcs), "-o", str(built)], "g++ (simulator build)")
            _atomic_copy(built, cached)
    _atomic_copy(cached, out_so)
    return out_so


def build_simulated_library(artifact_path: str | Path) -> Path:
    """The artifact's model.cu built with g++ against the CUDA simulator; cached by the source's sha256.

    Pass the result to `CompiledModel.load(artifact_path, library=...)`. ArtifactError unless the artifact
    is built for a CUDA target.
    """
    artifact = _cuda_artifact(artifact_path, "run it without --simulate")
    out = cache_root() / "simulated" / f"{_library_key(artifact)}.so"
    if out.is_file():  # written atomically, under its sources' digests
        return out
    return _build_artifact(
        artifact, lambda inc: build_simulated([artifact.source_path], out, extra_flags=("-O2",), include_dir=inc)
    )


def _cuda_artifact(artifact_path: str | Path, hint: str) -> Artifact:
    # verify=False: CompiledModel.load verifies every file (model.cu among them) right after this
    artifact = load_artifact(artifact_path, verify=False)
    if not artifact.is_cuda:
        raise ArtifactError(
            f"{artifact.path}: --simulate needs a CUDA-target artifact; this one is built for "
            f"{artifact.target_name} ({artifact.kind})",
            hint,
        )
    return artifact


_HEADER_MARK = "llmc_device.cuh"  # one of the headers compile copies into a CUDA artifact


def _headers_dir(artifact: Artifact) -> Path:
    """Where the artifact's model.cu finds the headers it was rendered against: in the artifact (compile
    copies them there), or, in an artifact from before that, only this installation's, which may have moved on."""
    return artifact.path if _HEADER_MARK in artifact.manifest["files"] else INCLUDE_DIR


def _build_artifact(artifact: Artifact, build) -> Path:
    """build(include_dir) for the artifact's headers; an old artifact that no longer builds against this
    llmc's headers is an ArtifactError that says to recompile, not g++'s errors."""
    include_dir = _headers_dir(artifact)
    try:
        return build(include_dir)
    except CompileError:
        if include_dir != INCLUDE_DIR:
            raise
        raise ArtifactError(
            f"{artifact.path}: its model.cu (llmc {artifact.manifest['compiler_version']}) does not build against "
            "this llmc's CUDA headers, and the artifact carries none of its own",
            recompile_hint(artifact.path, artifact.target_name),
        ) from None


def _library_key(artifact: Artifact) -> str:
    """The digests of the artifact's files (model.cu and, since artifacts carry them, its headers); for an older
    artifact, with those of this installation's headers: a header change rebuilds."""
    h = hashlib.sha256("".join(sorted(artifact.manifest["files"].values())).encode())
    if _headers_dir(artifact) == INCLUDE_DIR:
        for path in sorted(INCLUDE_DIR.rglob("*")):
            if path.is_file():
                h.update(path.relative_to(INCLUDE_DIR).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:24]


# The profiling build: kernel code calls __asan_{load,store}*_noabort on every access; the counter unit,
# built without the flag, defines them (templates/cuda/include/sim/llmc_sim_profile.h).
PROFILE_FLAGS = (
    "-DLLMC_SIM_PROFILE",
    "-fsanitize=kernel-address",
    "--param",
    "asan-instrumentation-with-call-threshold=0",
    "--param",
    "asan-stack=0",
    "--param",
    "asan-globals=0",
)
# The simulator's headers are in include/sim/; an artifact compiled before they moved there carries them flat.
_COUNTER_UNIT = """#define LLMC_SIM_PROFILE_IMPL
#if __has_include("sim/llmc_sim.h")
#include "sim/llmc_sim.h"
#else
#include "llmc_sim.h"
#endif
"""


def build_profiled(
    sources: list[Path] | str, out_so: Path, *, opt: str = "-O2", include_dir: Path = INCLUDE_DIR
) -> Path:
    """Like build_simulated, with the counters of `llmc profile --simulate`: llmc_sim_prof_enable(1) turns
    counting on, llmc_sim_prof_kernel(i, ...) reads kernel i's counters (llmc_sim_profile.h). Cached apart
    from the plain build (its flags are part of the key)."""
    out_so = Path(out_so)
    flags = sim_flags(False, (opt, "-DLLMC_SIM_PROFILE"), include_dir)
    kernel_flags = sim_flags(False, (opt, *PROFILE_FLAGS), include_dir)
    with tempfile.TemporaryDirectory(prefix="llmc-simprof-") as tmp:
        srcs = _sources(sources, Path(tmp))
        counter = Path(tmp) / "llmc_sim_counters.cc"
        counter.write_text(_COUNTER_UNIT)
        parts: list[str | bytes] = ["profile", _tool_version(CXX), " ".join(kernel_flags), " ".join(flags)]
        for s, f in [*((s, kernel_flags) for s in srcs), (counter, flags)]:
            pre = _run([CXX, *f, "-E", str(s), "-o", "-"], f"preprocessing {s.name}").stdout
            parts.append(_relative_markers(pre, s))
        cached = cache_dir() / f"simprof-{_key(parts)}.so"
        if not cached.exists():
            objs = []
            for i, s in enumerate(srcs):
                objs.append(Path(tmp) / f"k{i}.o")
                _run([CXX, *kernel_flags, "-c", str(s), "-o", str(objs[-1])], "g++ (profiling build)")
            objs.append(Path(tmp) / "counters.o")
            _run([CXX, *flags, "-c", str(counter), "-o", str(objs[-1])], "g++ (profiling counters)")
            built = Path(tmp) / "out.so"
            _run([CXX, "-shared", "-fPIC", *map(str, objs), "-ldl", "-o", str(built)], "g++ (profiling link)")
            _atomic_copy(built, cached)
    _atomic_copy(cached, out_so)
    return out_so


def build_profiled_library(artifact_path: str | Path) -> Path:
    """The artifact's model.cu as build_simulated_library builds it, with the profiling counters."""
    artifact = _cuda_artifact(artifact_path, "profile it without --simulate")
    out = cache_root() / "simulated" / f"{_library_key(artifact)}-profile.so"
    if out.is_file():
        return out
    return _build_artifact(artifact, lambda inc: build_profiled([artifact.source_path], out, include_dir=inc))


def asan_env(base: dict | None = None) -> dict:
    """Environment for a subprocess that loads an `asan=True` build: preloads g++'s libasan."""
    lib = subprocess.run([CXX, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    env = dict(os.environ if base is None else base)
    env["LD_PRELOAD"] = lib
    env.setdefault("ASAN_OPTIONS", "detect_leaks=0")
    return env


# ---------------------------------------------------------------------------------------------------
# nvcc + ptxas -v


@dataclasses.dataclass
class KernelResources:
    registers: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    stack_frame: int = 0
    smem: int = 0


def parse_ptxas(report: str) -> dict[str, KernelResources]:
    """Per function (mangled name) resources from the output of `ptxas -v`."""
    funcs: dict[str, KernelResources] = {}
    cur = None
    for line in report.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$.]+)'?", line)
        if m:
            cur = funcs.setdefault(m.group(1), KernelResources())
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur.stack_frame, cur.spill_stores, cur.spill_loads = map(int, m.groups())
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur.registers = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur.smem = int(s.group(1)) if s else 0
    return funcs


def _arch_number(arch: str) -> str:
    m = re.fullmatch(r"(?:sm_?|compute_?)?(\d+a?)", arch.strip())
    if not m:
        raise CompileError(f"unknown CUDA architecture {arch!r}", "use e.g. 'sm_80', 'sm89' or '90'")
    return m.group(1)


_LINE_MARKER = re.compile(r"#\s*(line\s+)?\d")


def nvcc_compile(source: Path | str, arch: str, out: Path, extra_flags=()) -> dict[str, KernelResources]:
    """nvcc -cubin for one architecture ('sm_80', 'sm89', '90'); returns ptxas's resources per kernel.

    `source` is a .cu file, or source text. The cubin is written to `out`.
    """
    num = _arch_number(arch)
    out = Path(out)
    flags = [
        "-cubin",
        "-std=c++17",
        f"-gencode=arch=compute_{num},code=sm_{num}",
        "-Xptxas",
        "-v",
        f"-I{INCLUDE_DIR}",
        *extra_flags,
    ]
    nvcc = nvcc_path()
    with tempfile.TemporaryDirectory(prefix="llmc-nvcc-") as tmp:
        src = _sources(source, Path(tmp))[0]
        pre = _run([nvcc, *flags[1:], "-E", str(src), "-o", "-"], f"preprocessing {src.name} (nvcc)").stdout
        # line markers (`# 12 "file"`) name the temporary directory; a `#pragma` changes the code
        pre = "\n".join(line for line in pre.splitlines() if not _LINE_MARKER.match(line))
        key = _key([_tool_version(nvcc), " ".join(flags), pre])
        cubin, report = cache_dir() / f"nvcc-{key}.cubin", cache_dir() / f"nvcc-{key}.ptxas.txt"
        if not (cubin.exists() and report.exists()):
            built = Path(tmp) / "out.cubin"
            r = _run([nvcc, *flags, str(src), "-o", str(built)], f"nvcc {arch}")
            text_tmp = Path(tmp) / "ptxas.txt"
            text_tmp.write_text(r.stdout + r.stderr)
            _atomic_copy(built, cubin)
            _atomic_copy(text_tmp, report)
    _atomic_copy(cubin, out)
    return parse_ptxas(report.read_text())
