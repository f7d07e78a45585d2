"""`llmc compile --kv-cache-dtype bfloat16 | int8 | fp8`: a KV cache of bf16 values at half the bytes of float32,
or of int8 or (CUDA sm89 and later) fp8 e4m3 values with a float32 scale per (token, kv head).

The module stores each k/v value (k after RoPE) rounded to bf16, nearest even, or quantized head by head as it
writes them (s = max |x| / 127 or 448, q = x / s rounded to the type, ties to even), and attends over the values
they hold. The
reference is transformers whose attention reads k and v rounded or quantized the same way: greedy tokens equal
(bf16: on the CPU target and on the simulated sm90 one), and logits of every prompt row within the fp32 parity
tolerance. The manifest and `llmc inspect` name the dtype, llmc_info reports the bytes per value, and the runtime
sizes blocks by them (an int8 block with its scales, padded to 16 bytes).
"""

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from tokenizers import Tokenizer
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from llmc.compiler.compile import compile_checkpoint
from llmc.errors import ArtifactError, CompileError
from llmc.manifest import seal_manifest
from llmc.runtime.batch import StepBatch
from llmc.runtime.engine import LLMEngine
from llmc.runtime.kv_cache import kv_bytes_per_block
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams
from llmc.tools.cli import main
from tests.checkpoints import hf_model
from tests.cuda_mode import cuda_library
from tests.logits_rows import REL

PROMPTS = [
    "The list type",
    "Return a new dictionary initialized from an optional positional argument and a possibly empty set of keyword",
    "def",
]
NEW_TOKENS = 32


def _int8(x):
    """x [batch, kv heads, tokens, head_dim] as an int8 cache holds it: per (token, head) s = max |x| / 127."""
    s = x.abs().amax(dim=-1, keepdim=True) / 127
    return torch.where(s > 0, torch.round(x / s), 0.0) * s


def _fp8(x):
    """x as an fp8 cache holds it: per (token, head) s = max |x| / 448, x / s as float8_e4m3fn."""
    s = x.abs().amax(dim=-1, keepdim=True) / 448
    return torch.where(s > 0, (x / s).to(torch.float8_e4m3fn).float(), 0.0) * s


# the KV cache dtype -> what it does to a k or v row
STORED = {"bfloat16": lambda x: x.bfloat16().float(), "int8": _int8, "float8_e4m3fn": _fp8}


def _stored_kv_attention(kv_dtype):
    def attention(module, query, key, value, attention_mask, **kwargs):
        store = STORED[kv_dtype]
        return sdpa_attention_forward(module, query, store(key), store(value), attention_mask, **kwargs)

    return attention


for _kv in STORED:
    AttentionInterface.register(f"llmc_test_{_kv}_kv", _stored_kv_attention(_kv))


def stored_kv_reference(path, kv_dtype):
    model = hf_model(path)
    model.set_attn_implementation(f"llmc_test_{kv_dtype}_kv")
    return model


_built = {}


def artifact(checkpoint_dir, tmp_path_factory, target: str, kv_dtype: str = "bfloat16"):
    if (target, kv_dtype) not in _built:
        out = tmp_path_factory.mktemp(f"kv_{kv_dtype}_{target}") / "model"
        _built[target, kv_dtype] = compile_checkpoint(
            checkpoint_dir("llama"), target=target, output=out, kv_dtype=kv_dtype
        )
    return _built[target, kv_dtype]


def _load(path, target: str, **kw) -> CompiledModel:
    library = cuda_library(path) if target == "sm90" else None
    return CompiledModel.load(path, library=library, **kw)


@pytest.mark.parametrize(
    "target,kv_dtype",
    [
        ("cpu", "bfloat16"),
        ("cpu", "int8"),
        pytest.param("sm90", "bfloat16", marks=pytest.mark.slow),
        pytest.param("sm90", "int8", marks=pytest.mark.slow),
        pytest.param("sm90", "float8_e4m3fn", marks=pytest.mark.slow),
    ],
)
def test_greedy_tokens_match_transformers_reading_the_stored_kv(target, kv_dtype, checkpoint_dir, tmp_path_factory):
    """The three prompts run as one batch; each continuation equals transformers' with k/v as the cache holds them."""
    path = checkpoint_dir("llama")
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    prompts = [tok.encode(p).ids for p in PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS)
    with _load(artifact(checkpoint_dir, tmp_path_factory, target, kv_dtype), target, max_num_seqs=4) as model:
        results = LLMEngine(model).generate(prompts, params)
    reference = stored_kv_reference(path, kv_dtype)
    for ids, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            expected = reference.generate(
                torch.tensor([ids]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )[0, len(ids) :].tolist()
        assert result.outputs[0].token_ids == expected


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_prompt_logits_match_transformers_reading_the_stored_kv(kv_dtype, checkpoint_dir, tmp_path_factory):
    """Every row of a prefill, then the same prompt again as a decode step over the first's cache."""
    path = checkpoint_dir("llama")
    ids = Tokenizer.from_file(str(path / "tokenizer.json")).encode(PROMPTS[1]).ids
    with torch.no_grad():
        want = stored_kv_reference(path, kv_dtype)(torch.tensor([ids])).logits[0].numpy()
    with CompiledModel.load(
        artifact(checkpoint_dir, tmp_path_factory, "cpu", kv_dtype), max_num_seqs=1, max_num_logits=len(ids)
    ) as model:
        table = list(range(model.num_blocks))[::-1][: -(-len(ids) // model.block_size)]  # non-trivial blocks
        got = model.step(StepBatch.build([ids], [0], [table], model.block_size, num_logits=[len(ids)]))
        last = model.step(StepBatch.build([ids[-1:]], [len(ids) - 1], [table], model.block_size))
    for i, (row, ref) in enumerate(zip([*got, *last], [*want, want[-1]], strict=True)):
        rel = abs(row - ref).max() / abs(ref).max()
        assert rel <= REL, f"row {i}: relative logit error {rel:.2e}"


@pytest.mark.parametrize("kv_dtype,short,nbytes", [("bfloat16", "bf16", 2), ("int8", "i8", 1)])
def test_manifest_inspect_and_cache_memory(kv_dtype, short, nbytes, checkpoint_dir, tmp_path_factory):
    out = artifact(checkpoint_dir, tmp_path_factory, "cpu", kv_dtype)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == kv_dtype
    attention = [k for k in manifest["kernels"] if k["template"] == "cpu/paged_attention"]
    assert attention and all(k["params"]["kv_dtype"] == short for k in attention)
    shown = CliRunner().invoke(main, ["inspect", str(out)])
    assert shown.exit_code == 0, shown.output
    assert f"KV cache       {kv_dtype}, blocks of 16 tokens" in shown.output
    assert manifest["activation_dtype"] == "float32" and "activations    float32" in shown.output  # the CPU's

    budget = 1 << 20
    with CompiledModel.load(out, kv_cache_memory=budget) as model:
        c = model.config
        assert model.info["kv_dtype_bytes"] == nbytes
        per_block = kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, model.block_size, kv_dtype)
        # a float32 cache's block over the value's size, and an int8 one's float32 scale per (token, kv head),
        # each layer's k or v block padded to 16 bytes
        slots = model.block_size * c.num_kv_heads * (c.head_dim * nbytes + (4 if nbytes == 1 else 0))
        assert per_block == 2 * c.num_layers * (-(-slots // 16) * 16 if nbytes == 1 else slots)
        assert model.num_blocks == budget // per_block
        assert model.kv_cache_bytes == model.num_blocks * per_block


def test_manifest_that_disagrees_with_the_module_is_refused(checkpoint_dir, tmp_path_factory, tmp_path):
    """kv_cache_dtype is checked against llmc_info's kv_dtype_bytes at load, and must be a known dtype."""
    for value, error in (("float32", "does not match the manifest"), ("float16", "kv_cache_dtype 'float16'")):
        copy = tmp_path / value
        shutil.copytree(artifact(checkpoint_dir, tmp_path_factory, "cpu"), copy)
        manifest = json.loads((copy / "manifest.json").read_text())
        manifest["kv_cache_dtype"] = value
        (copy / "manifest.json").write_text(json.dumps(seal_manifest(manifest)))
        with pytest.raises(ArtifactError, match=error):
            CompiledModel.load(copy)


def test_unknown_kv_cache_dtype_is_refused_before_compiling(checkpoint_dir, tmp_path):
    with pytest.raises(CompileError, match="--kv-cache-dtype takes auto, fp8 or one of float32, bfloat16, int8"):
        compile_checkpoint(checkpoint_dir("llama"), target="cpu", output=tmp_path / "m", kv_dtype="float16")
    result = CliRunner().invoke(
        main, ["compile", str(checkpoint_dir("llama")), "-o", str(tmp_path / "m"), "--kv-cache-dtype", "float16"]
    )
    assert result.exit_code == 2 and "'float16' is not one of 'auto', 'float32', 'bfloat16', 'int8'" in result.output
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("target", ["cpu", "sm80"])
def test_fp8_cache_is_refused_before_sm89(target, checkpoint_dir, tmp_path):
    with pytest.raises(CompileError, match=f"an fp8 KV cache needs a CUDA target of sm89 or later, not {target}"):
        compile_checkpoint(checkpoint_dir("llama"), target=target, output=tmp_path / "m", kv_dtype="fp8")
    assert not (tmp_path / "m").exists()


def test_fp8_cache_on_sm89(checkpoint_dir, tmp_path):
    """vLLM's spelling, fp8, is float8_e4m3fn in the manifest; the attention kernels take an fp8 cache, whose
    blocks are an int8 one's bytes (a value a byte, a float32 scale per (token, kv head), padded to 16 bytes)."""
    out = compile_checkpoint(checkpoint_dir("llama"), target="sm89", output=tmp_path / "m", kv_dtype="fp8")
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == "float8_e4m3fn"
    attention = [k for k in manifest["kernels"] if k["template"] == "cuda/paged_attention"]
    assert attention and all(k["params"]["kv_dtype"] == "fp8" for k in attention)
    c = json.loads((checkpoint_dir("llama") / "config.json").read_text())
    layers, kvh, hd = c["num_hidden_layers"], c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"]
    assert kv_bytes_per_block(layers, kvh, hd, 16, "float8_e4m3fn") == kv_bytes_per_block(layers, kvh, hd, 16, "int8")


def test_run_compiles_a_checkpoint_with_the_kv_cache_dtype(checkpoint_dir, tmp_path_factory, monkeypatch):
    """run (as serve and bench) hands --kv-cache-dtype to the compile of a checkpoint; an artifact keeps its own."""
    from llmc.tools import build as cache

    built = artifact(checkpoint_dir, tmp_path_factory, "cpu")
    asked = []

    def fake_cached_artifact(ckpt, **options):
        asked.append(options["kv_dtype"])
        return built

    monkeypatch.setattr(cache, "cached_artifact", fake_cached_artifact)
    ckpt = str(checkpoint_dir("llama"))
    result = CliRunner().invoke(
        main, ["run", ckpt, "--kv-cache-dtype", "bfloat16", "--prompt", "def", "--max-tokens", "2"]
    )
    assert result.exit_code == 0, result.output
    assert asked == ["bfloat16"]
    result = CliRunner().invoke(main, ["run", str(built), "--kv-cache-dtype", "bfloat16", "--prompt", "def"])
    assert result.exit_code == 1 and "--kv-cache-dtype applies when a checkpoint is compiled" in result.output


@pytest.mark.parametrize(
    "target,weight_dtype,want",
    [
        ("sm90", "bfloat16", "bfloat16"),  # a bf16 CUDA build caches bf16 (the tensor-core prefill attention reads it)
        ("sm90", "float32", "float32"),
        ("cpu", "bfloat16", "float32"),
    ],
)
def test_auto_is_the_cuda_builds_precision(target, weight_dtype, want, checkpoint_dir, tmp_path):
    out = compile_checkpoint(checkpoint_dir("llama"), target=target, output=tmp_path / "m", weight_dtype=weight_dtype)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["kv_cache_dtype"] == want
    attention = [k for k in manifest["kernels"] if k["template"].endswith("/paged_attention")]
    assert attention and all(k["params"]["kv_dtype"] == {"bfloat16": "bf16", "float32": "f32"}[want] for k in attention)
