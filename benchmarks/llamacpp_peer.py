"""llama.cpp as the CPU peer of the benchmarks (vs_llamacpp.py, quant_quality.py): its GGUF files, written by
llmc's writer or quantized by llama.cpp itself, the bytes a decode step reads from one, and llama-cpp-python at
batch 1, checked first in a child process (a build that crashes on a file names it instead of killing the run)."""

from __future__ import annotations

import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, log

# llama.cpp's quantizer's file types (llama_model_quantize's ftypes, LLAMA_FTYPE_MOSTLY_<type>) that the gguf
# package does not write
LLAMA_CPP_TYPES = ("Q4_1", "Q4_K_M", "Q5_K_M", "Q6_K", "IQ4_NL", "IQ4_XS", "Q3_K_M", "Q2_K")


def llama_cpp_quantize(src: Path, out: Path, gguf_type: str) -> Path:
    """An F32 GGUF file quantized by llama.cpp (llama_model_quantize, no imatrix) to its file type `gguf_type`
    (Q8_0, Q4_K_M, IQ4_XS...): SystemExit where llama.cpp fails."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{gguf_type}")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src.name} to {gguf_type}")
    return out


def _writer_hash() -> str:
    """What a GGUF file depends on besides the checkpoint: the writer and its names."""
    h = hashlib.sha256()
    for f in ("gguf_write.py", "gguf_names.py"):
        h.update((REPO / "compiler" / "frontend" / f).read_bytes())
    return h.hexdigest()[:12]


def gguf_file(ckpt: Path, cache: Path, tag: str, gguf_type: str, log=log) -> Path:
    """The checkpoint as a GGUF file of gguf_type, written once per writer source state: by llmc's writer, or
    for llama.cpp's quantizer's types (LLAMA_CPP_TYPES) by llama.cpp from the F32 file."""
    from llmc.compiler.frontend.gguf_write import write_gguf

    out = cache / f"{tag}-{gguf_type}-{_writer_hash()}.gguf"
    if out.is_file():
        return out
    for old in cache.glob(f"{tag}-{gguf_type}-*.gguf"):
        old.unlink()
    log(f"writing {out.name}")
    t = time.perf_counter()
    if gguf_type in LLAMA_CPP_TYPES:
        llama_cpp_quantize(gguf_file(ckpt, cache, tag, "F32", log), out, gguf_type)
    else:
        write_gguf(ckpt, out, gguf_type)
    log(f"  written in {time.perf_counter() - t:.1f} s")
    return out


def gguf_decode_bytes(path: Path) -> int:
    """Weight bytes one llama.cpp decode step reads from this file: every tensor once, but one row of the token
    embedding, the whole embedding again when it is the (tied) output matrix, and of stacked experts
    (ffn_*_exps) the expert_used_count of expert_count that a token chooses."""
    import gguf

    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}

    def field(key: str) -> int:
        f = reader.fields.get(key)
        return int(f.parts[f.data[0]][0]) if f is not None else 0

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    used, experts = field(f"{arch}.expert_used_count"), field(f"{arch}.expert_count")
    embd = tensors["token_embd.weight"]
    total = 0
    for n, t in tensors.items():
        if n != "token_embd.weight":
            total += int(t.n_bytes) * used // experts if "_exps." in n else int(t.n_bytes)
    total += int(embd.n_bytes) // int(embd.shape[-1])  # GGUF lists dims innermost first: shape[-1] is the rows
    if "output.weight" not in tensors:
        total += int(embd.n_bytes)
    return total


class LlamaCpp:
    """llama_cpp.Llama at batch 1 on token ids: one eval of the prompt, then greedy sample + eval per token."""

    def __init__(self, path: Path, threads: int, max_len: int, prompt_len: int):
        from llama_cpp import Llama

        batch = max(512, prompt_len)
        self.llm = Llama(
            model_path=str(path),
            n_ctx=max_len,
            n_batch=batch,
            n_ubatch=batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )

    def run(self, prompt: list[int], n: int) -> tuple[float, float, list[int]]:
        """(seconds of the prefill, seconds of the n decode steps, the n + 1 tokens), as LlmcStep.run."""
        llm = self.llm
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt)
        tok = llm.sample(temp=0.0)
        prefill = time.perf_counter() - t
        out = [tok]
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = llm.sample(temp=0.0)
            out.append(tok)
        return prefill, time.perf_counter() - t, out

    def close(self) -> None:
        self.llm.close()


class PeerCrashed(RuntimeError):
    """llama.cpp died on this GGUF file in a child process: measuring it in this one would kill the benchmark."""


_SMOKE = """
import sys
from llama_cpp import Llama
llm = Llama(model_path=sys.argv[1], n_ctx=16, n_threads=int(sys.argv[2]), verbose=False)
llm.eval([2, 3])
llm.close()
"""


def check_llamacpp_runs(gguf_path: Path, threads: int) -> None:
    """Evaluate two tokens of `gguf_path` with llama.cpp in a child process; PeerCrashed where it dies. (On some
    AMX hosts ggml's AMX int8 matmul segfaults on Q8_0/Q4_0, llama.cpp issue 20824: the module docstring gives
    a build without it.)"""
    r = subprocess.run([sys.executable, "-c", _SMOKE, str(gguf_path), str(threads)], capture_output=True, text=True)
    if r.returncode == 0:
        return
    from llama_cpp import llama_print_system_info

    how = f"signal {signal.Signals(-r.returncode).name}" if r.returncode < 0 else f"exit {r.returncode}"
    hint = ""
    if b"AMX_INT8 = 1" in llama_print_system_info():
        hint = "; this build uses ggml's AMX int8 kernels: rebuild without them (this file's docstring says how)"
    raise PeerCrashed(f"llama.cpp died ({how}) evaluating {gguf_path.name}{hint}\n{r.stderr[-2000:]}")
