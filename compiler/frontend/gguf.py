"""Open a GGUF file (llama.cpp's format) as a Checkpoint, so `llmc compile model.gguf` works as for a directory.

A GGUF holds in one file what a Hugging Face checkpoint spreads over config.json, tokenizer.json and
safetensors, under llama.cpp's names (gguf_names):
- Architecture metadata (`llama.*`, `qwen2.*`, `gemma3.*`, ...: gguf_names.HF_ARCH) becomes the config.json
  transformers would have, checked by parse_config like any other. llama3 rope scaling is stored by llama.cpp
  as the per-frequency divisors of the `rope_freqs` tensor; the scaling fields are recovered from them
  (`_llama3_scaling`).
- The tokenizer is stored as token lists, and rebuilt as a `tokenizers` tokenizer (gguf_tokenizer.py).
- Tensors are renamed to Hugging Face's, q/k rows of the `llama` and `granite` archs are put back in rotate-half
  order, and Gemma's norm weights, stored as 1 + w, become w again (the traced model adds the 1). A mixture of
  experts' stacked `ffn_*_exps` tensors are read as each expert's rows (gguf_names.expert_slices), quantized or not.

Quantized tensors keep their exact values: each of llama.cpp's legacy types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0), K-quants
(Q2_K to Q6_K) and IQ4_NL / IQ4_XS maps onto a QuantizedTensor (compiler/quant.py; gguf_blocks.py) with no rounding,
and `Checkpoint.tensor` returns its dequantization, equal bit for bit to gguf.quants.dequantize. Any other tensor
type (the IQ1-IQ3 codebooks, TQ*) is refused with one line naming the type and the tensor.

The file is mmapped (gguf_reader.py); tensors are read one at a time, as from safetensors.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import gguf
import numpy as np
import torch

from llmc.dtypes import BY_SAFETENSORS
from llmc.errors import CheckpointError, CompileError, LlmcError, UnsupportedModelError

from ..quant import QuantizedTensor, QuantScheme, dequantize
from . import gguf_names as names
from .checkpoint import Checkpoint
from .config import parse_config
from .gguf_blocks import FLOAT_TYPES, SCHEMES, SUPPORTED_TYPES, UNPACK
from .gguf_reader import GGUFFileReader, GGUFMetadata
from .gguf_tokenizer import gguf_tokenizer

GGMLType = gguf.GGMLQuantizationType


@dataclasses.dataclass
class GGUFCheckpoint(Checkpoint):
    gguf_arch: str  # general.architecture: a key of gguf_names.HF_ARCH
    gguf_names: dict[str, str]  # HF name -> GGUF tensor name
    gguf_types: dict[str, str]  # HF name -> "Q4_K", "F32", ...
    gguf_tensors: dict[str, gguf.ReaderTensor]  # GGUF name -> the reader's entry (its data mmapped)

    def quant_scheme(self, name: str) -> QuantScheme | None:
        if len(self._shape(name)) < 2:  # a quantized vector: no GEMM reads one
            return None
        return SCHEMES.get(self._info(name).tensor_type)

    def quantized_tensor(self, name: str) -> QuantizedTensor | None:
        """The matrix as the file quantizes it (rows in Hugging Face order); None for a float tensor or a
        quantized vector (no GEMM reads one)."""
        if self.quant_scheme(name) is None:
            return None
        shape = self._shape(name)
        qt = self._unpack(name)
        heads = self._qk_heads(name)
        rows = None if heads is None else names.unpermute_qk(np.arange(shape[0]), heads)
        if name in self.slices:  # rows of a fused tensor (phi3's attn_qkv, ffn_up) or of stacked experts
            rows = np.arange(*self.slices[name][1:])
        if rows is not None:
            mins = None if qt.mins is None else qt.mins[rows]
            records = None if qt.records is None else qt.records[rows]
            qt = QuantizedTensor(qt.q[rows], qt.scales[rows], mins, qt.scheme, records)
        return qt

    def tensor(self, name: str) -> torch.Tensor:
        info, shape = self._info(name), self._shape(name)
        if info.tensor_type in UNPACK:
            w = dequantize(self._unpack(name)).reshape(shape)
        else:  # a copy below: the mmap is read-only
            w = np.asarray(info.data)
            w = (w.view(np.uint16) if info.tensor_type == GGMLType.BF16 else w).reshape(shape)
        heads = self._qk_heads(name)
        w = np.array(w) if heads is None else names.unpermute_qk(w, heads)
        if name in self.slices:  # rows of a fused tensor (phi3's attn_qkv, ffn_up) or of stacked experts
            w = np.array(w.reshape(-1, shape[-1])[slice(*self.slices[name][1:])])
        if names.norm_shifted(self.gguf_arch, self.gguf_names[name]):  # stored 1 + w
            w = (w.astype(np.float64) - 1.0).astype(np.float32)
        if info.tensor_type == GGMLType.BF16:
            return torch.from_numpy(w.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(w)

    def _unpack(self, name: str) -> QuantizedTensor:
        """The tensor's blocks as a QuantizedTensor of [rows, last dim], rows in the file's order."""
        info, shape = self._info(name), self._shape(name)
        block, size = gguf.GGML_QUANT_SIZES[info.tensor_type]
        k = shape[-1]
        return UNPACK[info.tensor_type](np.asarray(info.data).reshape(-1, k // block, size))

    def _info(self, name: str) -> gguf.ReaderTensor:
        return self.gguf_tensors[self.gguf_names[name]]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._info(name).shape.tolist()))

    def _qk_heads(self, name: str) -> int | None:
        return names.qk_heads(self.gguf_arch, self.gguf_names[name], self.config.num_heads, self.config.num_kv_heads)


def load_gguf(path: str | Path) -> GGUFCheckpoint:
    path = Path(path)
    try:
        reader = GGUFFileReader(path)
    except (ValueError, KeyError, IndexError, TypeError, OverflowError, UnicodeDecodeError, OSError) as e:
        raise CheckpointError(f"{path}: not a readable GGUF file ({e})", "re-download or re-convert it") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: a big-endian GGUF file", "convert the model for a little-endian host")
    meta = GGUFMetadata(reader, path)
    arch = meta.get(names.ARCHITECTURE, str)
    if arch not in names.HF_ARCH:
        raise UnsupportedModelError(
            f"{path}: GGUF architecture {arch!r} is not supported", f"llmc imports {', '.join(sorted(names.HF_ARCH))}"
        )
    meta.arch = arch
    tensors = {t.name: t for t in reader.tensors}
    tokens = meta.get(names.TOKENS, list)
    config = _config(meta, tensors, tokens, path)
    if len(tokens) > config.vocab_size:  # token ids past the embedding's rows
        raise CheckpointError(
            f"{path}: {len(tokens)} tokens for a vocab_size of {config.vocab_size}",
            "the vocabulary does not match the embedding; re-convert the model",
        )

    gguf_names, dtypes, gguf_types, slices = {}, {}, {}, {}
    fused, experts = config.stored_slices(), names.expert_slices(config)
    for hf_name, shape in config.stored_shapes().items():
        if hf_name in experts:
            gguf_name = experts[hf_name][0]
            slices[hf_name] = experts[hf_name]
            shape = (config.num_experts, *shape)
        elif hf_name in fused:
            stored, lo, hi = fused[hf_name]
            gguf_name = names.hf_to_gguf(stored, arch)
            slices[hf_name] = (gguf_name, lo, hi)
        else:
            gguf_name = names.hf_to_gguf(hf_name, arch)
        info = tensors.get(gguf_name)
        if info is None:
            raise CheckpointError(
                f"{path}: tensor {gguf_name!r} ({hf_name}) is missing",
                "the metadata does not match the tensors; re-convert the model",
            )
        got = tuple(int(d) for d in reversed(info.shape.tolist()))
        if got != shape:
            raise CheckpointError(
                f"{path}: tensor {gguf_name!r} has shape {list(got)} but the metadata implies {list(shape)}",
                "re-convert the model",
            )
        kind = info.tensor_type
        if kind.name not in SUPPORTED_TYPES:
            raise CompileError(
                f"{path}: tensor {gguf_name!r} is {kind.name}, which llmc does not import",
                f"llmc reads {', '.join(SUPPORTED_TYPES)}; re-quantize to one of them",
            )
        gguf_names[hf_name], gguf_types[hf_name] = gguf_name, kind.name
        dtypes[hf_name] = BY_SAFETENSORS[kind.name].name if kind in FLOAT_TYPES else "float32"  # what tensor() returns
    special, chat_template, tokenizer_path = gguf_tokenizer(meta, tokens, path)
    return GGUFCheckpoint(
        path=path,
        config=config,
        tensor_files=dict.fromkeys(gguf_names, path),
        dtypes=dtypes,
        tokenizer_path=tokenizer_path,
        chat_template=chat_template,
        special_tokens=special,
        generation_defaults={},
        slices=slices,
        gguf_arch=arch,
        gguf_names=gguf_names,
        gguf_types=gguf_types,
        gguf_tensors=tensors,
    )


def _config(meta: GGUFMetadata, tensors: dict, tokens: list, path: Path):
    """The config.json llama.cpp's converter read, rebuilt from the metadata and checked by parse_config."""
    hidden, heads = meta.get(names.EMBEDDING_LENGTH, int), meta.get(names.HEAD_COUNT, int)
    head_dim = meta.get(names.KEY_LENGTH, int, None) or (hidden // heads if heads else None)
    rope_dims = meta.get(names.ROPE_DIMENSION_COUNT, int, head_dim)
    if rope_dims != head_dim and meta.arch != "phi3":
        raise UnsupportedModelError(
            f"{path}: RoPE over {rope_dims} of {head_dim} head dimensions", "llmc rotates the whole head_dim"
        )
    context = meta.get(names.CONTEXT_LENGTH, int)
    theta = meta.get(names.ROPE_FREQ_BASE, float, 10000.0)
    kv = meta.get(names.HEAD_COUNT_KV, int, heads)
    eos = [meta.get(k, int, None) for k in (names.EOS_ID, gguf.Keys.Tokenizer.EOT_ID, gguf.Keys.Tokenizer.EOM_ID)]
    raw = {
        "architectures": [names.HF_ARCH[meta.arch]],
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": head_dim,
        "num_hidden_layers": meta.get(names.BLOCK_COUNT, int),
        "intermediate_size": meta.get(names.FEED_FORWARD_LENGTH, int),
        "vocab_size": meta.get(names.VOCAB_SIZE, int, len(tokens)),
        "rms_norm_eps": meta.get(names.RMS_EPS, float),
        "rope_theta": theta,
        "max_position_embeddings": context,
        "tie_word_embeddings": names.hf_to_gguf("lm_head.weight", meta.arch) not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": "blk.0.ffn_up.bias" in tensors,
        "bos_token_id": meta.get(names.BOS_ID, int, None),
        "eos_token_id": list(dict.fromkeys(e for e in eos if e is not None)),
    }
    raw.update(_family_fields(meta, raw))
    raw.update(_expert_fields(meta, raw))
    if meta.arch == "phi3":
        raw.update(_phi3_fields(meta, tensors, raw, rope_dims, path))
    kind = meta.get(names.ROPE_SCALING_TYPE, str, "none")
    freqs = tensors.get(names.ROPE_FREQS)
    if kind == "linear" and freqs is None:
        raw["rope_scaling"] = {"rope_type": "linear", "factor": meta.get(names.ROPE_SCALING_FACTOR, float)}
    elif kind == "none" and freqs is not None:
        orig = meta.get(names.ROPE_SCALING_ORIG_CTX, int, context)
        raw["rope_scaling"] = _llama3_scaling(_rope_freqs(freqs, head_dim, path), theta, head_dim, orig, path)
    elif kind != "none":
        raise UnsupportedModelError(
            f"{path}: rope scaling {kind!r}{' with rope_freqs' if freqs is not None else ''} is not supported",
            "llmc imports none, linear and llama3 (rope_freqs)",
        )
    try:
        config = parse_config(raw)
    except LlmcError as e:  # its messages name config.json; here the metadata is at fault
        raise type(e)(
            f"{path}: GGUF metadata: {e.what.removeprefix('config.json: ')}", "re-convert the model"
        ) from None
    problem = config.inconsistency()
    if problem:
        raise CheckpointError(f"{path}: {problem}", "re-convert the model")
    if config.rope_scaling and config.rope_scaling["rope_type"] == "llama3":
        _check_rope(config, freqs, path)
    return config


def _phi3_fields(meta: GGUFMetadata, tensors: dict, raw: dict, rope_dims: int, path: Path) -> dict:
    """Phi-3's fields as its converter writes them: the rotated dims (partial_rotary_factor), the window (0: none,
    Phi-4's), and LongRoPE as the rope_factors_long / _short tensors with the original length and attention factor.
    llama.cpp itself runs phi3 with no window and picks the long set by its context size, not a sequence's length;
    llmc runs them as transformers does the checkpoint they came from."""
    fields = {
        "partial_rotary_factor": rope_dims / raw["head_dim"],
        "sliding_window": meta.get(names.SLIDING_WINDOW, int, 0) or None,
    }
    long, short = (tensors.get(n) for n in (names.ROPE_FACTORS_LONG, names.ROPE_FACTORS_SHORT))
    if long is None and short is None:
        return fields
    factors = {}
    for key, info in (("long_factor", long), ("short_factor", short)):
        if info is None or info.tensor_type != GGMLType.F32 or int(info.n_elements) != rope_dims // 2:
            raise CheckpointError(
                f"{path}: LongRoPE needs F32 rope_factors_long and rope_factors_short of {rope_dims // 2} values",
                "re-convert the model",
            )
        factors[key] = [float(v) for v in np.asarray(info.data, dtype=np.float32).reshape(-1)]
    orig = meta.get(names.ROPE_SCALING_ORIG_CTX, int)
    fields["rope_scaling"] = {
        "rope_type": "longrope",
        **factors,
        "original_max_position_embeddings": orig,
        "attention_factor": meta.get(names.ROPE_SCALING_ATTN_FACTOR, float, None),
    }
    fields["original_max_position_embeddings"] = orig
    return fields


def _expert_fields(meta: GGUFMetadata, raw: dict) -> dict:
    """A mixture-of-experts file's config.json fields (none for a dense one): the expert counts, every layer
    sparse, and routing as llama.cpp's arch runs it (gguf_names.NORM_TOPK); a `llama` file with experts is a
    Mixtral."""
    experts = meta.get(names.EXPERT_COUNT, int, 0)
    if not experts or meta.arch not in names.NORM_TOPK:
        return {}
    fields = {
        "num_experts": experts,
        "num_experts_per_tok": meta.get(names.EXPERT_USED_COUNT, int),
        "norm_topk_prob": names.NORM_TOPK[meta.arch],
    }
    if meta.arch == "llama":
        fields["architectures"] = [names.MIXTRAL]
    if meta.arch == "qwen3moe":
        fields["moe_intermediate_size"] = meta.get(names.EXPERT_FEED_FORWARD_LENGTH, int)
    return fields


def _family_fields(meta: GGUFMetadata, raw: dict) -> dict:
    """The config.json fields of a family beyond Llama's, as llama.cpp's loader reads them for its arch."""
    if meta.arch == "granite":
        keys = {
            "embedding_multiplier": names.EMBEDDING_SCALE,
            "residual_multiplier": names.RESIDUAL_SCALE,
            "attention_multiplier": names.ATTENTION_SCALE,
            "logits_scaling": names.LOGIT_SCALE,
        }
        return {field: meta.get(key, float, None) for field, key in keys.items()}
    if meta.arch == "smollm3":  # llama.cpp fixes the NoPE layers (no key holds them): every 4th
        return {"no_rope_layer_interval": names.SMOLLM3_NOPE_INTERVAL}
    if meta.arch not in ("gemma2", "gemma3"):
        return {}
    # llama.cpp: the softmax scale head_dim^-0.5, but (hidden / heads)^-0.5 for the 27B (46, 62 layers); the
    # sliding layers by its swa pattern (gemma2: every 2nd layer global, gemma3: every 6th, with RoPE base 10000)
    gemma2 = meta.arch == "gemma2"
    layers = raw["num_hidden_layers"]
    big = layers == (46 if gemma2 else 62)
    window = meta.get(names.SLIDING_WINDOW, int, 4096 if gemma2 else None) or None
    fields = {
        "sliding_window": window,
        "query_pre_attn_scalar": raw["hidden_size"] // raw["num_attention_heads"] if big else raw["head_dim"],
        "layer_types": _swa_layer_types(meta, 2 if gemma2 else 6, layers) if window else None,
    }
    if gemma2:  # llama.cpp's defaults where the file has no value
        fields["attn_logit_softcapping"] = meta.get(names.ATTN_SOFTCAP, float, 50.0)
        fields["final_logit_softcapping"] = meta.get(names.FINAL_SOFTCAP, float, 30.0)
        return fields
    return {**fields, "rope_local_base_freq": 10000.0}


def _swa_layer_types(meta: GGUFMetadata, default: int, layers: int) -> list[str]:
    """config.json's layer_types as llama.cpp's load_swa_pattern sets them: the file's per-layer flags, or a
    pattern n (the arch's default unless the file gives one) under which layer i slides when i % n < n - 1."""
    key = names.SLIDING_WINDOW_PATTERN
    raw = meta.reader.fields.get(key.format(arch=meta.arch))
    flags = meta.get(key, list) if raw is not None and raw.types[0] == gguf.GGUFValueType.ARRAY else None
    if flags is None:
        n = meta.get(key, int, default)
        flags = [n == 0 or i % n < n - 1 for i in range(layers)] if n >= 0 else None
    if flags is None or len(flags) != layers or not all(isinstance(f, bool) for f in flags):
        raise CheckpointError(
            f"{meta.path}: GGUF metadata {key.format(arch=meta.arch)!r} is no swa pattern of {layers} layers",
            "re-convert the model",
        )
    return [("sliding" if f else "full") + "_attention" for f in flags]


def _rope_freqs(info, head_dim: int, path: Path) -> np.ndarray:
    if info.tensor_type != GGMLType.F32 or int(info.n_elements) != head_dim // 2:
        raise CheckpointError(
            f"{path}: rope_freqs is {info.tensor_type.name}[{info.n_elements}], not F32[{head_dim // 2}]",
            "re-convert the model",
        )
    f = np.asarray(info.data, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(f)) or np.any(f < 1.0):
        raise CheckpointError(f"{path}: rope_freqs holds divisors below 1 or not finite", "re-convert the model")
    return f


def _llama3_scaling(f: np.ndarray, theta: float, head_dim: int, orig: int, path: Path) -> dict | None:
    """llama3 rope_scaling fields that give the rope_freqs divisors f (as convert_hf_to_gguf computes them).

    With u = 1 / wavelength of each frequency, llama3's divisor is 1 where u >= u_h, `factor` where
    u <= u_l, and 1 / ((1 - s) / factor + s) with s = (u - u_l) / (u_h - u_l) between. Only factor, u_l and
    u_h matter (any original context length gives the same divisors for the same u_l, u_h), so u_l and u_h
    are fitted to the divisors: exactly through two or more interpolated ones, else placed strictly inside
    the gap the samples leave, which every pair of thresholds there reproduces exactly.
    """
    factor = float(f.max())
    if factor == 1.0:
        return None
    u = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)
    s = (1.0 / f - 1.0 / factor) / (1.0 - 1.0 / factor)
    ones, full = s >= 1.0 - 1e-6, s <= 1e-6
    mid = ~(ones | full)
    if mid.sum() >= 2:
        slope, intercept = np.polyfit(u[mid], s[mid], 1)
        u_l, u_h = -intercept / slope, (1.0 - intercept) / slope
    else:
        above = u[ones].min() if ones.any() else None  # the smallest u kept at divisor 1
        below = u[full].max() if full.any() else 0.0  # the largest u divided by the full factor
        if mid.any():
            um, sm = float(u[mid][0]), float(s[mid][0])
            slope = 2 * max((1.0 - sm) / (above - um) if above is not None else 0.0, sm / (um - below))
            u_l = um - sm / slope
            u_h = u_l + 1.0 / slope
        else:
            top = above if above is not None else 3.0 * below
            u_l, u_h = below + (top - below) / 3, below + 2 * (top - below) / 3
    if not 0 < u_l < u_h:
        raise UnsupportedModelError(
            f"{path}: rope_freqs does not follow llama3 rope scaling",
            "llmc imports llama3 scaling as llama.cpp's converter writes it",
        )
    return {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": orig * u_l,
        "high_freq_factor": orig * u_h,
        "original_max_position_embeddings": orig,
    }


def _check_rope(config, freqs, path: Path) -> None:
    """The rebuilt llama3 fields must give the file's own frequencies (llama.cpp divides by rope_freqs)."""
    from .model import rope_inv_freq

    plain = rope_inv_freq(dataclasses.replace(config, rope_scaling=None)).double().numpy()
    want = plain / np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    got = rope_inv_freq(config).double().numpy()
    if not np.allclose(got, want, rtol=1e-5, atol=0):
        raise UnsupportedModelError(
            f"{path}: rope_freqs does not follow llama3 rope scaling",
            "llmc imports llama3 scaling as llama.cpp's converter writes it",
        )


# ---------------------------------------------------------------------------------------------------------
# Tokenizer
