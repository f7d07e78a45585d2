"""compiler/weights.py: the streamed packed-weights file is a valid, aligned safetensors file."""

import dataclasses
import hashlib
import json
import re
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from llmc import digests
from llmc.compiler.frontend.load import load_checkpoint
from llmc.compiler.quant import QuantizedTensor, QuantScheme, dequantize, quantize
from llmc.compiler.quant_pack import unpack_cpu
from llmc.compiler.weights import (
    ALIGN,
    PAD_PREFIX,
    WeightSpec,
    interleave_rows,
    quant_part_dtype,
    write_packed_weights,
)
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_interleaved_gate_up(ckpt, tmp_path, monkeypatch, dtype):
    """The CUDA SwiGLU GEMM's weight: gate and up rows 8 at a time, written in slabs (here of 16 rows, so the
    last of 120 rows' slab is short) with the digest and progress of any other tensor."""
    monkeypatch.setattr("llmc.compiler.weights._CHUNK_BYTES", 16 * 2 * ckpt.config.hidden_size * 4)
    spec = dataclasses.replace(_specs(ckpt, dtype)[-1], interleave=8)
    out, seen = tmp_path / "w.safetensors", []
    write_packed_weights(ckpt, [spec], out, progress=seen.append)
    gate, up = (ckpt.tensor(src).to(getattr(torch, dtype)) for src in spec.sources)
    with safe_open(out, framework="pt") as f:
        got = f.get_tensor(spec.name)
    assert torch.equal(
        got, torch.from_numpy(interleave_rows(gate.float().numpy(), up.float().numpy(), 8)).to(got.dtype)
    )
    assert torch.equal(got[8:16], up[:8]) and torch.equal(got[16:24], gate[8:16])
    assert sum(seen) == spec.nbytes and len(seen) > 1
    sources = (spec.sources[0], "model.layers.0.self_attn.q_proj.weight")  # 120 and 64 rows
    bad = WeightSpec("w", sources, dtype, (184, ckpt.config.hidden_size), interleave=8)
    with pytest.raises(CompileError, match="do not interleave"):
        write_packed_weights(ckpt, [bad], tmp_path / "bad.safetensors")


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


def _quant_specs(ckpt, sources, scheme):
    n = sum(ckpt.config.weight_shapes()[s][0] for s in sources)
    shape = (n, ckpt.config.hidden_size)
    parts = ["qweight", "scales"] + (["mins"] if scheme.asymmetric else [])
    return [WeightSpec(f"w.{p}", sources, quant_part_dtype(scheme, p), shape, scheme, p) for p in parts]


def _unpacked(path, specs):
    """The QuantizedTensor the file holds for specs (qweight, scales[, mins])."""
    scheme = specs[0].quant
    with safe_open(path, framework="np") as f:
        parts = {s.part: f.get_tensor(s.name) for s in specs}
    q = unpack_cpu(parts["qweight"], specs[0].shape, scheme.bits, scheme.asymmetric)
    assert parts["scales"].dtype == scheme.scale_dtype
    mins = parts.get("mins")
    return QuantizedTensor(
        q, parts["scales"].astype(np.float32), None if mins is None else mins.astype(np.float32), scheme
    )


@pytest.mark.parametrize(
    "scheme",
    [QuantScheme(8, 64), QuantScheme(4, 32), QuantScheme(4, 64, asymmetric=True)],
    ids=lambda s: s.describe().replace(" ", "-"),
)
def test_quantized_parts_are_each_source_quantized_once(ckpt, tmp_path, scheme, monkeypatch):
    qkv = tuple(f"model.layers.1.self_attn.{n}_proj.weight" for n in "qkv")
    specs = _quant_specs(ckpt, qkv, scheme)
    reads = []
    tensor = ckpt.tensor
    monkeypatch.setattr(ckpt, "tensor", lambda name: reads.append(name) or tensor(name))
    out = tmp_path / "w.safetensors"
    offsets = write_packed_weights(ckpt, specs, out)
    assert reads == list(qkv), "each source is read and quantized once for its two or three parts"
    want = quantize(torch.cat([tensor(s) for s in qkv]).numpy(), scheme)
    got = _unpacked(out, specs)
    assert np.array_equal(got.q, want.q) and np.array_equal(got.scales, want.scales)
    assert (got.mins is None) == (want.mins is None) and (want.mins is None or np.array_equal(got.mins, want.mins))
    assert all(offsets[s.name][1] == s.nbytes for s in specs)
    assert specs[0].stored_shape == (specs[0].shape[0], ckpt.config.hidden_size * scheme.bits // 8)


def test_weights_held_quantized_are_packed_as_held(ckpt, tmp_path, monkeypatch):
    """A GGUF Q4_K_M layer: q and k held as int4 g32 asym, v as int8 g16; packed in their common scheme with
    no requantization: the file dequantizes to exactly what each held tensor does."""
    qkv = tuple(f"model.layers.0.self_attn.{n}_proj.weight" for n in "qkv")
    rng = np.random.default_rng(4)
    held = {}
    schemes = [
        QuantScheme(4, 32, True, "float32"),
        QuantScheme(4, 32, True, "float32"),
        QuantScheme(8, 16, scale_dtype="float32"),
    ]
    for name, scheme in zip(qkv, schemes, strict=True):
        held[name] = quantize(rng.standard_normal(ckpt.config.weight_shapes()[name]).astype(np.float32), scheme)
    monkeypatch.setattr(ckpt, "quantized_tensor", held.get)
    specs = _quant_specs(ckpt, qkv, QuantScheme(8, 16, asymmetric=True, scale_dtype="float32"))
    write_packed_weights(ckpt, specs, tmp_path / "w.safetensors")
    got = dequantize(_unpacked(tmp_path / "w.safetensors", specs))
    want = np.concatenate([dequantize(held[n]) for n in qkv])
    assert np.array_equal(got.view(np.int32), want.view(np.int32))


def test_a_quantized_part_must_fit_its_dtype(ckpt, tmp_path):
    (spec, _) = _quant_specs(ckpt, ("model.layers.0.self_attn.o_proj.weight",), QuantScheme(8, 64))
    with pytest.raises(CompileError, match="not a part of a quantized"):
        write_packed_weights(ckpt, [dataclasses.replace(spec, dtype="float32")], tmp_path / "w.safetensors")


def _poisoned(ckpt, monkeypatch, name: str, value: float, row: int):
    """ckpt whose tensor `name` holds `value` at [row, 1] (or [row])."""
    tensor = ckpt.tensor

    def poisoned(src):
        t = tensor(src)
        if src == name:
            t = t.clone()
            t[(row, 1) if t.dim() == 2 else (row,)] = value
        return t

    monkeypatch.setattr(ckpt, "tensor", poisoned)


L0 = "model.layers.0."


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize(
    "case",
    ["float32", "bfloat16", "interleaved", "quantized", "norm"],
)
def test_a_weight_that_is_not_finite_is_refused_naming_the_tensor(case, value, ckpt, tmp_path, monkeypatch):
    """Found while the weights stream through (no extra pass): a CompileError naming the checkpoint tensor and the
    first row at fault, and no file left behind."""
    c = ckpt.config
    gate_up = (L0 + "mlp.gate_proj.weight", L0 + "mlp.up_proj.weight")
    spec = {
        "float32": WeightSpec("l0.gate_up", gate_up, "float32", (2 * c.intermediate_size, c.hidden_size)),
        "bfloat16": WeightSpec("l0.gate_up", gate_up, "bfloat16", (2 * c.intermediate_size, c.hidden_size)),
        "interleaved": WeightSpec(
            "l0.gate_up", gate_up, "bfloat16", (2 * c.intermediate_size, c.hidden_size), interleave=8
        ),
        "norm": WeightSpec("l0.norm", (L0 + "input_layernorm.weight",), "float32", (c.hidden_size,)),
    }.get(case)
    specs = [spec] if spec else _quant_specs(ckpt, gate_up, QuantScheme(8, 32))
    name = specs[0].sources[-1]
    _poisoned(ckpt, monkeypatch, name, value, row=5)
    out = tmp_path / "w.safetensors"
    kind = "NaN" if value != value else "an infinity"
    with pytest.raises(CompileError, match=rf"checkpoint tensor '{re.escape(name)}' holds {kind} \(row 5\)"):
        write_packed_weights(
            ckpt,
            [WeightSpec("embed", ("model.embed_tokens.weight",), "float32", (c.vocab_size, c.hidden_size)), *specs],
            out,
        )
    assert list(tmp_path.iterdir()) == [], "nothing is left behind"


@pytest.mark.parametrize("part", ["scales", "mins"])
def test_a_weight_held_quantized_with_a_scale_that_is_not_finite_is_refused(part, ckpt, tmp_path, monkeypatch):
    """A GGUF's quantized tensors are checked through their scales (and mins): the codes are integers."""
    name = L0 + "self_attn.o_proj.weight"
    scheme = QuantScheme(4, 32, True, "float32")
    held = quantize(
        np.random.default_rng(0).standard_normal(ckpt.config.weight_shapes()[name]).astype(np.float32), scheme
    )
    getattr(held, part)[3, 1] = np.nan
    monkeypatch.setattr(ckpt, "quantized_tensor", {name: held}.get)
    with pytest.raises(CompileError, match=rf"checkpoint tensor '{re.escape(name)}' holds NaN in its {part} \(row 3\)"):
        write_packed_weights(ckpt, _quant_specs(ckpt, (name,), scheme), tmp_path / "w.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_compile_refuses_a_checkpoint_with_nan_weights_in_one_line(checkpoint_dir, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file, save_file

    from llmc.tools.cli import main

    broken = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), broken)
    weights = load_file(broken / "model.safetensors")
    weights["model.layers.1.mlp.down_proj.weight"][2, 7] = float("nan")
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", str(broken), "-o", str(out)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 1 and lines[-1].startswith("error: "), result.output
    assert "'model.layers.1.mlp.down_proj.weight' holds NaN (row 2)" in lines[-1]
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
