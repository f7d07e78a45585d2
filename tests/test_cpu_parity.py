"""`llmc compile --target cpu` reproduces transformers: greedy tokens exactly, logits within 1e-3 (rel).

Prompts are real text through the checkpoint's tokenizer; the three prompts of different lengths run as
one batch, so their prefills and decodes share steps.
"""

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from llmc.compiler.compile import compile_checkpoint
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from tests.checkpoints import ARCHS, MOE_ARCHS, hf_model
from tests.logits_rows import assert_logits_rows_match_transformers

PROMPTS = [
    "The list type",
    "Return a new dictionary initialized from an optional positional argument and a possibly empty set of keyword",
    "def",
]
NEW_TOKENS = 48
_compiled = {}


def compiled(checkpoint_dir, tmp_path_factory, arch):
    if arch not in _compiled:
        out = tmp_path_factory.mktemp(f"art_{arch}") / "model.cpu"
        _compiled[arch] = compile_checkpoint(checkpoint_dir(arch), target="cpu", output=out)
    return _compiled[arch]


def _prompt_ids(path):
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [tok.encode(p).ids for p in PROMPTS]


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_greedy_tokens_match_transformers_in_one_batch(arch, checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir(arch)
    _assert_batched_greedy_matches(
        CompiledModel.load(compiled(checkpoint_dir, tmp_path_factory, arch)), path, _prompt_ids(path)
    )


def _assert_batched_greedy_matches(model, path, prompts, max_num_batched_tokens=None):
    """The prompts run as one batch (shared steps); each continuation equals transformers' generate."""
    results = LLMEngine(model, max_num_batched_tokens=max_num_batched_tokens).generate(
        prompts, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    )
    reference = hf_model(path)
    for ids, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(ids) :].tolist()
        assert result.outputs[0].token_ids == expected


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_every_step_logits_within_1e3(arch, checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir(arch)
    model = CompiledModel.load(compiled(checkpoint_dir, tmp_path_factory, arch))
    reference = hf_model(path)
    ids = _prompt_ids(path)[1]
    blocks = list(range(model.num_blocks))[::-1]  # a non-trivial block table
    tokens, computed, new = list(ids), 0, list(ids)
    for _ in range(12):  # one prefill, then decode steps
        table = blocks[: -(-(computed + len(new)) // model.block_size)]
        logits = model.step(StepBatch.build([new], [computed], [table], model.block_size))[0]
        with torch.no_grad():
            expected = reference(torch.tensor([tokens])).logits[0, -1].numpy()
        rel = np.abs(logits - expected).max() / np.abs(expected).max()
        assert rel <= 1e-3, f"step at {computed}: relative logit error {rel:.2e}"
        computed += len(new)
        new = [int(np.argmax(logits))]
        tokens.append(new[0])


@pytest.mark.parametrize("arch", (*ARCHS, *MOE_ARCHS))
def test_logits_at_every_row_and_at_mixed_rows(arch, checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir(arch)
    prompts = _prompt_ids(path)
    model = CompiledModel.load(
        compiled(checkpoint_dir, tmp_path_factory, arch), max_num_seqs=2, max_num_logits=len(prompts[1])
    )
    assert_logits_rows_match_transformers(model, path, long=prompts[1], short=prompts[0])


# More checkpoint variants. Sliding windows far shorter than the prompts, so nearly every attention row is cut
# by one (Qwen2's window covers only the layers from max_window_layers up); YaRN RoPE, whose inverse
# frequencies ramp between interpolated and extrapolated and whose attention factor scales q.k.
VARIANTS = {
    "mistral_sliding": ("mistral", dict(sliding_window=6)),
    "qwen2_sliding": ("qwen2", dict(use_sliding_window=True, sliding_window=5, max_window_layers=1)),
    "qwen2_yarn": (
        "qwen2",
        dict(rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}),
    ),
}


@pytest.mark.parametrize("variant", VARIANTS)
def test_variant_matches_transformers(variant, checkpoint_dir, tmp_path):
    arch, overrides = VARIANTS[variant]
    path = checkpoint_dir(arch, **overrides)
    model = CompiledModel.load(compile_checkpoint(path, target="cpu", output=tmp_path / "model.cpu"))
    _assert_batched_greedy_matches(model, path, _prompt_ids(path)[:2])


def test_longrope_prompt_prefilled_in_chunks_matches_transformers(checkpoint_dir, tmp_path_factory):
    """Phi-3's LongRoPE with a step budget of 8 tokens: the 62-token prompt, past the original length of 32, is
    prefilled in chunks that all rotate by the long set (its request's length decides, not the chunk's end), and
    the short prompts pass 32 while decoding, where their cache is computed again with the long set."""
    path = checkpoint_dir("phi3")
    model = CompiledModel.load(compiled(checkpoint_dir, tmp_path_factory, "phi3"))
    prompts = _prompt_ids(path)
    assert len(prompts[1]) > 32 > len(prompts[0]) + 8
    _assert_batched_greedy_matches(model, path, prompts, max_num_batched_tokens=8)
