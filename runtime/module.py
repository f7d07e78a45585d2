"""CompiledModel: a compiled artifact's model.so, driven through its C ABI with ctypes (docs/contracts.md).

    model = CompiledModel.load("tiny.cpu", kv_cache_memory="1GiB")
    logits = model.step(StepBatch.build(...))      # float32 [N, vocab]: the rows batch.logits_indices asks for

`load` checks the artifact (versions, sha256 of the manifest and every file, a CPU target = this machine), opens
model.so (or the library given, e.g. the simulated build of a CUDA artifact's model.cu), checks
that `llmc_info` agrees with the manifest, sizes the KV cache from a memory budget and calls `llmc_create`.
The module allocates the cache; the runtime (engine, scheduler) decides which block belongs to whom.
ctypes releases the GIL during a call, so a step never blocks other Python threads.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from llmc.artifact import Artifact, load_artifact
from llmc.dtypes import DTYPES
from llmc.errors import ArtifactError, LlmcError, RequestError
from llmc.manifest import ABI_VERSION, recompile_hint
from llmc.model_config import ModelConfig
from llmc.runtime.batch import StepBatch
from llmc.runtime.kv_cache import (
    blocks_for_memory,
    cdiv,
    kv_bytes_per_block,
    kv_cache_budget_bytes,
    mem_available_bytes,
)

_ERR_LEN = 4096
_i32p = ctypes.POINTER(ctypes.c_int32)
_i64p = ctypes.POINTER(ctypes.c_int64)
_f32p = ctypes.POINTER(ctypes.c_float)


class ModelInfo(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int32)
        for name in (
            "abi_version",
            "num_layers",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "kv_dtype_bytes",
            "max_num_tokens",
        )
    ]

    def as_dict(self) -> dict[str, int]:
        return {name: int(getattr(self, name)) for name, _ in self._fields_}


def _bind(lib: ctypes.CDLL, path: Path) -> None:
    try:
        lib.llmc_info.argtypes = [ctypes.POINTER(ModelInfo)]
        lib.llmc_info.restype = ctypes.c_int
        lib.llmc_create.argtypes = [ctypes.c_char_p] + [ctypes.c_int32] * 6 + [ctypes.c_char_p, ctypes.c_int32]
        lib.llmc_create.restype = ctypes.c_void_p
        lib.llmc_step.argtypes = [
            ctypes.c_void_p,
            ctypes.c_int32,
            _i32p,
            _i32p,
            _i64p,
            ctypes.c_int32,
            _i32p,
            _i32p,
            _i32p,
            ctypes.c_int32,
            ctypes.c_int32,
            _i32p,
            _f32p,
        ]
        lib.llmc_step.restype = ctypes.c_int
        lib.llmc_destroy.argtypes = [ctypes.c_void_p]
        lib.llmc_destroy.restype = None
    except AttributeError as e:
        raise ArtifactError(f"{path}: does not export the llmc C ABI ({e})", recompile_hint(path.parent)) from None


def _ptr(a: np.ndarray, ptype):
    return a.ctypes.data_as(ptype)


class CompiledModel:
    """The runtime model interface (docs/contracts.md): config, cache geometry and `step`."""

    config: ModelConfig
    artifact: Artifact
    block_size: int
    num_blocks: int
    max_num_tokens: int
    max_num_seqs: int
    max_num_logits: int
    max_blocks_per_seq: int

    def __init__(
        self,
        artifact: Artifact,
        lib: ctypes.CDLL,
        handle: int,
        info: ModelInfo,
        *,
        block_size: int,
        num_blocks: int,
        max_num_tokens: int,
        max_num_seqs: int,
        max_num_logits: int,
        max_blocks_per_seq: int,
    ):
        self.artifact = artifact
        self.config = artifact.config
        self._lib = lib
        self._handle = handle
        self.info = info.as_dict()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_logits = max_num_logits
        self.max_blocks_per_seq = max_blocks_per_seq
        self.kv_cache_bytes = num_blocks * kv_bytes_per_block(
            info.num_layers, info.num_kv_heads, info.head_dim, block_size, artifact.kv_dtype
        )
        self.tokenizer_path = artifact.tokenizer_path
        self.chat_template = artifact.chat_template
        self.bos_token = artifact.bos_token
        self.eos_token = artifact.eos_token
        self.weight_bytes = artifact.decode_weight_bytes  # what a batch-1 decode step streams: the roofline's bytes
        # transformers generates greedily unless generation_config.json says do_sample
        self.generation_defaults = {"temperature": 0.0, **(artifact.manifest.get("generation_defaults") or {})}

    # -- loading --------------------------------------------------------------------------------------

    @classmethod
    def load(
        cls,
        path: str | Path,
        *,
        kv_cache_memory: int | str | None = None,
        memory_fraction: float = 0.2,
        block_size: int | None = None,
        max_num_tokens: int = 512,
        max_num_seqs: int = 64,
        max_num_logits: int | None = None,
        library: str | Path | None = None,
    ) -> CompiledModel:
        """Load an artifact; the KV cache gets `kv_cache_memory` bytes (e.g. '2GiB') or `memory_fraction`
        of available memory, capped at what max_num_seqs sequences of full context could use.

        block_size: None takes the artifact's (manifest "block_size"); the module is built for that one and
        refuses another.
        max_num_logits: the most logits rows one step may ask for (StepBatch.logits_indices), at least one per
        sequence of a step and at most max_num_tokens; None: max_num_seqs. A CUDA module holds a
        [max_num_logits, vocab] float32 buffer for them.
        library: a shared library to load instead of the artifact's model.so, built from the same source: e.g.
        llmc.compiler.codegen.simulator.build_simulated_library(path), a CUDA artifact under the CUDA simulator.
        """
        artifact = load_artifact(path)
        if block_size is None:
            block_size = artifact.block_size
        elif block_size != artifact.block_size:
            raise LlmcError(
                f"{artifact.path}: the module is built for KV blocks of {artifact.block_size} tokens, not {block_size}",
                f"load it with block_size={artifact.block_size}, or recompile with --block-size",
            )
        if max_num_logits is None:
            max_num_logits = max_num_seqs
        for name, value in (
            ("block_size", block_size),
            ("max_num_tokens", max_num_tokens),
            ("max_num_seqs", max_num_seqs),
            ("max_num_logits", max_num_logits),
        ):
            if not isinstance(value, int) or value < 1:
                raise LlmcError(f"{name}={value!r} is invalid", f"{name} must be an integer >= 1")
        lib_path = Path(library) if library is not None else artifact.library_path
        try:
            lib = ctypes.CDLL(str(lib_path.resolve()), mode=ctypes.RTLD_LOCAL)
        except OSError as e:
            raise ArtifactError(f"{lib_path}: cannot be loaded ({e})", recompile_hint(artifact.path)) from None
        _bind(lib, lib_path)
        info = ModelInfo()
        if lib.llmc_info(ctypes.byref(info)) != 0:
            raise ArtifactError(f"{lib_path}: llmc_info failed", recompile_hint(artifact.path))
        _check_info(info, artifact)

        c = artifact.config
        if info.max_num_tokens > 0:
            max_num_tokens = min(max_num_tokens, int(info.max_num_tokens))
        max_num_logits = min(max_num_logits, max_num_tokens)
        if max_num_logits < min(max_num_seqs, max_num_tokens):
            raise LlmcError(
                f"max_num_logits={max_num_logits} is below the {min(max_num_seqs, max_num_tokens)} "
                "sequences a step may hold, and sampling takes one logits row per sequence",
                "pass max_num_logits >= max_num_seqs, or leave it unset",
            )
        max_blocks_per_seq = cdiv(c.max_context, block_size)
        per_block = kv_bytes_per_block(info.num_layers, info.num_kv_heads, info.head_dim, block_size, artifact.kv_dtype)
        try:
            free = None
            if not artifact.is_cuda and kv_cache_memory is None:  # llmc_create reads the weights into memory next
                free = max(0, mem_available_bytes() - artifact.weights_path.stat().st_size)
            budget = kv_cache_budget_bytes(kv_cache_memory, memory_fraction, free)
        except ValueError as e:
            raise LlmcError(f"KV cache size: {e}", "pass e.g. --kv-cache-memory 2GiB") from None
        num_blocks = min(blocks_for_memory(budget, per_block), max_num_seqs * max_blocks_per_seq, 2**31 - 1)
        if num_blocks < 1:
            raise LlmcError(
                f"the KV cache budget of {budget} bytes holds no block (one block of {block_size} tokens takes "
                f"{per_block} bytes)",
                "give the cache more memory (--kv-cache-memory) or use a smaller block size",
            )

        err = ctypes.create_string_buffer(_ERR_LEN)
        handle = lib.llmc_create(
            str(artifact.weights_path.resolve()).encode(),
            num_blocks,
            block_size,
            max_num_tokens,
            max_num_seqs,
            max_num_logits,
            max_blocks_per_seq,
            err,
            _ERR_LEN,
        )
        if not handle:
            msg = err.value.decode(errors="replace").strip() or "no message"
            hint = (
                "to run a GPU artifact on a machine without that GPU, pass --simulate (in Python, library="
                "build_simulated_library(path))"
                if artifact.is_cuda and library is None
                else None
            )
            raise ArtifactError(f"{artifact.path}: the module failed to start: {msg}", hint)
        return cls(
            artifact,
            lib,
            handle,
            info,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_tokens=max_num_tokens,
            max_num_seqs=max_num_seqs,
            max_num_logits=max_num_logits,
            max_blocks_per_seq=max_blocks_per_seq,
        )

    # -- the step -------------------------------------------------------------------------------------

    def experts_activated(self) -> int | None:
        """(layer, expert) pairs whose weights this module's steps have read since it loaded (its gate/up GEMMs'),
        None for a module that does not count them (an older build)."""
        count = getattr(self._lib, "llmc_experts_activated", None)
        if count is None:
            return None
        count.restype = ctypes.c_int64
        return int(count())

    def step(self, batch: StepBatch) -> np.ndarray:
        """Run one ragged batch; float32 logits [N, vocab], row i for token row batch.logits_indices[i]."""
        if self._handle is None:
            raise LlmcError("the model is closed")
        t, b, n = batch.num_tokens, batch.num_seqs, batch.num_logits
        if not 1 <= t <= self.max_num_tokens:
            raise RequestError(f"a step of {t} tokens; the model was loaded for 1..{self.max_num_tokens} per step")
        if not 1 <= b <= self.max_num_seqs:
            raise RequestError(f"a step of {b} sequences; the model was loaded for 1..{self.max_num_seqs} per step")
        if batch.max_blocks > self.max_blocks_per_seq:
            raise RequestError(
                f"block tables of {batch.max_blocks} blocks; the model takes at most {self.max_blocks_per_seq}"
            )
        if not 1 <= n <= self.max_num_logits:
            raise RequestError(
                f"a step asking for {n} logits rows; the model was loaded for 1..{self.max_num_logits}"
                " per step (CompiledModel.load(max_num_logits=))"
            )
        batch.validate()
        # LongRoPE (Phi-3): the positions of sequences past the original length carry the kernels' long-set flag
        positions = batch.long_rope_positions(self.config.long_rope) if self.config.long_rope else batch.positions
        logits = np.empty((n, self.config.vocab_size), dtype=np.float32)
        rc = self._lib.llmc_step(
            self._handle,
            t,
            _ptr(batch.token_ids, _i32p),
            _ptr(positions, _i32p),
            _ptr(batch.slot_mapping, _i64p),
            b,
            _ptr(batch.query_start_loc, _i32p),
            _ptr(batch.seq_lens, _i32p),
            _ptr(batch.block_tables, _i32p),
            batch.max_blocks,
            n,
            _ptr(batch.logits_indices, _i32p),
            _ptr(logits, _f32p),
        )
        if rc != 0:
            raise LlmcError(f"the model step failed: {_STEP_ERRORS.get(rc, f'code {rc}')}")
        return logits

    # -- lifetime -------------------------------------------------------------------------------------

    def close(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle is not None:
            self._lib.llmc_destroy(handle)

    def __enter__(self) -> CompiledModel:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"CompiledModel({str(self.artifact.path)!r}, {self.config.architecture}, "
            f"{self.num_blocks} blocks of {self.block_size})"
        )


def _check_info(info: ModelInfo, artifact: Artifact) -> None:
    if info.abi_version != ABI_VERSION:
        raise ArtifactError(
            f"{artifact.library_path}: C ABI version {info.abi_version}, this llmc speaks {ABI_VERSION}",
            recompile_hint(artifact.path),
        )
    c = artifact.config
    want = {
        "num_layers": c.num_layers,
        "num_kv_heads": c.num_kv_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
    }
    want["kv_dtype_bytes"] = DTYPES[artifact.kv_dtype].nbytes
    got = {k: int(getattr(info, k)) for k in want}
    if got != want:
        raise ArtifactError(
            f"{artifact.library_path}: llmc_info {info.as_dict()} does not match the manifest's model",
            recompile_hint(artifact.path),
        )


# llmc_step's return codes (docs/contracts.md)
_STEP_ERRORS = {
    1: "the batch exceeds the sizes the module was created for",
    2: "a token id is outside the vocabulary",
    3: "capturing the decode step in a CUDA graph failed (LLMC_CUDA_GRAPHS=0 turns graphs off)",
    4: "a CUDA error",
    5: "a TVM fallback kernel rejected its arguments (a compiler bug; TVM's message is on stderr)",
    6: "a logits index is outside the step's tokens",
}


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from tokenizer.json; ArtifactError if it cannot be read."""
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception subclasses
        raise ArtifactError(f"{path}: cannot load the tokenizer ({e})", "recompile the artifact") from None
