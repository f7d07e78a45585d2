"""parse_config: config.json -> ModelConfig (llmc/model_config.py), the one validated view of a checkpoint.

Everything downstream (passes, templates, manifest, runtime) reads that dataclass, never the raw JSON.
It accepts both spellings transformers has used for RoPE: `rope_theta` + `rope_scaling` (v4) and
`rope_parameters` (v5).
"""

from __future__ import annotations

from llmc.errors import UnsupportedModelError
from llmc.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _rope(raw: dict) -> tuple[float, dict | None]:
    params = raw.get("rope_parameters")
    if params is None:
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params = dict(params)
    rope_type = params.pop("rope_type", params.pop("type", "default")) or "default"
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} is not supported",
            f"llmc compiles RoPE of type {', '.join(SUPPORTED_ROPE_TYPES)}",
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):  # as transformers' standardize_rope_params fills it in
        params["original_max_position_embeddings"] = int(raw.get(
            "original_max_position_embeddings",
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 2048))))  # fmt: skip
    if rope_type == "yarn" and params.get("factor") is None:
        params["factor"] = raw.get("max_position_embeddings", 2048) / params["original_max_position_embeddings"]
    if "factor" not in params:
        raise UnsupportedModelError(f"config.json: rope type {rope_type!r} needs a 'factor'", "add it to rope_scaling")
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor"):
            if key not in params:
                raise UnsupportedModelError(f"config.json: llama3 rope scaling lacks {key!r}", "add it to rope_scaling")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("config.json: partial rotary embeddings are not supported",
                                    "llmc rotates the whole head_dim")  # fmt: skip
    return theta, {"rope_type": rope_type, **params}


def parse_config(raw: dict) -> ModelConfig:
    """Validate config.json and normalise it. Raises UnsupportedModelError for anything not compiled."""
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json: architecture {arch!r} is not supported",
            f"llmc compiles {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    act = raw.get("hidden_act", "silu")
    if act not in ("silu", "swish"):  # transformers maps both to SiLU
        raise UnsupportedModelError(f"config.json: hidden_act {act!r} is not supported", "llmc compiles SwiGLU (silu)")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        layers = int(raw["num_hidden_layers"])
        vocab = int(raw["vocab_size"])
        inter = int(raw["intermediate_size"])
    except KeyError as e:
        raise UnsupportedModelError(f"config.json: missing field {e.args[0]!r}", "is this a causal LM config?") from None
    if heads % kv_heads:
        raise UnsupportedModelError(
            f"config.json: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}"
        )
    if head_dim % 2:
        raise UnsupportedModelError(f"config.json: head_dim={head_dim} is odd; RoPE needs an even head_dim")
    theta, scaling = _rope(raw)
    sliding = raw.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not raw.get("use_sliding_window", False):
        sliding = None
    sliding_layers = _sliding_layers(raw, arch, layers) if sliding else ()
    llama_bias = bool(raw.get("attention_bias", False))
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
    return ModelConfig(
        architecture=arch,
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        sliding_window=int(sliding) if sliding_layers else None,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "Qwen2ForCausalLM" else llama_bias,
        o_bias=llama_bias and arch != "Qwen2ForCausalLM",
        mlp_bias=bool(raw.get("mlp_bias", False)),
        torch_dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=token_ids(raw.get("eos_token_id")),
        sliding_layers=sliding_layers,
    )


def token_ids(value) -> tuple[int, ...]:
    """An `eos_token_id` field (config.json, generation_config.json): one id, a list of them, or null."""
    if value is None:
        return ()
    return tuple(int(t) for t in (value if isinstance(value, list) else [value]))


def _sliding_layers(raw: dict, arch: str, layers: int) -> tuple[int, ...]:
    """The layers that use the sliding window, as transformers decides them (config.layer_types first)."""
    types = raw.get("layer_types")
    if types:
        if len(types) != layers or not set(types) <= {"full_attention", "sliding_attention"}:
            raise UnsupportedModelError(f"config.json: layer_types {types!r} is not supported",
                                        "llmc compiles full_attention and sliding_attention layers")  # fmt: skip
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if arch == "Qwen2ForCausalLM":
        return tuple(range(int(raw.get("max_window_layers", 0)), layers))
    return tuple(range(layers))
