"""GGUF naming (gguf_names) and the GGUF writer (gguf_write): names and the q/k row permutation invert exactly,
and a written file reads back with gguf.GGUFReader as the checkpoint it came from."""

import numpy as np
import pytest

from llmc.compiler.frontend import gguf_names as names


def _layer_names(n: int) -> list[str]:
    parts = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
             "mlp.up_proj", "mlp.down_proj", "input_layernorm", "post_attention_layernorm"]  # fmt: skip
    return [f"model.layers.{n}.{p}.weight" for p in parts] + [f"model.layers.{n}.self_attn.q_proj.bias"]


def test_names_round_trip():
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", *_layer_names(0), *_layer_names(17)]
    gg = [names.hf_to_gguf(n) for n in hf]
    assert len(set(gg)) == len(gg)
    assert [names.gguf_to_hf(n) for n in gg] == hf
    assert names.hf_to_gguf("model.layers.3.self_attn.o_proj.weight") == "blk.3.attn_output.weight"
    assert names.hf_to_gguf("model.layers.3.post_attention_layernorm.weight") == "blk.3.ffn_norm.weight"
    for bad in ("model.layers.0.self_attn.rotary_emb.inv_freq", "blk.0.attn_qkv.weight"):
        with pytest.raises(KeyError):
            names.hf_to_gguf(bad)
        with pytest.raises(KeyError):
            names.gguf_to_hf(bad)


def test_qk_heads_by_arch():
    assert names.qk_heads("llama", "blk.2.attn_q.weight", 9, 3) == 9
    assert names.qk_heads("llama", "blk.2.attn_k.bias", 9, 3) == 3
    assert names.qk_heads("llama", "blk.2.attn_v.weight", 9, 3) is None
    assert names.qk_heads("qwen2", "blk.2.attn_q.weight", 9, 3) is None
    assert names.ARCHITECTURE == "general.architecture"
    assert names.BLOCK_COUNT.format(arch="llama") == "llama.block_count"


def _reference_permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute, as written there."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@pytest.mark.parametrize("shape,n_head", [((72, 13), 9), ((24,), 3), ((40, 3, 34), 5)])
def test_permute_qk_inverts(shape, n_head):
    rng = np.random.default_rng(0)
    w = rng.standard_normal(shape).astype(np.float32)
    p = names.permute_qk(w, n_head)
    np.testing.assert_array_equal(p, _reference_permute(w, n_head))
    np.testing.assert_array_equal(names.unpermute_qk(p, n_head), w)
    q = rng.integers(-128, 128, size=shape, dtype=np.int8)  # quantized rows move as whole rows
    np.testing.assert_array_equal(names.unpermute_qk(names.permute_qk(q, n_head), n_head), q)
    # head 0's rotate-half partners (0, head_dim/2) become the adjacent rows 0 and 1
    half = shape[0] // n_head // 2
    np.testing.assert_array_equal(p[1], w[half])


def test_permute_qk_rejects_odd_heads():
    with pytest.raises(ValueError, match="heads"):
        names.permute_qk(np.zeros((30, 4)), 4)
