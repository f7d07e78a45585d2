"""`llmc compile --kv-cache-dtype int8` (CPU target): a KV cache of int8 values with a float32 scale per (token, kv
head), a quarter of float32's value bytes.

The module quantizes each token's k (after RoPE) and v head by head as it writes them: s = max |x| / 127, q =
round(x / s), ties to even; attention reads q * s. The reference is transformers whose attention reads k and v
quantized the same way: greedy tokens equal, and the logits of every prompt row within the fp32 parity
tolerance. The manifest and `llmc inspect` name the dtype, llmc_info reports 1 byte per value, the runtime sizes
blocks with their scales, and a CUDA target refuses it in one line (no int8 attention kernels there yet).
"""

import json

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from llmc.compiler.compile import compile_checkpoint
from llmc.errors import CompileError
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.kv_cache import kv_bytes_per_block
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from llmc.tools.cli import main
from tests.checkpoints import hf_model
from tests.logits_rows import REL

PROMPTS = [
    "The list type",
    "Return a new dictionary initialized from an optional positional argument and a possibly empty set of keyword",
    "def",
]
NEW_TOKENS = 32
INT8_KV_ATTENTION = "llmc_test_int8_kv"


def _quantized(x):
    """x [batch, kv heads, tokens, head_dim] as an int8 cache holds it: per (token, head) s = max |x| / 127."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.where(s > 0, torch.round(x / s), 0.0) * s


def _int8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    return sdpa_attention_forward(module, query, _quantized(key), _quantized(value), attention_mask, **kwargs)


AttentionInterface.register(INT8_KV_ATTENTION, _int8_kv_attention)


def int8_kv_reference(path):
    model = hf_model(path)
    model.set_attn_implementation(INT8_KV_ATTENTION)
    return model


@pytest.fixture(scope="module")
def artifact(checkpoint_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("kv_int8") / "model"
    return compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=out, kv_dtype="int8")


def test_greedy_tokens_match_transformers_reading_int8_kv(artifact, checkpoint_dir):
    """The three prompts run as one batch; each continuation equals transformers' with int8-quantized k/v."""
    path = checkpoint_dir("llama")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with CompiledModel.load(artifact, max_num_seqs=4) as model:
        results = LLMEngine(model).generate(prompts, params)
    reference = int8_kv_reference(path)
    for ids, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(ids) :].tolist()
        assert result.outputs[0].token_ids == expected


def test_prompt_logits_match_transformers_reading_int8_kv(artifact, checkpoint_dir):
    """Every row of a prefill, then the same prompt's last token again as a decode step over the first's cache."""
    path = checkpoint_dir("llama")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPTS[1]).ids
    with torch.no_grad():
        want = int8_kv_reference(path)(torch.tensor([ids])).logits[0].numpy()
    with CompiledModel.load(artifact, max_num_seqs=1, max_num_logits=len(ids)) as model:
        table = list(range(model.num_blocks))[::-1][: -(-len(ids) // model.block_size)]  # non-trivial blocks
        got = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
        last = model.step(StepBatch.build([ids[-1:]], [len(ids) - 1], [table], model.block_size))
    for i, (row, ref) in enumerate(zip([*got, *last], [*want, want[-1]], strict=True)):
        rel = abs(row - ref).max() / abs(ref).max()
        assert rel <= REL, f"row {i}: relative logit error {rel:.2e}"


def test_manifest_inspect_and_cache_memory(artifact):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == "int8"
    attention = [k for k in manifest["kernels"] if k["template"] == "cpu/paged_attention"]
    assert attention and all(k["params"]["kv_dtype"] == "i8" for k in attention)
    shown = CliRunner().invoke(main, ["inspect", str(artifact)])
    assert shown.exit_code == 0, shown.output
    assert "KV cache       int8, blocks of 16 tokens" in shown.output

    budget = 1 << 20
    with CompiledModel.load(artifact, kv_cache_memory=budget) as model:
        c = model.config
        assert model.info["kv_dtype_bytes"] == 1
        per_block = kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, model.block_size, "int8")
        assert per_block == 2 * c.num_layers * model.block_size * c.num_kv_heads * (c.head_dim + 4)
        assert model.num_blocks == budget // per_block
        assert model.kv_cache_bytes == model.num_blocks * per_block


def test_cuda_target_refuses_an_int8_cache(checkpoint_dir, tmp_path):
    with pytest.raises(CompileError, match="int8 has attention kernels for the cpu target only"):
        compile_checkpoint(checkpoint_dir("llama"), target="sm90", output=tmp_path / "m", kv_dtype="int8")
