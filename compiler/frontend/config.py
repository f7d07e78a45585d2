"""parse_config: config.json -> ModelConfig (llmc/model_config.py), the one validated view of a checkpoint.

Everything downstream (passes, templates, manifest, runtime) reads that dataclass, never the raw JSON.
It accepts both spellings transformers has used for RoPE: `rope_theta` + `rope_scaling` (v4) and
`rope_parameters` (v5).
"""

from __future__ import annotations

import math

import numpy as np

from llmc.errors import CheckpointError, UnsupportedModelError
from llmc.model_config import ModelConfig

# Each family llmc compiles, and which of its variants (what `llmc inspect --architectures` lists)
ARCHITECTURES = {
    "LlamaForCausalLM": "Llama 2, 3, 3.1-3.3 (llama3 / linear / YaRN RoPE scaling), SmolLM, TinyLlama; q/k/v/o and MLP biases",
    "MistralForCausalLM": "Mistral 7B, Ministral; sliding window on every layer",
    "Qwen2ForCausalLM": "Qwen2, Qwen2.5 (qkv bias; sliding window above max_window_layers)",
    "Qwen3ForCausalLM": "Qwen3 dense (per-head q/k norms, explicit head_dim)",
    "SmolLM3ForCausalLM": "SmolLM3 (no RoPE on the no_rope_layers)",
    "GraniteForCausalLM": "Granite 3.x dense (embedding, residual, attention and logits multipliers)",
    "Gemma2ForCausalLM": "Gemma 2: GeGLU, (1 + w) and sandwich norms, attention and final-logit soft-capping, "
    "a sliding window on alternate layers",
    "Gemma3ForCausalLM": "Gemma 3 text (1B; the text weights of larger ones): GeGLU, (1 + w) and sandwich norms, "
    "q/k norms, 5 local to 1 global layers with their own RoPE bases; no soft-capping",
    "Olmo2ForCausalLM": "OLMo 2 (norms after each branch, q/k norms over the whole projection)",
    "Phi3ForCausalLM": "Phi-3, Phi-3.5-mini and Phi-4-mini (fused qkv / gate_up projections, partial rotary, "
    "LongRoPE, a sliding window on every layer)",
    "Qwen3MoeForCausalLM": "Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, top-k experts per token "
    "(CPU target)",
    "MixtralForCausalLM": "Mixtral 8x7B, 8x22B: Mistral's attention, top-2 of 8 experts (CPU target)",
    "OlmoeForCausalLM": "OLMoE (q/k norms over the whole projection, top-8 of 64 experts; CPU target)",
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)
# Checkpoints of these hold a vision tower, experts or layers llmc does not build yet: named in the refusal, so a
# user knows why
_REFUSED = {
    "Gemma3ForConditionalGeneration": "its vision tower is not compiled; a text-only Gemma 3 (Gemma3ForCausalLM) is",
}
# sliding window only with use_sliding_window, above max_window_layers
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_OLMOE = "OlmoeForCausalLM"
_MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM", _OLMOE)
_PARTIAL_ROTARY = ("Phi3ForCausalLM",)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


# Bounds far beyond any released checkpoint; a config outside them is damaged or hostile, and would make
# compile or run allocate without limit (10**7 layers, a context of 10**12 tokens).
_LIMITS = {
    "hidden_size": 1 << 17,
    "num_attention_heads": 1024,
    "num_hidden_layers": 1024,
    "vocab_size": 1 << 22,
    "intermediate_size": 1 << 20,
    "head_dim": 1024,
    "max_position_embeddings": 1 << 24,
    "sliding_window": 1 << 24,
    "max_window_layers": 1024,
    "original_max_position_embeddings": 1 << 24,
}
_ROPE_NUMBERS = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "beta_fast",
    "beta_slow",
    "attention_factor",
    "mscale",
    "mscale_all_dim",
    "partial_rotary_factor",
)


def _bad(key: str, value, want: str) -> CheckpointError:
    return CheckpointError(f"config.json: {key}={value!r} is invalid ({want})", "fix config.json, or re-download it")


def _int(raw: dict, key: str, default=None, low: int = 1) -> int:
    value = raw.get(key)
    value = default if value is None else value  # configs spell "use the default" as null, too
    if value is None:
        raise UnsupportedModelError(f"config.json: missing field {key!r}", "is this a causal LM config?")
    high = _LIMITS.get(key, 1 << 31)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(key, value, f"an integer in [{low}, {high}]")
    return value


def _number(raw: dict, key: str, default: float, low: float = 0.0) -> float:
    """A finite float > low (every float field here is a positive scale, base or epsilon)."""
    value = raw.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= low:
        raise _bad(key, value, f"a finite number > {low:g}")
    return float(value)


def _rope(raw: dict, params=None) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters") if params is None else params
    if params is None:
        params = raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise _bad("rope_scaling", params, "an object")
        params = {"rope_theta": raw.get("rope_theta", 10000.0), **params}
    if not isinstance(params, dict):
        raise _bad("rope_parameters", params, "an object")
    params = dict(params)
    params.pop("partial_rotary_factor", None)  # _rotary_dim's
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    theta = _number({"rope_theta": params.pop("rope_theta", raw.get("rope_theta", 10000.0))}, "rope_theta", 1e4)
    if not isinstance(rope_type, str) or rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} is not supported",
            f"llmc compiles RoPE of type {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return theta, None
    for key in _ROPE_NUMBERS:
        if params.get(key) is not None:
            params[key] = _number(params, key, 1.0)
    if rope_type in ("llama3", "yarn", "longrope"):  # as transformers' standardize_rope_params fills it in
        key = "original_max_position_embeddings"
        source = raw if raw.get(key) is not None else params if params.get(key) is not None else None
        params[key] = _int(source, key) if source else _int(raw, "max_position_embeddings", 2048)
    if rope_type == "longrope":
        return theta, _longrope(raw, params)
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = _int(raw, "max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    if "factor" not in params:
        raise UnsupportedModelError(f"config.json: rope type {rope_type!r} needs a 'factor'", "add it to rope_scaling")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise UnsupportedModelError(f"config.json: llama3 rope scaling lacks {key!r}", "add it to rope_scaling")
        if params["low_freq_factor"] == params["high_freq_factor"]:
            raise _bad("high_freq_factor", params["high_freq_factor"], "different from low_freq_factor")
    return theta, {"rope_type": rope_type, **params}


def _longrope(raw: dict, params: dict) -> dict:
    """Phi-3's LongRoPE: per-frequency divisors for short sequences and for ones past
    original_max_position_embeddings, and the attention factor on cos and sin (transformers' defaults filled in:
    factor max_position_embeddings / original, attention_factor sqrt(1 + ln factor / ln original))."""
    for key in ("short_factor", "long_factor"):
        f = params.get(key)
        if (
            not isinstance(f, list)
            or not f
            or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in f
            )
        ):
            raise _bad(key, f, "a list of finite numbers > 0, one per rotary frequency")
        params[key] = [float(v) for v in f]
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor") or _int(raw, "max_position_embeddings", 2048) / orig
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", **params, "factor": float(factor), "attention_factor": float(attention)}


def _rotary_dim(raw: dict, arch: str, head_dim: int) -> int | None:
    """The dimensions of each head that RoPE rotates: int(head_dim * partial_rotary_factor), as transformers sizes
    it (Phi-4-mini: 0.75), or None for all of them; the factor sits in rope_parameters (v5) or at the top level
    (v4)."""
    params = raw.get("rope_parameters")
    source = params if isinstance(params, dict) and params.get("partial_rotary_factor") is not None else raw
    factor = _number(source, "partial_rotary_factor", 1.0)
    if factor == 1.0:
        return None
    dim = int(head_dim * factor)
    if arch not in _PARTIAL_ROTARY or factor > 1.0 or dim < 2 or dim % 2:
        raise UnsupportedModelError(
            f"config.json: partial_rotary_factor={factor!r} is not supported for {arch}",
            f"llmc rotates part of each head for {', '.join(_PARTIAL_ROTARY)}, an even count of its dimensions",
        )
    return dim


def parse_config(raw: dict) -> ModelConfig:
    """Validate config.json and normalise it: UnsupportedModelError for anything not compiled,
    CheckpointError for a field of the wrong type or outside any real model's range."""
    archs = raw.get("architectures") or []
    arch = archs[0] if isinstance(archs, list) and archs else None
    if isinstance(arch, str) and arch in _REFUSED:
        raise UnsupportedModelError(f"config.json: architecture {arch!r} is not supported: {_REFUSED[arch]}")
    if not isinstance(arch, str) or arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json: architecture {arch!r} is not supported",
            f"llmc compiles {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    gemma = arch in _GEMMA
    act_key = "hidden_activation" if gemma else "hidden_act"
    act_name = raw.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
    act = _ACTIVATIONS.get(act_name) if isinstance(act_name, str) else None
    if act is None:
        raise UnsupportedModelError(
            f"config.json: {act_key} {raw.get(act_key)!r} is not supported",
            f"llmc compiles the gated MLP with {', '.join(sorted(_ACTIVATIONS))}",
        )
    if arch != "Gemma2ForCausalLM":
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if raw.get(key) is not None:
                raise UnsupportedModelError(
                    f"config.json: {key}={raw[key]!r} is not supported", "llmc soft-caps Gemma 2 only"
                )
    hidden = _int(raw, "hidden_size")
    heads = _int(raw, "num_attention_heads")
    kv_heads = _int(raw, "num_key_value_heads", heads)
    head_dim = _int(raw, "head_dim", hidden // heads or None)
    layers = _int(raw, "num_hidden_layers")
    vocab = _int(raw, "vocab_size")
    inter = _int(raw, "intermediate_size")
    if head_dim % 2:
        raise UnsupportedModelError(f"config.json: head_dim={head_dim} is odd; RoPE needs an even head_dim")
    theta, scaling, sliding_theta = _layer_ropes(raw) if arch == "Gemma3ForCausalLM" else (*_rope(raw), None)
    sliding = raw.get("sliding_window")
    if arch in _QWEN and not raw.get("use_sliding_window", False):
        sliding = None
    sliding = _int(raw, "sliding_window") if sliding is not None else None
    sliding_layers = _sliding_layers(raw, arch, layers) if sliding else ()
    llama_bias = bool(raw.get("attention_bias", False))
    dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if not isinstance(dtype, str):
        raise _bad("torch_dtype", dtype, "a dtype name")
    dtype = dtype.replace("torch.", "")
    granite = arch == "GraniteForCausalLM"
    bos = raw.get("bos_token_id")
    if bos is not None and (isinstance(bos, bool) or not isinstance(bos, int) or bos < 0):
        raise _bad("bos_token_id", bos, "a token id >= 0, or null")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
        sliding_window=sliding if sliding_layers else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "Qwen2ForCausalLM" else llama_bias,
        o_bias=llama_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=dtype,
        bos_token_id=bos,
        eos_token_ids=token_ids(raw.get("eos_token_id")),
        sliding_layers=sliding_layers,
        qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM", "Olmo2ForCausalLM", _OLMOE),
        nope_layers=_nope_layers(raw, layers) if arch == "SmolLM3ForCausalLM" else (),
        sliding_rope_theta=sliding_theta if sliding_layers else None,
        hidden_act=act,
        norm_unit_offset=gemma,
        sandwich_norms=gemma,
        post_norms=arch == "Olmo2ForCausalLM",
        qk_norm_over_heads=arch in ("Olmo2ForCausalLM", _OLMOE),
        embedding_scale=_embedding_scale(raw, arch, hidden, dtype),
        residual_scale=_number(raw, "residual_multiplier", 1.0) if granite else 1.0,
        query_scale=(
            _number(raw, "attention_multiplier", 1.0)
            if granite
            else _number(raw, "query_pre_attn_scalar", head_dim) ** -0.5
            if gemma
            else None
        ),
        logits_scaling=_number(raw, "logits_scaling", 1.0) if granite else 1.0,
        rotary_dim=_rotary_dim(raw, arch, head_dim),
        fused_projections=arch == "Phi3ForCausalLM",
        attn_softcap=_softcap(raw, "attn_logit_softcapping"),
        final_softcap=_softcap(raw, "final_logit_softcapping"),
        **(_experts(raw, arch, layers) if arch in _MOE else {}),
    )


def _experts(raw: dict, arch: str, layers: int) -> dict:
    """The ModelConfig fields of a mixture-of-experts family, with its config class's defaults: Qwen3-MoE's
    sparse layers are every decoder_sparse_step-th but mlp_only_layers (the others keep a dense MLP of
    intermediate_size); Mixtral's and OLMoE's are all, their experts of intermediate_size, and Mixtral always
    renormalizes the chosen probabilities."""
    if raw.get("clip_qkv") is not None:
        raise UnsupportedModelError(f"config.json: clip_qkv={raw['clip_qkv']!r} is not supported")
    qwen = arch == "Qwen3MoeForCausalLM"
    mixtral = arch == "MixtralForCausalLM"
    # transformers v5 writes num_local_experts for all three; v4 num_experts, but for Mixtral
    key = next((k for k in ("num_local_experts", "num_experts") if raw.get(k) is not None), "num_experts")
    experts = _int(raw, key, 8 if mixtral else 128 if qwen else 64)
    if experts > 1 << 12:
        raise _bad("num_experts", experts, f"an integer in [1, {1 << 12}]")
    top_k = _int(raw, "num_experts_per_tok", 2 if mixtral else 8)
    if top_k > experts:
        raise _bad("num_experts_per_tok", top_k, f"at most num_experts={experts}")
    moe = range(layers)
    if qwen:
        step = _int(raw, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise _bad("mlp_only_layers", dense, "a list of layer indices")
        moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
    norm = raw.get("norm_topk_prob")
    norm = False if norm is None else norm
    if not isinstance(norm, bool):
        raise _bad("norm_topk_prob", norm, "true or false")
    return {
        "num_experts": experts,
        "experts_per_token": top_k,
        "expert_intermediate_size": _int(raw, "moe_intermediate_size", 768) if qwen else _int(raw, "intermediate_size"),
        "norm_topk_prob": True if mixtral else norm,
        "moe_layers": tuple(moe),
    }


def _softcap(raw: dict, key: str) -> float | None:
    """Gemma 2's soft-capping value; null turns it off (as transformers reads it)."""
    return None if raw.get(key) is None else _number(raw, key, 1.0)


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' ACT2FN names


def _layer_ropes(raw: dict) -> tuple[float, dict | None, float]:
    """Gemma 3's two RoPEs: (theta, scaling) of the full-attention layers, and the sliding layers' theta (their
    RoPE is unscaled). transformers v5 writes one rope_parameters entry per layer type; v4 rope_theta,
    rope_scaling and rope_local_base_freq."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
        if not isinstance(full, dict) or not isinstance(local, dict):
            raise _bad("rope_parameters", params, "an object per layer type")
        full = {"rope_theta": 1e6, **full}
        local = {"rope_theta": 1e4, **local}
    else:
        scaling = raw.get("rope_scaling") or {}
        if not isinstance(scaling, dict):
            raise _bad("rope_scaling", scaling, "an object")
        full = {"rope_theta": raw.get("rope_theta") or 1e6, **scaling}
        local = {"rope_theta": raw.get("rope_local_base_freq") or 1e4}
    theta, scaling = _rope(raw, full)
    local_theta, local_scaling = _rope(raw, local)
    if local_scaling is not None:
        raise UnsupportedModelError("config.json: scaled RoPE on sliding layers is not supported")
    return theta, scaling, local_theta


def _embedding_scale(raw: dict, arch: str, hidden: int, dtype: str) -> float:
    """Granite's embedding_multiplier; Gemma's sqrt(hidden), rounded to the checkpoint dtype as transformers
    rounds it (the scale is cast to the embedding's dtype before it multiplies)."""
    if arch == "GraniteForCausalLM":
        return _number(raw, "embedding_multiplier", 1.0)
    if arch not in _GEMMA:
        return 1.0
    scale = np.float32(math.sqrt(hidden))
    if dtype == "float16":
        return float(np.float16(scale))
    if dtype == "bfloat16":  # round to nearest even on the top 16 bits
        bits = int(scale.view(np.uint32))
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return float(np.uint32(bits).view(np.float32))
    return float(scale)


def token_ids(value, path: object = "config.json") -> tuple[int, ...]:
    """An `eos_token_id` field (config.json, generation_config.json): one id, a list of them, or null."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 31 for t in ids):
        raise CheckpointError(
            f"{path}: eos_token_id={value!r} is not a token id or a list of them",
            "fix eos_token_id, or re-download the file",
        )
    return tuple(ids)


def _nope_layers(raw: dict, layers: int) -> tuple[int, ...]:
    """SmolLM3's layers without RoPE: `no_rope_layers[i]` is 1 where layer i rotates and 0 where it does not; by
    default every `no_rope_layer_interval`-th layer does not (as transformers' SmolLM3Config fills it in)."""
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = _int(raw, "no_rope_layer_interval", 4)
        flags = [int((i + 1) % interval != 0) for i in range(layers)]
    if (
        not isinstance(flags, list)
        or len(flags) != layers
        or not all(f in (0, 1) and not isinstance(f, bool) for f in flags)
    ):
        raise _bad("no_rope_layers", flags, f"a list of {layers} flags, 1 (RoPE) or 0 (none)")
    return tuple(i for i, f in enumerate(flags) if f == 0)


def _sliding_layers(raw: dict, arch: str, layers: int) -> tuple[int, ...]:
    """The layers that use the sliding window, as transformers decides them (config.layer_types first)."""
    types = raw.get("layer_types")
    if types:
        if (
            not isinstance(types, list)
            or len(types) != layers
            or not all(t in ("full_attention", "sliding_attention") for t in types)
        ):
            raise UnsupportedModelError(
                f"config.json: layer_types {types!r} is not supported",
                "llmc compiles full_attention and sliding_attention layers",
            )
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch in _QWEN:
        return tuple(range(_int(raw, "max_window_layers", 0, low=0), layers))
    if arch == "Gemma2ForCausalLM":  # before layer_types: even layers slide, odd ones are global
        return tuple(range(0, layers, 2))
    if arch == "Gemma3ForCausalLM":  # before layer_types: every sliding_window_pattern-th layer is global
        pattern = _int(raw, "sliding_window_pattern", 6)
        return tuple(i for i in range(layers) if (i + 1) % pattern)
    return tuple(range(layers))
