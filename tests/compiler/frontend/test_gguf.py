"""GGUF import (compiler/frontend/gguf.py): a .gguf file opens as a Checkpoint and compiles.

Files are written from the tiny checkpoints by gguf_write (F32, Q8_0, Q4_0 through gguf.quants.quantize), and
Q4_K / Q6_K files from random blocks (the gguf package cannot quantize to them; every byte pattern is a valid
block once its fp16 fields are finite). The references: the safetensors build (greedy tokens), gguf.quants.
dequantize (quantized tensors, bit for bit), transformers on the dequantized weights (logits), the source
tokenizer, transformers' own GGUF tokenizer conversion and llama.cpp's tokenizer (token ids).
"""

import ctypes
import dataclasses
import json
import math
import shutil

import gguf
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file
from tokenizers import Tokenizer

from llmc.compiler.compile import compile_checkpoint, quant_schemes
from llmc.compiler.export import build_eager_model
from llmc.compiler.frontend import gguf_blocks
from llmc.compiler.frontend import gguf_names as names
from llmc.compiler.frontend.gguf import _llama3_scaling
from llmc.compiler.frontend.gguf_write import _llama3_rope_freqs, write_gguf
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.frontend.model import rope_inv_freq
from llmc.compiler.quant import Q6_K, QuantConfig, dequantize, quantize
from llmc.compiler.quant_widen import held_on_cuda, widen_exactly
from llmc.errors import CheckpointError, CompileError, LlmcError
from llmc.model_config import ModelConfig
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from llmc.tools.cli import main
from tests.checkpoints import GGUF_ARCHS, GGUF_OVERRIDES, MOE_ARCHS, hf_model
from tests.cpu_activations import assert_quantized_experts_match, round_as_cpu_qgemm

T = gguf.GGMLQuantizationType
TEXTS = [
    "The list type",
    "Return a new dictionary initialized from an optional positional argument\n\n  and keywords",
    "def f(x):\n\treturn x ** 2  # <|eos|> ünïcødé 😀 1234567",
]
# K-quants need rows of 256: the llama variant widened (head_dim 32, so llama3 rope has interpolated frequencies)
KQUANT = dict(hidden_size=256, intermediate_size=256)


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "llmc_cache"))


@pytest.fixture(scope="module")
def gguf_file(checkpoint_dir, tmp_path_factory):
    """gguf_file(arch, dtype) -> a GGUF of the tiny checkpoint, written once per module."""
    made = {}

    def get(arch: str, dtype: str):
        if (arch, dtype) not in made:
            out = tmp_path_factory.mktemp("gguf") / f"{arch}-{dtype}.gguf"
            made[arch, dtype] = write_gguf(checkpoint_dir(arch, **GGUF_OVERRIDES.get(arch, {})), out, dtype)
            if arch == "phi3":  # llama.cpp looks up Phi-3's own special tokens in a file named phi3; the tiny
                # vocabulary has none of them
                meta = {names.NAME: ("tiny", gguf.GGUFValueType.STRING, None)}
                made[arch, dtype] = _rewrite(made[arch, dtype], out.with_name(f"tiny-{dtype}.gguf"), None, meta=meta)
        return made[arch, dtype]

    return get


def _rewrite(src, out, rng, types=None, meta=None):
    """Copy GGUF `src` to `out`: metadata `meta` {key: (value, GGUFValueType, array sub-type), or None to drop it}
    replaces, adds or drops keys, and each tensor named in `types` becomes random blocks of that type."""
    types, meta = types or {}, meta or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(out, reader.fields[names.ARCHITECTURE].contents())
    for f in reader.fields.values():
        if not f.name.startswith("GGUF.") and f.name != names.ARCHITECTURE and f.name not in meta:
            writer.add_key_value(f.name, f.contents(), f.types[0], f.types[-1] if len(f.types) > 1 else None)
    for key, value in meta.items():
        if value is not None:
            writer.add_key_value(key, *value)
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if types.get(t.name) == T.F16:
            writer.add_tensor(t.name, np.array(t.data).astype(np.float16))
        elif t.name in types:
            writer.add_tensor(t.name, _random_blocks(shape, types[t.name], rng), raw_dtype=types[t.name])
        else:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Where each type's fp16 d (and m / dmin) lie in its block, and their size: about the tiny model's weight scale
_FP16_FIELDS = {
    T.Q8_0: ((0, 1e-3),),
    T.Q4_0: ((0, 1e-2),),
    T.Q4_1: ((0, 3e-3), (2, 3e-2)),
    T.Q5_0: ((0, 3e-3),),
    T.Q5_1: ((0, 1.5e-3), (2, 3e-2)),
    T.Q2_K: ((80, 1e-3), (82, 1e-3)),
    T.Q3_K: ((108, 3e-4),),
    T.Q4_K: ((0, 3e-4), (2, 3e-4)),
    T.Q5_K: ((0, 2e-4), (2, 2e-4)),
    T.Q6_K: ((208, 1e-4),),
    T.IQ4_NL: ((0, 3e-4),),
    T.IQ4_XS: ((0, 1e-5),),
    T.IQ2_XXS: ((0, 1e-3),),
    T.TQ1_0: ((52, 1e-3),),
}
# The types imported beside Q8_0, Q4_0, Q4_K and Q6_K, and the scheme each becomes
MORE_TYPES = {
    "Q4_1": "int4 g32 asym",
    "Q5_0": "int5 g32",
    "Q5_1": "int5 g32 asym",
    "Q2_K": "int2 g16 asym k-scales",
    "Q3_K": "int3 g16 k-scales",
    "Q5_K": "int5 g32 asym k-scales",
    "IQ4_NL": "iq4 g32",
    "IQ4_XS": "iq4 g32 k-scales",
}


def _random_blocks(shape, qtype, rng) -> np.ndarray:
    """Random bytes as whole blocks, with finite fp16 d (and dmin) of about the tiny model's weight scale; rows
    of a matrix, or of stacked experts."""
    *rows, k = shape
    n = math.prod(rows)
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for offset, scale in _FP16_FIELDS[qtype]:
        d = rng.uniform(-scale, scale, (n, k // block, 1)).astype(np.float16)
        b[..., offset : offset + 2] = d.view(np.uint8)
    return b.reshape(*rows, -1)


@pytest.fixture(scope="module")
def kquant_file(checkpoint_dir, tmp_path_factory):
    """kquant_file(v_type) -> the widened llama with Q6_K for the embedding, lm_head, down projections and
    v_proj if v_type is Q6_K (llama.cpp's Q4_K_M mix), Q4_K for the other matrices; norms stay F32."""
    made = {}

    def get(v_type=T.Q6_K):
        if v_type not in made:
            out = tmp_path_factory.mktemp("kq")
            src = write_gguf(checkpoint_dir("llama", **KQUANT), out / "f32.gguf", "F32")
            six = ("token_embd", "output.", "ffn_down") + (("attn_v",) if v_type == T.Q6_K else ())
            types = {
                t.name: (T.Q6_K if any(s in t.name for s in six) else T.Q4_K)
                for t in gguf.GGUFReader(src).tensors
                if len(t.shape) == 2
            }
            made[v_type] = _rewrite(src, out / f"v_{v_type.name}.gguf", np.random.default_rng(7), types)
        return made[v_type]

    return get


def _greedy(artifact, texts, tokenizer_path, n=24):
    tok = Tokenizer.from_file(str(tokenizer_path))
    model = CompiledModel.load(artifact)
    results = LLMEngine(model).generate(
        [tok.encode(t).ids for t in texts], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    )
    return [r.outputs[0].token_ids for r in results]


@pytest.mark.slow
@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_f32_gguf_generates_the_safetensors_tokens(arch, checkpoint_dir, gguf_file, tmp_path):
    """llama: q/k rows unpermuted and llama3 rope rebuilt from rope_freqs; mistral: tied embeddings and 9 heads
    (as llama); qwen2: biases and no permutation."""
    src = checkpoint_dir(arch, **GGUF_OVERRIDES.get(arch, {}))
    ckpt = load_checkpoint(gguf_file(arch, "F32"))
    assert ckpt.quantized_tensor("model.layers.0.self_attn.q_proj.weight") is None
    for name in ckpt.config.weight_shapes():
        ours, theirs = ckpt.tensor(name), load_checkpoint(src).tensor(name)
        if names.norm_shifted(ckpt.gguf_arch, ckpt.gguf_names[name]):  # the file holds 1 + w, which the model uses
            ours, theirs = ours + 1, theirs + 1
        assert torch.equal(ours, theirs), name
    result = CliRunner().invoke(
        main, ["compile", str(gguf_file(arch, "F32")), "--target", "cpu", "-o", str(tmp_path / "gguf.cpu")]
    )
    assert result.exit_code == 0, result.output
    ours = tmp_path / "gguf.cpu"
    theirs = compile_checkpoint(src, target="cpu", output=tmp_path / "st.cpu")
    assert _greedy(ours, TEXTS, src / "tokenizer.json") == _greedy(theirs, TEXTS, src / "tokenizer.json")


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_config_and_tokenizer_as_the_source(arch, checkpoint_dir, gguf_file):
    src = load_checkpoint(checkpoint_dir(arch, **GGUF_OVERRIDES.get(arch, {})))
    ckpt = load_checkpoint(gguf_file(arch, "F32"))
    a, b = src.config, ckpt.config
    # llama.cpp writes Mistral as llama (Mixtral too: a llama with experts), and a window wider than the context
    # attends to all of it
    assert b.architecture == (a.architecture if a.num_experts else names.HF_ARCH[names.GGUF_ARCH[a.architecture]])
    assert a.sliding_window is None or a.sliding_window >= a.max_position_embeddings or arch in ("gemma2", "gemma3")
    same = (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rms_norm_eps",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "o_bias",
        "mlp_bias",
        "bos_token_id",
        "eos_token_ids",
        "qk_norm",
        "hidden_act",
        "norm_unit_offset",
        "sandwich_norms",
        "post_norms",
        "qk_norm_over_heads",
        "embedding_scale",
        "residual_scale",
        "query_scale",
        "logits_scaling",
        "attn_softcap",
        "final_softcap",
        "num_experts",
        "experts_per_token",
        "expert_intermediate_size",
        "norm_topk_prob",
        "moe_layers",
    )
    assert {k: getattr(b, k) for k in same} == {k: getattr(a, k) for k in same}

    def windows(c):  # each layer's window, 0 where none (or one wider than the context: llama.cpp drops it)
        return [(w if w < c.max_context else 0) for w in map(c.attention_window, range(c.num_layers))]

    assert windows(b) == windows(a)
    assert torch.equal(rope_inv_freq(b), rope_inv_freq(a))
    if a.sliding_rope_theta is not None:
        assert b.sliding_rope_theta == a.sliding_rope_theta
    assert ckpt.chat_template == src.chat_template and ckpt.special_tokens == src.special_tokens
    ours, theirs = Tokenizer.from_file(str(ckpt.tokenizer_path)), Tokenizer.from_file(str(src.tokenizer_path))
    for text in TEXTS:
        ids = theirs.encode(text).ids
        assert ours.encode(text).ids == ids
        assert ours.decode(ids) == theirs.decode(ids) and ours.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False
        )


@pytest.mark.parametrize("dtype", ["F16", "BF16"])
def test_float_types_import_as_they_are(dtype, checkpoint_dir, gguf_file, tmp_path):
    """llama: the bf16 and fp16 q/k rows are unpermuted too."""
    src = load_checkpoint(checkpoint_dir("llama"))
    path = gguf_file("llama", "BF16")
    if dtype == "F16":
        f32 = gguf_file("llama", "F32")
        types = {t.name: T.F16 for t in gguf.GGUFReader(f32).tensors if len(t.shape) == 2}
        path = _rewrite(f32, tmp_path / "f16.gguf", None, types)
    ckpt = load_checkpoint(path)
    torch_dtype = {"F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    for name, shape in ckpt.config.weight_shapes().items():
        t = ckpt.tensor(name)
        assert ckpt.quantized_tensor(name) is None
        want = src.tensor(name).to(torch_dtype) if len(shape) == 2 else src.tensor(name)
        assert t.dtype == want.dtype and torch.equal(t, want), name
    assert ckpt.weight_dtype == {"F16": "float16", "BF16": "bfloat16"}[dtype]


def _raw_reference(ckpt, name) -> np.ndarray:
    """gguf.quants.dequantize of the tensor's bytes, its rows put back in Hugging Face order (a fused tensor's:
    the part's row range; an expert's: its rows of the stacked experts)."""
    info = ckpt.gguf_tensors[ckpt.gguf_names[name]]
    w = gguf.quants.dequantize(np.array(info.data), info.tensor_type)
    if name in ckpt.slices:
        _, lo, hi = ckpt.slices[name]
        w = w.reshape(-1, w.shape[-1])[lo:hi]
    heads = names.qk_heads(ckpt.gguf_arch, info.name, ckpt.config.num_heads, ckpt.config.num_kv_heads)
    return w if heads is None else names.unpermute_qk(w, heads)


SCHEMES = {
    "Q8_0": "int8 g32",
    "Q4_0": "int4 g32",
    "Q4_K": "int4 g32 asym k-scales",
    "Q6_K": "int6 g16 k-scales",
    **MORE_TYPES,
}


def _assert_exact(ckpt, expect_types):
    seen = set()
    for name in ckpt.config.weight_shapes():
        kind = ckpt.gguf_types[name]
        qt = ckpt.quantized_tensor(name)
        assert ckpt.quant_scheme(name) == (None if qt is None else qt.scheme), name
        if kind not in SCHEMES:
            assert qt is None
            continue
        seen.add(kind)
        assert qt.scheme.describe() == SCHEMES[kind], name
        want = _raw_reference(ckpt, name)
        got = dequantize(qt)
        assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32)), name
        assert np.array_equal(ckpt.tensor(name).numpy().view(np.uint32), want.view(np.uint32)), name
    assert seen == set(expect_types)


@pytest.mark.parametrize(
    ("arch", "dtype"),  # mistral's sizes are no multiple of Q8_0's 32: all F32
    [*((a, "Q8_0") for a in GGUF_ARCHS if a != "mistral"), *((a, "Q4_0") for a in ("llama", "qwen2", "qwen3"))],
)
def test_quantized_tensors_equal_gguf_dequantize(arch, dtype, gguf_file):
    _assert_exact(load_checkpoint(gguf_file(arch, dtype)), [dtype])


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_routers_stay_f32_and_experts_quantize(arch, gguf_file):
    ckpt = load_checkpoint(gguf_file(arch, "Q8_0"))
    router, experts, (gate, _, _) = ckpt.config.moe_names(0)
    assert ckpt.gguf_types[router] == "F32" and ckpt.gguf_types[f"{experts}0.{gate}.weight"] == "Q8_0"


@pytest.mark.parametrize("expert_type", ["Q4_0", "Q4_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K"])
def test_expert_tensors_import_exactly_and_run(expert_type, checkpoint_dir, tmp_path, monkeypatch):
    """A qwen3moe file whose stacked experts are Q4_0, Q4_K, Q6_K, IQ4_XS, Q3_K or Q2_K blocks (hidden and expert
    sizes 256), each held at its size: each expert's rows equal gguf dequantize, and the build's logits are the
    family's module on those values, its experts' inputs rounded as the kernels round them."""
    path = _experts_file(expert_type, checkpoint_dir, tmp_path)
    ckpt = load_checkpoint(path)
    _assert_exact(ckpt, [expert_type])
    artifact = compile_checkpoint(path, target="cpu", output=tmp_path / "m.cpu")
    model = build_eager_model(ckpt)
    assert_quantized_experts_match(artifact, model, monkeypatch, 23)


def _experts_file(expert_type, checkpoint_dir, tmp_path):
    """A qwen3moe file (hidden and expert sizes 256) whose stacked experts are random expert_type blocks."""
    src = checkpoint_dir("qwen3_moe", **KQUANT, moe_intermediate_size=256, mlp_only_layers=[])
    f32 = write_gguf(src, tmp_path / "f32.gguf", "F32")
    types = {t.name: T[expert_type] for t in gguf.GGUFReader(f32).tensors if "_exps." in t.name}
    return _rewrite(f32, tmp_path / f"{expert_type}.gguf", np.random.default_rng(3), types)


@pytest.mark.slow
@pytest.mark.parametrize("expert_type", ["Q8_0", "Q4_0", "Q4_K", "Q6_K"])
def test_expert_tensors_run_on_cuda(expert_type, checkpoint_dir, tmp_path):
    """The same files built for sm90 (Q6_K's experts widened to int8, exactly) and run under the simulator one
    token a step (the expert GEMV: fp32 dequantization and sums): the family's module's logits on the file's
    values, within the fp32 parity tolerance (1e-3 of the row's largest)."""
    from tests.cuda_mode import cuda_library

    path = _experts_file(expert_type, checkpoint_dir, tmp_path)
    artifact = compile_checkpoint(path, target="sm90", output=tmp_path / "m.sm90")
    ids = [int(i) for i in np.random.default_rng(5).integers(2, 384, 7)]
    with torch.no_grad():
        want = build_eager_model(load_checkpoint(path))(torch.tensor(ids), torch.arange(len(ids))).numpy()
    with CompiledModel.load(artifact, library=cuda_library(artifact), max_num_seqs=1) as m:
        table = list(range(m.num_blocks))[: -(-len(ids) // m.block_size)]
        got = np.concatenate([m.step(StepBatch.build([[t]], [i], [table], m.block_size)) for i, t in enumerate(ids)])
    rel = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 1e-3, f"relative logit errors per row {np.round(rel, 5)}"


def test_kquant_tensors_equal_gguf_dequantize(kquant_file):
    _assert_exact(load_checkpoint(kquant_file()), ["Q4_K", "Q6_K"])


@pytest.fixture(scope="module")
def mixed_types_file(checkpoint_dir, tmp_path_factory):
    """The widened llama with each of MORE_TYPES on one GEMM's weights (q/k/v, o, gate/up and down of two
    layers: each fused GEMM reads one type, so each type gets its own kernel scheme), Q6_K elsewhere."""
    out = tmp_path_factory.mktemp("mixed")
    src = write_gguf(checkpoint_dir("llama", **KQUANT), out / "f32.gguf", "F32")
    gemms = [("attn_q", "attn_k", "attn_v"), ("attn_output",), ("ffn_gate", "ffn_up"), ("ffn_down",)]
    slots = [(layer, g) for layer in (0, 1) for g in gemms]
    types = {}
    for t in gguf.GGUFReader(src).tensors:
        if len(t.shape) == 2:
            layer = int(t.name.split(".")[1]) if t.name.startswith("blk.") else None
            slot = next((i for i, (n, g) in enumerate(slots) if n == layer and t.name.split(".")[2] in g), None)
            types[t.name] = T.Q6_K if slot is None else T[list(MORE_TYPES)[slot]]
    return _rewrite(src, out / "mixed.gguf", np.random.default_rng(11), types)


def test_every_type_equals_gguf_dequantize(mixed_types_file):
    _assert_exact(load_checkpoint(mixed_types_file), [*MORE_TYPES, "Q6_K"])


def test_a_cuda_build_holds_the_5_and_6_bit_types_exactly_in_int8(mixed_types_file):
    """The CUDA kernels read int8 and int4 layouts: Q5_0 / Q5_1 / Q5_K / Q6_K keep their values there, in int8."""
    ckpt = load_checkpoint(mixed_types_file)
    on_cpu, on_cuda = (quant_schemes(ckpt, QuantConfig(), cuda=cuda) for cuda in (False, True))
    assert {s.bits for s in on_cpu.values()} >= {5, 6} and {s.bits for s in on_cuda.values()} <= {4, 8}
    for name, scheme in on_cuda.items():
        held = ckpt.quantized_tensor(name)
        assert scheme == on_cpu[name] or scheme.bits == 8 > on_cpu[name].bits, name
        assert np.array_equal(dequantize(widen_exactly(held, scheme)), dequantize(held)), name


# llama.cpp's file types -> the tensor types it writes for the widened llama (its mixes: Q6_K for the lm_head,
# higher types for attn_v and ffn_down of some layers)
LLAMA_CPP_FTYPES = {
    "Q8_0": ["Q8_0"],
    "Q4_0": ["Q4_0", "Q6_K"],
    "Q4_1": ["Q4_1", "Q6_K"],
    "Q5_0": ["Q5_0", "Q6_K"],
    "Q5_1": ["Q5_1", "Q6_K"],
    "Q2_K": ["Q2_K", "Q3_K", "Q4_K", "Q6_K"],
    "Q3_K_M": ["Q3_K", "Q4_K", "Q5_K", "Q6_K"],
    "Q4_K_S": ["Q4_K", "Q5_K", "Q6_K"],
    "Q4_K_M": ["Q4_K", "Q6_K"],
    "Q5_K_M": ["Q5_K", "Q6_K"],
    "Q6_K": ["Q6_K"],
    "IQ4_NL": ["IQ4_NL", "Q5_K", "Q6_K"],
    "IQ4_XS": ["IQ4_XS", "Q5_K", "Q6_K"],
}


@pytest.mark.parametrize("ftype", LLAMA_CPP_FTYPES)
def test_llama_cpp_quantized_file_imports_exactly(ftype, checkpoint_dir, tmp_path):
    """A file quantized by llama.cpp itself (in the bench extra), with its own mix of types."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src = write_gguf(checkpoint_dir("llama", **KQUANT), tmp_path / "f32.gguf", "F32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    out = tmp_path / f"{ftype}.gguf"
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    ckpt = load_checkpoint(out)
    assert ckpt.config == load_checkpoint(src).config
    _assert_exact(ckpt, LLAMA_CPP_FTYPES[ftype])


def test_llmc_q6_k_quantizes_as_llama_cpp(checkpoint_dir, tmp_path):
    """llmc's own Q6_K (the q4_k_m recipe's head and wide layers) against llama.cpp's quantize_row_q6_K on the same
    F32 weights: the same search (make_qx_quants' grid, weighted by x^2) and codes, so the same values but where
    the candidates' float sums, added in another order, break a near-tie the other way (0.4% of the weights
    here), to the same error."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src = write_gguf(checkpoint_dir("llama", **KQUANT), tmp_path / "f32.gguf", "F32")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K
    out = tmp_path / "Q6_K.gguf"
    assert llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params)) == 0
    theirs, floats = load_checkpoint(out), load_checkpoint(src)
    compared = 0
    for name, kind in theirs.gguf_types.items():
        if kind != "Q6_K":
            continue
        w = floats.tensor(name).float().numpy()
        ours, want = dequantize(quantize(w, Q6_K)), dequantize(theirs.quantized_tensor(name))
        err_ours, err_want = (np.sqrt(np.mean((a - w) ** 2)) for a in (ours, want))
        assert np.mean(ours == want) >= 0.99 and abs(err_ours / err_want - 1) < 0.01, name
        compared += 1
    assert compared


def _dequantized_checkpoint(ckpt, source_dir, out):
    """A safetensors checkpoint of the GGUF's dequantized weights, with the source's config and tokenizer."""
    out.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source_dir / f, out / f)
    save_file(
        {n: ckpt.tensor(n).float().contiguous() for n in ckpt.config.weight_shapes()}, str(out / "model.safetensors")
    )
    return out


def _assert_logits_match(artifact, reference_dir, quantized: set[str]):
    """Every prefill row and one decode step against transformers on the same weights, its Linears that read a
    quantized weight given the kernel's activation rounding. As in tests/tools/test_quantized_build.py, most
    rows agree within 1e-3; a row where an activation at a rounding midpoint rounds the other way (the sums run
    in another order) moves by about 1e-2, a little more through int4 weights (1.1e-2 seen with Q4_0)."""
    model = CompiledModel.load(artifact, max_num_logits=64)
    ids = Tokenizer.from_file(str(reference_dir / "tokenizer.json")).encode(TEXTS[1]).ids
    table = list(range(model.num_blocks))[::-1][: -(-(len(ids) + 1) // model.block_size)]
    prefill = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
    nxt = int(np.argmax(prefill[-1]))
    decode = model.step(StepBatch.build([[nxt]], [len(ids)], [table], model.block_size))
    model.close()
    reference = round_as_cpu_qgemm(hf_model(reference_dir), lambda name: f"{name}.weight" in quantized)
    with torch.no_grad():
        want = reference(torch.tensor([[*ids, nxt]])).logits[0].numpy()
    rel = np.abs(np.concatenate([prefill, decode]) - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= 3e-2 and np.mean(rel <= 1e-3) >= 0.75, f"relative logit errors per row {np.round(rel, 4)}"


@pytest.mark.slow
# Q4_K_M: llama.cpp's mix puts attn_v in Q6_K beside Q4_K q / k, so the fused qkv GEMM is int8 g16 with mins
# (quant_widen.common_scheme)
@pytest.mark.parametrize("dtype", ["Q8_0", "Q4_0", "Q4_K+Q6_K", "Q4_K_M", "mixed"])
def test_quantized_file_compiles_and_matches_fp32_of_its_weights(
    dtype, checkpoint_dir, gguf_file, kquant_file, mixed_types_file, tmp_path
):
    if dtype == "mixed":
        path, source = mixed_types_file, checkpoint_dir("llama", **KQUANT)
    elif dtype.startswith("Q4_K"):
        path, source = kquant_file(T.Q6_K if dtype == "Q4_K_M" else T.Q4_K), checkpoint_dir("llama", **KQUANT)
    else:
        path, source = gguf_file("llama", dtype), checkpoint_dir("llama")
    ckpt = load_checkpoint(path)
    reference = _dequantized_checkpoint(ckpt, source, tmp_path / "dequantized")
    artifact = compile_checkpoint(path, target="cpu", output=tmp_path / "model.cpu")
    quantized = {n for n, k in ckpt.gguf_types.items() if k in SCHEMES}
    entry = json.loads((artifact / "manifest.json").read_text())["quant"]
    # the file's own schemes, not requantized: a GEMM of one source type keeps that type's scheme
    assert {SCHEMES[ckpt.gguf_types[n]] for n in quantized if "embed" not in n} <= set(entry["weights"].values())
    _assert_logits_match(artifact, reference, quantized)


def _file_decode_bytes(path) -> int:
    """What a decode token reads of a GGUF file: its tensors' bytes, of the token embedding one row (the whole
    table where it is the head too)."""
    tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
    # rope_freqs (Llama 3's scaled frequencies) is folded into the rope kernel's constants: no weight to read
    sizes = {name: int(t.n_bytes) for name, t in tensors.items() if name != "rope_freqs.weight"}
    rows = int(tensors["token_embd.weight"].shape[-1])  # GGUF lists dims innermost first
    want = sum(v for k, v in sizes.items() if k != "token_embd.weight") + sizes["token_embd.weight"] // rows
    return want + (sizes["token_embd.weight"] if "output.weight" not in sizes else 0)


def _prefill_logits(artifact, ids) -> np.ndarray:
    with CompiledModel.load(artifact, max_num_seqs=1, max_num_logits=len(ids)) as model:
        table = list(range(model.num_blocks))[: -(-len(ids) // model.block_size)]
        return model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS, T.Q3_K, T.Q2_K])
def test_a_file_is_held_at_its_size(qtype, checkpoint_dir, tmp_path, monkeypatch):
    """Every matrix IQ4_NL (IQ4_XS, Q3_K), the embedding and the head too: held as the file's 4-bit indices and
    fp16 scales (IQ4_XS's superblock records; Q3_K's 3-bit values, its scales in Q6_K's records, 4 bytes a
    superblock more than its own), so a decode token reads the file's tensor bytes. The logits are bit for bit
    those of the same values widened to int8 (as a CUDA build holds them, and as llmc held them before), and for
    IQ4 those of transformers on the file's values. (The int8 path meets transformers in the mixed-types test;
    an all-Q3_K random model puts 40% of rows 2e-3 from its activation rounding's emulation.)"""
    source = checkpoint_dir("llama", **KQUANT)
    src = write_gguf(source, tmp_path / "f32.gguf", "F32")
    types = {t.name: qtype for t in gguf.GGUFReader(src).tensors if len(t.shape) == 2}
    path = _rewrite(src, tmp_path / f"{qtype.name}.gguf", np.random.default_rng(5), types)
    ckpt = load_checkpoint(path)
    art = compile_checkpoint(path, target="cpu", output=tmp_path / "m.cpu")
    manifest = json.loads((art / "manifest.json").read_text())
    assert set(manifest["quant"]["weights"].values()) == {SCHEMES[qtype.name]}
    want, got = _file_decode_bytes(path), CompiledModel.load(art).artifact.decode_weight_bytes
    assert want <= got <= want * (1 + (4 / 110 if qtype == T.Q3_K else 0))
    ids = Tokenizer.from_file(str(source / "tokenizer.json")).encode(TEXTS[1]).ids

    native, wide = gguf_blocks.SCHEMES[qtype], held_on_cuda(gguf_blocks.SCHEMES[qtype])
    unpack = gguf_blocks.UNPACK[qtype]

    def widened(blocks):  # the file's values, held in int8
        monkeypatch.setitem(gguf_blocks.SCHEMES, qtype, native)
        t = unpack(blocks)
        monkeypatch.setitem(gguf_blocks.SCHEMES, qtype, wide)
        return widen_exactly(t, wide)

    monkeypatch.setitem(gguf_blocks.SCHEMES, qtype, wide)
    monkeypatch.setitem(gguf_blocks.UNPACK, qtype, widened)
    int8 = compile_checkpoint(path, target="cpu", output=tmp_path / "int8.cpu")
    assert set(json.loads((int8 / "manifest.json").read_text())["quant"]["weights"].values()) == {wide.describe()}
    assert np.array_equal(_prefill_logits(art, ids), _prefill_logits(int8, ids))
    if qtype in (T.IQ4_NL, T.IQ4_XS):
        quantized = {n for n, k in ckpt.gguf_types.items() if k == qtype.name}
        _assert_logits_match(art, _dequantized_checkpoint(ckpt, source, tmp_path / "dequantized"), quantized)


def test_a_q4_k_m_file_streams_its_own_bytes(kquant_file, tmp_path):
    """attn_v in Q6_K beside Q4_K q and k (llama.cpp's Q4_K_M mix) is read at the file's types, each in its own
    GEMM: a decode token reads the file's tensor bytes, of the token embedding one row (the whole table where
    it is the head too), and `llmc profile` says so."""
    path = kquant_file(T.Q6_K)
    art = compile_checkpoint(path, target="cpu", output=tmp_path / "m.cpu")
    want = _file_decode_bytes(path)
    artifact = CompiledModel.load(art).artifact
    assert artifact.decode_weight_bytes == want
    launches = json.loads((art / "manifest.json").read_text())["kernel_program"]["launches"]
    assert sum("ldy" in launch["params"] for launch in launches) == 2 * 2  # q / k and v, both layers
    report = CliRunner().invoke(main, ["profile", str(art), "--context", "8", "--repeats", "1"])
    assert report.exit_code == 0 and f"reads {want / 1e6:.2f} MB of weights" in report.output, report.output


@pytest.mark.parametrize("qtype", [T.TQ1_0, T.IQ2_XXS])
def test_unsupported_type_is_one_line(qtype, checkpoint_dir, tmp_path):
    src = write_gguf(checkpoint_dir("llama", **KQUANT), tmp_path / "f32.gguf", "F32")
    bad = _rewrite(src, tmp_path / "bad.gguf", np.random.default_rng(0), {"blk.1.ffn_up.weight": qtype})
    with pytest.raises(CompileError, match=rf"'blk\.1\.ffn_up\.weight' is {qtype.name}, which llmc does not import"):
        load_checkpoint(bad)
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and qtype.name in lines[0] and "blk.1.ffn_up.weight" in lines[0], result.output


def test_reader_reads_what_gguf_reads(sentencepiece_file):
    """The importer's reader (fast arrays, refusing short reads) gives every field and tensor GGUFReader gives."""
    from llmc.compiler.frontend.gguf_reader import GGUFFileReader as _Reader

    ours, theirs = _Reader(sentencepiece_file), gguf.GGUFReader(sentencepiece_file)
    assert {k: f.contents() for k, f in ours.fields.items()} == {k: f.contents() for k, f in theirs.fields.items()}
    assert [(t.name, t.tensor_type, t.data_offset) for t in ours.tensors] == [
        (t.name, t.tensor_type, t.data_offset) for t in theirs.tensors
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors, strict=True))


def _cut_tensor_data(data: bytes) -> bytes:
    return data[:-100]


def _cut_header(data: bytes) -> bytes:
    return data[:2000]  # inside the token list


CORRUPT = {
    "truncated_tensors": (_cut_tensor_data, "truncated"),
    "truncated_metadata": (_cut_header, "truncated"),
    "bad_magic": (lambda d: b"GGUX" + d[4:], "GGUF magic invalid"),
    "empty": (lambda d: b"", "not a readable GGUF file"),
    "bad_version": (lambda d: d[:4] + (99).to_bytes(4, "little") + d[8:], "version 99"),
}


@pytest.mark.parametrize("case", CORRUPT)
def test_corrupt_file_is_a_checkpoint_error(case, gguf_file, tmp_path):
    damage, expected = CORRUPT[case]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(gguf_file("llama", "F32").read_bytes()))
    with pytest.raises(CheckpointError, match=expected):
        load_checkpoint(bad)
    result = CliRunner().invoke(main, ["inspect", str(bad)])
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and str(bad) in result.output


def test_unsupported_arch_and_tokenizer_are_named(gguf_file, tmp_path):
    src, rng, S = gguf_file("llama", "F32"), np.random.default_rng(0), gguf.GGUFValueType.STRING
    cases = {
        "gemma2": {names.ARCHITECTURE: ("gemma2", S, None)},
        "'bert'": {names.TOKENIZER_MODEL: ("bert", S, None)},
        "'gemma4'": {names.TOKENIZER_PRE: ("gemma4", S, None)},
        "'yarn'": {"llama.rope.scaling.type": ("yarn", S, None)},
    }
    for expected, meta in cases.items():
        with pytest.raises(LlmcError, match=expected):
            load_checkpoint(_rewrite(src, tmp_path / "x.gguf", rng, meta=meta))


def test_a_hostile_chat_template_in_a_gguf_is_refused_at_load(gguf_file, tmp_path):
    src, S = gguf_file("llama", "F32"), gguf.GGUFValueType.STRING
    bomb = "{{ ((10 ** 1024) ** 1024) ** 32 > 5 }}"  # 44 s in one C call, were it run
    bad = _rewrite(src, tmp_path / "x.gguf", np.random.default_rng(0), meta={names.CHAT_TEMPLATE: (bomb, S, None)})
    with pytest.raises(CheckpointError, match="tokenizer.chat_template.*'\\*\\*' would build"):
        load_checkpoint(bad)


def _sentencepiece_vocab():
    """A llama-style SentencePiece vocabulary of 384 pieces: <unk> <s> </s>, the 256 byte pieces, then pieces
    learned by BPE over the same text as the tiny tokenizer, scored best first."""
    from pydoc_data.topics import topics

    from tokenizers import SentencePieceBPETokenizer

    bpe = SentencePieceBPETokenizer()
    bpe.train_from_iterator(
        [topics[k] for k in sorted(topics)][:40],
        vocab_size=400,
        min_frequency=2,
        special_tokens=[],
        show_progress=False,
    )
    learned = [t for t, _ in sorted(bpe.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [t for t in learned if t not in tokens][: 384 - len(tokens)]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(tokens) - 259)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, types, scores


@pytest.fixture(scope="module")
def sentencepiece_file(gguf_file, tmp_path_factory):
    """The tiny llama with a llama-style SentencePiece tokenizer (tokenizer.ggml.model "llama", no merges)."""
    tokens, types, scores = _sentencepiece_vocab()
    v = gguf.GGUFValueType
    meta = {
        names.TOKENIZER_MODEL: ("llama", v.STRING, None),
        names.TOKENS: (tokens, v.ARRAY, v.STRING),
        names.TOKEN_TYPE: (types, v.ARRAY, v.INT32),
        "tokenizer.ggml.scores": (scores, v.ARRAY, v.FLOAT32),
        names.MERGES: None,  # SentencePiece files list none: they come from the scores
        names.TOKENIZER_PRE: None,
        names.BOS_ID: (1, v.UINT32, None),
        names.EOS_ID: (2, v.UINT32, None),
        "tokenizer.ggml.unknown_token_id": (0, v.UINT32, None),
    }
    out = tmp_path_factory.mktemp("sp") / "sp.gguf"
    return _rewrite(gguf_file("llama", "F32"), out, np.random.default_rng(0), meta=meta)


# Text that starts with spaces or follows a special token, where SentencePiece (and llama.cpp) add the dummy
# prefix space and transformers' Metaspace does not.
PREFIX_TEXTS = ["  leading spaces", " ", "<s>hello</s> world</s>", "x</s>  y"]


def test_sentencepiece_tokenizer_as_transformers_converts_it(sentencepiece_file):
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer, get_gguf_tokenizer

    ckpt = load_checkpoint(sentencepiece_file)
    assert ckpt.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    ours = Tokenizer.from_file(str(ckpt.tokenizer_path))
    theirs, _ = convert_gguf_tokenizer(*get_gguf_tokenizer(str(sentencepiece_file))[:2])
    for text in TEXTS + ["tabs\tand\nnewlines", "中文 bytes"]:
        want = theirs.encode(text, add_special_tokens=False).ids
        got = ours.encode(text).ids
        assert got == [1] + want, text  # llama.cpp adds <s> to a SentencePiece vocabulary by default
        assert ours.decode(got) == theirs.decode(want) == text, text
    assert any(ours.id_to_token(i).startswith("<0x") for i in ours.encode("中文").ids)  # byte fallback
    assert ours.decode(ours.encode(PREFIX_TEXTS[0]).ids) == PREFIX_TEXTS[0]


@pytest.mark.parametrize("case", [*GGUF_ARCHS, "llama-bpe", "qwen2-pre", "sentencepiece"])
def test_tokenizer_as_llama_cpp_tokenizes(case, gguf_file, sentencepiece_file, tmp_path):
    """llama.cpp, the file format's own runtime (in the bench extra): the same ids, special tokens and BOS
    included. llama-bpe / qwen2-pre: the tiny vocabulary under Llama 3's and Qwen2's split regexes."""
    llama_cpp = pytest.importorskip("llama_cpp")
    path = sentencepiece_file if case == "sentencepiece" else gguf_file(case.split("-")[0], "F32")
    if case in ("llama-bpe", "qwen2-pre"):
        meta = {names.TOKENIZER_PRE: (case.removesuffix("-pre"), gguf.GGUFValueType.STRING, None)}
        path = _rewrite(path, tmp_path / "pre.gguf", None, meta=meta)
    ours = Tokenizer.from_file(str(load_checkpoint(path).tokenizer_path))
    reference = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in TEXTS + PREFIX_TEXTS + ["tabs\tand\nnewlines", "中文 bytes", "The  fox's 'quoted' THE end.\r\n"]:
        assert ours.encode(text).ids == reference.tokenize(text.encode(), add_bos=True, special=True), text


@pytest.mark.parametrize("arch", GGUF_ARCHS)
def test_llama_cpp_runs_the_written_file_as_transformers_does(arch, checkpoint_dir, gguf_file):
    """The layout llmc writes and reads is llama.cpp's own: llama.cpp's loader, with the arch's own graph (rope
    style, norm placement, multipliers, window pattern), gives transformers' logits and greedy tokens."""
    llama_cpp = pytest.importorskip("llama_cpp")
    src = checkpoint_dir(arch, **GGUF_OVERRIDES.get(arch, {}))
    ids = Tokenizer.from_file(str(src / "tokenizer.json")).encode(TEXTS[0]).ids
    model = hf_model(src)
    with torch.no_grad():
        want_logits = model(torch.tensor([ids])).logits[0].numpy()
        want = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)[0, len(ids) :].tolist()
    llm = llama_cpp.Llama(model_path=str(gguf_file(arch, "F32")), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids)
    np.testing.assert_allclose(np.asarray(llm.scores[: len(ids)]), want_logits, atol=5e-2, rtol=0)
    llm.reset()
    got = [t for t, _ in zip(llm.generate(ids, temp=0.0, top_k=1), range(8), strict=False)]
    assert got == want


def test_gguf_file_without_the_gguf_suffix_is_refused(gguf_file, tmp_path):
    renamed = tmp_path / "model.bin"
    shutil.copy(gguf_file("llama", "F32"), renamed)
    with pytest.raises(CheckpointError, match="a .gguf file"):
        load_checkpoint(renamed)


# Llama 3.1 (factor 8) and 3.2 (factor 32) rope scaling at their real head_dim, and the tiny variant's, as
# llama.cpp's converter turns them into rope_freqs: the fields rebuilt from the divisors give the same rotations.
LLAMA3 = {
    "llama3.1": dict(head_dim=128, theta=500000.0, factor=8.0, low=1.0, high=4.0, orig=8192),
    "llama3.2": dict(head_dim=64, theta=500000.0, factor=32.0, low=1.0, high=4.0, orig=8192),
    "one_interpolated": dict(head_dim=16, theta=10000.0, factor=4.0, low=1.0, high=2.0, orig=64),
    "tiny": dict(head_dim=8, theta=10000.0, factor=8.0, low=1.0, high=4.0, orig=32),
}


@pytest.mark.parametrize("case", LLAMA3)
def test_llama3_scaling_from_rope_freqs(case):
    c = LLAMA3[case]
    scaling = {
        "rope_type": "llama3",
        "factor": c["factor"],
        "low_freq_factor": c["low"],
        "high_freq_factor": c["high"],
        "original_max_position_embeddings": c["orig"],
    }
    config = ModelConfig(
        "LlamaForCausalLM",
        32,
        c["head_dim"] * 2,
        8,
        1,
        2,
        2,
        c["head_dim"],
        1e-5,
        c["theta"],
        scaling,
        131072,
        None,
        False,
        False,
        False,
        False,
        "float32",
        None,
        (),
    )
    freqs = _llama3_rope_freqs(config).astype(np.float64)
    fitted = _llama3_scaling(freqs, c["theta"], c["head_dim"], 131072, None)
    rebuilt = dataclasses.replace(config, rope_scaling=fitted)
    np.testing.assert_allclose(rope_inv_freq(rebuilt).numpy(), rope_inv_freq(config).numpy(), rtol=2e-6, atol=0)


def test_run_compiles_a_gguf_once_per_content(gguf_file, tmp_path, monkeypatch):
    """`llmc run model.gguf` goes through the compile cache, keyed by the file's content."""
    import llmc.compiler.compile as compile_module
    from llmc.tools.engine_setup import resolve_artifact

    compiled = []

    def record(ckpt, *, output, **_):
        compiled.append(ckpt)
        output.mkdir(parents=True)
        (output / "manifest.json").write_text(json.dumps({}))

    monkeypatch.setattr(compile_module, "compile_checkpoint", record)
    a = tmp_path / "a.gguf"
    shutil.copy(gguf_file("llama", "F32"), a)
    first = resolve_artifact(a)
    assert resolve_artifact(a) == first and compiled == [a]
    shutil.copy(gguf_file("llama", "Q8_0"), a)
    assert resolve_artifact(a) != first and len(compiled) == 2


@pytest.mark.parametrize("value, kind", [(np.nan, "NaN"), (np.inf, "an infinity")], ids=["nan", "inf"])
def test_a_quantized_tensor_with_a_scale_that_is_not_finite_is_refused_naming_it(value, kind, checkpoint_dir, tmp_path):
    """A GGUF's quantized tensor is checked through its scales while it is packed: compile names both names."""
    path = write_gguf(checkpoint_dir("llama"), tmp_path / "q8.gguf", "Q8_0")
    info = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.0.attn_output.weight")
    assert info.tensor_type == T.Q8_0
    block, size = gguf.GGML_QUANT_SIZES[T.Q8_0]
    at = int(info.data_offset) + 3 * (int(info.shape[0]) // block) * size  # row 3's first block: its fp16 d
    data = bytearray(path.read_bytes())
    data[at : at + 2] = np.array([value], np.float16).tobytes()
    path.write_bytes(bytes(data))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", str(path), "-o", str(out)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and lines[-1].startswith("error: "), result.output
    assert (
        f"'model.layers.0.self_attn.o_proj.weight' (GGUF 'blk.0.attn_output.weight') holds {kind} in its scales "
        "(row 3)" in lines[-1]
    )
    assert not out.exists()
