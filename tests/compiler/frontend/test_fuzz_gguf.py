"""Property-based fuzzing of the GGUF importer, as test_fuzz_checkpoint.py does for safetensors.

Inputs are mutations of two small valid files: the tiny llama as gguf_write writes it (Q8_0, byte-level BPE with
merges) and a one-layer model with a SentencePiece vocabulary (scores, no merges). A mutation changes the
structure (version, header counts, truncation, stray bytes), the metadata (values, types, nesting, missing and
duplicate keys), the tokenizer fields (tokens, scores, token types, merges, bos/eos ids, model and pre-tokenizer
names) or the tensor infos (offsets, shapes, types, names).

Each input is loaded in a forked child (tests/compiler/frontend/bounded.py) and must either fail with one line (an
LlmcError) or load usable: a consistent config, every tensor it implies readable at its shape, and a tokenizer
that encodes a sample text into ids the embedding has. Neither may take over 5 s or grow memory over 1 GiB (the
files are under 1 MB). The default run is a few dozen inputs; `-m slow` runs thousands.
"""

from __future__ import annotations

import copy
import struct

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from llmc.compiler.frontend import gguf_names as names
from llmc.compiler.frontend.gguf_write import write_gguf
from llmc.compiler.frontend.load import load_checkpoint
from tests.compiler.frontend.bounded import run_bounded
from tests.compiler.frontend.gguf_raw import Raw, RawGGUF, V, pack_value, tiny_llama

SECONDS, MEMORY = 5.0, 1 << 30
UNK_ID = "tokenizer.ggml.unknown_token_id"
SAMPLE = "The  fox's 'quoted' <s>THE</s> end.\r\n\tünïcødé 😀 1234567 $A:0"
_COMMON = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck))
FAST = settings(max_examples=50, **_COMMON)
LONG = settings(max_examples=1500, **_COMMON)


def _sentencepiece_base() -> RawGGUF:
    pieces = ["▁", "t", "h", "e", "▁t", "he", "▁the", "x", "xx", "xxxx", "▁f", "o", "ox", "▁fox", "'", "s", "'s"]
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    raw = tiny_llama(
        specials + pieces,
        [0.0] * len(specials) + [-float(i) for i in range(len(pieces))],
        [2, 3, 3] + [6] * 256 + [1] * len(pieces),
    )
    return raw.set(names.BOS_ID, V.UINT32, 1).set(names.EOS_ID, V.UINT32, 2).set(UNK_ID, V.UINT32, 0)


@pytest.fixture(scope="module")
def bases(checkpoint_dir, tmp_path_factory) -> list[RawGGUF]:
    bpe = write_gguf(checkpoint_dir("llama"), tmp_path_factory.mktemp("fuzz") / "llama.gguf", "Q8_0")
    return [RawGGUF.read(bpe), _sentencepiece_base()]


# --------------------------------------------------------------------------------------------------------------
# Values

SCALARS = [V.UINT8, V.INT8, V.UINT16, V.INT16, V.UINT32, V.INT32, V.UINT64, V.INT64, V.BOOL, V.FLOAT32, V.FLOAT64]
odd_ints = st.sampled_from([0, 1, -1, 2, 255, 256, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1])
ints = odd_ints | st.integers(-(2**64), 2**64)
floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
texts = st.text(max_size=12) | st.sampled_from(["", " ", ":", "$A", "$B:1", "<s>", "a b", "▁", "\0", "x" * 300])
strings = texts | st.binary(max_size=8)  # bytes: possibly invalid UTF-8


def scalar(vtype: int):
    return floats if vtype in (V.FLOAT32, V.FLOAT64) else st.booleans() if vtype == V.BOOL else ints


@st.composite
def array_value(draw, depth: int = 0):
    """An ARRAY's (item type, items): of scalars, of strings, or of arrays (two deep at most)."""
    itype = draw(st.sampled_from(SCALARS + [V.STRING] + ([V.ARRAY] if depth < 2 else [])))
    if itype == V.ARRAY:
        return itype, draw(st.lists(array_value(depth + 1), max_size=3))
    return itype, draw(st.lists(strings if itype == V.STRING else scalar(itype), max_size=6))


@st.composite
def value(draw):
    """(GGUFValueType, value) of any type."""
    vtype = draw(st.sampled_from(SCALARS + [V.STRING, V.ARRAY]))
    if vtype == V.ARRAY:
        return vtype, draw(array_value())
    return vtype, draw(strings if vtype == V.STRING else scalar(vtype))


# --------------------------------------------------------------------------------------------------------------
# Mutations: each takes (raw, draw) and changes raw in place.


def m_version(raw, draw):
    raw.version = draw(st.sampled_from([0, 1, 2, 4, 0x03000000]) | st.integers(0, 2**32 - 1))


def m_counts(raw, draw):
    n_t, n_kv = len(raw.tensors), len(raw.fields)
    near = st.integers(-2, 2)
    raw.counts = (
        max(0, n_t + draw(near)) if draw(st.booleans()) else draw(odd_ints) % 2**64,
        max(0, n_kv + draw(near)) if draw(st.booleans()) else draw(odd_ints) % 2**64,
    )


def m_field_value(raw, draw):
    key = draw(st.sampled_from([k for k, _, _ in raw.fields]))
    raw.set(key, *draw(value()))


def m_field_type(raw, draw):
    """The same bytes declared as another type."""
    i = draw(st.integers(0, len(raw.fields) - 1))
    key, vtype, v = raw.fields[i]
    raw.fields[i] = (
        key,
        draw(st.sampled_from(SCALARS + [V.STRING, V.ARRAY, 13, 2**32 - 1])),
        Raw(pack_value(vtype, v)),
    )


def m_drop_field(raw, draw):
    raw.drop(draw(st.sampled_from([k for k, _, _ in raw.fields])))


def m_add_field(raw, draw):
    known = [
        names.ADD_BOS,
        names.CHAT_TEMPLATE,
        names.TOKENIZER_PRE,
        names.MERGES,
        "tokenizer.ggml.add_space_prefix",
        "general.alignment",
        "llama.rope.scaling.type",
        "llama.attention.key_length",
        UNK_ID,
    ]
    key = draw(st.sampled_from(known) | texts)
    if draw(st.booleans()) and any(k == key for k, _, _ in raw.fields):
        raw.fields.append((key, *draw(value())))  # a duplicate key
    else:
        raw.set(key, *draw(value()))


def m_deep_nesting(raw, draw):
    depth = draw(st.sampled_from([2, 8, 9, 64, 2000]))
    inner = struct.pack("<IQ", V.ARRAY, 1) * (depth - 1) + struct.pack("<IQi", V.INT32, 1, 7)
    raw.set(draw(st.sampled_from(["general.nested", names.TOKEN_TYPE])), V.ARRAY, Raw(inner))


def _array(raw, key):
    v = raw.get(key)
    return list(v[1]) if isinstance(v, tuple) and len(v) == 2 and isinstance(v[1], list) else None


def _edit_list(items, draw, element):
    """Replace, drop, add or duplicate a few entries."""
    items = list(items)
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["replace"] * 4 + ["drop", "append", "duplicate", "truncate"]))
        if op == "replace" and items:
            items[draw(st.integers(0, len(items) - 1))] = draw(element)
        elif op == "drop" and items:
            del items[draw(st.integers(0, len(items) - 1))]
        elif op == "append":
            items.append(draw(element))
        elif op == "duplicate" and items:
            items.append(items[draw(st.integers(0, len(items) - 1))])
        elif op == "truncate":
            items = items[: draw(st.integers(0, len(items)))]
    return items


def m_tokens(raw, draw):
    tokens = _array(raw, names.TOKENS) or []
    raw.set(names.TOKENS, V.ARRAY, (V.STRING, _edit_list(tokens, draw, strings)))


def m_scores(raw, draw):
    scores = _array(raw, "tokenizer.ggml.scores") or [0.0] * len(_array(raw, names.TOKENS) or [])
    raw.set("tokenizer.ggml.scores", V.ARRAY, (V.FLOAT32, _edit_list(scores, draw, floats)))


def m_token_types(raw, draw):
    types = _array(raw, names.TOKEN_TYPE) or []
    element = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, -1])
    raw.set(names.TOKEN_TYPE, V.ARRAY, (V.INT32, _edit_list(types, draw, element)))


def m_vocabulary(raw, draw):
    """Tokens added or removed with their types and scores, so the lists still agree."""
    lists = {k: _array(raw, k) for k in (names.TOKENS, names.TOKEN_TYPE, "tokenizer.ggml.scores")}
    n = len(lists[names.TOKENS] or [])
    if draw(st.booleans()) or not n:
        new = {
            names.TOKENS: draw(strings),
            names.TOKEN_TYPE: draw(st.sampled_from([1, 3, 4, 5, 6])),
            "tokenizer.ggml.scores": draw(floats),
        }
        at = draw(st.integers(0, n))
        for key, items in lists.items():
            if items is not None:
                items.insert(at, new[key])
    else:
        at = draw(st.integers(0, n - 1))
        for items in lists.values():
            if items is not None and at < len(items):
                del items[at]
    for key, vtype in ((names.TOKENS, V.STRING), (names.TOKEN_TYPE, V.INT32), ("tokenizer.ggml.scores", V.FLOAT32)):
        if lists[key] is not None:
            raw.set(key, V.ARRAY, (vtype, lists[key]))


def m_merges(raw, draw):
    merges = _array(raw, names.MERGES) or []
    tokens = [t for t in _array(raw, names.TOKENS) or [] if isinstance(t, str)] or ["a"]
    pair = st.tuples(st.sampled_from(tokens), st.sampled_from(tokens)).map(" ".join)
    raw.set(names.MERGES, V.ARRAY, (V.STRING, _edit_list(merges, draw, pair | texts)))


def m_special_ids(raw, draw):
    key = draw(st.sampled_from([names.BOS_ID, names.EOS_ID, UNK_ID, "tokenizer.ggml.eot_token_id"]))
    n = len(_array(raw, names.TOKENS) or [])
    vtype = draw(st.sampled_from([V.UINT32, V.UINT32, V.INT32, V.UINT64, V.INT64, V.FLOAT32, V.STRING]))
    ids = st.sampled_from([0, n - 1, n, n + 1, 2**32 - 1, -1]) | st.integers(0, max(n - 1, 0))
    raw.set(key, vtype, draw(texts if vtype == V.STRING else ids))


def m_tokenizer_names(raw, draw):
    if draw(st.booleans()):
        raw.set(names.TOKENIZER_MODEL, V.STRING, draw(st.sampled_from(["llama", "gpt2", "bert", ""]) | texts))
    else:
        pres = ["default", "gpt-2", "llama-bpe", "llama3", "qwen2", "smaug-bpe", "tekken", ""]
        raw.set(names.TOKENIZER_PRE, V.STRING, draw(st.sampled_from(pres) | texts))


def _tensor(raw, draw):
    return raw.tensors[draw(st.integers(0, len(raw.tensors) - 1))]


def m_tensor_offset(raw, draw):
    laid = raw.layout()
    t = _tensor(raw, draw)
    here = laid[raw.tensors.index(t)]
    t.offset = draw(
        st.sampled_from([2**64 - 1, 2**64 - 32, 2**63, here + 1, here + 32, here - 32, laid[-1] + 64])
        | st.sampled_from(laid)
        | st.integers(0, laid[-1] + 4096)
    )


def m_tensor_shape(raw, draw):
    t = _tensor(raw, draw)
    dims = list(t.dims)
    op = draw(st.sampled_from(["dim", "add", "drop", "swap"]))
    if op == "dim" and dims:
        dims[draw(st.integers(0, len(dims) - 1))] = draw(st.sampled_from([0, 1, 2, 32, 2**32, 2**63]) | odd_ints)
    elif op == "add":
        dims.append(draw(st.integers(0, 4)))
    elif op == "drop" and dims:
        dims.pop()
    elif op == "swap":
        dims.reverse()
    t.dims = [d % 2**64 for d in dims]


def m_tensor_type(raw, draw):
    t = _tensor(raw, draw)
    T = gguf.GGMLQuantizationType
    t.type = draw(
        st.sampled_from([T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_K, T.Q6_K, T.I8, T.F64, 4, 5, 39, 2**31])
        | st.integers(0, 2**32 - 1)
    )


def m_tensor_name(raw, draw):
    t = _tensor(raw, draw)
    other = raw.tensors[draw(st.integers(0, len(raw.tensors) - 1))].name
    t.name = draw(
        st.sampled_from([other, "output.weight", "rope_freqs.weight", "blk.0.attn_q.bias", b"\xff\xfe"]) | texts
    )


def m_tensor_list(raw, draw):
    i = draw(st.integers(0, len(raw.tensors) - 1))
    if draw(st.booleans()):
        del raw.tensors[i]
    else:
        raw.tensors.append(copy.deepcopy(raw.tensors[i]))


def m_alignment(raw, draw):
    raw.set(
        "general.alignment",
        draw(st.sampled_from([V.UINT32, V.UINT64, V.INT32])),
        draw(st.sampled_from([0, 1, 3, 8, 16, 64, 4096, 2**31])),
    )


MUTATIONS = [
    m_version,
    m_counts,
    m_field_value,
    m_field_type,
    m_drop_field,
    m_add_field,
    m_deep_nesting,
    m_tokens,
    m_scores,
    m_token_types,
    m_vocabulary,
    m_merges,
    m_special_ids,
    m_tokenizer_names,
    m_tensor_offset,
    m_tensor_shape,
    m_tensor_type,
    m_tensor_name,
    m_tensor_list,
    m_alignment,
]


# The tokenizer's and the tensors' mutations twice as often: most structural ones stop the load at the header.
WEIGHTED = MUTATIONS + [
    m_vocabulary,
    m_vocabulary,
    m_tokens,
    m_scores,
    m_token_types,
    m_merges,
    m_special_ids,
    m_tokenizer_names,
    m_tensor_offset,
    m_tensor_shape,
    m_tensor_type,
]


def mutated(draw, bases: list[RawGGUF]) -> bytes:
    """A mutated file from draws of small values only (Hypothesis prints each draw of a failing example)."""
    raw = copy.deepcopy(bases[draw(st.integers(0, len(bases) - 1))])
    for mutation in draw(st.lists(st.sampled_from(WEIGHTED), min_size=1, max_size=3)):
        mutation(raw, draw)
    blob = raw.to_bytes()
    end = draw(st.sampled_from(["keep"] * 7 + ["truncate", "garbage", "flip"]))
    if end == "truncate":
        blob = blob[: draw(st.integers(0, len(blob) - 1))]
    elif end == "garbage":
        blob += draw(st.binary(min_size=1, max_size=64))
    elif end == "flip":  # stray bytes in the header (the first 16 KiB hold the metadata and tensor infos)
        data = bytearray(blob)
        for _ in range(draw(st.integers(1, 4))):
            data[draw(st.integers(0, min(len(data), 16384) - 1))] = draw(st.integers(0, 255))
        blob = bytes(data)
    return blob


# --------------------------------------------------------------------------------------------------------------
# The property


def _load_and_use(path) -> str:
    """What accepting a GGUF promises compile: runs in the child; an AssertionError there is a failure."""
    ckpt = load_checkpoint(path)
    config = ckpt.config
    assert config.inconsistency() is None
    for name, shape in config.weight_shapes().items():
        assert tuple(ckpt.tensor(name).shape) == shape, name
        qt = ckpt.quantized_tensor(name)
        assert qt is None or qt.q.shape[0] == shape[0], name
    tok = Tokenizer.from_file(str(ckpt.tokenizer_path))
    ids = tok.encode(SAMPLE).ids
    assert ids and all(0 <= i < config.vocab_size for i in ids), ids  # every id has an embedding row
    tok.decode(ids)
    assert ckpt.chat_template is None or isinstance(ckpt.chat_template, str)
    return "usable"


def check(blob: bytes, path) -> None:
    path.write_bytes(blob)
    assert len(blob) < 1 << 20
    out = run_bounded(lambda: _load_and_use(path), seconds=SECONDS, memory=2 * MEMORY)
    assert out.kind in ("ok", "error"), str(out)
    assert "\n" not in str(out.value) and "Traceback" not in str(out.value), str(out)
    assert out.wall <= SECONDS, str(out)
    assert out.peak is None or out.peak <= MEMORY, str(out)


def test_bases_load_usable(bases, tmp_path):
    for raw in bases:
        path = tmp_path / "base.gguf"
        path.write_bytes(raw.to_bytes())
        assert run_bounded(lambda: _load_and_use(path)).value == "usable"  # noqa: B023 - called at once


def _fuzz(bases, tmp_path, run_settings):
    path = tmp_path / "fuzz.gguf"

    @run_settings
    @given(st.data())
    def run(data):
        check(mutated(data.draw, bases), path)

    run()


def test_fuzz_gguf(bases, tmp_path):
    _fuzz(bases, tmp_path, FAST)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_fuzz_gguf_long(bases, tmp_path):
    _fuzz(bases, tmp_path, LONG)
