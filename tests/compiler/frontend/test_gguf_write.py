"""GGUF naming (gguf_names) and the GGUF writer (gguf_write): names and the q/k row permutation invert exactly,
and a written file reads back with gguf.GGUFReader as the checkpoint it came from."""

import json

import numpy as np
import pytest

from llmc.compiler.frontend import gguf_names as names


def _layer_names(n: int) -> list[str]:
    parts = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    return [f"model.layers.{n}.{p}.weight" for p in parts] + [f"model.layers.{n}.self_attn.q_proj.bias"]


def test_names_round_trip():
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight", *_layer_names(0), *_layer_names(17)]
    gg = [names.hf_to_gguf(n, "llama") for n in hf]
    assert len(set(gg)) == len(gg)
    assert [names.gguf_to_hf(n, "llama") for n in gg] == hf
    assert names.hf_to_gguf("model.layers.3.self_attn.o_proj.weight", "llama") == "blk.3.attn_output.weight"
    assert names.hf_to_gguf("model.layers.3.post_attention_layernorm.weight", "llama") == "blk.3.ffn_norm.weight"
    # Gemma's sandwich: its post-attention norm is its own tensor, and ffn_norm is the pre-MLP norm
    sandwich = {
        "model.layers.3.post_attention_layernorm.weight": "blk.3.post_attention_norm.weight",
        "model.layers.3.pre_feedforward_layernorm.weight": "blk.3.ffn_norm.weight",
        "model.layers.3.post_feedforward_layernorm.weight": "blk.3.post_ffw_norm.weight",
    }
    for hf_name, gguf_name in sandwich.items():
        assert names.hf_to_gguf(hf_name, "gemma3") == gguf_name and names.gguf_to_hf(gguf_name, "gemma3") == hf_name
    assert names.norm_shifted("gemma3", "blk.3.ffn_norm.weight") and not names.norm_shifted(
        "llama", "blk.3.ffn_norm.weight"
    )
    for bad in ("model.layers.0.self_attn.rotary_emb.inv_freq", "blk.0.attn_qkv.weight"):
        with pytest.raises(KeyError):
            names.hf_to_gguf(bad, "llama")
        with pytest.raises(KeyError):
            names.gguf_to_hf(bad, "llama")


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


# -- the writer ---------------------------------------------------------------------------------------

gguf = pytest.importorskip("gguf")

from llmc.compiler.frontend.checkpoint import to_numpy  # noqa: E402
from llmc.compiler.frontend.gguf_write import write_gguf  # noqa: E402
from llmc.compiler.frontend.load import load_checkpoint  # noqa: E402
from llmc.errors import UnsupportedModelError  # noqa: E402
from llmc.examples import EXAMPLES_DIR  # noqa: E402

torch = pytest.importorskip("torch")
BUNDLED = EXAMPLES_DIR / "pystdlib-5m"

# Sizes that are whole Q8_0 / Q4_0 blocks (32), so every matrix is quantized; GQA 4 (8 heads, 2 KV heads).
_QUANTIZABLE = dict(rope_scaling=None, intermediate_size=96)


def _fields(reader) -> dict:
    return {k: f.contents() for k, f in reader.fields.items()}


@pytest.mark.parametrize("dtype", ["F32", "BF16", "Q8_0", "Q4_0"])
def test_writer_round_trips(checkpoint_dir, tmp_path, dtype):
    path = checkpoint_dir("llama", **_QUANTIZABLE)
    ckpt = load_checkpoint(path)
    cfg = ckpt.config
    reader = gguf.GGUFReader(write_gguf(path, tmp_path / "m.gguf", dtype))
    meta = _fields(reader)
    arch = meta[names.ARCHITECTURE]
    assert arch == "llama"
    key = {k: v.format(arch=arch) for k, v in vars(names).items() if isinstance(v, str) and "{arch}" in v}
    assert meta[key["BLOCK_COUNT"]] == cfg.num_layers == 2
    assert meta[key["EMBEDDING_LENGTH"]] == 64 and meta[key["FEED_FORWARD_LENGTH"]] == 96
    assert (meta[key["HEAD_COUNT"]], meta[key["HEAD_COUNT_KV"]], meta[key["ROPE_DIMENSION_COUNT"]]) == (8, 2, 8)
    assert meta[key["ROPE_FREQ_BASE"]] == cfg.rope_theta
    assert meta[key["RMS_EPS"]] == pytest.approx(cfg.rms_norm_eps)
    assert meta[names.TOKENIZER_MODEL] == "gpt2"
    tok = json.loads(ckpt.tokenizer_path.read_text())
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    assert meta[names.TOKENS] == sorted(vocab, key=vocab.get)
    assert meta[names.TOKEN_TYPE][:3] == [names.TOKEN_CONTROL, names.TOKEN_CONTROL, names.TOKEN_NORMAL]
    assert meta[names.MERGES] == [" ".join(m) for m in tok["model"]["merges"]]  # pairs, as tokenizers writes them
    assert (meta[names.BOS_ID], meta[names.EOS_ID]) == (0, 1)
    assert meta[names.CHAT_TEMPLATE] == ckpt.chat_template

    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == {names.hf_to_gguf(n, "llama") for n in cfg.weight_shapes()}
    qtype = gguf.GGMLQuantizationType[dtype]
    tol = {"F32": 0, "BF16": 2**-8, "Q8_0": 2**-7, "Q4_0": 2**-3}[dtype]
    for hf_name, shape in cfg.weight_shapes().items():
        t = tensors[names.hf_to_gguf(hf_name, "llama")]
        assert tuple(int(d) for d in reversed(t.shape)) == shape  # GGUF lists dims innermost first
        assert t.tensor_type == (qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32)
        w = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
        heads = names.qk_heads(arch, t.name, cfg.num_heads, cfg.num_kv_heads)
        if heads is not None:
            w = names.unpermute_qk(w, heads)
        ref = to_numpy(ckpt.tensor(hf_name)).astype(np.float32)
        # per block, Q8_0 / Q4_0 round to within half a step of the block's absmax / 127 (resp. / 8)
        np.testing.assert_allclose(w, ref, rtol=0, atol=tol * np.abs(ref).max() + 1e-7, err_msg=hf_name)
        if dtype == "F32":
            np.testing.assert_array_equal(w, ref)


def test_writer_falls_back_to_f32_for_partial_blocks(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama", rope_scaling=None, intermediate_size=100)  # down_proj rows: 100 values
    reader = gguf.GGUFReader(write_gguf(path, tmp_path / "m.gguf", "q4_0"))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.ffn_down.weight"] == "F32" and types["blk.0.ffn_up.weight"] == "Q4_0"


def test_writer_llama3_rope_freqs(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama")  # llama3 rope scaling, factor 8, original context 32
    reader = gguf.GGUFReader(write_gguf(path, tmp_path / "m.gguf", "F32"))
    freqs = {t.name: t for t in reader.tensors}[names.ROPE_FREQS].data
    dim, theta = 8, load_checkpoint(path).config.rope_theta
    wavelen = 2 * np.pi * theta ** (np.arange(0, dim, 2) / dim)
    assert freqs.shape == (dim // 2,)
    np.testing.assert_allclose(freqs[wavelen < 32 / 4], 1.0)  # high frequencies are not scaled
    np.testing.assert_allclose(freqs[wavelen > 32], 8.0)  # low ones by the factor


def test_a_bf16_checkpoint_is_written_as_its_values(tmp_path):
    """The bundled model is stored in bf16, as most checkpoints are: each F32 tensor holds its bf16 values."""
    src = load_checkpoint(BUNDLED)
    ckpt = load_checkpoint(write_gguf(BUNDLED, tmp_path / "m.gguf", "F32"))
    assert {src.tensor(n).dtype for n in src.config.weight_shapes()} == {torch.bfloat16}
    for name in src.config.weight_shapes():
        assert torch.equal(ckpt.tensor(name), src.tensor(name).float()), name


def test_writer_refuses_what_it_cannot_write(checkpoint_dir, tmp_path):
    path = checkpoint_dir("llama", rope_scaling=None)
    with pytest.raises(UnsupportedModelError, match="Q5_K"):
        write_gguf(path, tmp_path / "m.gguf", "Q5_K")
    yarn = checkpoint_dir("qwen2", rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        write_gguf(yarn, tmp_path / "m.gguf", "F32")
    with pytest.raises(UnsupportedModelError, match=r"layers without RoPE \(\[1\]\) are not llama.cpp's"):
        write_gguf(checkpoint_dir("smollm3"), tmp_path / "m.gguf", "F32")  # every 2nd; llama.cpp's: every 4th
    assert not list(tmp_path.iterdir())  # no file, not even the partial one


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2"])
def test_llamacpp_greedy_tokens_equal_transformers(checkpoint_dir, tmp_path, variant):
    """llama.cpp reads the F32 file as transformers runs the checkpoint: names, q/k order, rope, tokenizer ids."""
    llama_cpp = pytest.importorskip("llama_cpp")
    torch = pytest.importorskip("torch")
    from tests.checkpoints import hf_model

    # llama: llama3 rope scaling with 8x8 heads / 2 KV; mistral: 9 heads / 3 KV, tied, sharded; qwen2: biases
    path = checkpoint_dir(variant, **({"rope_scaling": None} if variant == "qwen2" else {}))
    prompt = np.random.default_rng(1).integers(2, 384, 40).tolist()  # past llama3's original context of 32
    with torch.no_grad():
        ref = hf_model(path).generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)[0, 40:].tolist()
    llm = llama_cpp.Llama(str(write_gguf(path, tmp_path / "m.gguf", "F32")), n_ctx=128, n_threads=1, verbose=False)
    out = []
    for tok in llm.generate(prompt, temp=0.0, reset=True):
        out.append(tok)
        if len(out) == len(ref):
            break
    assert out == ref
