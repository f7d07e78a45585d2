"""runtime/module.py (CompiledModel) and the CLI commands that run models: run, eval ppl, inspect, compile.

Two kinds of artifact:
- a *fake* one, whose model.so is a few lines of C++ built here that speak the C ABI (next token = this
  token + 1): it tests loading, KV sizing, step checks, error paths and the CLI plumbing in isolation;
- a *real* one compiled from a tiny checkpoint, compared with Hugging Face transformers.
"""

from __future__ import annotations

import ctypes
import json
import math
import shutil
import subprocess

import numpy as np
import pytest
from click.testing import CliRunner

import llmc.compiler.compile
import llmc.examples
from llmc.artifact import load_artifact
from llmc.artifact_writer import write_artifact
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import ArtifactError, LlmcError, RequestError
from llmc.manifest import ABI_VERSION
from llmc.runtime.batch import StepBatch
from llmc.runtime.kv_cache import cdiv, kv_bytes_per_block
from llmc.runtime.module import CompiledModel
from llmc.tools import cli
from llmc.tools.cli import run as cli_run

POISON = 2  # ("!") the fake module fails a step that returns logits for this token
REFUSED_SEQS = 13  # the fake module refuses to start with max_num_seqs == 13

FAKE_MODULE = r"""
#include <cstdint>
#include <cstdio>
#include <cstring>
extern "C" {
typedef struct { int32_t abi_version, num_layers, num_kv_heads, head_dim, vocab_size, kv_dtype_bytes,
                 max_num_tokens; } llmc_model_info;
struct Model { int32_t args[6]; };
static int32_t g_args[6];
int fake_create_args(int32_t *out) { memcpy(out, g_args, sizeof g_args); return 0; }
int llmc_info(llmc_model_info *o) {
  o->abi_version = ABI; o->num_layers = LAYERS; o->num_kv_heads = KV_HEADS; o->head_dim = HEAD_DIM;
  o->vocab_size = VOCAB; o->kv_dtype_bytes = 4; o->max_num_tokens = 4096; return 0;
}
void *llmc_create(const char *weights, int32_t nb, int32_t bs, int32_t mt, int32_t ms, int32_t ml, int32_t mbps,
                  char *err, int32_t err_len) {
  FILE *f = fopen(weights, "rb");
  if (!f) { snprintf(err, err_len, "cannot open %s", weights); return nullptr; }
  fclose(f);
  if (ms == REFUSED) { snprintf(err, err_len, "fake module refuses max_num_seqs=%d", ms); return nullptr; }
  Model *m = new Model{{nb, bs, mt, ms, ml, mbps}};
  memcpy(g_args, m->args, sizeof g_args);
  return m;
}
int llmc_step(void *mp, int32_t T, const int32_t *ids, const int32_t *pos, const int64_t *slots, int32_t B,
              const int32_t *qsl, const int32_t *seq_lens, const int32_t *bt, int32_t max_blocks, int32_t N,
              const int32_t *li, float *logits) {
  Model *m = (Model *)mp;
  int32_t bs = m->args[1];
  for (int b = 0; b < B; b++) {
    for (int t = qsl[b]; t < qsl[b + 1]; t++) {
      int64_t want = (int64_t)bt[b * max_blocks + pos[t] / bs] * bs + pos[t] % bs;
      if (slots[t] != want || pos[t] >= seq_lens[b]) return 1;
    }
  }
  for (int n = 0; n < N; n++) {
    int32_t tok = ids[li[n]];
    if (tok == POISON) return 2;
    float *row = logits + (int64_t)n * VOCAB;
    for (int v = 0; v < VOCAB; v++) row[v] = 0.0f;
    row[(tok + 1) % VOCAB] = 10.0f;
  }
  return 0;
}
void llmc_destroy(void *mp) { delete (Model *)mp; }
}
"""


def _fake_populate(ckpt_dir, lib_dir, target="cpu"):
    ckpt = load_checkpoint(ckpt_dir)

    def populate(tmp):
        shutil.copy(lib_dir / "model.so", tmp / "model.so")
        (tmp / ("model.cc" if target == "cpu" else "model.cu")).write_text(FAKE_MODULE)
        # a valid (tiny) safetensors file: weight_bytes reads its header
        from safetensors.numpy import save_file

        save_file({"w": np.zeros(16, np.float32)}, str(tmp / "weights.safetensors"))
        shutil.copy(ckpt_dir / "tokenizer.json", tmp / "tokenizer.json")
        shutil.copy(ckpt_dir / "tokenizer_config.json", tmp / "tokenizer_config.json")
        return {
            "target": target,
            "model_config": ckpt.config,
            "weight_dtype": "float32",
            "kernels": [
                {
                    "id": "k0",
                    "template": "rmsnorm",
                    "params": {"hidden": 64},
                    "fuses": ["add", "rmsnorm"],
                    "tuning_source": "default",
                },
                {"id": "k1", "template": "gemm", "params": {"n": 64, "k": 64}, "tuning_source": "default"},
            ],
            "passes": {"fuse_rmsnorm": 5, "fuse_rope": 0},
            "buffer_plan": {"total_bytes": 8192, "buffers": 3},
            "tokenizer": {"chat_template": ckpt.chat_template, "bos_token": "<|bos|>", "eos_token": "<|eos|>"},
        }

    return populate


@pytest.fixture(scope="module")
def fake_lib(tmp_path_factory, checkpoint_dir):
    c = load_checkpoint(checkpoint_dir("llama")).config
    d = tmp_path_factory.mktemp("fake_lib")
    (d / "fake.cc").write_text(FAKE_MODULE)
    defines = [
        f"-DLAYERS={c.num_layers}",
        f"-DKV_HEADS={c.num_kv_heads}",
        f"-DHEAD_DIM={c.head_dim}",
        f"-DVOCAB={c.vocab_size}",
        f"-DPOISON={POISON}",
        f"-DREFUSED={REFUSED_SEQS}",
    ]
    for name, abi in (("model.so", ABI_VERSION), ("abi1.so", 1)):  # abi1.so: a module compiled before ABI 2
        subprocess.run(
            ["g++", "-O1", "-shared", "-fPIC", *defines, f"-DABI={abi}", "-o", str(d / name), str(d / "fake.cc")],
            check=True,
        )
    return d


@pytest.fixture
def fake_artifact(tmp_path, checkpoint_dir, fake_lib):
    return write_artifact(tmp_path / "fake.cpu", _fake_populate(checkpoint_dir("llama"), fake_lib))


def _invoke(*args, env=None):
    return CliRunner().invoke(cli.main, [str(a) for a in args], env=env)


def _created_args(model) -> list[int]:
    out = (ctypes.c_int32 * 6)()
    model._lib.fake_create_args(out)
    return list(out)


# ----------------------------------------------------------------------------------------------------------
# CompiledModel on the fake module


def test_load_sizes_the_kv_cache(fake_artifact):
    a = load_artifact(fake_artifact)
    c = a.config
    per_block = kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, 16, "float32")
    with CompiledModel.load(fake_artifact, kv_cache_memory=7 * per_block + 5, max_num_seqs=4) as m:
        assert m.num_blocks == 7
        assert m.max_blocks_per_seq == cdiv(c.max_context, 16)
        assert _created_args(m) == [7, 16, 512, 4, 4, m.max_blocks_per_seq]  # max_num_logits: one per sequence
        assert m.kv_cache_bytes == 7 * per_block
        assert m.config == c and m.tokenizer_path == fake_artifact / "tokenizer.json"
        assert m.bos_token == "<|bos|>" and m.eos_token == "<|eos|>" and m.chat_template
        assert m.weight_bytes == 64
        assert m.generation_defaults == {"temperature": 0.0}  # no generation_config.json: greedy, as in HF
    # a big budget is capped at max_num_seqs full-context sequences
    with CompiledModel.load(fake_artifact, kv_cache_memory="1GiB", max_num_seqs=3) as m:
        assert m.num_blocks == 3 * cdiv(c.max_context, 16)


def test_block_size_comes_from_the_artifact(tmp_path, checkpoint_dir, fake_lib):
    populate = _fake_populate(checkpoint_dir("llama"), fake_lib)
    out = write_artifact(tmp_path / "b32", lambda tmp: {**populate(tmp), "block_size": 32})
    with CompiledModel.load(out, kv_cache_memory="8MiB") as m:
        assert m.block_size == 32 and _created_args(m)[1] == 32
    with pytest.raises(LlmcError, match="built for KV blocks of 32 tokens, not 16"):
        CompiledModel.load(out, kv_cache_memory="8MiB", block_size=16)


def test_budget_below_one_block(fake_artifact):
    with pytest.raises(LlmcError, match="holds no block.*--kv-cache-memory"):
        CompiledModel.load(fake_artifact, kv_cache_memory=100)
    with pytest.raises(LlmcError, match="cannot read memory size"):
        CompiledModel.load(fake_artifact, kv_cache_memory="lots")


def test_step_and_its_checks(fake_artifact):
    m = CompiledModel.load(fake_artifact, kv_cache_memory="64MiB", max_num_tokens=8, max_num_seqs=2)
    batch = StepBatch.build([[5, 6, 7], [9]], [0, 4], [[0], [1]], m.block_size)
    logits = m.step(batch)
    assert logits.dtype == np.float32 and logits.shape == (2, m.config.vocab_size)
    assert logits.argmax(-1).tolist() == [8, 10]
    with pytest.raises(RequestError, match="9 tokens"):
        m.step(StepBatch.build([list(range(9))], [0], [[0]], m.block_size))
    with pytest.raises(RequestError, match="3 sequences"):
        m.step(StepBatch.build([[1], [2], [3]], [0, 0, 0], [[0], [1], [2]], m.block_size))
    with pytest.raises(LlmcError, match="step failed: a token id is outside the vocabulary"):
        m.step(StepBatch.build([[POISON]], [0], [[0]], m.block_size))
    with pytest.raises(RequestError, match="3 logits rows; the model was loaded for 1..2"):
        m.step(StepBatch.build([[5, 6, 7]], [0], [[0]], m.block_size, num_logits=[3]))
    m.close()
    m.close()  # idempotent
    with pytest.raises(LlmcError, match="closed"):
        m.step(batch)
    # logits at several rows: each row's next token, in the order asked
    with CompiledModel.load(
        fake_artifact, kv_cache_memory="64MiB", max_num_tokens=8, max_num_seqs=2, max_num_logits=4
    ) as m:
        logits = m.step(StepBatch.build([[5, 6, 7], [9]], [0, 4], [[0], [1]], m.block_size, num_logits=[3, 1]))
        assert logits.shape == (4, m.config.vocab_size) and logits.argmax(-1).tolist() == [6, 7, 8, 10]
        assert m.max_num_logits == 4 and _created_args(m)[4] == 4
    with pytest.raises(LlmcError, match="max_num_logits=2 is below the 3 sequences"):
        CompiledModel.load(fake_artifact, kv_cache_memory="64MiB", max_num_seqs=3, max_num_logits=2)


def test_a_module_of_another_abi_version_is_refused(fake_artifact, fake_lib):
    with pytest.raises(ArtifactError, match=rf"C ABI version 1, this llmc speaks {ABI_VERSION}.*recompile it"):
        CompiledModel.load(fake_artifact, kv_cache_memory="64MiB", library=fake_lib / "abi1.so")


def test_create_failure_is_an_artifact_error(fake_artifact):
    with pytest.raises(ArtifactError, match=f"failed to start: fake module refuses max_num_seqs={REFUSED_SEQS}"):
        CompiledModel.load(fake_artifact, kv_cache_memory="64MiB", max_num_seqs=REFUSED_SEQS)


def test_cuda_artifact_without_a_gpu_says_to_simulate(tmp_path, checkpoint_dir):
    from llmc.compiler.compile import compile_checkpoint

    out = compile_checkpoint(checkpoint_dir("llama"), target="sm90", output=tmp_path / "m.sm90")
    try:
        CompiledModel.load(out, kv_cache_memory="8MiB").close()  # a machine with an sm90 GPU runs it
    except ArtifactError as e:
        assert "failed to start: CUDA error" in str(e) or "GPU architecture mismatch" in str(e)
        assert "--simulate" in str(e)


# ----------------------------------------------------------------------------------------------------------
# CLI on the fake module


def test_run_streams_and_json(fake_artifact):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(fake_artifact / "tokenizer.json"))
    prompt = "The list type"
    ids = tok.encode(prompt).ids
    r = _invoke("run", fake_artifact, "--prompt", prompt, "--max-tokens", 6, "--json", "--kv-cache-memory", "8MiB")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    want = [(ids[-1] + 1 + i) % 384 for i in range(6)]
    assert out["prompt_token_ids"] == ids and out["token_ids"] == want
    assert out["text"] == tok.decode(want) and out["finish_reason"] == "length"
    assert set(out["timings"]) == {"prefill_ms", "decode_tokens_per_s", "total_ms"}
    r = _invoke("run", fake_artifact, "--prompt", prompt, "--max-tokens", 6, "--kv-cache-memory", "8MiB")
    assert r.exit_code == 0, r.output
    assert r.stdout == tok.decode(want) + "\n"
    assert "6 generated" in r.stderr


def test_run_prompt_from_stdin(fake_artifact):
    r = CliRunner().invoke(cli.main, ["run", str(fake_artifact), "--max-tokens", "2", "--json"], input="hello")
    assert r.exit_code == 0, r.output
    assert len(json.loads(r.stdout)["token_ids"]) == 2


def test_run_errors(tmp_path, fake_artifact):
    r = _invoke("run", tmp_path / "missing", "--prompt", "hi")
    assert r.exit_code == 1 and r.stderr.startswith("error: ") and "no such artifact" in r.stderr
    assert "Traceback" not in r.output and len(r.stderr.strip().splitlines()) == 1

    long_prompt = " ".join(["list"] * 400)
    r = _invoke("run", fake_artifact, "--prompt", long_prompt, "--kv-cache-memory", "8MiB")
    assert r.exit_code == 1 and "more than the model's context of 256 tokens" in r.stderr

    r = _invoke("run", fake_artifact, "--prompt", "hi", "--simulate")
    assert r.exit_code == 1 and "needs a CUDA-target artifact" in r.stderr

    with open(fake_artifact / "weights.safetensors", "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    r = _invoke("run", fake_artifact, "--prompt", "hi")
    assert r.exit_code == 1 and "weights.safetensors is corrupt" in r.stderr
    r = _invoke("--debug", "run", fake_artifact, "--prompt", "hi")
    assert isinstance(r.exception, ArtifactError)


def test_run_interactive_chat(fake_artifact, monkeypatch):
    monkeypatch.setattr(cli_run, "_stdin_is_tty", lambda: True)
    r = CliRunner().invoke(
        cli.main,
        ["run", str(fake_artifact), "--max-tokens", "3", "--kv-cache-memory", "8MiB"],
        input="hello\n/reset\nagain\n/exit\n",
    )
    assert r.exit_code == 0, r.output
    assert "/reset starts a new conversation" in r.stdout and "(new conversation)" in r.stdout


def test_serve(fake_artifact, monkeypatch):
    from fastapi.testclient import TestClient

    from llmc.runtime import server

    seen = {}

    def fake_serve(app, host, port, **kw):
        seen["where"] = (host, port)
        with TestClient(app, base_url=f"http://{host}:{port}") as client:
            seen["models"] = client.get("/v1/models").json()
            seen["completion"] = client.post(
                "/v1/completions", json={"model": "fake.cpu", "prompt": [5, 6], "max_tokens": 3, "temperature": 0}
            ).json()
            seen["too_long"] = client.post("/v1/completions", json={"prompt": [5] * 300, "max_tokens": 1})

    monkeypatch.setattr(server, "serve", fake_serve)
    r = _invoke("serve", fake_artifact, "--port", 8123, "--kv-cache-memory", "8MiB")
    assert r.exit_code == 0, r.output
    assert seen["where"] == ("127.0.0.1", 8123)
    assert [m["id"] for m in seen["models"]["data"]] == ["fake.cpu"]
    choice = seen["completion"]["choices"][0]
    assert choice["finish_reason"] == "length" and seen["completion"]["usage"]["completion_tokens"] == 3
    assert seen["too_long"].status_code == 400


def _serve_app(fake_artifact, monkeypatch, *args):
    """The app `llmc serve ARTIFACT *args` would serve (its exit code, output and the app)."""
    from llmc.runtime import server

    apps = []
    monkeypatch.setattr(server, "serve", lambda app, host, port, **kw: apps.append(app))
    r = _invoke("serve", fake_artifact, "--kv-cache-memory", "8MiB", *args)
    return r, apps[0] if apps else None


def test_serve_answers_only_its_own_host_names_by_default(fake_artifact, monkeypatch):
    """A DNS-rebinding page's requests carry its own Host: the default server refuses them, even /health."""
    from fastapi.testclient import TestClient

    r, app = _serve_app(fake_artifact, monkeypatch)
    assert r.exit_code == 0, r.output
    with TestClient(app, base_url="http://127.0.0.1:8000") as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"host": "localhost:8000"}).status_code == 200
        r = client.get("/health", headers={"host": "evil.example.com"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        r = client.post("/v1/completions", json={"prompt": [5], "max_tokens": 1}, headers={"host": "evil.example.com"})
        assert r.status_code == 400
        r = client.post("/v1/completions", content=b'{"prompt": [5]}', headers={"content-type": "text/plain"})
        assert r.status_code == 415

    r, app = _serve_app(
        fake_artifact,
        monkeypatch,
        "--allowed-hosts",
        "llm.internal,*.corp.example",
        "--allowed-origins",
        "https://app.example.com",
    )
    assert r.exit_code == 0, r.output
    with TestClient(app, base_url="http://llm.internal:8000") as client:
        assert client.get("/health").status_code == 200
        assert client.get("/health", headers={"host": "x.corp.example"}).status_code == 200
        assert client.get("/health", headers={"host": "evil.example.com"}).status_code == 400
        preflight = {"origin": "https://app.example.com", "access-control-request-method": "POST"}
        assert client.options("/v1/completions", headers=preflight).status_code == 200


@pytest.mark.parametrize(
    "args, named",
    [
        (("--replicas", "2"), "--replicas"),
        (("--address", "auto"), "--address"),
        (("--threads-per-replica", "2"), "--threads-per-replica"),
        (("--autoscale", "1:2"), "--autoscale"),
        (("--allowed-methods", "GET"), "--allowed-origins"),
    ],
)
def test_serve_refuses_options_that_would_be_ignored_in_one_line(fake_artifact, monkeypatch, args, named):
    r, app = _serve_app(fake_artifact, monkeypatch, *args)
    assert r.exit_code == 1 and app is None
    assert r.stderr.startswith("error: ") and named in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_bench(fake_artifact):
    args = (
        "bench",
        fake_artifact,
        "--concurrency",
        "1,2",
        "--prompt-len",
        8,
        "--output-len",
        4,
        "--memory-bandwidth",
        1e10,
        "--kv-cache-memory",
        "8MiB",
    )
    r = _invoke(*args, "--json")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert [lv["concurrency"] for lv in out["levels"]] == [1, 2]
    assert out["roofline"]["weight_bytes_per_decode_step"] == 64
    assert out["prefix_cache_hit_rate"] == 0.0  # random prompts share no full block
    r = _invoke(*args)
    assert r.exit_code == 0 and "TTFT p50 ms" in r.stdout and "prefix cache hit rate" in r.stdout
    for flags, hits in [((), True), (("--no-prefix-caching",), False)]:
        r = _invoke(*args, "--prompt-len", 40, "--shared-prefix", 32, "--json", *flags)
        assert r.exit_code == 0, r.output
        assert (json.loads(r.stdout)["prefix_cache_hit_rate"] > 0) == hits
    r = _invoke("bench", fake_artifact, "--concurrency", "0,x")
    assert r.exit_code == 2 and "comma-separated" in r.stderr


def test_run_without_a_bundled_model(tmp_path, monkeypatch):
    monkeypatch.setattr(llmc.examples, "EXAMPLES_DIR", tmp_path)
    r = _invoke("run")
    assert r.exit_code == 1 and "no bundled model found" in r.stderr


def test_run_compiles_a_checkpoint_once_into_the_cache(tmp_path, checkpoint_dir, fake_lib, monkeypatch):
    ckpt = checkpoint_dir("llama")
    calls = []

    def fake_compile(model, *, target, output, progress, **options):  # options: dtype, quant, ... as compile's
        calls.append((model, target, output))
        return write_artifact(output, _fake_populate(ckpt, fake_lib))

    monkeypatch.setattr(llmc.compiler.compile, "compile_checkpoint", fake_compile)
    env = {"LLMC_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        r = _invoke("run", ckpt, "--prompt", "hi", "--max-tokens", 2, "--json", "--kv-cache-memory", "8MiB", env=env)
        assert r.exit_code == 0, r.output
    assert len(calls) == 1 and calls[0][1] == "cpu"
    assert calls[0][2].parent == tmp_path / "cache" / "artifacts"
    # the bundled model goes the same way
    examples = tmp_path / "examples"
    examples.mkdir()
    (examples / "tiny-model").symlink_to(ckpt, target_is_directory=True)
    monkeypatch.setattr(llmc.examples, "EXAMPLES_DIR", examples)
    r = _invoke("run", "--max-tokens", 2, "--kv-cache-memory", "8MiB", env=env)
    assert r.exit_code == 0, r.output
    assert "The list type" in r.stderr and len(calls) == 1


def test_eval_ppl(tmp_path, fake_artifact):
    from tokenizers import Tokenizer

    text = tmp_path / "t.txt"
    text.write_text("Lists are mutable sequences, typically used to store collections. " * 40)
    ids = Tokenizer.from_file(str(fake_artifact / "tokenizer.json")).encode(text.read_text()).ids
    assert len(ids) > 256, "the text must span more than one context window"
    r = _invoke("eval", "ppl", fake_artifact, "--text", text, "--json", "--kv-cache-memory", "8MiB")
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    nll, n = 0.0, 0
    lse = math.log(math.exp(10) + 383)
    for w in range(0, len(ids), 256):  # windows of the context (max_position_embeddings = 256)
        chunk = ids[w : w + 256]
        for a, b in zip(chunk, chunk[1:], strict=False):
            nll += lse - (10.0 if b == (a + 1) % 384 else 0.0)
            n += 1
    assert out["num_tokens"] == n
    assert out["perplexity"] == pytest.approx(math.exp(nll / n), rel=1e-9)
    r = _invoke("eval", "ppl", fake_artifact, "--text", text, "--max-tokens", 10)
    assert r.exit_code == 0 and "over 9 tokens" in r.stdout


def test_inspect_artifact(fake_artifact):
    r = _invoke("inspect", fake_artifact)
    assert r.exit_code == 0, r.output
    assert "llmc artifact for cpu" in r.stdout
    assert "fuse_rmsnorm" in r.stdout and "5 rewrites" in r.stdout
    assert "fuse_rope" in r.stdout and "no pattern found" in r.stdout
    assert "rmsnorm" in r.stdout and "fuses add + rmsnorm" in r.stdout
    assert "total 8.0 KiB" in r.stdout and "LlamaForCausalLM" in r.stdout
    r = _invoke("inspect", "-v", fake_artifact)
    assert "k1: gemm" in r.stdout


# ----------------------------------------------------------------------------------------------------------
# A real compiled tiny model (turns on with llmc.compiler.compile)


@pytest.fixture(scope="module")
def real_artifact(tmp_path_factory, checkpoint_dir):
    out = tmp_path_factory.mktemp("real") / "tiny.cpu"
    r = _invoke("compile", checkpoint_dir("llama"), "--target", "cpu", "-o", out)
    assert r.exit_code == 0, r.output
    return out


def test_real_run_matches_transformers_greedy(real_artifact, checkpoint_dir):
    import torch

    from tests.checkpoints import hf_model

    r = _invoke(
        "run", real_artifact, "--prompt", "The list type", "--max-tokens", 12, "--json", "--kv-cache-memory", "16MiB"
    )
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    hf = hf_model(checkpoint_dir("llama"))
    with torch.no_grad():
        ref = hf.generate(
            torch.tensor([out["prompt_token_ids"]]), max_new_tokens=12, do_sample=False, eos_token_id=1, pad_token_id=1
        )
    assert out["token_ids"] == ref[0, len(out["prompt_token_ids"]) :].tolist()


def test_real_step_logits_match_transformers(real_artifact, checkpoint_dir):
    import torch

    from tests.checkpoints import hf_model

    hf = hf_model(checkpoint_dir("llama"))
    ids = [3, 17, 200, 45, 9, 120, 33]
    with CompiledModel.load(real_artifact, kv_cache_memory="16MiB") as m:
        logits = m.step(StepBatch.build([ids], [0], [[0]], m.block_size))[0]
        nxt = m.step(StepBatch.build([[88]], [len(ids)], [[0]], m.block_size))[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids + [88]])).logits[0].numpy()
    np.testing.assert_allclose(logits, ref[len(ids) - 1], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(nxt, ref[len(ids)], rtol=1e-4, atol=1e-4)


def test_real_eval_ppl_matches_transformers(tmp_path, real_artifact, checkpoint_dir):
    import torch
    from tokenizers import Tokenizer

    from tests.checkpoints import hf_model

    text = tmp_path / "t.txt"
    text.write_text("Lists may be constructed in several ways: using a pair of square brackets.")
    r = _invoke("eval", "ppl", real_artifact, "--text", text, "--json", "--kv-cache-memory", "16MiB")
    assert r.exit_code == 0, r.output
    ids = Tokenizer.from_file(str(real_artifact / "tokenizer.json")).encode(text.read_text()).ids
    hf = hf_model(checkpoint_dir("llama"))
    with torch.no_grad():
        loss = hf(torch.tensor([ids]), labels=torch.tensor([ids])).loss.item()
    out = json.loads(r.stdout)
    assert out["num_tokens"] == len(ids) - 1
    assert out["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)


def test_real_inspect_and_errors(tmp_path, real_artifact):
    r = _invoke("inspect", real_artifact)
    assert r.exit_code == 0 and "llmc artifact for cpu" in r.stdout and "passes" in r.stdout
    r = _invoke("run", real_artifact, "--prompt", " ".join(["list"] * 400), "--kv-cache-memory", "16MiB")
    assert r.exit_code == 1 and "more than the model's context" in r.stderr
    broken = tmp_path / "broken"
    shutil.copytree(real_artifact, broken)
    (broken / "model.so").write_bytes(b"garbage")
    r = _invoke("run", broken, "--prompt", "hi")
    assert r.exit_code == 1 and "model.so is corrupt" in r.stderr


def test_real_run_of_a_checkpoint_uses_the_cache(tmp_path, checkpoint_dir):
    env = {"LLMC_CACHE_DIR": str(tmp_path / "cache")}
    args = (
        "run",
        checkpoint_dir("llama"),
        "--prompt",
        "The list type",
        "--max-tokens",
        4,
        "--json",
        "--kv-cache-memory",
        "16MiB",
    )
    first = _invoke(*args, env=env)
    assert first.exit_code == 0, first.output
    assert len(list((tmp_path / "cache" / "artifacts").glob("*/manifest.json"))) == 1
    second = _invoke(*args, env=env)
    assert json.loads(second.stdout)["token_ids"] == json.loads(first.stdout)["token_ids"]
    assert "compiling" not in second.stderr


# ----------------------------------------------------------------------------------------------------------
# --quant: the flags, where they apply, and what inspect shows (the quantized builds: tests/compiler/)


def test_quant_flag_errors(tmp_path, checkpoint_dir, fake_artifact):
    ckpt, out = checkpoint_dir("llama"), tmp_path / "out"
    r = _invoke("compile", ckpt, "-o", out, "--quant", "int3")
    assert r.exit_code == 2 and "'int3' is not one of 'none', 'int8', 'int4'" in r.stderr
    r = _invoke("compile", ckpt, "-o", out, "--quant", "int4", "--group-size", "48")
    assert r.exit_code == 2 and "'48' is not one of '32', '64', '128', 'channel'" in r.stderr
    r = _invoke("compile", ckpt, "-o", out, "--quant", "int4", "--group-size", "channel")
    assert r.exit_code == 1 and "--group-size channel is int8's" in r.stderr and "Traceback" not in r.output
    r = _invoke("compile", ckpt, "-o", out, "--quant-lm-head")
    assert r.exit_code == 1 and "apply to a quantized build" in r.stderr and "add --quant int8 or int4" in r.stderr
    r = _invoke("run", fake_artifact, "--quant", "int4", "--prompt", "hi")
    assert r.exit_code == 1 and "--quant applies when a checkpoint is compiled" in r.stderr
    r = _invoke("compile", ckpt, "-o", out, "--quant", "int4", "--tensor-quant", "down_proj")
    assert r.exit_code == 2 and "'down_proj' is not PATTERN=TYPE" in r.stderr
    r = _invoke("compile", ckpt, "-o", out, "--quant", "int4", "--tensor-quant", "down_proj=int2")
    assert r.exit_code == 1 and "no tensor type 'int2'" in r.stderr and "Traceback" not in r.output
    assert not out.exists()


def test_run_compiles_a_checkpoint_with_quant_under_its_own_cache_key(tmp_path, checkpoint_dir, fake_lib, monkeypatch):
    from llmc.compiler.quant import QuantConfig

    ckpt = checkpoint_dir("llama")
    calls = []

    def fake_compile(model, *, target, output, progress, quant=None, **options):
        calls.append((output, quant))
        return write_artifact(output, _fake_populate(ckpt, fake_lib))

    monkeypatch.setattr(llmc.compiler.compile, "compile_checkpoint", fake_compile)
    env = {"LLMC_CACHE_DIR": str(tmp_path / "cache")}
    override = ["--quant", "int4", "--tensor-quant", "mlp[.]down=q8_0"]
    for flags in (
        [],
        ["--quant", "int4"],
        ["--quant", "int8", "--group-size", "64", "--quant-lm-head"],
        ["--quant", "int8", "--group-size", "channel"],
        override,
        [*override[:-1], "mlp.down=q8_0"],  # the same key but for the characters a key drops
    ):
        r = _invoke("run", ckpt, *flags, "--prompt", "hi", "--max-tokens", 2, "--kv-cache-memory", "8MiB", env=env)
        assert r.exit_code == 0, r.output
    assert [q for _, q in calls][:5] == [
        QuantConfig(),
        QuantConfig("int4"),
        QuantConfig("int8", 64, lm_head=True),
        QuantConfig("int8", "channel"),
        QuantConfig("int4", overrides=(("mlp[.]down", "q8_0"),)),
    ]
    keys = [out.name for out, _ in calls]
    assert keys[1].endswith("-int4-g32") and keys[2].endswith("-int8-g64-lm-head")
    assert keys[3].endswith("-int8-per-channel") and len(set(keys)) == 6


def test_inspect_shows_the_quant_entry(tmp_path, checkpoint_dir, fake_lib):
    populate = _fake_populate(checkpoint_dir("llama"), fake_lib)
    entry = {
        "mode": "int4",
        "default": "int4 g32",
        "lm_head": False,
        "activations": "int8 per 32",
        "weights": {
            "model.layers.0.self_attn.q+k+v_proj.weight": "int4 g32",
            "model.layers.0.self_attn.o_proj.weight": "int4 g32",
        },
        "packed_bytes": {"quantized": 3 << 20, "float": 1 << 20},
    }
    art = write_artifact(tmp_path / "q.cpu", lambda tmp: {**populate(tmp), "quantization": "int4", "quant": entry})
    r = _invoke("inspect", art)
    assert r.exit_code == 0, r.output
    assert "quantization int4" in r.stdout and "activations int8 per 32" in r.stdout
    assert "quantized 3.0 MiB, float 1.0 MiB" in r.stdout and "2 GEMM weights int4 g32" in r.stdout
    r = _invoke("inspect", "-v", art)
    assert "model.layers.0.self_attn.o_proj.weight: int4 g32" in r.stdout
