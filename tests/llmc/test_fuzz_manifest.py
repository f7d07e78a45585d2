"""Property-based fuzzing of an artifact's manifest.json, untrusted input (an artifact may come from anywhere).

Every manifest either loads or raises an LlmcError of one line: no other exception, hang or crash. Nothing
outside the artifact directory is read: a `files` entry that leads out of it (.., an absolute path, a
symlink) is refused before any file is hashed or opened. Edits that keep the manifest's own digests valid
(a resealed manifest, as someone who recomputes them would write) are fuzzed too, so the checks behind the
seal are reached.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmc import artifact as art
from llmc import artifact_writer as writer
from llmc import manifest as mf
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import ArtifactError, LlmcError
from llmc.kernel_program import decode_weight_bytes, format_program
from llmc.model_config import ModelConfig
from llmc.tools.cli import main as cli

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
path_parts = st.sampled_from(["..", ".", "", "etc", "passwd", "model.so", "a b", "\\", "~", "\n", "manifest.json"])
file_names = st.lists(path_parts, min_size=1, max_size=5).map("/".join) | st.text(max_size=12)
OUTSIDE = Path("/etc/passwd")
# A kernel program of llmc/kernel_program.py's schema: an embedding, a bf16 GEMM and a quantized one
PROGRAM = {
    "schema": 1,
    "kv_dtype": "float32",
    "act_dtype": "float32",
    "buffers": [{"rows": "T", "cols": 64}, {"rows": "N", "cols": 64}],
    "weights": [
        {
            "name": "model.embed_tokens.weight",
            "dtype": "float32",
            "shape": [384, 64],
            "quant": None,
            "interleave": 0,
            "sources": ["model.embed_tokens.weight"],
        },
        {
            "name": "lm_head.weight.qweight",
            "dtype": "uint8",
            "shape": [384, 32],
            "quant": "int4 g32",
            "interleave": 0,
            "sources": ["lm_head.weight"],
        },
        {
            "name": "lm_head.weight.scales",
            "dtype": "float16",
            "shape": [384, 2],
            "quant": "int4 g32",
            "interleave": 0,
            "sources": ["lm_head.weight"],
        },
    ],
    "launches": [
        {
            "op": "embedding",
            "params": {"hidden": 64, "wdtype": "f32"},
            "args": ["token_ids", "T", "W[0]", "buf0"],
            "fused": ["take(embed_tokens)"],
        },
        {
            "op": "qgemm",
            "params": {"n": 384, "k": 64, "bits": 4, "has_bias": False},
            "args": ["buf1", "W[1]", "W[2]", "nullptr", "nullptr", "logits", "N"],
            "fused": ["lm_head"],
        },
    ],
    "tvm_funcs": {},
}


@pytest.fixture(scope="module")
def valid(checkpoint_dir, tmp_path_factory) -> Path:
    config = load_checkpoint(checkpoint_dir("llama")).config

    def populate(tmp: Path) -> dict:
        for name in ("model.so", "model.cc", "weights.safetensors", "tokenizer.json", "tokenizer_config.json"):
            (tmp / name).write_bytes(name.encode() * 8)
        return {
            "target": "cpu",
            "model_config": config,
            "weight_dtype": "float32",
            "kernels": [{"id": "k0", "template": "rmsnorm", "params": {"hidden": 64}}],
            "tokenizer": {"chat_template": "{{x}}", "bos_token": "<s>", "eos_token": "</s>"},
            "generation_defaults": {"temperature": 0.7, "top_k": 40},
            "kernel_program": PROGRAM,
            "passes": {"fuse_rmsnorm": 3, "fold": 0},
            "buffer_plan": {"buffers": PROGRAM["buffers"], "values_per_token_row": 128},
            "quantization": "int4 g32",
            "quant": {"default": "int4 g32", "activations": "float32", "weights": {"lm_head.weight": "int4 g32"}},
            "quality": {"kl_mean": 0.01, "tokens": 100},
            "tuning": {"database": "none", "kernels": {"k0": {"template": "rmsnorm", "source": "default"}}},
        }

    return writer.write_artifact(tmp_path_factory.mktemp("valid") / "a.cpu", populate)


@pytest.fixture
def artifact(valid, tmp_path, monkeypatch):
    """(a copy of the valid artifact, the list of every path load_artifact hashes)."""
    path = tmp_path / "a.cpu"
    shutil.copytree(valid, path)
    hashed: list[str] = []
    real = art.file_sha256

    def recording(p):
        hashed.append(str(p))
        return real(p)

    monkeypatch.setattr(art, "file_sha256", recording)
    return path, hashed


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _write(path: Path, m, seal: bool = True) -> None:
    m = mf.seal_manifest(m) if seal and isinstance(m, dict) else m
    (path / "manifest.json").write_text(json.dumps(m))


def _loads_or_one_line_error(path: Path, hashed: list[str]) -> ArtifactError | None:
    """The property: load_artifact returns a usable Artifact or raises one LlmcError of one line, and hashes
    nothing outside the artifact; `llmc inspect -v` agrees (it verifies as the runtime does) and either describes
    the artifact or prints that one line."""
    hashed.clear()
    error = None
    try:
        a = art.load_artifact(path)
    except LlmcError as e:
        assert "\n" not in str(e) and "\r" not in str(e), str(e)
        error = e
    else:  # what the runtime reads of a loaded artifact
        _ = (
            a.config.max_context,
            a.config.num_parameters(),
            a.block_size,
            a.kind,
            a.target_name,
            a.source_path,
            a.chat_template,
            a.bos_token,
            a.eos_token,
            a.weight_dtype,
            a.weight_bytes,
            {"temperature": 0.0, **(a.manifest.get("generation_defaults") or {})},
            a.decode_weight_bytes,
            format_program(a.manifest["kernel_program"]) if "kernel_program" in a.manifest else None,
        )
    inspected = CliRunner().invoke(cli, ["inspect", "-v", str(path)])
    if error is None:
        assert inspected.exit_code == 0 and inspected.exception is None, (inspected.exception, inspected.output)
    else:
        assert inspected.exit_code == 1 and isinstance(inspected.exception, SystemExit), inspected.exception
        assert inspected.stderr == f"error: {error}\n", inspected.stderr
    root = os.path.realpath(path)
    outside = [p for p in hashed if os.path.commonpath([root, os.path.realpath(p)]) != root]
    assert not outside, f"read outside the artifact: {outside}"
    return error


def test_valid_kernel_program_reads():
    assert decode_weight_bytes(PROGRAM) == {"embedding": 64 * 4, "qgemm": 384 * 32 + 384 * 2 * 2}
    assert format_program(PROGRAM).splitlines()[-1] == (
        "  qgemm(n=384, k=64, bits=4, has_bias=False)(buf1, W[1], W[2], nullptr, nullptr, logits, N)  # lm_head"
    )


def test_config_field_types_are_all_checked():
    assert {f.type for f in dataclasses.fields(ModelConfig)} <= set(mf._CONFIG_TYPES)


def test_valid_manifest_loads(artifact):
    path, hashed = artifact
    assert _loads_or_one_line_error(path, hashed) is None
    assert len(set(hashed)) == 5


@FUZZ
@given(st.binary(max_size=512))
def test_fuzz_manifest_bytes(artifact, blob):
    path, hashed = artifact
    (path / "manifest.json").write_bytes(blob)
    assert _loads_or_one_line_error(path, hashed) is not None


def test_fuzz_manifest_text_edits(artifact):
    path, hashed = artifact
    text = (path / "manifest.json").read_bytes()

    @FUZZ
    @given(st.integers(0, len(text)), st.integers(0, 16), st.binary(max_size=8))
    def run(at, cut, insert):
        (path / "manifest.json").write_bytes(text[:at] + insert + text[at + cut :])
        _loads_or_one_line_error(path, hashed)

    run()


def test_fuzz_flipped_bit_in_manifest_is_refused(artifact):
    """Integrity, not only robustness: a flipped bit anywhere is refused naming manifest.json, unless the
    manifest still parses to the very same content."""
    path, hashed = artifact
    text = (path / "manifest.json").read_bytes()
    original = json.loads(text)

    @FUZZ
    @given(st.integers(0, len(text) - 1), st.integers(0, 7))
    def run(at, bit):
        flipped = text[:at] + bytes([text[at] ^ (1 << bit)]) + text[at + 1 :]
        (path / "manifest.json").write_bytes(flipped)
        error = _loads_or_one_line_error(path, hashed)
        if error is None:
            assert json.loads(flipped) == original
        else:
            assert "manifest.json" in str(error), str(error)

    run()


def test_fuzz_manifest_fields_resealed(artifact):
    path, hashed = artifact
    valid = _manifest(path)
    keys = sorted(k for k in valid if k != mf.MANIFEST_DIGESTS)

    @FUZZ
    @given(
        st.sampled_from(keys) | st.text(max_size=8),
        json_values,
        st.sampled_from(["replace", "delete", "nested", "nested_delete"]),
        st.booleans(),
        st.data(),
    )
    def run(key, value, how, seal, data):
        m = json.loads(json.dumps(valid))
        if how == "replace":
            m[key] = value
        elif how == "delete":
            m.pop(key, None)
        elif isinstance(m.get(key), dict):  # a field inside: model_config's, target's, tokenizer's, files'
            inner = data.draw(st.sampled_from(sorted(m[key]) or [""]) | st.text(max_size=12))
            if how == "nested":
                m[key][inner] = value
            else:
                m[key].pop(inner, None)
        _write(path, m, seal)
        _loads_or_one_line_error(path, hashed)

    run()


def test_fuzz_kernel_program_resealed(artifact):
    """An edit anywhere inside kernel_program (resealed): it loads and reads, or is one ArtifactError."""
    path, hashed = artifact
    valid = _manifest(path)

    @FUZZ
    @given(st.lists(st.integers(0, 9) | st.text(max_size=8), max_size=4), json_values, st.booleans())
    def run(steps, value, delete):
        m = json.loads(json.dumps(valid))
        parent, key = m, "kernel_program"
        for step in steps:  # down the path that `steps` picks among what is there
            node = parent[key]
            if isinstance(node, dict) and node:
                parent, key = node, sorted(node)[step % len(node)] if isinstance(step, int) else step
            elif isinstance(node, list) and node:
                parent, key = node, (step if isinstance(step, int) else len(step)) % len(node)
            else:
                break
            if isinstance(node, dict) and key not in node:  # a new key: it is set, not gone down into
                break
        if delete and isinstance(parent, dict):
            parent.pop(key, None)
        else:
            parent[key] = value
        _write(path, m)
        _loads_or_one_line_error(path, hashed)

    run()


@pytest.mark.parametrize(
    "field, value",
    [
        ("model_config", {"num_layers": 0}),
        ("model_config", {"num_heads": 7}),
        ("model_config", {"eos_token_ids": [1 << 20]}),
        ("model_config", {"rms_norm_eps": float("nan")}),
        ("model_config", {"hidden_size": True}),
        ("model_config", {"sliding_layers": [99]}),
        ("target", {"isa": [["avx2"]]}),
        ("target", {"name": "cpu\nrm -rf /"}),
        ("tokenizer", {"chat_template": 7}),
        ("generation_defaults", {"seed": 1}),
        ("generation_defaults", {"temperature": "hot"}),
        ("block_size", 1 << 40),
        ("kernel_program", ["kernel program: 2 launches"]),  # the printed form of format 2
        ("kernel_program", {"schema": 2}),
        ("kernel_program", {"schema": True}),
        ("kernel_program", {"launches": [{"op": "gemm", "params": {}, "args": ["W[3]"], "fused": []}]}),
        ("kernel_program", {"weights": [{**PROGRAM["weights"][0], "shape": [-1]}]}),
        ("kernel_program", {"weights": [{**PROGRAM["weights"][0], "dtype": "float128"}]}),
        ("kernel_program", {"buffers": [{"rows": "B", "cols": 8}]}),
        ("kernel_program", {"tvm_funcs": {"f": 1}}),
        ("kernel_program", {"act_dtype": "float16"}),
        ("kernel_program", 1),
        ("kernels", 5),
        ("kernels", [{"id": "k0", "fuses": 3}]),
        ("kernels", [{"id": "k0", "launches": "x"}]),
        ("kernels", [{"id": "k0", "params": [1]}]),
        ("passes", {"fold": "x"}),
        ("buffer_plan", []),
        ("quant", "int4"),
        ("quality", 0.5),
        ("tuning", {"kernels": {"k0": 1}}),
        ("tuning", {"kernels": [1]}),
        ("quantization", 4),
        ("compiler_version", ["0.1"]),
    ],
)
def test_resealed_bad_field_is_refused(artifact, field, value):
    path, hashed = artifact
    m = _manifest(path)
    m[field] = {**m[field], **value} if isinstance(value, dict) and isinstance(m.get(field), dict) else value
    _write(path, m)
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and field in str(error)


@pytest.mark.parametrize(
    "field",
    ["generation_defaults", "quantization", "tuning", "kernels", "compiler_version", "weight_dtype", "kernel_program"],
)
def test_field_deleted_with_its_digest_is_refused(artifact, field):
    """The set of fields is sealed too: taking a field out together with its digest is an edit."""
    path, hashed = artifact
    m = _manifest(path)
    del m[field], m[mf.MANIFEST_DIGESTS][field]
    _write(path, m, seal=False)
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and "set of fields" in str(error), error


def test_field_added_with_its_digest_is_refused(artifact):
    path, hashed = artifact
    m = _manifest(path)
    m["extra"] = {"temperature": 9}
    m[mf.MANIFEST_DIGESTS]["extra"] = mf._canonical_sha256(m["extra"])
    _write(path, m, seal=False)
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and "set of fields" in str(error), error


def _passwd_sha256() -> str:
    return hashlib.sha256(OUTSIDE.read_bytes()).hexdigest()


@pytest.mark.parametrize(
    "name",
    [
        "../../../../../../etc/passwd",
        str(OUTSIDE),
        "a/../../../../../../etc/passwd",
        "./model.so",
        "model.so/",
        "sub//x",
        "..",
        ".",
        "",
        "manifest.json",
    ],
)
def test_files_outside_the_artifact_are_refused_unread(artifact, name):
    path, hashed = artifact
    m = _manifest(path)
    m["files"][name] = _passwd_sha256()
    _write(path, m)
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and "not a plain name inside the artifact" in str(error)
    assert hashed == [], "refused before any file is hashed"


@FUZZ
@given(file_names, st.booleans())
def test_fuzz_files_entries(valid, artifact, name, replace_library):
    path, hashed = artifact
    m = _manifest(valid)
    if replace_library:
        del m["files"]["model.so"]
    m["files"][name] = _passwd_sha256()
    _write(path, m)
    _loads_or_one_line_error(path, hashed)


def test_symlink_out_of_the_artifact_is_refused_unread(artifact, tmp_path):
    path, hashed = artifact
    secret = tmp_path / "secret"
    secret.write_text("not the artifact's")
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.json").symlink_to(secret)
    m = _manifest(path)
    m["files"]["tokenizer.json"] = hashlib.sha256(secret.read_bytes()).hexdigest()
    _write(path, m)
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and "tokenizer.json is a symlink out of the artifact" in str(error)
    assert str(secret) not in hashed and not any(p.endswith("tokenizer.json") for p in hashed)


def test_fifo_is_refused_without_hanging(artifact):
    path, hashed = artifact
    (path / "model.so").unlink()
    os.mkfifo(path / "model.so")
    error = _loads_or_one_line_error(path, hashed)
    assert isinstance(error, ArtifactError) and "model.so is missing (or not a regular file)" in str(error)


def test_deep_and_huge_manifests_are_refused(artifact, monkeypatch):
    path, hashed = artifact
    m = _manifest(path)
    (path / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    assert "corrupt manifest" in str(_loads_or_one_line_error(path, hashed))
    _write(path, {**m, "kernels": json.loads("[" * 40 + "]" * 40)})
    assert "nested more than 32 levels" in str(_loads_or_one_line_error(path, hashed))
    _write(path, m)
    monkeypatch.setattr(mf, "_MAX_MANIFEST_BYTES", 100)
    assert "more than" in str(_loads_or_one_line_error(path, hashed))
