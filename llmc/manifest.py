"""manifest.json: the artifact's record of what was built, its seal, and the checks that make it safe to read.

The fields and their meaning are docs/contracts.md's ("The artifact module"). `complete_manifest` fills in
what the writer (llmc/artifact_writer.py) adds to the compiler's fields: magic, versions, defaults, the
digests of every file and of the manifest's own fields (`seal_manifest`). The loader (llmc/artifact.py)
parses and checks it here.

The manifest is untrusted input: any text either loads or is one ArtifactError of one line. Its `files`
are plain relative names inside the artifact (no "..", no absolute path, nothing a symlink leads outside
to), checked before anything is opened, and every field the runtime reads is type-checked.

The manifest's `manifest_sha256` maps each of its other top-level fields to the sha256 of that field's
canonical JSON, so an edit names the field it touched (model_config, block_size, tokenizer, ...), and its
own name to the sha256 of the sorted field names: a field taken out (or put in) together with its digest
changes that set. It guards against edits and damage, not against someone who recomputes the digests on
purpose.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from collections.abc import Callable
from pathlib import Path

from llmc import __version__
from llmc.dtypes import KV_DTYPES
from llmc.errors import ArtifactError, CompileError
from llmc.host import host_cpu_target
from llmc.kernel_program import schema_problem
from llmc.model_config import ModelConfig
from llmc.targets import KINDS, SOURCE_FILE, load_target

MAGIC = "llmc-artifact"
# 2: the target's kind, block_size and manifest_sha256 are required; 3: kernel_program is JSON; 4: the set of
# fields is sealed
FORMAT_VERSION = 4
ABI_VERSION = 2  # docs/contracts.md LLMC_ABI_VERSION
MANIFEST = "manifest.json"
MANIFEST_DIGESTS = "manifest_sha256"
LIBRARY = "model.so"
WEIGHTS = "weights.safetensors"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"

# The SamplingParams fields a checkpoint's generation_config.json may set (compiler/frontend/checkpoint.py),
# every request's defaults: the runtime passes them on as keyword arguments.
GENERATION_DEFAULT_KEYS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")

_MAX_MANIFEST_BYTES = 64 << 20  # an 8B model's manifest is well under 1 MiB; more is not one llmc wrote
_FILE_PART = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")  # one component of a `files` name
_SHA256 = re.compile(r"[0-9a-f]{64}")
_TARGET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
_ISA_NAME = re.compile(r"[A-Za-z0-9_.]{1,64}")


def _canonical_sha256(value) -> str:
    """sha256 of a JSON value's canonical text: key order and whitespace do not change it."""
    text = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def seal_manifest(m: dict) -> dict:
    """The manifest with `manifest_sha256` (re)computed over its other fields and over the set of them."""
    fields = {k: v for k, v in m.items() if k != MANIFEST_DIGESTS}
    digests = {k: _canonical_sha256(v) for k, v in fields.items()}
    return {**fields, MANIFEST_DIGESTS: {**digests, MANIFEST_DIGESTS: _canonical_sha256(sorted(fields))}}


def _complete_target(target) -> dict:
    """A target name, or a dict with "name": completed from its TOML unless it already says its kind."""
    if isinstance(target, str):
        target = {"name": target}
    if not isinstance(target, dict) or not isinstance(target.get("name"), str):
        raise ArtifactError(f"manifest: target {target!r} has no name")
    if "kind" not in target:
        try:
            target = {**load_target(target["name"]).raw, **target}
        except CompileError as e:
            raise ArtifactError(f"manifest: target {target['name']!r}: {e.what}", e.hint) from None
    if target["kind"] == "cpu":
        target = {**host_cpu_target(), **target}
    return target


def complete_manifest(fields: dict, files: dict[str, str]) -> dict:
    if not isinstance(fields, dict):
        raise TypeError(f"populate must return the manifest fields as a dict, got {type(fields).__name__}")
    fields = dict(fields)
    target = _complete_target(fields.pop("target", None))
    block_size = fields.pop("block_size", None) or (target.get("defaults") or {}).get("block_size")
    config = fields.pop("model_config", None)
    if isinstance(config, ModelConfig):
        config = config.to_dict()
    if not isinstance(config, dict):
        raise ArtifactError("manifest: model_config is missing")
    for reserved in ("magic", "format_version", "abi_version", "compiler_version", "files", MANIFEST_DIGESTS):
        fields.pop(reserved, None)
    manifest = {
        "magic": MAGIC,
        "format_version": FORMAT_VERSION,
        "abi_version": ABI_VERSION,
        "compiler_version": __version__,
        "target": target,
        "model_config": config,
        "weight_dtype": fields.pop("weight_dtype", None),
        "quantization": fields.pop("quantization", "none"),
        "block_size": block_size,
        "kv_cache_dtype": fields.pop("kv_cache_dtype", "float32"),
        "kernels": fields.pop("kernels", []),
        "passes": fields.pop("passes", {}),
        "buffer_plan": fields.pop("buffer_plan", {}),
        "tokenizer": {"chat_template": None, "bos_token": None, "eos_token": None, **fields.pop("tokenizer", {})},
        **fields,
        "files": files,
    }
    return seal_manifest(json.loads(json.dumps(manifest)))  # digests over what a reader will parse


def recompile_hint(path: Path, target: str = "cpu") -> str:
    return f"recompile it: llmc compile CHECKPOINT --target {target} -o {path}"


def _show(value, limit: int = 60) -> str:
    """A manifest value in a message: its repr, which is one line, cut short."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def recorded_target_name(m: dict) -> str:
    """The target a (possibly damaged) manifest names, for the recompile hint."""
    target = m.get("target")
    name = target.get("name") if isinstance(target, dict) else None
    return name if isinstance(name, str) and _TARGET_NAME.fullmatch(name) else "cpu"


def _is_file_name(rel) -> bool:
    """A name llmc writes into `files`: relative, inside the artifact, of plain parts (no "", ".", "..")."""
    return (
        isinstance(rel, str)
        and rel != MANIFEST
        and len(rel) <= 255
        and all(_FILE_PART.fullmatch(part) for part in rel.split("/"))
    )


def _is_int(value, low: int = 1, high: int = 2**31 - 1) -> bool:
    return type(value) is int and low <= value <= high  # bool is no int here; the C ABI takes int32


def check_manifest(m: dict, path: Path) -> None:
    """Structure and types (no hashing) of every field the runtime reads: target, block_size, files (plain
    names inside the artifact, the required ones listed), tokenizer, weight_dtype, kv_cache_dtype,
    kernel_program (llmc/kernel_program.py's schema) and generation_defaults; and the shapes of those only
    `llmc inspect` reads."""
    damaged = "the manifest is damaged; recompile the artifact"
    target = m.get("target")
    name = target.get("name") if isinstance(target, dict) else None
    if not isinstance(name, str) or not _TARGET_NAME.fullmatch(name) or target.get("kind") not in KINDS:
        raise ArtifactError(
            f"{path}: manifest target {_show(target)} has no name or no kind of {', '.join(KINDS)}", damaged
        )
    hint = recompile_hint(path, name)
    machine, isa = target.get("machine"), target.get("isa")
    if not (machine is None or isinstance(machine, str) and _ISA_NAME.fullmatch(machine)) or not (
        isa is None or isinstance(isa, list) and all(isinstance(f, str) and _ISA_NAME.fullmatch(f) for f in isa)
    ):
        raise ArtifactError(
            f"{path}: manifest target machine {_show(machine)} or isa {_show(isa)} is not a name or a list of names",
            damaged,
        )
    block_size = m.get("block_size")
    if not _is_int(block_size):
        raise ArtifactError(f"{path}: manifest block_size {_show(block_size)} is not a positive integer", hint)
    files = m.get("files")
    if not isinstance(files, dict):
        raise ArtifactError(f"{path}: manifest lists no files", damaged)
    for rel, digest in files.items():
        if not _is_file_name(rel):
            raise ArtifactError(
                f"{path}: the manifest lists a file {_show(rel)}, which is not a plain name inside "
                "the artifact; nothing was read",
                damaged,
            )
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise ArtifactError(f"{path}: the manifest's sha256 of {rel} is {_show(digest)}, not 64 hex digits", hint)
    for required in (LIBRARY, WEIGHTS, TOKENIZER, SOURCE_FILE[target["kind"]]):
        if required not in files:
            raise ArtifactError(f"{path}: the manifest lists no {required}", hint)
    tokenizer = m.get("tokenizer")
    if not isinstance(tokenizer, dict) or not all(
        isinstance(tokenizer.get(k), str | None) for k in ("chat_template", "bos_token", "eos_token")
    ):
        raise ArtifactError(f"{path}: manifest tokenizer {_show(tokenizer)} is not an object of strings", hint)
    if not isinstance(m.get("weight_dtype"), str | None):
        raise ArtifactError(f"{path}: manifest weight_dtype {_show(m['weight_dtype'])} is not a name", hint)
    kv_dtype = m.get("kv_cache_dtype", "float32")
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise ArtifactError(
            f"{path}: manifest kv_cache_dtype {_show(kv_dtype)} is not one of {', '.join(KV_DTYPES)}", hint
        )
    if "kernel_program" in m and (problem := schema_problem(m["kernel_program"])):
        raise ArtifactError(f"{path}: manifest kernel_program {problem}", hint)
    if problem := _described_fields_problem(m):
        raise ArtifactError(f"{path}: manifest {problem}", hint)
    defaults = m.get("generation_defaults")
    if not (
        defaults is None
        or isinstance(defaults, dict)
        and all(k in GENERATION_DEFAULT_KEYS and type(v) in (int, float) for k, v in defaults.items())
    ):
        raise ArtifactError(
            f"{path}: manifest generation_defaults {_show(defaults)} are not sampling parameters "
            f"(numbers for {', '.join(GENERATION_DEFAULT_KEYS)})",
            hint,
        )


# The fields only the tools read (`llmc inspect`), and the JSON type each must have
_DESCRIBED_FIELDS = {
    "compiler_version": str,
    "quantization": str,
    "activation_dtype": str,
    "kernels": list,
    "passes": dict,
    "buffer_plan": dict,
    "quant": dict,
    "quality": dict,
    "tuning": dict,
}


def _described_fields_problem(m: dict) -> str | None:
    """What is wrong with the shape of a field `llmc inspect` goes through, if anything."""
    for key, kind in _DESCRIBED_FIELDS.items():
        if key in m and not isinstance(m[key], kind):
            return (
                f"{key} {_show(m[key])} is not {dict(str='a string', list='a list', dict='an object')[kind.__name__]}"
            )
    if not all(_is_int(n, 0) for n in m.get("passes", {}).values()):
        return f"passes {_show(m['passes'])} are not counts of rewrites"
    for k in m.get("kernels", []):
        if not (
            isinstance(k, dict)
            and isinstance(k.get("params", {}), dict)
            and _is_int(k.get("launches", 1), 0)
            and isinstance(k.get("fuses", []), list)
        ):
            return f"kernels entry {_show(k)} is not a kernel (params an object, launches a count, fuses a list)"
    tuned = m.get("tuning", {}).get("kernels", {})
    if not isinstance(tuned, dict) or not all(
        isinstance(t, dict)
        and isinstance(t.get("params", {}), dict)
        and isinstance(ignored := t.get("ignored", []), list)
        and all(isinstance(i, str) for i in ignored)
        for t in tuned.values()
    ):
        return f"tuning kernels {_show(tuned)} are not kernels' tuned parameters"
    return None


def check_seal(m: dict, path: Path) -> None:
    """Every field of the manifest still has the sha256 recorded when it was written."""
    recorded = m.get(MANIFEST_DIGESTS)
    hint = recompile_hint(path, recorded_target_name(m))
    if not isinstance(recorded, dict):
        raise ArtifactError(f"{path / MANIFEST}: no {MANIFEST_DIGESTS} (the manifest's own digests)", hint)
    fields = {k: v for k, v in m.items() if k != MANIFEST_DIGESTS}
    changed = sorted(
        k
        for k in fields.keys() | recorded.keys() - {MANIFEST_DIGESTS}
        if k not in recorded or k not in fields or _canonical_sha256(fields[k]) != recorded[k]
    )
    if changed:
        named = ", ".join(k if k.isidentifier() else _show(k) for k in changed[:8])
        raise ArtifactError(
            f"{path / MANIFEST}: field {named} was edited or damaged after compile "
            f"(its sha256 does not match {MANIFEST_DIGESTS})",
            hint,
        )
    if recorded.get(MANIFEST_DIGESTS) != _canonical_sha256(sorted(fields)):
        raise ArtifactError(
            f"{path / MANIFEST}: its set of fields was changed after compile (a field was taken out or put in; "
            f"the names do not match their sha256 in {MANIFEST_DIGESTS})",
            hint,
        )


def check_config(d, path: Path, hint: str) -> None:
    """model_config has every ModelConfig field, of its type, in range: the runtime sizes buffers from it."""
    if not isinstance(d, dict):
        raise ArtifactError(f"{path}: manifest model_config {_show(d)} is not an object", hint)
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    unknown = sorted(k for k in d if k not in fields)
    missing = sorted(k for k, f in fields.items() if k not in d and f.default is dataclasses.MISSING)
    if unknown or missing:
        odd = ", ".join(_show(k) for k in unknown[:4])
        raise ArtifactError(
            f"{path}: manifest model_config "
            + (f"has unknown fields {odd}" if unknown else f"lacks {', '.join(missing)}"),
            hint,
        )
    for key, value in d.items():
        if not _CONFIG_TYPES[fields[key].type](value):
            raise ArtifactError(
                f"{path}: manifest model_config {key} {_show(value)} is not a {fields[key].type} in range", hint
            )
    problem = ModelConfig.from_dict(d).inconsistency()
    if problem:
        raise ArtifactError(f"{path}: manifest model_config is inconsistent: {problem}", hint)


def _finite_positive(value) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value > 0


# ModelConfig's field types (as annotated) -> what a manifest value of that type must be
_CONFIG_TYPES: dict[str, Callable[[object], bool]] = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": _finite_positive,
    "bool": lambda v: isinstance(v, bool),
    "dict | None": lambda v: v is None or isinstance(v, dict),
    "int | None": lambda v: v is None or _is_int(v, 0),
    "float | None": lambda v: v is None or _finite_positive(v),
    "tuple[int, ...]": lambda v: isinstance(v, list) and all(_is_int(i, 0) for i in v),
}


def quant_bits_per_weight(quant) -> float | None:
    """Bits a quantized GEMM weight is stored in, scales and mins included (the manifest's `quant` entry)."""
    if not isinstance(quant, dict) or not _is_int(quant.get("quantized_weights")):
        return None
    packed = quant.get("packed_bytes")
    stored = packed.get("quantized") if isinstance(packed, dict) else None
    return 8 * stored / quant["quantized_weights"] if _is_int(stored) else None


def parse_manifest(path: Path) -> dict:
    """manifest.json of an artifact dir, parsed (with limits on size and nesting) and its magic checked."""
    if not path.exists():
        raise ArtifactError(
            f"{path}: no such artifact", "compile one: llmc compile CHECKPOINT --target cpu -o " + str(path)
        )
    if not path.is_dir():
        raise ArtifactError(f"{path}: not an artifact directory", "pass the directory llmc compile -o wrote")
    mpath = path / MANIFEST
    if not mpath.is_file():
        if (path / "config.json").is_file():
            raise ArtifactError(
                f"{path}: is a checkpoint, not a compiled artifact",
                f"compile it first: llmc compile {path} --target cpu -o OUT",
            )
        raise ArtifactError(f"{path}: not an llmc artifact (no {MANIFEST})", "compile one with llmc compile")
    try:
        with open(mpath, "rb") as f:
            raw = f.read(_MAX_MANIFEST_BYTES + 1)
        if len(raw) > _MAX_MANIFEST_BYTES:
            raise ValueError(f"more than {_MAX_MANIFEST_BYTES >> 20} MiB")
        m = json.loads(raw.decode())
        if _nesting_exceeds(m, 32):
            raise ValueError("nested more than 32 levels deep")
    except OSError as e:
        raise ArtifactError(f"{mpath}: cannot be read ({e.strerror})", "check its permissions") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise ArtifactError(
            f"{mpath}: corrupt manifest ({_show(str(e), 120)[1:-1]})", "recompile the artifact"
        ) from None
    if not isinstance(m, dict) or m.get("magic") != MAGIC:
        raise ArtifactError(f"{path}: {MANIFEST} is not an llmc artifact manifest", "recompile the artifact")
    return m


def _nesting_exceeds(value, limit: int) -> bool:
    """Whether a parsed JSON value nests deeper than `limit` (hashing it again must not exhaust the stack)."""
    level = [value]
    for _ in range(limit):
        level = [v for c in level if isinstance(c, dict | list) for v in (c.values() if isinstance(c, dict) else c)]
        if not level:
            return False
    return True


def check_versions(m: dict, path: Path) -> None:
    version = m.get("compiler_version")
    by = version if isinstance(version, str) and re.fullmatch(r"[\w.+-]{1,40}", version) else "?"
    for key, want in (("format_version", FORMAT_VERSION), ("abi_version", ABI_VERSION)):
        if m.get(key) != want:
            raise ArtifactError(
                f"{path}: artifact {key.replace('_', ' ')} {_show(m.get(key))} (compiled by llmc {by}), but llmc "
                f"{__version__} reads version {want}",
                recompile_hint(path, recorded_target_name(m)),
            )


def read_manifest(path: str | Path) -> dict:
    """manifest.json of an artifact dir, with magic and versions checked (no file hashing)."""
    path = Path(path)
    m = parse_manifest(path)
    check_versions(m, path)
    return m
