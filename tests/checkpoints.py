"""Tiny random Hugging Face checkpoints, built with transformers' own config classes. Nothing downloads.

Each variant stresses one thing the compiler must get right: an odd head count, GQA ratio 4, tied
embeddings, qkv bias, sharded safetensors, and both rope_scaling types. The tokenizer is a byte-level
BPE trained here on text that ships with CPython.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

VOCAB = 384

VARIANTS = {
    # GQA ratio 4, llama3 rope scaling, untied lm_head.
    "llama": dict(
        arch="llama",
        hidden_size=64,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=136,
        num_hidden_layers=2,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    # Odd head count (9 heads, 3 KV heads, head_dim 8), tied embeddings, sharded safetensors.
    "mistral": dict(
        arch="mistral",
        hidden_size=72,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=100,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        shard="20KB",
    ),
    # qkv bias (always, for Qwen2), linear rope scaling.
    "qwen2": dict(
        arch="qwen2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=120,
        num_hidden_layers=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # q/k norms per head; an explicit head_dim that is no power of two and not hidden / heads. (Qwen3's
    # checkpoints have no sliding window, and llama.cpp's qwen3 arch none: the variants above cover windows.)
    "qwen3": dict(
        arch="qwen3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=120,
        num_hidden_layers=2,
    ),
    # layer 1 without RoPE (NoPE), tied embeddings
    "smollm3": dict(
        arch="smollm3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=120,
        num_hidden_layers=2,
        no_rope_layer_interval=2,
        pad_token_id=None,  # its default (128004) is past this vocabulary
    ),
    # every multiplier Granite has, none of them 1; tied embeddings
    "granite": dict(
        arch="granite",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=120,
        num_hidden_layers=2,
        tie_word_embeddings=True,
        embedding_multiplier=6.0,
        residual_multiplier=0.3,
        attention_multiplier=0.09,
        logits_scaling=3.5,
    ),
    # GeGLU, (1 + w) norms, sandwich norms, q/k norms, query_pre_attn_scalar, head_dim 24 (not hidden / heads),
    # a window of 5 (shorter than the parity prompts) on 2 of 3 layers with their own RoPE base, and a
    # linearly scaled global RoPE (as Gemma 3 4B)
    "gemma3": dict(
        arch="gemma3",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=120,
        num_hidden_layers=3,
        query_pre_attn_scalar=20,
        sliding_window=5,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
        pad_token_id=None,
    ),
    # Gemma 3's norms and GeGLU without q/k norms; attention and final-logit soft-capping low enough to bite (random
    # scores reach several times 3, the logits tens), a window of 5 on alternate layers (layer_types' default)
    "gemma2": dict(
        arch="gemma2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=120,
        num_hidden_layers=3,
        query_pre_attn_scalar=20,
        sliding_window=5,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=10.0,
    ),
    # fused qkv_proj and gate_up_proj; RoPE on 18 of each head's 24 dims (partial_rotary_factor 0.75, as Phi-4-mini)
    # with LongRoPE, whose original length (32) generation crosses; a window of 7 on every layer
    "phi3": dict(
        arch="phi3",
        hidden_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=120,
        num_hidden_layers=2,
        sliding_window=7,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8, 4.6],
            "long_factor": [1.0, 1.4, 2.2, 3.5, 5.1, 7.2, 9.8, 13.0, 16.9],
        },
        original_max_position_embeddings=32,
        pad_token_id=None,  # its default (32000) is past this vocabulary
    ),
    # norms after each branch, q / k norms over the whole projection (GQA: k's is kv_size), untied
    "olmo2": dict(
        arch="olmo2",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=120,
        num_hidden_layers=2,
        pad_token_id=None,  # its default (1) is this vocabulary's eos
    ),
    # Mixture-of-experts. Qwen3-MoE: 6 experts, top 2 renormalized; layer 1 dense (mlp_only_layers), with its own
    # intermediate size; experts of 40 (no multiple of 32)
    "qwen3_moe": dict(
        arch="qwen3_moe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        intermediate_size=120,
        moe_intermediate_size=40,
        num_experts=6,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        mlp_only_layers=[1],
        num_hidden_layers=3,
    ),
    # Mixtral: 5 experts, top 2 (always renormalized), tied embeddings
    "mixtral": dict(
        arch="mixtral",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=72,
        num_local_experts=5,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        tie_word_embeddings=True,
    ),
    # OLMoE: q / k norms over the whole projection, 8 experts, top 3 not renormalized
    "olmoe": dict(
        arch="olmoe",
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=False,
        num_hidden_layers=2,
        pad_token_id=None,
    ),
}

MOE_ARCHS = ("qwen3_moe", "mixtral", "olmoe")
ARCHS = tuple(a for a in VARIANTS if a not in MOE_ARCHS)  # the dense families
GGUF_ARCHS = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "granite",
    "gemma2",
    "gemma3",
    "olmo2",
    "phi3",
    "smollm3",
    "qwen3_moe",
    "mixtral",
    "olmoe",
)
# What a GGUF of the variant can hold, or llama.cpp runs as transformers does: llama.cpp's gemma2 and gemma3 have
# query_pre_attn_scalar = head_dim, gemma3 a global layer every 6th and local RoPE base 10000, and no field for any
# other
GGUF_OVERRIDES = {
    "gemma2": dict(query_pre_attn_scalar=24),
    # llama.cpp runs phi3 with no window and picks LongRoPE's long set by its context (64 in the test that runs it)
    # past the original length: an original length of 4 has every test sequence long in both
    "phi3": dict(sliding_window=None, original_max_position_embeddings=4),
    # llama.cpp's smollm3 runs every 4th layer without RoPE
    "smollm3": dict(num_hidden_layers=4, no_rope_layer_interval=4),
    # llama.cpp's qwen3moe has experts on every layer; its olmoe sizes k_norm by the hidden size (no GQA)
    "qwen3_moe": dict(mlp_only_layers=[]),
    "olmoe": dict(num_key_value_heads=4),
    "gemma3": dict(
        num_hidden_layers=6,
        layer_types=None,
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        },
    ),
}


def train_tokenizer(out_dir: Path, vocab_size: int = VOCAB, texts: list[str] | None = None) -> None:
    """A byte-level BPE (and a tokenizer_config.json with a chat template) in out_dir, trained on `texts`
    (default: 40 of pydoc's topics)."""
    from pydoc_data.topics import topics

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts or [topics[k] for k in sorted(topics)][:40], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|bos|>{{ m['role'] }}\n{{ m['content'] }}<|eos|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|bos|>assistant\n{% endif %}"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<|bos|>",
                "eos_token": "<|eos|>",
                "chat_template": template,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def make_checkpoint(
    out_dir: Path, variant: str, dtype: torch.dtype = torch.float32, seed: int = 0, **overrides
) -> Path:
    """Write a random checkpoint of one VARIANTS entry (plus overrides) to out_dir; returns out_dir."""
    from transformers import (
        Gemma2Config,
        Gemma2ForCausalLM,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GraniteConfig,
        GraniteForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Olmo2Config,
        Olmo2ForCausalLM,
        OlmoeConfig,
        OlmoeForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
        SmolLM3Config,
        SmolLM3ForCausalLM,
    )

    classes = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "smollm3": (SmolLM3Config, SmolLM3ForCausalLM),
        "granite": (GraniteConfig, GraniteForCausalLM),
        "gemma2": (Gemma2Config, Gemma2ForCausalLM),
        "gemma3": (Gemma3TextConfig, Gemma3ForCausalLM),
        "olmo2": (Olmo2Config, Olmo2ForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "olmoe": (OlmoeConfig, OlmoeForCausalLM),
    }
    spec = {**VARIANTS[variant], **overrides}
    arch, shard = spec.pop("arch"), spec.pop("shard", None)
    config_cls, model_cls = classes[arch]
    out_dir.mkdir(parents=True, exist_ok=True)
    train_tokenizer(out_dir)
    config = config_cls(
        vocab_size=VOCAB, max_position_embeddings=256, bos_token_id=0, eos_token_id=1, rms_norm_eps=1e-5, **spec
    )
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # weights wide enough that logits are far from ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5 * (3.0 if "embed" in name else 1.0))
    model = model.to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(out_dir, safe_serialization=True, **kwargs)
    return out_dir


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()


def write_large_checkpoint(
    out_dir: Path, config, dtype: torch.dtype = torch.bfloat16, shard_bytes: int = 2 << 30
) -> Path:
    """A full-size checkpoint without ever holding the model: tensors are made and written one shard at a time.

    The values are zeros: compile never looks at them, and zeros cost no random-number time.
    """
    from safetensors.torch import save_file

    from llmc.compiler.frontend.config import parse_config

    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    train_tokenizer(out_dir)
    shapes = parse_config(config.to_dict()).weight_shapes()
    shards, current, size = [], {}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * torch.finfo(dtype).bits // 8
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = shape
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: torch.zeros(s, dtype=dtype) for n, s in shard.items()}, str(out_dir / fname))
        weight_map.update({n: fname for n in shard})
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out_dir
