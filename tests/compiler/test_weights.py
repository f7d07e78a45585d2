"""compiler/weights.py: the streamed packed-weights file is a valid, aligned safetensors file."""

import hashlib
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open

from llmc import digests
from llmc.compiler.frontend.checkpoint import load_checkpoint
from llmc.compiler.weights import ALIGN, PAD_PREFIX, WeightSpec, write_packed_weights
from llmc.errors import CompileError


@pytest.fixture(scope="module")
def ckpt(checkpoint_dir):
    return load_checkpoint(checkpoint_dir("qwen2"))  # qkv bias: 1-D sources too


def _specs(ckpt, dtype):
    c = ckpt.config
    p = "model.layers.0."
    qkv = tuple(p + f"self_attn.{n}_proj.weight" for n in "qkv")
    bias = tuple(p + f"self_attn.{n}_proj.bias" for n in "qkv")
    rows = c.q_size + 2 * c.kv_size
    return [
        WeightSpec("embed", ("model.embed_tokens.weight",), dtype, (c.vocab_size, c.hidden_size)),
        WeightSpec("l0.qkv", qkv, dtype, (rows, c.hidden_size)),
        WeightSpec("l0.qkv_bias", bias, "float32", (rows,)),
        WeightSpec("l0.norm", (p + "input_layernorm.weight",), dtype, (c.hidden_size,)),
        WeightSpec(
            "l0.gate_up",
            (p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
            dtype,
            (2 * c.intermediate_size, c.hidden_size),
        ),
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_file_is_valid_safetensors(ckpt, tmp_path, dtype, monkeypatch):
    monkeypatch.setattr(digests, "_MIN_BYTES", 0)  # remember even this small file's write-time digest
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    specs = _specs(ckpt, dtype)
    out = tmp_path / "weights.safetensors"
    seen = []
    offsets = write_packed_weights(ckpt, specs, out, progress=seen.append)
    assert set(offsets) == {s.name for s in specs}
    assert sum(seen) == sum(s.nbytes for s in specs)
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % ALIGN == 0, "data region must start on a 64-byte boundary"
    assert raw[8 : 8 + n].decode().rstrip(" ").endswith("}")
    header = json.loads(raw[8 : 8 + n])
    with safe_open(out, framework="pt") as f:
        assert {k for k in f.keys() if not k.startswith(PAD_PREFIX)} == {s.name for s in specs}
        for s in specs:
            got = f.get_tensor(s.name)
            want = torch.cat([ckpt.tensor(src) for src in s.sources]).to(getattr(torch, s.dtype))
            assert got.dtype == want.dtype and tuple(got.shape) == s.shape
            assert torch.equal(got, want)
            off, nbytes = offsets[s.name]
            assert off % ALIGN == 0, f"{s.name} at {off} is not 64-byte aligned"
            assert nbytes == s.nbytes == header[s.name]["data_offsets"][1] - header[s.name]["data_offsets"][0]
            assert off == 8 + n + header[s.name]["data_offsets"][0]
            # the offset points at the tensor's bytes
            np_dtype = np.float32 if s.dtype == "float32" else np.uint16
            at = np.frombuffer(raw, dtype=np_dtype, count=nbytes // np.dtype(np_dtype).itemsize, offset=off)
            ref = want.view(torch.int16).numpy().view(np.uint16) if s.dtype == "bfloat16" else want.numpy()
            np.testing.assert_array_equal(at, ref.reshape(-1))
    assert digests.known_sha256(out) == hashlib.sha256(raw).hexdigest()  # hashed while writing, and right


def test_bf16_conversion_rounds_like_torch(ckpt, tmp_path):
    spec = WeightSpec(
        "w",
        ("model.layers.1.mlp.down_proj.weight",),
        "bfloat16",
        (ckpt.config.hidden_size, ckpt.config.intermediate_size),
    )
    out = tmp_path / "w.safetensors"
    write_packed_weights(ckpt, [spec], out)
    src = ckpt.tensor(spec.sources[0])
    with safe_open(out, framework="pt") as f:
        got = f.get_tensor("w")
    assert torch.equal(got, src.to(torch.bfloat16))
    assert (got.float() - src).abs().max() <= src.abs().max() * 2**-8


def test_shape_mismatch_is_a_compile_error_and_writes_nothing(ckpt, tmp_path):
    c = ckpt.config
    bad = WeightSpec(
        "qk",
        ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"),
        "float32",
        (c.q_size, c.hidden_size),
    )
    out = tmp_path / "w.safetensors"
    with pytest.raises(CompileError, match="do not concatenate"):
        write_packed_weights(ckpt, [bad], out)
    assert not out.exists() and not list(tmp_path.iterdir())
    with pytest.raises(CompileError, match="no tensor"):
        write_packed_weights(ckpt, [WeightSpec("x", ("nope",), "float32", (1,))], out)
    with pytest.raises(CompileError, match="dtype"):
        write_packed_weights(ckpt, [WeightSpec("x", ("model.norm.weight",), "float16", (c.hidden_size,))], out)
