"""Run a function in a forked child with its time and memory measured and bounded, for hostile-input tests.

    out = run_bounded(lambda: load_checkpoint(path), seconds=5)
    out.kind       # "ok" | "error" (an LlmcError: out.value is its message) | "crash" (any other exception:
                   # out.value is the traceback) | "killed" (past the alarm, or out of address space)
    out.wall, out.peak  # seconds, and bytes of resident memory grown above the child's start

The child gets SIGALRM after `seconds` (killing it) and an address-space limit of `memory` above what it has
mapped at the fork, so a runaway input cannot take the machine down; the peak is measured from the child's own
high-water mark (reset at the start through /proc/self/clear_refs).
"""

from __future__ import annotations

import dataclasses
import math
import os
import pickle
import resource
import signal
import time
import traceback

from llmc.errors import LlmcError


@dataclasses.dataclass
class Outcome:
    kind: str
    value: object
    wall: float
    peak: int | None  # None where the kernel does not let a process reset its high-water mark

    def __str__(self) -> str:
        peak = "?" if self.peak is None else f"{self.peak / 2**20:.0f} MiB"
        return f"{self.kind} after {self.wall:.2f} s, {peak}: {str(self.value)[:2000]}"


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


def run_bounded(fn, seconds: float = 5.0, memory: int = 2 << 30) -> Outcome:
    read_end, write_end = os.pipe()
    start = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: never returns into the caller (pytest) and never raises
        try:
            os.close(read_end)
            signal.alarm(math.ceil(seconds))
            soft = _status_kib("VmSize") * 1024 + memory
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            resource.setrlimit(resource.RLIMIT_AS, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                rss = _status_kib("VmRSS")
            except OSError:
                rss = None
            t0 = time.perf_counter()
            try:
                kind, value = "ok", fn()
            except LlmcError as e:
                kind, value = "error", str(e)
            except BaseException:  # everything else is what the tests look for
                kind, value = "crash", traceback.format_exc()
            wall = time.perf_counter() - t0
            peak = None if rss is None else (_status_kib("VmHWM") - rss) * 1024
            try:
                blob = pickle.dumps(Outcome(kind, value, wall, peak))
            except Exception:  # an unpicklable result
                blob = pickle.dumps(Outcome(kind, repr(value), wall, peak))
            with os.fdopen(write_end, "wb") as f:
                f.write(blob)
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        blob = f.read()
    _, status = os.waitpid(pid, 0)
    if blob:
        return pickle.loads(blob)
    why = f"signal {signal.Signals(os.WTERMSIG(status)).name}" if os.WIFSIGNALED(status) else f"status {status}"
    return Outcome("killed", why, time.perf_counter() - start, None)
