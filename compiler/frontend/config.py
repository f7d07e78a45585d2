"""ModelConfig: the one validated view of a checkpoint's config.json.

Everything downstream (passes, templates, manifest, runtime) reads this dataclass, never the raw JSON.
It accepts both spellings transformers has used for RoPE: `rope_theta` + `rope_scaling` (v4) and
`rope_parameters` (v5).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from llmc.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3" | "yarn", ...}; None for plain RoPE
    max_position_embeddings: int
    sliding_window: int | None  # a query at position p sees keys p-W+1..p in the layers of sliding_layers
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v carry a bias (Qwen2 always; Llama with attention_bias)
    o_bias: bool  # o_proj carries a bias (Llama attention_bias)
    mlp_bias: bool
    torch_dtype: str  # "float32" | "float16" | "bfloat16"
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    sliding_layers: tuple[int, ...] = ()  # Mistral: every layer; Qwen2 with use_sliding_window: the upper ones

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def max_context(self) -> int:
        """Longest sequence the compiled model serves."""
        return self.max_position_embeddings

    def attention_window(self, layer: int) -> int:
        """Keys a query of `layer` attends to, itself included; 0 is the whole causal context."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else 0

    @property
    def kv_window(self) -> int:
        """The window every layer shares (so older KV cache blocks can be released); 0 if any layer has none."""
        return self.sliding_window if self.sliding_window and len(self.sliding_layers) == self.num_layers else 0

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by its Hugging Face name."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
            for name, out_features in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                shapes[p + f"self_attn.{name}_proj.weight"] = (out_features, h)
                if self.attention_bias:
                    shapes[p + f"self_attn.{name}_proj.bias"] = (out_features,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            for name, (out_features, in_features) in (("gate", (i, h)), ("up", (i, h)), ("down", (h, i))):
                shapes[p + f"mlp.{name}_proj.weight"] = (out_features, in_features)
                if self.mlp_bias:
                    shapes[p + f"mlp.{name}_proj.bias"] = (out_features,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def num_parameters(self) -> int:
        return sum(math.prod(s) for s in self.weight_shapes().values())

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        d["sliding_layers"] = list(self.sliding_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        return cls(**d)


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
