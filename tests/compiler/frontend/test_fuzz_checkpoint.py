"""Property-based fuzzing of every checkpoint parser of untrusted input.

Each input either loads or raises an LlmcError: no other exception, hang or crash. The safetensors
inputs are mutations of a real file's header (offsets, dtypes, shapes, overlaps, non-object headers)
and raw bytes; what the scanner accepts must also open with the safetensors library itself.
"""

from __future__ import annotations

import json
import shutil
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from tokenizers import Tokenizer

from llmc.compiler.frontend.checkpoint import _scan_safetensors
from llmc.compiler.frontend.load import load_checkpoint
from llmc.errors import LlmcError
from llmc.sampling_params import SamplingParams

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
offsets_or_junk = st.one_of(st.lists(st.integers(-5, 1 << 40), min_size=0, max_size=3), json_values)


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header, data: bytes) -> bytes:
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + data


@st.composite
def mutated_headers(draw, header: dict):
    header = json.loads(json.dumps(header))
    names = sorted(k for k in header if k != "__metadata__")
    for _ in range(draw(st.integers(1, 3))):
        name = draw(st.sampled_from(names))
        field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "swap", "copy_offsets"]))
        entry = header[name]
        if not isinstance(entry, dict):  # replaced whole by an earlier mutation
            continue
        if field == "dtype":
            entry["dtype"] = draw(st.sampled_from(["F32", "BF16", "F16", "I8", "F64", "X9", ""]) | json_values)
        elif field == "shape":
            entry["shape"] = draw(st.lists(st.integers(-2, 1 << 33), max_size=3) | json_values)
        elif field == "data_offsets":
            entry["data_offsets"] = draw(offsets_or_junk)
        elif field == "entry":
            header[name] = draw(json_values)
        elif field == "swap" and isinstance(entry.get("data_offsets"), list):
            entry["data_offsets"] = entry["data_offsets"][::-1]
        elif field == "copy_offsets":  # two tensors over the same bytes
            other = header[draw(st.sampled_from(names))]
            entry["data_offsets"] = other.get("data_offsets") if isinstance(other, dict) else None
    return draw(st.sampled_from([header, header, [header], "header", None]))


def _check_scan(path) -> None:
    try:
        found = _scan_safetensors(path)
    except LlmcError as e:
        assert "\n" not in str(e)
        return
    with safe_open(path, framework="numpy") as f:  # accepted means safetensors itself reads every tensor
        assert sorted(f.keys()) == sorted(found)


@pytest.fixture(scope="module")
def valid_file(checkpoint_dir):
    return (checkpoint_dir("llama") / "model.safetensors").read_bytes()


def test_fuzz_safetensors_header(valid_file, tmp_path):
    header, data = _split(valid_file)
    path = tmp_path / "model.safetensors"

    @FUZZ
    @given(mutated_headers(header), st.integers(-64, 64))
    def run(mutated, trim):
        blob = _join(mutated, data)
        path.write_bytes(blob[: len(blob) + trim] if trim < 0 else blob + b"\0" * trim)
        _check_scan(path)

    run()


@FUZZ
@given(st.binary(max_size=256), st.integers(0, 300))
def test_fuzz_safetensors_bytes(tmp_path_factory, blob, claimed):
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    path.write_bytes(struct.pack("<Q", claimed) + blob)
    _check_scan(path)


@pytest.mark.parametrize(
    "damage, expected",
    [
        (
            lambda h: h["model.norm.weight"].update(
                data_offsets=h["model.layers.0.input_layernorm.weight"]["data_offsets"]
            ),
            "overlap",
        ),
        (
            lambda h: h["model.norm.weight"].update(data_offsets=h["model.norm.weight"]["data_offsets"][::-1]),
            "begin <= end",
        ),
        (lambda h: h["model.norm.weight"].update(shape=[3]), "bytes of data"),
    ],
    ids=["overlapping", "reversed", "wrong_size"],
)
def test_bad_offsets_name_the_tensor(valid_file, tmp_path, damage, expected):
    header, data = _split(valid_file)
    damage(header)
    (tmp_path / "model.safetensors").write_bytes(_join(header, data))
    with pytest.raises(LlmcError, match=expected):
        _scan_safetensors(tmp_path / "model.safetensors")


def test_header_that_is_a_list(valid_file, tmp_path):
    header, data = _split(valid_file)
    (tmp_path / "model.safetensors").write_bytes(_join([header], data))
    with pytest.raises(LlmcError, match="not an object"):
        _scan_safetensors(tmp_path / "model.safetensors")


@pytest.mark.parametrize(
    "name,base",
    [
        *((n, "llama") for n in ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json")),
        ("config.json", "gemma3"),  # the fields of the families with more of them
        ("config.json", "granite"),
    ],
)
def test_fuzz_json_files(checkpoint_dir, tmp_path, name, base):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir(base), ckpt)
    original = json.loads((ckpt / name).read_text()) if (ckpt / name).is_file() else {}

    @FUZZ
    @given(st.one_of(json_values, st.builds(_mutate_fields, st.just(original), st.data())))
    def run(value):
        (ckpt / name).write_text(json.dumps(value))
        try:
            loaded = load_checkpoint(ckpt)
        except LlmcError as e:
            assert "\n" not in str(e)
            return
        _assert_usable(loaded)

    run()


def _assert_usable(ckpt) -> None:
    """What accepting a checkpoint promises compile: a consistent config, every tensor it implies in the files at
    the shape it implies, a tokenizer that parses, and generation defaults every request can take."""
    assert ckpt.config.inconsistency() is None
    for name, shape in ckpt.config.weight_shapes().items():
        assert _scan_safetensors(ckpt.tensor_files[name])[name][1] == shape, name
    assert Tokenizer.from_file(str(ckpt.tokenizer_path)).get_vocab_size() > 0
    SamplingParams(**ckpt.generation_defaults)
    assert ckpt.chat_template is None or isinstance(ckpt.chat_template, str)


def _mutate_fields(original: dict, data) -> dict:
    """The real file with a few fields replaced by arbitrary JSON (so parsing gets past the first check)."""
    mutated = dict(original)
    keys = sorted(original) or ["x"]
    for key in data.draw(st.lists(st.sampled_from(keys), min_size=1, max_size=3)):
        mutated[key] = data.draw(json_values | st.integers(-(10**13), 10**13))
    return mutated


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_hidden_layers", 10**7),
        ("max_position_embeddings", 10**12),
        ("hidden_size", "64"),
        ("rms_norm_eps", float("inf")),
        ("eos_token_id", ["</s>"]),
        ("rope_parameters", [1, 2]),
    ],
)
def test_absurd_config_is_refused_at_once(checkpoint_dir, tmp_path, field, value):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), ckpt)
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(LlmcError, match=field):
        load_checkpoint(ckpt)


@pytest.mark.parametrize(
    "name, field, value, match",
    [
        ("config.json", "num_key_value_heads", 3, "not a multiple of num_kv_heads"),
        ("config.json", "bos_token_id", 5000, "past the vocabulary"),
        ("generation_config.json", "eos_token_id", [1, 5000], "past the vocabulary"),
    ],
)
def test_contradicting_fields_fail_the_compile_not_every_load(checkpoint_dir, tmp_path, name, field, value, match):
    """The cross-field rules an artifact's manifest is checked by at load refuse the checkpoint first."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(checkpoint_dir("llama"), ckpt)
    original = json.loads((ckpt / name).read_text()) if (ckpt / name).is_file() else {}
    (ckpt / name).write_text(json.dumps({**original, field: value}))
    with pytest.raises(LlmcError, match=match):
        load_checkpoint(ckpt)
