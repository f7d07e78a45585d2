"""The TVM codegen fallback, end to end: with fuse_swiglu left out of the pipeline, silu and the multiply
have no kernel template, so TVM generates them (compiler/codegen/tvm_fallback.py). The model must still
match transformers token for token, run without TVM importable, and say in `llmc inspect` what fell back.
A CUDA target has no fallback and refuses such a graph."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer

from llmc.compiler.compile import compile_checkpoint
from llmc.compiler.passes import pipeline
from llmc.errors import CompileError
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from llmc.tools import cli
from tests.checkpoints import hf_model

PROMPT = "Return a new dictionary initialized from an optional positional argument"


@pytest.fixture(scope="module")
def without_swiglu():
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "PASSES", [p for p in pipeline.PASSES if p.__name__ != "fuse_swiglu"])
        yield


@pytest.fixture(scope="module")
def fallback_artifact(checkpoint_dir, tmp_path_factory, without_swiglu):
    return compile_checkpoint(checkpoint_dir("qwen2"), target="cpu", output=tmp_path_factory.mktemp("fb") / "m")


def test_fallback_model_matches_transformers(fallback_artifact, checkpoint_dir):
    path = checkpoint_dir("qwen2")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPT).ids
    reference = hf_model(path)
    with CompiledModel.load(fallback_artifact, kv_cache_memory="16MiB") as model:
        table = list(range(-(-len(ids) // model.block_size)))
        logits = model.step(StepBatch.build([ids], [0], [table], model.block_size))[0]
        params = SamplingParams(temperature=0, max_tokens=24, min_tokens=24)
        tokens = LLMEngine(model).generate([ids], params)[0].outputs[0].token_ids
    with torch.no_grad():
        expected_logits = reference(torch.tensor([ids])).logits[0, -1].numpy()
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=24, min_new_tokens=24, do_sample=False)[
            0, len(ids) :
        ].tolist()
    assert np.abs(logits - expected_logits).max() <= 1e-3 * np.abs(expected_logits).max()
    assert tokens == expected


def test_fallback_module_runs_without_tvm(fallback_artifact):
    assert (fallback_artifact / "tvm_kernels.cc").is_file()
    script = (
        "import sys, json; sys.modules['tvm'] = sys.modules['tvm_ffi'] = None\n"
        "from llmc.runtime.module import CompiledModel\nfrom llmc.runtime.batch import StepBatch\n"
        f"m = CompiledModel.load({str(fallback_artifact)!r}, kv_cache_memory='8MiB')\n"
        "print(json.dumps(m.step(StepBatch.build([[5, 6, 7]], [0], [[0]], m.block_size))[0][:4].tolist()))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert len(json.loads(out.stdout)) == 4
    undefined = subprocess.run(
        ["nm", "-D", "--undefined-only", str(fallback_artifact / "model.so")],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "TVM" not in undefined


def test_inspect_names_the_ops_that_fell_back(fallback_artifact):
    r = CliRunner().invoke(cli.main, ["inspect", str(fallback_artifact)])
    assert r.exit_code == 0, r.output
    assert "TVM fallback   relax.multiply, relax.nn.silu" in r.output


def test_cuda_target_refuses_a_fallback(checkpoint_dir, tmp_path, without_swiglu):
    with pytest.raises(CompileError, match="no CUDA kernel template covers relax.multiply, relax.nn.silu"):
        compile_checkpoint(checkpoint_dir("qwen2"), target="sm90", output=tmp_path / "m")
