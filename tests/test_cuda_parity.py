"""CUDA artifacts, verified without a GPU: built by nvcc for every GPU target, and run under the CUDA
simulator against the CPU target and transformers.

fp32 weights: the simulated sm90 module must produce the CPU target's and transformers' greedy tokens.
bf16 weights: logits within bf16 tolerance of transformers' fp32 logits, and the same token wherever the
reference's top-2 margin is clear. The rule, for the logits l of one step (teacher-forced on the
reference tokens): max|l_sim - l_ref| <= BF16_REL * max|l_ref|, and argmax agrees whenever the reference's
top-1 minus top-2 gap exceeds 2 * BF16_REL * max|l_ref| (twice the error bound, so no rounding can flip it).
"""

import json

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from llmc.compiler.codegen.simulator import nvcc_compile
from llmc.compiler.compile import compile_checkpoint
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from tests.checkpoints import ARCHS, MOE_ARCHS, hf_model
from tests.cuda_mode import cuda_library
from tests.logits_rows import assert_logits_rows_match_transformers

PROMPT = "The list type"
NEW_TOKENS = 24
BF16_REL = 3e-2
_built = {}


def artifact(checkpoint_dir, tmp_path_factory, arch, target, dtype="float32"):
    key = (arch, target, dtype)
    if key not in _built:
        out = tmp_path_factory.mktemp(f"{arch}_{target}_{dtype}") / "model"
        _built[key] = compile_checkpoint(checkpoint_dir(arch), target=target, output=out, weight_dtype=dtype)
    return _built[key]


def _greedy(model, ids):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    return LLMEngine(model).generate([ids], params)[0].outputs[0].token_ids


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_simulated_sm90_matches_cpu_and_transformers(arch, checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir(arch)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    sm90 = artifact(checkpoint_dir, tmp_path_factory, arch, "sm90")
    with CompiledModel.load(sm90, library=cuda_library(sm90), max_num_seqs=2) as sim:
        simulated = _greedy(sim, ids)
    with CompiledModel.load(artifact(checkpoint_dir, tmp_path_factory, arch, "cpu")) as cpu:
        assert simulated == _greedy(cpu, ids)
    with torch.no_grad():
        expected = (
            hf_model(path)
            .generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(ids) :
            ]
            .tolist()
        )
    assert simulated == expected


def test_simulated_sm90_logits_at_every_row_and_at_mixed_rows(checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir("llama")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    long, short = tok.encode(PROMPT + " holds items in order").ids, tok.encode(PROMPT).ids
    sm90 = artifact(checkpoint_dir, tmp_path_factory, "llama", "sm90")
    with CompiledModel.load(sm90, library=cuda_library(sm90), max_num_seqs=2, max_num_logits=len(long)) as sim:
        assert_logits_rows_match_transformers(sim, path, long=long, short=short)


@pytest.mark.parametrize("arch,window", [*((a, None) for a in ARCHS), ("mistral", 6)])
def test_simulated_bf16_within_tolerance(checkpoint_dir, tmp_path_factory, arch, window):
    """A bf16 build runs bf16 end to end (weights, activations, KV cache; fp32 accumulation): every architecture,
    and Mistral's sliding window (6 positions, crossed by the 24 decoded tokens)."""
    path = checkpoint_dir(arch, **({"sliding_window": window} if window else {}))
    reference = hf_model(path)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    with torch.no_grad():
        tokens = reference.generate(
            torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )[0].tolist()
        ref_logits = reference(torch.tensor([tokens])).logits[0].numpy()
    clear = 0
    if window:
        sm90 = compile_checkpoint(
            path, target="sm90", output=tmp_path_factory.mktemp("sw") / "m", weight_dtype="bfloat16"
        )
    else:
        sm90 = artifact(checkpoint_dir, tmp_path_factory, arch, "sm90", "bfloat16")
    manifest = json.loads((sm90 / "manifest.json").read_text())
    assert manifest["activation_dtype"] == manifest["kv_cache_dtype"] == "bfloat16"
    with CompiledModel.load(sm90, library=cuda_library(sm90), max_num_seqs=2) as sim:
        blocks = list(range(sim.num_blocks))
        computed, new = 0, ids
        for pos in range(len(ids) - 1, len(tokens) - 1):
            table = blocks[: -(-(computed + len(new)) // sim.block_size)]
            got = sim.step(StepBatch.build([new], [computed], [table], sim.block_size))[0]
            ref = ref_logits[pos]
            scale = np.abs(ref).max()
            assert np.abs(got - ref).max() <= BF16_REL * scale, f"position {pos}"
            top2 = np.sort(ref)[-2:]
            if top2[1] - top2[0] > 2 * BF16_REL * scale:
                clear += 1
                assert int(np.argmax(got)) == int(np.argmax(ref)), f"position {pos}: clear margin, different token"
            computed += len(new)
            new = [tokens[pos + 1]]
    assert clear > 0, "no step had a clear margin: the test checked no token"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # bf16: the mma GEMMs and the SwiGLU GEMM
@pytest.mark.parametrize("target", ["sm80", "sm89", "sm90"])
def test_nvcc_builds_every_target_without_spills(target, dtype, checkpoint_dir, tmp_path_factory, tmp_path):
    built = artifact(checkpoint_dir, tmp_path_factory, "llama", target, dtype)
    from llmc.compiler.compile import module_sources
    from llmc.targets import load_target

    for name, text in module_sources(load_target(target), (built / "model.cu").read_text()).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)  # sim/: the simulator's headers
        (tmp_path / name).write_text(text)
    report = nvcc_compile(tmp_path / "model.cu", f"sm_{target[2:]}", tmp_path / "model.cubin")
    assert report, "ptxas reported no kernels"
    for kernel, res in report.items():
        assert res.spill_stores == 0 and res.spill_loads == 0, f"{target} {kernel}: {res}"


def test_simulated_sliding_window_matches_transformers(checkpoint_dir, tmp_path):
    path = checkpoint_dir("mistral", sliding_window=6)
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    out = compile_checkpoint(path, target="sm90", output=tmp_path / "model.sm90")
    with CompiledModel.load(out, library=cuda_library(out), max_num_seqs=2) as sim:
        simulated = _greedy(sim, ids)
    with torch.no_grad():
        expected = (
            hf_model(path)
            .generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(ids) :
            ]
            .tolist()
        )
    assert simulated == expected
