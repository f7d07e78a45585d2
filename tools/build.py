"""Building artifacts with what the compiler alone cannot do: a quantized build's quality gate, which runs the
build and its unquantized twin through the runtime, and llmc's cache of artifacts compiled from checkpoints on
demand (`llmc run CHECKPOINT`, the bundled model), compiled once per checkpoint, compiler version and host
CPU, then reused while the checkpoint is unchanged.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import math
import re
import sys
import tempfile
from pathlib import Path

from llmc import __version__
from llmc.artifact_writer import write_manifest
from llmc.digests import checkpoint_hash, file_sha256
from llmc.dtypes import resolve_kv_dtype
from llmc.errors import CompileError
from llmc.host import cache_root, host_cpu_target
from llmc.manifest import ABI_VERSION, FORMAT_VERSION, read_manifest

from .quality import (
    DEFAULT_CALIBRATION_TOKENS,
    QUALITY_STAGE,
    Quality,
    calibration_tokens,
    check_gate,
    measure_artifacts,
)

IMPORTANCE_TOKENS = 1024  # calibration tokens after the gate's that the activation importance is measured on
MIN_IMPORTANCE_TOKENS = 128


def compile_checkpoint(
    checkpoint,
    *,
    quant=None,
    calibration: str | Path | None = None,
    max_kl: float | None = None,
    max_ppl_increase: float | None = None,
    **options,
) -> Path:
    """llmc.compiler.compile.compile_checkpoint, with the quality gate for a quantized build (quant, a
        QuantConfig): the gate runs the build against the unquantized model on the calibration text (None: the
        bundled model's held-out text), writes the figures into the manifest's `quality`, and fails the compile,
        writing nothing, when the mean KL is over max_kl or the perplexity over the reference's by more than
        max_ppl_increase percent. checkpoint: a path, or a Checkpoint loaded already (it is
    loaded once for the gate and the compile). options: compile_checkpoint's."""
    from llmc.compiler.compile import compile_checkpoint as compile_only  # torch and TVM load only to compile
    from llmc.compiler.frontend.checkpoint import Checkpoint
    from llmc.compiler.frontend.load import load_checkpoint

    enabled = quant is not None and quant.enabled
    if not enabled and (calibration is not None or max_kl is not None or max_ppl_increase is not None):
        raise CompileError(
            "--calibration, --max-kl and --max-ppl-increase apply to a quantized build", "add --quant int8 or int4"
        )
    if max_kl is not None and not max_kl >= 0:
        raise CompileError(f"--max-kl {max_kl} is not a KL divergence", "pass a number >= 0")
    if max_ppl_increase is not None and not math.isfinite(max_ppl_increase):
        raise CompileError(f"--max-ppl-increase {max_ppl_increase} is not a percentage", "pass a finite number")
    if not enabled:
        return compile_only(checkpoint, quant=quant, **options)
    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else load_checkpoint(checkpoint)
    # read and tokenized before anything is built: a bad file fails at once. The gate scores the first
    # DEFAULT_CALIBRATION_TOKENS; the quantizer's activation importance is measured on the tokens after them, so
    # the gate's figures are not of the text the rounding was fitted to (a text with too few: unweighted), as one
    # sequence no longer than the model's context.
    ids, label = calibration_tokens(ckpt.tokenizer_path, calibration, DEFAULT_CALIBRATION_TOKENS + IMPORTANCE_TOKENS)
    token_ids = ids[:DEFAULT_CALIBRATION_TOKENS]
    importance_tokens = ids[DEFAULT_CALIBRATION_TOKENS:][: ckpt.config.max_position_embeddings]
    if len(importance_tokens) < MIN_IMPORTANCE_TOKENS:
        importance_tokens = None

    def gate(tmp: Path, fields: dict) -> dict:
        """This build against the unquantized one on the CPU: itself for a CPU target, else a CPU twin."""
        dtype, kv_dtype = fields["weight_dtype"], fields["kv_cache_dtype"]
        if fields["target"]["kind"] == "cpu":
            write_manifest(tmp, fields)  # provisional, so that the runtime loads the module being built
            reference = _reference_artifact(ckpt, dtype, kv_dtype)
            result = measure_artifacts(reference, tmp, token_ids, label)
        else:
            with tempfile.TemporaryDirectory() as d:
                twin = compile_checkpoint(
                    ckpt,
                    target="cpu",
                    output=Path(d) / "cpu",
                    weight_dtype=dtype,
                    quant=quant,
                    kv_dtype=kv_dtype,
                    calibration=calibration,
                )
                result = dataclasses.replace(Quality(**read_manifest(twin)["quality"]), measured_on="cpu build")
        check_gate(result, max_kl, max_ppl_increase)
        return {"quality": result.to_manifest()}

    return compile_only(ckpt, quant=quant, gate=(QUALITY_STAGE, gate), importance_tokens=importance_tokens, **options)


def _reference_artifact(ckpt, weight_dtype: str, kv_dtype: str) -> Path:
    """The unquantized CPU build of checkpoint `ckpt` with the same weight and KV cache dtypes, from llmc's
    compile cache (compiled into it the first time: every quantized build of the checkpoint reuses it)."""
    from llmc.compiler.compile import resolve_weight_dtype

    # the checkpoint's own dtype is the entry `llmc run CHECKPOINT` compiles ("auto"): one build serves both
    requested = "auto" if weight_dtype == resolve_weight_dtype(ckpt, "auto") else weight_dtype
    return cached_artifact(ckpt.path, progress=False, weight_dtype=requested, kv_dtype=kv_dtype)


def cached_artifact(
    ckpt: Path, *, progress: bool = True, quant=None, weight_dtype: str = "auto", kv_dtype: str = "auto"
) -> Path:
    """A CPU artifact of checkpoint `ckpt`, from the cache, compiled into it first if it is not there.

    Key: the checkpoint's content hash (a .gguf file's own sha256; digests.py remembers the hashes of big
    files), the compiler version, the artifact format and ABI versions (they change between releases during
    development), this host's
    CPU, so a cache shared across hosts or llmc builds never hands out an artifact another one cannot load,
    and the quantization asked for (quant, a QuantConfig; None is none), weight dtype and KV cache dtype.
    Processes that ask for the same key at once compile it once: the others wait on its lock, then reuse it.
    """
    kv_dtype = resolve_kv_dtype(kv_dtype, cuda=False, weight_dtype=weight_dtype)
    isa = hashlib.sha256(json.dumps(host_cpu_target(), sort_keys=True).encode()).hexdigest()[:8]
    content = file_sha256(ckpt) if ckpt.is_file() else checkpoint_hash(ckpt)  # a GGUF file holds all of it
    key = f"{content[:24]}-llmc{__version__}-f{FORMAT_VERSION}-abi{ABI_VERSION}-cpu-{isa}"
    if quant is not None and quant.enabled:
        key += "-" + re.sub(r"[^a-z0-9]+", "-", quant.describe()).strip("-")  # int8-per-channel, int4-g32-lm-head
        if quant.overrides:  # patterns differ in the characters the line above drops
            key += "-" + hashlib.sha256(quant.describe().encode()).hexdigest()[:8]
    key += (f"-{weight_dtype}" if weight_dtype != "auto" else "") + (f"-kv-{kv_dtype}" if kv_dtype != "float32" else "")
    root = cache_root() / "artifacts"
    out = root / key
    if (out / "manifest.json").is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "manifest.json").is_file():
            if progress:
                print(f"compiling {ckpt} for this CPU (once; cached in {out})", file=sys.stderr)
            compile_checkpoint(
                ckpt,
                target="cpu",
                output=out,
                weight_dtype=weight_dtype,
                progress=progress,
                quant=quant,
                kv_dtype=kv_dtype,
            )
    return out
