"""write_gguf: a Llama-family safetensors checkpoint -> a GGUF file that llama.cpp loads, as its
convert_hf_to_gguf.py would write it.

    write_gguf("ckpt/", "model.gguf", "Q8_0")

- Architecture metadata from config.json (through parse_config), under llama.cpp's keys (gguf_names).
- The tokenizer: tokenizer.json's byte-level BPE as `tokenizer.ggml.model = "gpt2"`: tokens by id (the
  vocabulary padded to vocab_size with unused `[PAD<id>]` tokens, as the converter does), token types
  (added special tokens are CONTROL), merges, bos/eos ids, and the chat template when there is one.
- Tensors under llama.cpp's names. In the `llama`, `granite` and `smollm3` archs, q_proj and k_proj rows (and biases) are
  permuted to llama.cpp's interleaved RoPE pairs (gguf_names.permute_qk); `qwen2`, `qwen3`, `gemma2`, `gemma3`
  and `olmo2` keep Hugging Face's order. llama3 rope scaling is written as the `rope_freqs` tensor, as the converter does.
  Gemma's norm weights are written as 1 + w; Granite's multipliers as its scale keys; Gemma 2's soft-caps as
  its soft-capping keys. Mixture-of-experts layers (qwen3moe, olmoe, and Mixtral as `llama`) write the router as
  `ffn_gate_inp` and each linear's experts stacked into one [experts, rows, K] `ffn_*_exps` tensor. SmolLM3's NoPE layers have no key: llama.cpp runs every 4th layer without RoPE, so
  only that pattern is written.
- dtype F32, BF16, Q8_0 or Q4_0 applies to every 2-D tensor (the token embedding and lm_head included) and the
  stacked experts; 1-D tensors (norms, biases, rope_freqs) and routers stay F32, as llama.cpp writes them. A 2-D tensor whose rows are not a
  whole number of the type's blocks (32 values for Q8_0 / Q4_0) stays F32, as the converter falls back;
  callers who want every matrix quantized pick hidden and intermediate sizes that are multiples of 32.
  Q8_0 / Q4_0 / BF16 bytes come from `gguf.quants.quantize`, the converter's own code.

Tensors are read, converted and written one at a time (header and tensor table first), so a checkpoint
larger than memory converts; the file appears under its name only once complete.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

from llmc.errors import CheckpointError, UnsupportedModelError

from . import gguf_names as names
from .load import load_checkpoint

DTYPES = ("F32", "BF16", "Q8_0", "Q4_0")


def write_gguf(checkpoint_dir: str | Path, out_path: str | Path, dtype: str) -> Path:
    """Write checkpoint_dir (config.json, safetensors, tokenizer.json) as a GGUF file of dtype (DTYPES).

    Returns out_path. UnsupportedModelError for an architecture, tokenizer or rope scaling llama.cpp's
    loader would read differently from transformers (see the module docstring for what is written)."""
    import gguf

    dtype = dtype.upper()
    if dtype not in DTYPES:
        raise UnsupportedModelError(f"GGUF dtype {dtype!r} is not written", f"choose one of {', '.join(DTYPES)}")
    qtype = gguf.GGMLQuantizationType[dtype]
    ckpt = load_checkpoint(checkpoint_dir)
    cfg = ckpt.config
    arch = names.GGUF_ARCH.get(cfg.architecture)
    if arch is None:
        raise UnsupportedModelError(
            f"{cfg.architecture} has no GGUF writer", f"{', '.join(sorted(names.GGUF_ARCH))} are written"
        )
    if arch in ("gemma2", "gemma3"):
        _check_gemma(cfg, arch)
    elif arch != "phi3" and cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
        raise UnsupportedModelError(
            f"sliding-window attention (window {cfg.sliding_window}) is not written to GGUF",
            "llama.cpp's llama arch attends to the whole context",
        )
    if arch == "smollm3":
        _check_smollm3(cfg)
    if cfg.moe_layers:
        _check_experts(cfg, arch)

    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(Path(checkpoint_dir).resolve().name)
    writer.add_file_type(gguf.LlamaFileType[{"F32": "ALL_F32"}.get(dtype, "MOSTLY_" + dtype)])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_hparams(writer, cfg, arch)
    _add_tokenizer(writer, ckpt, cfg)

    # (gguf name, its values: hf names stacked by rows or an array of its own, shape, GGML type): the tensor
    # table goes before any data
    f32 = gguf.GGMLQuantizationType.F32
    plan = [(name, values, values.shape, f32) for name, values in _extra_tensors(cfg).items()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    for gguf_name, (parts, shape) in _stored_tensors(cfg, arch).items():
        # a router (ffn_gate_inp) stays F32, as the converter and llama.cpp's quantizer keep it
        routed = gguf_name.endswith("ffn_gate_inp.weight")
        t = qtype if len(shape) >= 2 and shape[-1] % block == 0 and not routed else f32
        plan.append((gguf_name, parts, shape, t))
    for gguf_name, _, shape, t in plan:
        if t == f32:
            writer.add_tensor_info(gguf_name, shape, np.dtype(np.float32), 4 * math.prod(shape))
        else:
            byte_shape = gguf.quants.quant_shape_to_byte_shape(shape, t)
            writer.add_tensor_info(gguf_name, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=t)

    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for gguf_name, values, shape, t in plan:
            if isinstance(values, np.ndarray):
                w = values
            else:
                w = np.concatenate([ckpt.tensor(n).float().numpy() for n in values]).reshape(shape)
            heads = names.qk_heads(arch, gguf_name, cfg.num_heads, cfg.num_kv_heads)
            if heads is not None:
                w = names.permute_qk(w, heads)
            if names.norm_shifted(arch, gguf_name):
                w = w + np.float32(1.0)
            if t != f32:
                w = gguf.quants.quantize(w, t)
            writer.write_tensor_data(np.ascontiguousarray(w))
        writer.close()
        os.replace(tmp, out_path)
    finally:
        tmp.unlink(missing_ok=True)
    return out_path


def _stored_tensors(cfg, arch: str) -> dict[str, tuple[list[str], tuple[int, ...]]]:
    """{gguf name: (the hf tensors it stacks by rows, its shape)}: one each, but Phi-3's fused projections and
    the experts' linears ([experts, rows, K] each, gguf_names.expert_slices)."""
    fused, experts = cfg.stored_slices(), names.expert_slices(cfg)
    out: dict[str, tuple[list[str], tuple[int, ...]]] = {}
    for hf_name, shape in cfg.stored_shapes().items():
        if hf_name in experts:
            gguf_name = experts[hf_name][0]
            shape = (cfg.num_experts, *shape)
        else:
            gguf_name = names.hf_to_gguf(fused[hf_name][0] if hf_name in fused else hf_name, arch)
        out[gguf_name] = ([*out.get(gguf_name, ([], shape))[0], hf_name], shape)
    return out


def _extra_tensors(cfg) -> dict[str, np.ndarray]:
    """The GGUF-only tensors: llama3's rope_freqs, LongRoPE's rope_factors_long / _short."""
    rope_freqs = _llama3_rope_freqs(cfg)
    if rope_freqs is not None:
        return {names.ROPE_FREQS: rope_freqs}
    if cfg.long_rope:
        s = cfg.rope_scaling
        return {
            names.ROPE_FACTORS_LONG: np.array(s["long_factor"], dtype=np.float32),
            names.ROPE_FACTORS_SHORT: np.array(s["short_factor"], dtype=np.float32),
        }
    return {}


def _check_smollm3(cfg) -> None:
    """llama.cpp's smollm3 runs every 4th layer without RoPE and reads no key for it."""
    n = names.SMOLLM3_NOPE_INTERVAL
    if cfg.nope_layers != tuple(i for i in range(cfg.num_layers) if (i + 1) % n == 0):
        raise UnsupportedModelError(
            f"this SmolLM3's layers without RoPE ({list(cfg.nope_layers)}) are not llama.cpp's",
            f"GGUF's smollm3 runs every {n}th layer without RoPE (no_rope_layer_interval = {n})",
        )


def _check_experts(cfg, arch: str) -> None:
    """A mixture-of-experts model llama.cpp's arch runs as transformers does: every layer sparse, and the chosen
    probabilities renormalized exactly where llama.cpp always does (gguf_names.NORM_TOPK)."""
    if len(cfg.moe_layers) != cfg.num_layers or cfg.norm_topk_prob != names.NORM_TOPK[arch]:
        raise UnsupportedModelError(
            f"this {cfg.architecture}'s dense layers or norm_topk_prob={cfg.norm_topk_prob} are not what llama.cpp's "
            f"{arch} runs",
            f"GGUF's {arch} has experts on every layer and norm_topk_prob={names.NORM_TOPK[arch]}",
        )
    if arch == "olmoe" and cfg.num_kv_heads != cfg.num_heads:
        raise UnsupportedModelError(
            f"this OLMoE's {cfg.num_kv_heads} KV heads of {cfg.num_heads}: llama.cpp's olmoe reads k_norm over "
            "the whole hidden size",
            "GGUF's olmoe has as many KV heads as query heads",
        )


def _check_gemma(cfg, arch: str) -> None:
    """A Gemma whose layers llama.cpp would set up as transformers does: the sliding layers by its pattern (gemma2:
    every 2nd layer global, gemma3: every 6th, with RoPE base 10000), and the softmax scale llama.cpp derives
    (GGUF has no field for it). Gemma 2's soft-capping is always on in llama.cpp."""
    n = 2 if arch == "gemma2" else 6
    pattern = tuple(i for i in range(cfg.num_layers) if i % n < n - 1) if cfg.sliding_window else ()
    big = cfg.num_layers == (46 if arch == "gemma2" else 62)
    scale = (cfg.hidden_size // cfg.num_heads if big else cfg.head_dim) ** -0.5
    if (
        cfg.sliding_layers != pattern
        or (arch == "gemma3" and pattern and cfg.sliding_rope_theta != 10000.0)
        or not math.isclose(cfg.query_scale, scale, rel_tol=1e-12)
        or (arch == "gemma2" and (cfg.attn_softcap is None or cfg.final_softcap is None))
    ):
        raise UnsupportedModelError(
            f"this {cfg.architecture}'s layer types, RoPE bases, query_pre_attn_scalar or soft-capping are not "
            f"what llama.cpp's {arch} sets up",
            f"GGUF's {arch} has a global layer every {n}th and query_pre_attn_scalar = head_dim"
            + (", local RoPE base 10000" if arch == "gemma3" else ", both soft-caps"),
        )


def _add_hparams(writer, cfg, arch: str) -> None:
    import gguf

    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.rope_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.moe_layers:
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.experts_per_token)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.expert_intermediate_size)
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type")
    if kind == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    elif kind not in (None, "llama3", "longrope"):  # llama3 is the rope_freqs tensor, longrope rope_factors_*
        raise UnsupportedModelError(f"rope scaling {kind!r} is not written to GGUF", "default, linear and llama3 are")
    if arch in ("gemma2", "gemma3") and cfg.sliding_window:
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        writer.add_sliding_window(cfg.sliding_window or 0)  # the converter's 0: none
    if kind == "longrope":
        writer.add_rope_scaling_orig_ctx_len(scaling["original_max_position_embeddings"])
        writer.add_rope_scaling_attn_factors(scaling["attention_factor"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_softcap)
        writer.add_final_logit_softcapping(cfg.final_softcap)
    if arch == "granite":
        writer.add_embedding_scale(cfg.embedding_scale)
        writer.add_residual_scale(cfg.residual_scale)
        writer.add_attention_scale(cfg.query_scale if cfg.query_scale is not None else cfg.head_dim**-0.5)
        writer.add_logit_scale(cfg.logits_scaling)


def _llama3_rope_freqs(cfg) -> np.ndarray | None:
    """convert_hf_to_gguf's LlamaModel rope_factors: the divisor of each rotary frequency under llama3 scaling."""
    s = cfg.rope_scaling or {}
    if s.get("rope_type") != "llama3":
        return None
    dim = cfg.head_dim
    freqs = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / s["low_freq_factor"], old / s["high_freq_factor"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(s["factor"])
        else:
            smooth = (old / wavelen - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.asarray(out, dtype=np.float32)


def _add_tokenizer(writer, ckpt, cfg) -> None:
    raw = json.loads(Path(ckpt.tokenizer_path).read_text())
    model = raw.get("model") or {}
    pre = raw.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or "ByteLevel" not in json.dumps(pre):
        raise UnsupportedModelError(
            f"{ckpt.tokenizer_path}: only byte-level BPE tokenizers are written to GGUF",
            f"this one is {model.get('type')!r} with pre-tokenizer {pre.get('type')!r}",
        )
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for t in raw.get("added_tokens") or []:
        vocab[t["content"]] = t["id"]
        if t.get("special"):
            special.add(t["id"])
    by_id = {i: s for s, i in vocab.items()}
    if max(by_id) >= cfg.vocab_size:
        raise CheckpointError(
            f"{ckpt.tokenizer_path}: token id {max(by_id)} is past vocab_size {cfg.vocab_size}", "fix config.json"
        )
    tokens, types = [], []
    for i in range(cfg.vocab_size):
        if i in by_id:
            tokens.append(by_id[i])
            types.append(names.TOKEN_CONTROL if i in special else names.TOKEN_NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(names.TOKEN_UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    writer.add_tokenizer_model("gpt2")
    # GPT-2's split regex is what a bare ByteLevel pre-tokenizer runs; anything else gets llama.cpp's default
    gpt2 = pre.get("type") == "ByteLevel" and pre.get("use_regex", True)
    writer.add_tokenizer_pre("gpt-2" if gpt2 else "default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    if cfg.bos_token_id is not None:
        writer.add_bos_token_id(cfg.bos_token_id)
    if cfg.eos_token_ids:
        writer.add_eos_token_id(cfg.eos_token_ids[0])
    tok_config = Path(ckpt.path) / "tokenizer_config.json"
    add_bos = json.loads(tok_config.read_text()).get("add_bos_token") if tok_config.is_file() else None
    if isinstance(add_bos, bool):
        writer.add_add_bos_token(add_bos)
    if ckpt.chat_template:
        writer.add_chat_template(ckpt.chat_template)
