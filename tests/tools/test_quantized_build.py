"""`llmc compile --quant`: int8 and int4 builds of the tiny checkpoints compile, generate, and compute what the
quantized weights say.

The reference is transformers on a checkpoint whose quantized weights ARE quant.dequantize(quantize(w)), so
the weights lose nothing to the build; what remains is the CPU kernel's activation quantization (int8 per
block of 32, the manifest's "activations"; the lm_head's in two passes), which the reference reproduces with a
forward pre-hook on each quantized Linear (tests/cpu_activations.py). Against that, the logits agree to the fp32 parity tolerance, but for the rows where some
activation sits at a rounding midpoint and the two sides round it differently (float sums in another order):
one step of one activation moves those rows' logits by well under the whole activation quantization's effect,
which (against transformers without the hooks) is 1-3% on these models.
"""

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmc.compiler.quant import QuantConfig, dequantize, quantize
from llmc.manifest import read_manifest
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from llmc.tools.build import compile_checkpoint
from tests.checkpoints import hf_model, make_checkpoint
from tests.cpu_activations import round_as_cpu_qgemm

REL = 1e-3  # the fp32 parity tolerance (tests/logits_rows.py)
FLIP_REL = 1e-2  # a row with an activation rounded the other way (see the module docstring)
# (arch, quant): qwen2 has the qkv bias (joins the quantized GEMM); llama's down_proj (K = 136) stays float, and
# its embedding is tied: the head's qgemm and the qembedding gather read one packed table
# Each build compiles twice (the quality gate's unquantized reference too), 25-70 s here: one runs by default.
BUILDS = [
    ("llama", QuantConfig("int4", lm_head=True)),
    # --tensor-quant: gate/up int4 under an int8 mode, o_proj left float
    pytest.param(
        "llama",
        QuantConfig("int8", lm_head=True, overrides=((r"mlp\.(gate|up)_proj", "int4"), ("o_proj", "float"))),
        marks=pytest.mark.slow,
    ),
    pytest.param("qwen2", QuantConfig("int8", group_size=32), marks=pytest.mark.slow),
    pytest.param("qwen2", QuantConfig("int4", group_size=64), marks=pytest.mark.slow),
    # a recipe: int4 asym (no K % 256 here), layer 1's qkv and down_proj and the head as Q8_0, the untied
    # embedding's gather quantized
    pytest.param("qwen2", QuantConfig("q4_k_m"), marks=pytest.mark.slow),
    # the same at 5 bits: int5 with mins (Q5_1, llama.cpp's Q5_K fallback), through the int5 kernels
    pytest.param("qwen2", QuantConfig("q5_k_m"), marks=pytest.mark.slow),
]
_built = {}


def _quantized_names(state: dict, quant: QuantConfig, num_layers: int) -> dict:
    """The weights a build quantizes (compile.quant_schemes' rule, restated here from each tensor's role)."""
    out = {}
    for name, t in state.items():
        block_linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
        tied = name == "model.embed_tokens.weight" and "lm_head.weight" not in state
        role = "lm_head.weight" if tied else name
        if t.dim() == 2 and (block_linear or role in ("lm_head.weight", "model.embed_tokens.weight")):
            scheme = quant.tensor_scheme(role, t.shape[1], num_layers)
            if scheme is not None:
                out[name] = scheme
    return out


def build(tmp_path_factory, arch: str, quant: QuantConfig):
    """(checkpoint of representable weights, its quantized artifact, the names it quantizes)."""
    key = (arch, quant)
    if key not in _built:
        root = tmp_path_factory.mktemp(f"q_{arch}_{quant.mode}")
        ckpt = make_checkpoint(root / "ckpt", arch, seed=3, tie_word_embeddings=arch == "llama")
        (weights,) = ckpt.glob("*.safetensors")
        state = load_file(weights)
        names = _quantized_names(state, quant, json.loads((ckpt / "config.json").read_text())["num_hidden_layers"])
        for name, scheme in names.items():
            state[name] = torch.from_numpy(dequantize(quantize(state[name].numpy(), scheme)))
        save_file(state, str(weights), metadata={"format": "pt"})
        _built[key] = ckpt, compile_checkpoint(ckpt, target="cpu", output=root / "model.cpu", quant=quant), names
    return _built[key]


def _reference(ckpt, names):
    tied = "model.embed_tokens.weight" in names  # the head reads it quantized (not the gather's ids)
    return round_as_cpu_qgemm(hf_model(ckpt), lambda name: f"{name}.weight" in names or (name == "lm_head" and tied))


@pytest.mark.parametrize("arch,quant", BUILDS, ids=lambda v: v if isinstance(v, str) else v.describe())
def test_logits_match_the_dequantized_weights_with_quantized_activations(arch, quant, tmp_path_factory):
    ckpt, artifact, names = build(tmp_path_factory, arch, quant)
    assert names, "the build must quantize something"
    model = CompiledModel.load(artifact, max_num_logits=64)
    ids = [int(i) for i in np.random.default_rng(1).integers(2, 384, 37)]
    table = list(range(model.num_blocks))[::-1][: -(-(len(ids) + 1) // model.block_size)]
    prefill = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
    nxt = int(np.argmax(prefill[-1]))
    decode = model.step(StepBatch.build([[nxt]], [len(ids)], [table], model.block_size))  # T = 1: the GEMV path
    model.close()
    reference = _reference(ckpt, names)
    with torch.no_grad():
        want = reference(torch.tensor([[*ids, nxt]])).logits[0].numpy()
    got = np.concatenate([prefill, decode])
    rel = np.abs(got - want).max(axis=1) / np.abs(want).max(axis=1)
    assert rel.max() <= FLIP_REL, f"relative logit errors per row {np.round(rel, 4)}"
    assert np.mean(rel <= REL) >= 0.75, f"relative logit errors per row {np.round(rel, 4)}"


@pytest.mark.parametrize("arch,quant", BUILDS[:2], ids=lambda v: v if isinstance(v, str) else v.describe())
def test_quantized_build_generates_and_records_its_scheme(arch, quant, tmp_path_factory):
    _, artifact, names = build(tmp_path_factory, arch, quant)
    m = read_manifest(artifact)
    entry = m["quant"]
    assert m["quantization"] == quant.mode
    assert entry["mode"] == quant.mode and entry["lm_head"] == quant.quantizes_head
    assert entry["activations"] == "int8 per 32" and entry["default"] == quant.describe()
    # one entry per quantized GEMM: fused qkv and gate/up are one each, named as packed
    fused = {n.replace(".q_proj", ".q+k+v_proj").replace(".gate_proj", ".gate+up_proj") for n in names}
    assert set(entry["weights"]) == {n for n in fused if not any(p in n for p in (".k_proj", ".v_proj", ".up_proj"))}
    assert set(entry["weights"].values()) == {s.describe() for s in names.values()}
    raw = (artifact / "weights.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    qweights = {k: v for k, v in header.items() if k.endswith(".qweight")}
    assert len(qweights) == len(entry["weights"]) and all(v["dtype"] == "U8" for v in qweights.values())
    if "model.embed_tokens.weight" in names:  # tied: the gather reads the head's packed table, stored once
        assert not any(
            k.startswith("model.embed_tokens.weight") and not k.endswith(("qweight", "scales")) for k in header
        )
    assert entry["packed_bytes"]["quantized"] == sum(
        v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k.endswith((".qweight", ".scales"))
    )
    model = CompiledModel.load(artifact)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (result,) = LLMEngine(model).generate([[5, 6, 7]], params)
    model.close()
    assert len(result.outputs[0].token_ids) == 12
