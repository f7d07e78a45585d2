"""Open and validate a Hugging Face checkpoint directory without loading its weights.

A checkpoint is config.json, model.safetensors or shards listed by model.safetensors.index.json, and
tokenizer.json (+ tokenizer_config.json, whose chat template is kept). Validation reads only the
safetensors headers, so an 8B checkpoint opens in milliseconds; tensors are read one at a time later
(`Checkpoint.tensor`), mmapped, which is how compile streams weights without holding them twice.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open

from llmc.dtypes import BY_SAFETENSORS
from llmc.errors import CheckpointError, LlmcError
from llmc.manifest import GENERATION_DEFAULT_KEYS

from ..quant import QuantizedTensor, QuantScheme
from .config import ModelConfig, parse_config, token_ids

_READS = ("float32", "float16", "bfloat16")  # the weight dtypes llmc reads from a checkpoint


@dataclasses.dataclass
class Checkpoint:
    path: Path
    config: ModelConfig
    tensor_files: dict[str, Path]  # HF tensor name -> the safetensors file holding it
    dtypes: dict[str, str]  # HF tensor name -> "float32" | "float16" | "bfloat16"
    tokenizer_path: Path
    chat_template: str | None
    special_tokens: dict[str, str]  # bos_token / eos_token from tokenizer_config.json, when given
    generation_defaults: dict  # sampling defaults from generation_config.json (SamplingParams names)
    slices: dict[str, tuple[str, int, int]]  # config.stored_slices(): tensors read as rows of a fused one

    @property
    def weight_dtype(self) -> str:
        """The dtype of the checkpoint's weights (the most common one, by tensor count)."""
        values = list(self.dtypes.values())
        return max(set(values), key=values.count)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as float; a quantized one (GGUF) comes dequantized, exactly."""
        with safe_open(self.tensor_files[name], framework="pt") as f:
            if name in self.slices:  # rows of a fused tensor (Phi-3's qkv_proj, gate_up_proj), read alone
                stored, lo, hi = self.slices[name]
                return f.get_slice(stored)[lo:hi]
            return f.get_tensor(name)

    def quant_scheme(self, name: str) -> QuantScheme | None:
        """The scheme of `quantized_tensor(name)`, without unpacking it; None for a float tensor."""
        return None

    def quantized_tensor(self, name: str) -> QuantizedTensor | None:
        """The tensor as the checkpoint quantizes it, to be packed with no requantization; None when it is
        stored as float (always, for safetensors)."""
        return None

    def tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor in config order, one file open at a time."""
        for name in self.config.weight_shapes():
            yield name, self.tensor(name)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self.tensors())

    def files(self) -> list[Path]:
        return sorted(set(self.tensor_files.values()))


def _read_json(path: Path, what: str) -> dict:
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} is missing", "a Hugging Face checkpoint directory needs it")
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})", f"re-download or rewrite {path.name}") from None
    if not isinstance(value, dict):
        raise CheckpointError(
            f"{path}: holds a JSON {type(value).__name__}, not an object", f"re-download or rewrite {path.name}"
        )
    return value


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index, "the shard index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: has no 'weight_map'", "rewrite the index with save_pretrained")
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: shard listed in {index.name} is missing", "copy the missing shard")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    if any(path.glob("*.bin")) or any(path.glob("*.pth")):
        raise CheckpointError(
            f"{path}: has only PyTorch .bin/.pth weights",
            "convert them to safetensors (save_pretrained(..., safe_serialization=True))",
        )
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json", "is this a checkpoint dir?")


_MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header


def _scan_safetensors(f: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) from one file's header, checked as strictly as the format allows.

    The header is untrusted input that later drives mmapped reads: every tensor's byte range must match
    its dtype and shape exactly, and the ranges must tile the data region with no overlap or gap, as the
    safetensors format requires. Anything else is a CheckpointError naming the file.
    """
    try:
        size = f.stat().st_size
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise ValueError("file is shorter than its 8-byte header length")
            n = int.from_bytes(head, "little")
            if n > size - 8:
                raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
            if n > _MAX_HEADER:
                raise ValueError(f"header of {n} bytes exceeds the format's {_MAX_HEADER}-byte limit")
            header = json.loads(fh.read(n))
        return _check_header(header, data_bytes=size - 8 - n)
    except (ValueError, UnicodeDecodeError, RecursionError, OSError) as e:
        raise CheckpointError(f"{f}: corrupt safetensors: {e}", "re-download or re-save this file") from None


def _check_header(header, data_bytes: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    out, ranges = {}, []
    for name, info in header.items():
        if name == "__metadata__":
            if not isinstance(info, dict) or not all(isinstance(v, str) for v in info.values()):
                raise ValueError("__metadata__ must map strings to strings")
            continue
        if not isinstance(info, dict):
            raise ValueError(f"tensor {name!r}: entry is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(dtype, str) or dtype not in BY_SAFETENSORS:  # llmc reads a few; any valid file scans
            raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise ValueError(f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end] with begin <= end")
        if offsets[1] > data_bytes:
            raise ValueError(
                f"tensor {name!r} ends at data byte {offsets[1]} but the file holds {data_bytes} "
                "bytes of data (truncated)"
            )
        if offsets[1] - offsets[0] != math.prod(shape) * BY_SAFETENSORS[dtype].nbytes:
            raise ValueError(f"tensor {name!r}: {offsets[1] - offsets[0]} bytes of data for {dtype}{shape}")
        ranges.append((offsets[0], offsets[1], name))
        out[name] = (dtype, tuple(shape))
    ranges.sort()
    for (_, end, a), (begin, _, b) in zip(ranges, ranges[1:], strict=False):
        if begin < end:
            raise ValueError(f"tensors {a!r} and {b!r} overlap")
        if begin > end:
            raise ValueError(f"{begin - end} bytes between tensors {a!r} and {b!r} belong to no tensor")
    covered = (ranges[0][0], ranges[-1][1]) if ranges else (0, 0)
    if covered != (0, data_bytes):  # the format's rule: the tensors tile the data region exactly
        raise ValueError(f"the tensors cover data bytes {covered[0]}..{covered[1]} of {data_bytes}")
    return out


def load_hf_checkpoint(path: Path) -> Checkpoint:
    """A Hugging Face checkpoint directory: config.json, *.safetensors and tokenizer.json."""
    config = parse_config(_read_json(path / "config.json", "config.json"))
    gen_path = path / "generation_config.json"
    gen = _read_json(gen_path, "generation_config.json") if gen_path.is_file() else {}
    if gen.get("eos_token_id") is not None:  # transformers' generate stops on these, not config.json's
        config = dataclasses.replace(config, eos_token_ids=token_ids(gen["eos_token_id"], gen_path))
    problem = config.inconsistency()
    if problem:  # an artifact built from it would be refused at every load
        raise CheckpointError(f"{path}: {problem}", "fix config.json (or generation_config.json's eos_token_id)")

    found: dict[str, tuple[Path, str, tuple[int, ...]]] = {}
    for f in _weight_files(path):
        for name, (dtype, shape) in _scan_safetensors(f).items():
            found[name] = (f, dtype, shape)
    slices = config.stored_slices()
    tensor_files, dtypes = {}, {}
    for name, shape in config.stored_shapes().items():
        stored = slices[name][0] if name in slices else name
        if stored not in found:
            raise CheckpointError(
                f"{path}: tensor {stored!r} is missing from the weights",
                "the config does not match these weights (check num_hidden_layers, tie_word_embeddings, biases)",
            )
        f, dtype, got = found[stored]
        if got != shape:
            raise CheckpointError(
                f"{f.name}: tensor {stored!r} has shape {list(got)} but config.json implies {list(shape)}",
                "config.json and the weights disagree; fix the config or use matching weights",
            )
        if BY_SAFETENSORS[dtype].name not in _READS:
            raise CheckpointError(
                f"{f.name}: tensor {stored!r} has dtype {dtype}", "llmc reads F32, F16 and BF16 weights"
            )
        tensor_files[name], dtypes[name] = f, BY_SAFETENSORS[dtype].name

    tokenizer_path = path / "tokenizer.json"
    _check_tokenizer(tokenizer_path)
    tok_config_path = path / "tokenizer_config.json"
    tok_config = _read_json(tok_config_path, "tokenizer_config.json") if tok_config_path.is_file() else {}
    chat_template = _chat_template(tok_config.get("chat_template"), tok_config_path)
    if (path / "chat_template.jinja").is_file():
        chat_template = (path / "chat_template.jinja").read_text()
    special = {
        k: _token_text(tok_config[k], tok_config_path, k) for k in ("bos_token", "eos_token") if tok_config.get(k)
    }
    generation = generation_defaults(gen, gen_path) if gen_path.is_file() else {}
    return Checkpoint(path, config, tensor_files, dtypes, tokenizer_path, chat_template, special, generation, slices)


def _check_tokenizer(path: Path) -> None:
    """tokenizer.json must parse now: compile copies it into the artifact, and run would fail on it later."""
    from tokenizers import Tokenizer

    if not path.is_file():
        raise CheckpointError(f"{path}: tokenizer is missing", "copy tokenizer.json into the checkpoint dir")
    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises plain Exception for every parse error
        raise CheckpointError(
            f"{path}: not a valid tokenizer ({str(e).splitlines()[0][:200]})",
            "re-download tokenizer.json, or re-save it with transformers",
        ) from None


def generation_defaults(gen: dict, path: Path | str = "generation_config.json") -> dict:
    """The sampling settings a checkpoint ships, as SamplingParams fields: greedy unless it samples.

    They become every request's defaults, so they are checked here by the runtime's own rules: a bad
    value fails the compile, not every later request.
    """
    from llmc.sampling_params import SamplingParams

    if not gen.get("do_sample", False):
        return {"temperature": 0.0} if gen else {}
    defaults = {"temperature": 1.0, **{k: gen[k] for k in GENERATION_DEFAULT_KEYS if gen.get(k) is not None}}
    try:
        SamplingParams(**defaults)
    except LlmcError as e:
        raise CheckpointError(f"{path}: {e.what}", e.hint) from None
    return defaults


def _token_text(token, path: Path, key: str) -> str:
    text = token.get("content") if isinstance(token, dict) else token
    if not isinstance(text, str):
        raise CheckpointError(f"{path}: {key} is {token!r}, not a token string", f"fix {key} in {path.name}")
    return text


def _chat_template(value, path: Path) -> str | None:
    """A template string; transformers also allows a list of named templates, of which "default" is used."""
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    if value is None or isinstance(value, str):
        return value
    raise CheckpointError(f"{path}: chat_template is not a string", f"fix chat_template in {path.name}")


def to_numpy(t: torch.Tensor) -> np.ndarray:
    """A tensor as numpy; bf16 comes out as its raw uint16 bits (numpy has no bf16)."""
    if t.dtype == torch.bfloat16:
        return t.contiguous().view(torch.int16).numpy().view(np.uint16)
    return t.contiguous().numpy()
