"""ModelConfig: the model-config schema every layer shares (the artifact manifest's `model_config`).

The compiler builds it from config.json (compiler/frontend/config.py: parse_config); the runtime reads it
back from the manifest. It is plain data with derived sizes, so reading it needs neither torch nor TVM.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any


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
    rope_scaling: dict | None  # {"rope_type": "linear" | "llama3" | "yarn" | "longrope", ...}; None for plain RoPE
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
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and of k (q_norm, k_norm: [head_dim]) before RoPE
    nope_layers: tuple[int, ...] = ()  # SmolLM3: the layers whose attention has no RoPE
    # Gemma 3: the sliding layers' RoPE base (rope_local_base_freq), unscaled; None: every layer's is rope_theta
    sliding_rope_theta: float | None = None
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" (SwiGLU) or "gelu_tanh" (Gemma's GeGLU)
    norm_unit_offset: bool = False  # Gemma: every RMSNorm scales by 1 + w
    sandwich_norms: bool = False  # Gemma: each branch's output normed before its residual add, and a pre-MLP norm
    post_norms: bool = False  # OLMo 2: each branch's output normed before its residual add, and no input norms
    qk_norm_over_heads: bool = False  # OLMo 2: q_norm / k_norm over the whole projection (q_size, kv_size)
    embedding_scale: float = 1.0  # the embedding times this (Granite's embedding_multiplier; Gemma's sqrt(hidden))
    residual_scale: float = 1.0  # Granite: x + branch * residual_multiplier
    query_scale: float | None = None  # the softmax scale, when not head_dim^-0.5 (Granite, Gemma)
    logits_scaling: float = 1.0  # Granite: the logits divided by this
    # Gemma 2's soft-capping, c * tanh(x / c): of the attention scores after the scale, and of the final logits
    attn_softcap: float | None = None
    final_softcap: float | None = None
    rotary_dim: int | None = None  # the leading dims of each head that RoPE rotates (Phi-4-mini: 3/4); None: all
    # Phi-3: the checkpoint stores q, k, v as one qkv_proj and gate, up as one gate_up_proj (stored_slices)
    fused_projections: bool = False
    # Mixture-of-experts (Qwen3-MoE, Mixtral, OLMoE): the MLP of each layer in moe_layers is a router over
    # num_experts gated MLPs of expert_intermediate_size, experts_per_token of them per token, their outputs
    # summed by the softmax probabilities of the chosen ones (renormalized to sum 1 with norm_topk_prob); None
    # for a dense model
    num_experts: int | None = None
    experts_per_token: int | None = None
    expert_intermediate_size: int | None = None
    norm_topk_prob: bool = False
    moe_layers: tuple[int, ...] = ()

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

    @property
    def long_rope(self) -> int:
        """LongRoPE's original length (Phi-3): a sequence of more tokens rotates by its long set; 0: none."""
        s = self.rope_scaling or {}
        return int(s["original_max_position_embeddings"]) if s.get("rope_type") == "longrope" else 0

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    def stored_slices(self) -> dict[str, tuple[str, int, int]]:
        """The tensors of weight_shapes() that the checkpoint stores as row ranges of another: {name: (stored
        name, first row, end row)} (Phi-3's fused qkv_proj and gate_up_proj); empty for the other families."""
        if not self.fused_projections:
            return {}
        q, kv, i = self.q_size, self.kv_size, self.intermediate_size
        out = {}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            qkv, gate_up = p + "self_attn.qkv_proj.weight", p + "mlp.gate_up_proj.weight"
            for name, lo, hi in (("q", 0, q), ("k", q, q + kv), ("v", q + kv, q + 2 * kv)):
                out[p + f"self_attn.{name}_proj.weight"] = (qkv, lo, hi)
            out[p + "mlp.gate_proj.weight"] = (gate_up, 0, i)
            out[p + "mlp.up_proj.weight"] = (gate_up, i, 2 * i)
        return out

    def stored_shapes(self) -> dict[str, tuple[int, ...]]:
        """weight_shapes(), each name with the shape of what the checkpoint stores for it: for one of
        stored_slices(), the fused tensor's, all its parts' rows stacked."""
        shapes, slices = self.weight_shapes(), self.stored_slices()
        rows: dict[str, int] = {}
        for stored, _, hi in slices.values():
            rows[stored] = max(hi, rows.get(stored, 0))
        return {n: (rows[slices[n][0]], *s[1:]) if n in slices else s for n, s in shapes.items()}

    def moe_names(self, layer: int) -> tuple[str, str, tuple[str, str, str]]:
        """(router weight, experts' prefix, (gate, up, down) linear names) of a sparse layer: expert e's gate is
        f"{prefix}{e}.{gate}.weight". Mixtral's block_sparse_moe with w1 / w3 / w2, else the mlp's."""
        p = f"model.layers.{layer}."
        if self.architecture == "MixtralForCausalLM":
            return p + "block_sparse_moe.gate.weight", p + "block_sparse_moe.experts.", ("w1", "w3", "w2")
        return p + "mlp.gate.weight", p + "mlp.experts.", ("gate_proj", "up_proj", "down_proj")

    def attention_window(self, layer: int) -> int:
        """Keys a query of `layer` attends to, itself included; 0 is the whole causal context."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else 0

    @property
    def kv_window(self) -> int:
        """The window every layer shares (so older KV cache blocks can be released); 0 if any layer has none."""
        return self.sliding_window if self.sliding_window and len(self.sliding_layers) == self.num_layers else 0

    def inconsistency(self) -> str | None:
        """What makes these fields contradict each other, or None. The one statement of the cross-field rules:
        a checkpoint is refused by them at compile, and a manifest at load."""
        if self.num_heads % self.num_kv_heads:
            return f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
        ids = ([] if self.bos_token_id is None else [self.bos_token_id]) + list(self.eos_token_ids)
        past = [i for i in ids if i >= self.vocab_size]
        if past:
            return f"token id {past[0]} (bos/eos) is past the vocabulary of {self.vocab_size}"
        if any(layer >= self.num_layers for layer in self.sliding_layers):
            return f"a sliding-window layer is past the last of {self.num_layers} layers"
        if any(layer >= self.num_layers for layer in self.nope_layers):
            return f"a layer without RoPE is past the last of {self.num_layers} layers"
        if self.hidden_act not in ("silu", "gelu_tanh"):
            return f"hidden_act {self.hidden_act!r} is neither silu nor gelu_tanh"
        if self.sandwich_norms and self.post_norms:
            return "sandwich_norms and post_norms both set"
        if self.fused_projections and (self.attention_bias or self.mlp_bias):
            return "fused projections with biases"
        if any(layer >= self.num_layers for layer in self.moe_layers):
            return f"a mixture-of-experts layer is past the last of {self.num_layers} layers"
        if self.moe_layers and not (
            self.num_experts
            and self.expert_intermediate_size
            and 1 <= (self.experts_per_token or 0) <= self.num_experts
        ):
            return (
                f"mixture-of-experts layers with num_experts={self.num_experts}, experts_per_token="
                f"{self.experts_per_token}, expert_intermediate_size={self.expert_intermediate_size}"
            )
        if not 2 <= self.rope_dim <= self.head_dim or self.rope_dim % 2:
            return f"rotary_dim={self.rotary_dim} is not an even count of at most head_dim={self.head_dim}"
        s = self.rope_scaling or {}
        if (
            s.get("rope_type") == "longrope"
            and not len(s["short_factor"]) == len(s["long_factor"]) == self.rope_dim // 2
        ):
            return (
                f"LongRoPE's short_factor and long_factor must hold rotary_dim / 2 = {self.rope_dim // 2} values each"
            )
        return None

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor the checkpoint must hold, by its Hugging Face name."""
        h, i = self.hidden_size, self.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for n in range(self.num_layers):
            p = f"model.layers.{n}."
            norms = ("input", "post_attention", "pre_feedforward", "post_feedforward")
            if self.post_norms:
                norms = norms[1::2]
            for norm in norms if self.sandwich_norms or self.post_norms else norms[:2]:
                shapes[p + f"{norm}_layernorm.weight"] = (h,)
            for name, out_features in (("q", self.q_size), ("k", self.kv_size), ("v", self.kv_size)):
                shapes[p + f"self_attn.{name}_proj.weight"] = (out_features, h)
                if self.attention_bias:
                    shapes[p + f"self_attn.{name}_proj.bias"] = (out_features,)
            if self.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (self.q_size if self.qk_norm_over_heads else self.head_dim,)
                shapes[p + "self_attn.k_norm.weight"] = (self.kv_size if self.qk_norm_over_heads else self.head_dim,)
            shapes[p + "self_attn.o_proj.weight"] = (h, self.q_size)
            if self.o_bias:
                shapes[p + "self_attn.o_proj.bias"] = (h,)
            if n in self.moe_layers:
                router, experts, (gate, up, down) = self.moe_names(n)
                shapes[router] = (self.num_experts, h)
                e_i = self.expert_intermediate_size
                for e in range(self.num_experts):
                    for name, shape in ((gate, (e_i, h)), (up, (e_i, h)), (down, (h, e_i))):
                        shapes[f"{experts}{e}.{name}.weight"] = shape
                continue
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
        d["nope_layers"] = list(self.nope_layers)
        d["moe_layers"] = list(self.moe_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d["eos_token_ids"])
        d["sliding_layers"] = tuple(d.get("sliding_layers", ()))
        d["nope_layers"] = tuple(d.get("nope_layers", ()))
        d["moe_layers"] = tuple(d.get("moe_layers", ()))
        return cls(**d)
