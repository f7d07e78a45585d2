"""The Hugging Face <-> GGUF naming of the llama family, shared by the GGUF writer and the GGUF importer.

Three things are fixed by llama.cpp (its convert_hf_to_gguf.py and gguf-py's constants), not by llmc:
- tensor names: `model.layers.N.self_attn.q_proj.weight` is `blk.N.attn_q.weight`, and so on;
- metadata keys: `general.architecture`, then `{arch}.block_count` etc., with `{arch}` the GGUF arch name;
- the row order of q_proj and k_proj (weights and biases) in the `llama` arch. Hugging Face's RoPE rotates
  halves (dimension i pairs with i + head_dim/2); llama.cpp's `llama` arch rotates adjacent pairs (2i with
  2i + 1), so the converter permutes each head's rows: permute_qk. `qwen2` and `qwen3` keep Hugging Face's
  order (llama.cpp runs them with NEOX-style rope), so nothing is permuted there; `granite` and `smollm3` are
  converted as `llama` is, permuted; `olmo2`, `gemma2` and `gemma3` are not permuted (NEOX-style rope).
- Gemma's norm weights: transformers scales by 1 + w, llama.cpp by the stored weight, so the converter stores
  w + 1 (NORM_SHIFTED_ARCHS).
- Phi-3's fused projections: `attn_qkv` and `ffn_up` (gate then up) hold what the Hugging Face checkpoint's
  qkv_proj and gate_up_proj do; llmc reads q, k, v, gate and up as their row ranges (ModelConfig.stored_slices).

Pure numpy, no `gguf` import: the importer and the writer each bring the `gguf` package themselves.
"""

from __future__ import annotations

import re

import numpy as np

# config.json `architectures[0]` -> GGUF `general.architecture`. llama.cpp converts Mistral as `llama`.
GGUF_ARCH = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "SmolLM3ForCausalLM": "smollm3",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "MixtralForCausalLM": "llama",  # with expert_count: the importer rebuilds a Mixtral
    "OlmoeForCausalLM": "olmoe",
}
# GGUF arch -> the Hugging Face class the importer rebuilds (a `llama` file with experts: MIXTRAL).
HF_ARCH = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}
MIXTRAL = "MixtralForCausalLM"
# How llama.cpp routes each mixture-of-experts arch: it renormalizes the chosen probabilities in `llama` (Mixtral)
# and `qwen3moe` whatever the file says, never in `olmoe`
NORM_TOPK = {"llama": True, "qwen3moe": True, "olmoe": False}
# The GGUF archs whose q/k rows are stored in llama.cpp's interleaved-pair order.
PERMUTED_ARCHS = frozenset({"llama", "granite", "smollm3"})
# The GGUF archs whose norm weights are stored as 1 + w (Gemma's)
NORM_SHIFTED_ARCHS = frozenset({"gemma2", "gemma3"})

# llama.cpp's smollm3 runs every 4th layer without RoPE, whatever the file says (n_no_rope_layer_step)
SMOLLM3_NOPE_INTERVAL = 4

# Metadata keys; `.format(arch=...)` the ones with `{arch}`.
ARCHITECTURE = "general.architecture"
NAME = "general.name"
FILE_TYPE = "general.file_type"
CONTEXT_LENGTH = "{arch}.context_length"
EMBEDDING_LENGTH = "{arch}.embedding_length"
BLOCK_COUNT = "{arch}.block_count"
FEED_FORWARD_LENGTH = "{arch}.feed_forward_length"
VOCAB_SIZE = "{arch}.vocab_size"
HEAD_COUNT = "{arch}.attention.head_count"
HEAD_COUNT_KV = "{arch}.attention.head_count_kv"
KEY_LENGTH = "{arch}.attention.key_length"
VALUE_LENGTH = "{arch}.attention.value_length"
RMS_EPS = "{arch}.attention.layer_norm_rms_epsilon"
ROPE_FREQ_BASE = "{arch}.rope.freq_base"
ROPE_DIMENSION_COUNT = "{arch}.rope.dimension_count"
ROPE_SCALING_TYPE = "{arch}.rope.scaling.type"
ROPE_SCALING_FACTOR = "{arch}.rope.scaling.factor"
ROPE_SCALING_ORIG_CTX = "{arch}.rope.scaling.original_context_length"
ROPE_SCALING_ATTN_FACTOR = "{arch}.rope.scaling.attn_factor"  # LongRoPE's attention factor (phi3)
SLIDING_WINDOW = "{arch}.attention.sliding_window"
SLIDING_WINDOW_PATTERN = "{arch}.attention.sliding_window_pattern"  # an int n, or a bool per layer
ATTENTION_SCALE = "{arch}.attention.scale"  # Granite's attention_multiplier
EMBEDDING_SCALE = "{arch}.embedding_scale"  # Granite's multipliers
RESIDUAL_SCALE = "{arch}.residual_scale"
LOGIT_SCALE = "{arch}.logit_scale"  # Granite's logits_scaling (llama.cpp divides the logits by it)
ATTN_SOFTCAP = "{arch}.attn_logit_softcapping"  # Gemma 2's
FINAL_SOFTCAP = "{arch}.final_logit_softcapping"
EXPERT_COUNT = "{arch}.expert_count"
EXPERT_USED_COUNT = "{arch}.expert_used_count"
EXPERT_FEED_FORWARD_LENGTH = "{arch}.expert_feed_forward_length"  # qwen3moe's moe_intermediate_size
TOKENIZER_MODEL = "tokenizer.ggml.model"
TOKENIZER_PRE = "tokenizer.ggml.pre"
TOKENS = "tokenizer.ggml.tokens"
TOKEN_TYPE = "tokenizer.ggml.token_type"
MERGES = "tokenizer.ggml.merges"
BOS_ID = "tokenizer.ggml.bos_token_id"
EOS_ID = "tokenizer.ggml.eos_token_id"
ADD_BOS = "tokenizer.ggml.add_bos_token"
CHAT_TEMPLATE = "tokenizer.chat_template"

QUANTIZATION_VERSION = "general.quantization_version"

# llama.cpp's token types (llama_token_type / gguf.TokenType).
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED = 1, 3, 4, 5

# A GGUF-only tensor: llama3 rope scaling's per-frequency divisors (head_dim / 2 floats), which llama.cpp
# reads instead of the rope_scaling fields; no Hugging Face tensor maps to it.
ROPE_FREQS = "rope_freqs.weight"
# phi3's LongRoPE: the long and short per-frequency divisors (rotary dims / 2 floats each)
ROPE_FACTORS_LONG, ROPE_FACTORS_SHORT = "rope_factors_long.weight", "rope_factors_short.weight"

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {  # the part after `model.layers.N.` -> the part after `blk.N.`, weights and biases alike
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",  # Qwen3's per-head norms
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",  # a mixture-of-experts router (Mixtral's below)
    "block_sparse_moe.gate": "ffn_gate_inp",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
# Gemma's sandwich: post_attention_layernorm norms the attention's output, pre_feedforward_layernorm is the MLP's
_SANDWICH = {
    **_LAYER,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# OLMo 2's norms follow each branch, and there is no norm before either
_POST_NORMS = {
    **{h: g for h, g in _LAYER.items() if h != "input_layernorm"},
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# Phi-3's projections fused, as its checkpoint stores them (ModelConfig.stored_slices)
_FUSED = {
    **{
        h: g
        for h, g in _LAYER.items()
        if h.split(".")[-1] not in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    },
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
# a GGUF arch's layer names, where they are not _LAYER
_LAYERS = {"gemma2": _SANDWICH, "gemma3": _SANDWICH, "olmo2": _POST_NORMS, "phi3": _FUSED}
_GLOBAL_BACK = {g: h for h, g in _GLOBAL.items()}
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")
_GGUF_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def hf_to_gguf(name: str, arch: str) -> str:
    """A Hugging Face tensor name -> llama.cpp's in GGUF arch `arch`. KeyError for a name outside the family."""
    if name in _GLOBAL:
        return _GLOBAL[name]
    layer = _LAYERS.get(arch, _LAYER)
    m = _HF_LAYER.fullmatch(name)
    if m and m.group(2) in layer:
        return f"blk.{m.group(1)}.{layer[m.group(2)]}.{m.group(3)}"
    raise KeyError(name)


def gguf_to_hf(name: str, arch: str) -> str:
    """A llama.cpp tensor name in GGUF arch `arch` -> Hugging Face's. KeyError for a name outside the family."""
    if name in _GLOBAL_BACK:
        return _GLOBAL_BACK[name]
    back = {g: h for h, g in _LAYERS.get(arch, _LAYER).items()}
    m = _GGUF_LAYER.fullmatch(name)
    if m and m.group(2) in back:
        return f"model.layers.{m.group(1)}.{back[m.group(2)]}.{m.group(3)}"
    raise KeyError(name)


def expert_slices(config) -> dict[str, tuple[str, int, int]]:
    """Each expert linear's rows in llama.cpp's stacked expert tensors: {hf name: (gguf name, first row, end row)},
    `blk.N.ffn_{gate,up,down}_exps.weight` [experts, rows, K] read as [experts * rows, K]."""
    out = {}
    for n in config.moe_layers:
        _, prefix, linears = config.moe_names(n)
        for linear, part in zip(linears, ("gate", "up", "down"), strict=True):
            rows = config.hidden_size if part == "down" else config.expert_intermediate_size
            for e in range(config.num_experts):
                out[f"{prefix}{e}.{linear}.weight"] = (f"blk.{n}.ffn_{part}_exps.weight", e * rows, (e + 1) * rows)
    return out


def norm_shifted(arch: str, gguf_name: str) -> bool:
    """Whether this tensor holds 1 + w (a norm weight of a NORM_SHIFTED_ARCHS file)."""
    return arch in NORM_SHIFTED_ARCHS and gguf_name.endswith("norm.weight")


def qk_heads(gguf_arch: str, gguf_name: str, n_head: int, n_head_kv: int) -> int | None:
    """The head count permute_qk / unpermute_qk take for this tensor, or None when it is stored as is."""
    if gguf_arch not in PERMUTED_ARCHS:
        return None
    m = _GGUF_LAYER.fullmatch(gguf_name)
    kind = m.group(2) if m else None
    return n_head if kind == "attn_q" else n_head_kv if kind == "attn_k" else None


def _check(w: np.ndarray, n_head: int) -> int:
    rows = w.shape[0]
    if n_head < 1 or rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of an even head_dim")
    return rows // n_head // 2


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Hugging Face's rotate-half row order -> llama.cpp's interleaved pairs (convert_hf_to_gguf's
    LlamaModel.permute). Rows are dim 0; any trailing dims (columns, quantized blocks) ride along."""
    half = _check(w, n_head)
    return w.reshape(n_head, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of permute_qk: llama.cpp's interleaved pairs -> Hugging Face's rotate-half rows."""
    half = _check(w, n_head)
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
