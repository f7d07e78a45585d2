"""The machine llmc runs on: its cache directory, its CPU's instruction set, whether a process is alive.

Compiler and runtime both ask these questions (builds and digests are cached; a CPU artifact records the
ISA it was built for and loading checks it), so the answers live here, outside both.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path

# Instruction-set extensions in /proc/cpuinfo that generated code built with -march=native may use
# (x86 "flags", Arm "Features"); kernel and virtualisation flags are left out so that two VMs of one CPU
# model agree.
_ISA_FLAG = re.compile(
    r"(sse\d?(_\d)?|ssse3|sse4a|avx.*|fma4?|f16c|amx.*|bmi\d|popcnt|movbe|abm|adx|aes|vaes|pclmulqdq|vpclmulqdq"
    r"|gfni|sha_ni|cx16|xsave|rdrand|rdseed|asimd.*|sve.*|sme.*|fphp|bf16|i8mm|dotprod|svebf16|svei8mm)"
)


def cache_root() -> Path:
    """llmc's cache directory: $LLMC_CACHE_DIR, else $XDG_CACHE_HOME/llmc, else ~/.cache/llmc."""
    root = os.environ.get("LLMC_CACHE_DIR")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "llmc"


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists on this host (a temporary file named after a dead one is a leftover)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


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


def host_cpu_model(cpuinfo_path: str = "/proc/cpuinfo") -> str:
    """This CPU's model name, from /proc/cpuinfo ("model name"); the machine type where it cannot be read."""
    try:
        for line in Path(cpuinfo_path).read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def host_caches(sysfs: str = "/sys/devices/system/cpu/cpu0/cache") -> list[dict]:
    """cpu0's caches from sysfs: [{"level", "type" (Data, Instruction, Unified), "bytes"}]; [] where unreadable."""
    out = []
    for d in sorted(Path(sysfs).glob("index*")):
        try:
            text = (d / "size").read_text().strip()
            size = int(text[:-1]) * {"K": 1 << 10, "M": 1 << 20}[text[-1]] if text[-1] in "KM" else int(text)
            out.append(
                {"level": int((d / "level").read_text()), "type": (d / "type").read_text().strip(), "bytes": size}
            )
        except (OSError, ValueError, KeyError, IndexError):
            continue
    return out


def host_llc_bytes() -> int:
    """The last-level cache's size in bytes: sysfs, else sysconf, else 32 MiB. (glibc's sysconf reads CPUID
    leaves that some VMs leave empty, and answers 0 where sysfs knows the size.)"""
    sizes = [c["bytes"] for c in host_caches() if c["type"] != "Instruction"]
    if sizes:
        return max(sizes)
    try:
        return int(os.sysconf("SC_LEVEL3_CACHE_SIZE")) or 32 << 20
    except (ValueError, OSError):
        return 32 << 20


def host_cpu_target() -> dict:
    """What a CPU artifact built here records about the machine: architecture and ISA extensions."""
    return {"machine": platform.machine(), "isa": host_cpu_isa()}
