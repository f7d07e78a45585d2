"""parse_config: which layers use a sliding window, as transformers decides it; each family's fields; refusals."""

import math

import pytest
from transformers import LlamaConfig, MistralConfig, Qwen2Config

from llmc.compiler.frontend.config import parse_config
from llmc.errors import UnsupportedModelError


def _parse(config_cls, **kw):
    raw = config_cls(num_hidden_layers=4, **kw).to_dict()
    raw["architectures"] = [config_cls.__name__.replace("Config", "ForCausalLM")]
    return parse_config(raw)


def test_sliding_window_layers():
    mistral = _parse(MistralConfig, sliding_window=6, max_position_embeddings=64)
    assert mistral.sliding_layers == (0, 1, 2, 3) and mistral.attention_window(2) == 6 and mistral.kv_window == 6
    assert mistral.max_context == 64  # the window is exact in the kernels; it no longer caps the context
    assert _parse(MistralConfig, sliding_window=None).attention_window(0) == 0
    # Qwen2: only with use_sliding_window, and only from max_window_layers up
    qwen = _parse(Qwen2Config, use_sliding_window=True, sliding_window=5, max_window_layers=3)
    assert qwen.sliding_layers == (3,) and [qwen.attention_window(i) for i in range(4)] == [0, 0, 0, 5]
    assert qwen.kv_window == 0  # the full-attention layers need every block
    assert _parse(Qwen2Config, sliding_window=5).sliding_window is None
    assert _parse(LlamaConfig).sliding_layers == ()


def test_v4_qwen2_config_without_layer_types():
    raw = Qwen2Config(num_hidden_layers=4).to_dict()
    raw.pop("layer_types")
    raw.update(architectures=["Qwen2ForCausalLM"], use_sliding_window=True, sliding_window=7, max_window_layers=2)
    assert parse_config(raw).sliding_layers == (2, 3)


def test_yarn_rope_matches_transformers():
    import math

    import torch
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from llmc.compiler.frontend.model import attention_scale, rope_inv_freq

    for params in (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        {
            "rope_type": "yarn",
            "factor": 8.0,
            "beta_fast": 16,
            "mscale": 0.7,
            "mscale_all_dim": 0.3,
            "original_max_position_embeddings": 32,
            "truncate": False,
        },
    ):
        hf = Qwen2Config(
            num_hidden_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=256,
            rope_parameters={"rope_theta": 10000.0, **params},
        )
        inv_freq, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
        ours = parse_config({**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]})
        assert torch.equal(rope_inv_freq(ours), inv_freq.float())
        assert math.isclose(attention_scale(ours), 16**-0.5 * factor**2, rel_tol=1e-12)


GEMMA3_1B_V4 = {  # google/gemma-3-1b-it's config.json as transformers v4 wrote it (sizes cut down)
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "num_hidden_layers": 7,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 1000000,
    "rope_local_base_freq": 10000,
    "rope_scaling": None,
    "sliding_window": 512,
    "sliding_window_pattern": 6,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "bfloat16",
    "eos_token_id": [1, 106],
    "bos_token_id": 2,
}


def test_gemma3_v4_config():
    c = parse_config(GEMMA3_1B_V4)
    assert c.sliding_layers == (0, 1, 2, 3, 4, 6) and c.attention_window(5) == 0 and c.attention_window(6) == 512
    assert (c.rope_theta, c.sliding_rope_theta, c.rope_scaling) == (1e6, 1e4, None)
    assert c.query_scale == 256**-0.5 and c.hidden_act == "gelu_tanh" and c.norm_unit_offset and c.sandwich_norms
    assert c.qk_norm and c.embedding_scale == 8.0  # sqrt(64), exact in bf16


def test_gemma3_v5_config_matches_transformers():
    """transformers v5 writes one rope_parameters entry per layer type; the embedding scale is sqrt(hidden) rounded
    to the checkpoint's dtype, as Gemma3TextScaledWordEmbedding casts it."""
    import torch
    from transformers import Gemma3TextConfig

    hf = Gemma3TextConfig(
        hidden_size=72,
        num_hidden_layers=6,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
        dtype="bfloat16",
    )
    c = parse_config({**hf.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    assert c.rope_scaling == {"rope_type": "linear", "factor": 8.0} and c.sliding_rope_theta == 1e4
    assert c.sliding_layers == tuple(i for i, t in enumerate(hf.layer_types) if t == "sliding_attention")
    assert c.embedding_scale == torch.tensor(72**0.5).to(torch.bfloat16).item() != 72**0.5


GEMMA2_2B = {  # google/gemma-2-2b-it's config.json (sizes cut down): no layer_types, so even layers slide
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "num_hidden_layers": 5,
    "vocab_size": 256000,
    "hidden_act": "gelu_pytorch_tanh",
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "rope_theta": 10000.0,
    "sliding_window": 4096,
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-06,
    "torch_dtype": "float32",
    "eos_token_id": [1, 107],
    "bos_token_id": 2,
}


def test_gemma2_config():
    c = parse_config(GEMMA2_2B)
    assert c.sliding_layers == (0, 2, 4) and c.attention_window(0) == 4096 and c.attention_window(1) == 0
    assert (c.attn_softcap, c.final_softcap) == (50.0, 30.0) and c.query_scale == 256**-0.5
    assert c.hidden_act == "gelu_tanh" and c.norm_unit_offset and c.sandwich_norms and not c.qk_norm
    assert (c.rope_theta, c.sliding_rope_theta) == (10000.0, None) and c.embedding_scale == 8.0
    off = parse_config({**GEMMA2_2B, "attn_logit_softcapping": None, "final_logit_softcapping": None})
    assert (off.attn_softcap, off.final_softcap) == (None, None)


PHI4_MINI = {  # microsoft/Phi-4-mini-instruct's config.json (transformers v4 spelling; layers and factors cut down)
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "num_hidden_layers": 2,
    "vocab_size": 200064,
    "hidden_act": "silu",
    "partial_rotary_factor": 0.75,
    "rope_theta": 10000.0,
    "rope_scaling": {"type": "longrope", "long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0] * 48},
    "original_max_position_embeddings": 4096,
    "max_position_embeddings": 131072,
    "sliding_window": 262144,
    "rms_norm_eps": 1e-05,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
    "bos_token_id": 199999,
    "eos_token_id": 199999,
}


def test_phi4_mini_config():
    c = parse_config(PHI4_MINI)
    assert (c.head_dim, c.rotary_dim, c.rope_dim, c.long_rope) == (128, 96, 96, 4096) and c.fused_projections
    s = c.rope_scaling
    assert s["rope_type"] == "longrope" and s["factor"] == 32.0 and len(s["long_factor"]) == 48
    assert s["attention_factor"] == (1 + math.log(32) / math.log(4096)) ** 0.5  # transformers' default
    assert c.inconsistency() is None
    short = parse_config({**PHI4_MINI, "rope_scaling": {**PHI4_MINI["rope_scaling"], "short_factor": [1.0] * 47}})
    assert "rotary_dim / 2 = 48" in short.inconsistency()


def test_granite_multipliers():
    from transformers import GraniteConfig

    hf = GraniteConfig(
        num_hidden_layers=2, embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0078125
    )
    c = parse_config({**hf.to_dict(), "logits_scaling": 8.0, "architectures": ["GraniteForCausalLM"]})
    assert (c.embedding_scale, c.residual_scale, c.query_scale, c.logits_scaling) == (12.0, 0.22, 0.0078125, 8.0)


@pytest.mark.parametrize(
    "arch,extra,match",
    [
        ("Gemma3ForConditionalGeneration", {}, "vision tower"),
        ("OlmoeForCausalLM", {"clip_qkv": 8.0}, "clip_qkv=8.0"),
        ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5 is not supported"),
        ("Gemma3ForCausalLM", {"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ("Gemma3ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        ("Gemma3ForCausalLM", {"hidden_activation": ["gelu"]}, "hidden_activation"),
        ("LlamaForCausalLM", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ],
)
def test_refusals_name_the_field(arch, extra, match):
    with pytest.raises(UnsupportedModelError, match=match) as e:
        parse_config({**GEMMA3_1B_V4, "architectures": [arch], **extra})
    assert "\n" not in str(e.value)


def test_mixture_of_experts_configs():
    """Qwen3-30B-A3B's, Mixtral 8x7B's and OLMoE-1B-7B's config.json fields, in transformers v4's spelling and
    v5's (num_local_experts); Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step) keep their MLP."""
    qwen = {
        "architectures": ["Qwen3MoeForCausalLM"],
        **{k: GEMMA3_1B_V4[k] for k in ("max_position_embeddings", "rope_theta")},
        "vocab_size": 151936,
        "tie_word_embeddings": False,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_hidden_layers": 48,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    c = parse_config(qwen)
    assert (c.num_experts, c.experts_per_token, c.expert_intermediate_size, c.norm_topk_prob) == (128, 8, 768, True)
    assert c.moe_layers == tuple(range(48)) and c.qk_norm and not c.qk_norm_over_heads
    shapes = c.weight_shapes()
    assert shapes["model.layers.3.mlp.gate.weight"] == (128, 2048)
    assert shapes["model.layers.3.mlp.experts.127.down_proj.weight"] == (2048, 768)
    assert "model.layers.3.mlp.down_proj.weight" not in shapes
    assert round(c.num_parameters() / 1e9, 1) == 30.5
    v5 = {k: v for k, v in qwen.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert parse_config(v5) == c
    dense = parse_config({**qwen, "mlp_only_layers": [0], "decoder_sparse_step": 2})
    assert dense.moe_layers == tuple(range(1, 48, 2))
    assert dense.weight_shapes()["model.layers.0.mlp.down_proj.weight"] == (2048, 6144)

    mixtral = parse_config(
        {**qwen, "architectures": ["MixtralForCausalLM"], "num_local_experts": 8, "num_experts_per_tok": 2}
        | {"hidden_size": 4096, "head_dim": 128, "num_hidden_layers": 32, "intermediate_size": 14336}
        | {"num_key_value_heads": 8, "norm_topk_prob": None, "num_experts": None, "vocab_size": 32000}
    )
    assert (mixtral.num_experts, mixtral.experts_per_token, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and not mixtral.qk_norm
    assert mixtral.weight_shapes()["model.layers.31.block_sparse_moe.experts.7.w2.weight"] == (4096, 14336)
    assert round(mixtral.num_parameters() / 1e9, 1) == 46.7

    olmoe = parse_config(
        {**qwen, "architectures": ["OlmoeForCausalLM"], "num_experts": 64, "num_experts_per_tok": 8}
        | {"hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": None}
        | {"num_hidden_layers": 16, "intermediate_size": 1024, "norm_topk_prob": False, "clip_qkv": None}
        | {"vocab_size": 50304}
    )
    assert (olmoe.num_experts, olmoe.expert_intermediate_size, olmoe.norm_topk_prob) == (64, 1024, False)
    assert olmoe.qk_norm and olmoe.qk_norm_over_heads and olmoe.moe_layers == tuple(range(16))
    assert round(olmoe.num_parameters() / 1e9, 1) == 6.9
