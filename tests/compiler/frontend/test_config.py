"""parse_config: which layers use a sliding window, as transformers decides it."""

from transformers import LlamaConfig, MistralConfig, Qwen2Config

from llmc.compiler.frontend.config import parse_config


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
