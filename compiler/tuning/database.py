"""The tuning database of a target: `targets/<target>.tuning.json`, written by `llmc tune`, read by compile.

    {"version": 1, "target": "cpu", "entries": [
      {"key": {"template": "cpu/gemm", "shape": {"n": 960, "k": 576, "has_bias": false}, "dtype": "bf16",
               "quant": "none"},
       "params": {"prefetch_bytes": 8192, "task_bytes": 65536},
       "figures": {"time_us": ..., "default_time_us": ..., "speedup": ..., "candidates": 20, "rejected": 0},
       "source": "measured" | "simulated",
       "machine": {"cpu": "...", "isa": [...], "threads": 2} | {"gpu": "..."},
       "date": "2026-12-02"}]}

An entry applies to a kernel whose key matches. A CPU entry applies only on a host with the same ISA flags
(host_cpu_isa: the code it was timed as is -march=native code), so one file holds the winners of several
machines; a measured entry beats a simulated one, and a newer one of the same source an older one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from llmc.errors import CompileError
from llmc.host import host_cpu_isa, host_cpu_model

VERSION = 1
SOURCES = ("simulated", "measured")  # by rank: a later one replaces an earlier one
# act_passes: a two-pass qgemm (the CPU's quantized lm_head) streams the same weights as its one-pass twin, and takes
# its tuning; so does a qgemm writing a column range of a wider output (ldy)
_NOT_SHAPE = {
    "name",
    "inv_freq",
    "wdtype",
    "kv_dtype",
    "bits",
    "group_size",
    "asymmetric",
    "scale_bits",
    "codebook",
    "act_passes",
    "ldy",
}


def entry_key(template: str, params: Mapping[str, Any], tunables: set[str]) -> dict:
    """The database key of a kernel: template, shape (its other parameters), dtype and quantization."""
    quant = "none"
    if "bits" in params:
        quant = f"int{params['bits']}_g{params['group_size']}" + ("_asym" if params.get("asymmetric") else "")
        quant += {32: "_fp32scales", 8: "_kscales"}.get(params.get("scale_bits"), "")
        quant += "_iq4" if params.get("codebook") else ""
    shape = {k: v for k, v in sorted(params.items()) if k not in _NOT_SHAPE and k not in tunables}
    dtype = params.get("wdtype") or params.get("kv_dtype") or "f32"
    return {"template": template, "shape": shape, "dtype": dtype, "quant": quant}


def cpu_machine(threads: int) -> dict:
    return {"cpu": host_cpu_model(), "machine": platform.machine(), "isa": host_cpu_isa(), "threads": threads}


@dataclasses.dataclass
class TuningDB:
    path: Path
    target: str
    entries: list[dict]

    @classmethod
    def load(cls, path: str | os.PathLike, target: str, *, required: bool = False) -> TuningDB:
        """The database at `path` (a symlink to it is followed). An absent file is an empty database, unless
        `required` (a path the user named: a typo must not compile with the defaults in silence)."""
        path = Path(path)
        try:
            mode = path.stat().st_mode
        except FileNotFoundError:
            if required:
                raise CompileError(
                    f"tuning database {path}: no such file",
                    "check the path, or pass --tuning-db none for the templates' defaults",
                ) from None
            return cls(path, target, [])
        except OSError as e:
            raise CompileError(f"tuning database {path} cannot be read ({e.strerror})") from None
        if not stat.S_ISREG(mode):
            raise CompileError(f"tuning database {path} is not a regular file", "pass the database's file")
        try:
            raw = json.loads(path.read_text())
            if raw.get("version") != VERSION or not isinstance(raw.get("entries"), list):
                raise ValueError(f"version {raw.get('version')!r}, want {VERSION} with a list of entries")
            for e in raw["entries"]:
                if e["source"] not in SOURCES or not isinstance(e["params"], dict):
                    raise ValueError(f"entry {e['key']}: bad source or params")
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CompileError(
                f"tuning database {path} cannot be read: {e}",
                "fix it, or delete it to compile with the templates' defaults",
            ) from None
        if raw.get("target") != target:
            raise CompileError(f"tuning database {path} is for target {raw.get('target')!r}, not {target!r}")
        return cls(path, target, raw["entries"])

    def save(self) -> None:
        """Written whole to a temporary file and renamed over the old one: a crash leaves one or the other. Only
        a regular file is replaced, in a directory that exists: a directory, a device, a FIFO or a symlink at
        the path (which the rename would replace rather than write through) is a CompileError, as is a failed
        write, and no temporary file is left behind."""
        entries = sorted(self.entries, key=lambda e: json.dumps([e["key"], e.get("machine", {})], sort_keys=True))
        text = json.dumps({"version": VERSION, "target": self.target, "entries": entries}, indent=1) + "\n"
        self._check_replaceable()
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        try:
            try:
                tmp.write_text(text)
                os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        except OSError as e:
            raise CompileError(
                f"tuning database {self.path} cannot be written ({e.strerror}); it is unchanged", "choose another --db"
            ) from None

    def _check_replaceable(self) -> None:
        try:
            mode = self.path.lstat().st_mode
        except FileNotFoundError:
            if not self.path.absolute().parent.is_dir():
                raise CompileError(
                    f"tuning database {self.path}: no such directory {self.path.absolute().parent}",
                    "create it first, or choose another --db",
                ) from None
            return
        except OSError as e:
            raise CompileError(f"tuning database {self.path} cannot be written ({e.strerror})") from None
        if stat.S_ISLNK(mode):
            why = "is a symlink (replacing it would not write where it leads)"
        elif stat.S_ISDIR(mode):
            why = "is a directory"
        elif not stat.S_ISREG(mode):
            why = "is not a regular file (a device, FIFO or socket)"
        else:
            return
        raise CompileError(f"tuning database {self.path} {why}", "choose another --db, or pass the file itself")

    @staticmethod
    def _applies(entry: dict, isa: list[str] | None) -> bool:
        machine = entry.get("machine", {})
        return isa is None or "isa" not in machine or machine["isa"] == isa

    def lookup(self, key: dict, isa: list[str] | None) -> dict | None:
        """The entry for `key` that applies here (isa: this host's flags for a CPU target, None for a GPU)."""
        found = [e for e in self.entries if e["key"] == key and self._applies(e, isa)]
        found.sort(key=lambda e: (SOURCES.index(e["source"]), e.get("date", "")))
        return found[-1] if found else None

    def ignored(self, key: dict, isa: list[str] | None) -> list[dict]:
        """Entries for `key` that do not apply here: tuned on a CPU with other ISA flags."""
        return [e for e in self.entries if e["key"] == key and not self._applies(e, isa)]

    def put(self, key: dict, params: dict, figures: dict, source: str, machine: dict) -> dict:
        """Adds an entry, replacing one for the same key and machine ISA unless that one outranks it."""
        same_isa = machine.get("isa")
        for old in list(self.entries):
            if old["key"] == key and old.get("machine", {}).get("isa") == same_isa:
                if SOURCES.index(old["source"]) > SOURCES.index(source):
                    return old  # a simulated result does not replace a measured one
                self.entries.remove(old)
        entry = {
            "key": key,
            "params": params,
            "figures": figures,
            "source": source,
            "machine": machine,
            "date": datetime.date.today().isoformat(),
        }
        self.entries.append(entry)
        return entry
