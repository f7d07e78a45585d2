"""Structured output in the engine (runtime/structured.py), on the fake model: every output matches its
constraint, checked by a matcher of its own (jsonschema, re, lark); greedy output is the same with and without
speculation, prefix caching and preemption; a constraint that cannot compile is one RequestError naming it."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import lark
import numpy as np
import pytest

from llmc.errors import RequestError
from llmc.runtime.engine import LLMEngine
from llmc.runtime.spec_decode import SpeculativeConfig
from llmc.runtime.structured import GrammarMatcher, MaskFiller, add_mask_biases, constrained_schema
from llmc.sampling_params import SamplingParams, StructuredOutputs
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe, run_with_arrivals

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        "email": {"type": "string", "pattern": "^[a-z]{1,6}@[a-z]{1,6}\\.com$"},
    },
    "required": ["name", "age", "tags"],
}
LARK = r"""
start: expr
expr: term (("+" | "-") term)*
term: NUMBER | "(" expr ")"
NUMBER: /[0-9]{1,3}/
"""
GBNF = r"""
root ::= "[" item ("," item)* "]"
item ::= [a-c]{1,4}
"""
REGEX = r"[A-Z][a-z]{1,6}-\d{2,4}"
CHOICES = ["red", "green", "blue", "dark blue"]


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def config(tok):
    return FakeConfig(vocab_size=tok.get_vocab_size(), eos_token_ids=(1,))


def new_engine(tok, config, *, num_blocks=64, speculative=None, **kw):
    logits = 16 * 5 if speculative else 16
    model = FakeModel(config, num_blocks=num_blocks, block_size=16, max_num_tokens=256, max_num_logits=logits)
    return LLMEngine(model, tok, seed=0, speculative=speculative, **kw)


def check(spec: StructuredOutputs, text: str) -> None:
    """The output matches the constraint, by a matcher that is not llguidance."""
    if spec.json is not None:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        jsonschema.validate(json.loads(text), schema)
    elif spec.json_object:
        assert isinstance(json.loads(text), dict)
    elif spec.regex is not None:
        assert re.fullmatch(spec.regex, text), text
    elif spec.choice is not None:
        assert text in spec.choice, text
    elif spec.grammar is LARK:
        lark.Lark(LARK).parse(text)
    else:
        assert re.fullmatch(r"\[[a-c]{1,4}(,[a-c]{1,4})*\]", text), text


SPECS = [
    StructuredOutputs(json=PERSON),
    StructuredOutputs(json=json.dumps({"type": "array", "items": {"type": "number"}, "maxItems": 4})),
    StructuredOutputs(json_object=True),
    StructuredOutputs(regex=REGEX),
    StructuredOutputs(choice=CHOICES),
    StructuredOutputs(grammar=LARK),
    StructuredOutputs(grammar=GBNF),
]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_every_sampled_output_matches_its_constraint(tok, config, spec):
    engine = new_engine(tok, config)
    prompts = ["hello world", "the quick brown fox", "日本語", "emoji 🙂 and"]
    params = SamplingParams(temperature=1.0, seed=7, n=3, max_tokens=400, structured=spec)
    results = engine.generate(prompts, params)
    finished = 0
    for result in results:
        for c in result.outputs:
            if c.finish_reason == "stop":  # only max_tokens may cut an output short
                check(spec, c.text)
                finished += 1
            else:
                assert c.finish_reason == "length", c.finish_reason
    assert finished >= len(prompts) * 3 - 2, "most outputs end where the grammar lets them"
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_a_finished_grammar_ends_the_sequence_without_an_eos(tok, config):
    engine = new_engine(tok, config)
    (result,) = engine.generate(
        ["x"], SamplingParams(temperature=0, max_tokens=50, structured=StructuredOutputs(regex="ab{3}"))
    )
    c = result.outputs[0]
    assert (c.text, c.finish_reason) == ("abbb", "stop") and 1 not in c.token_ids


def test_max_tokens_still_ends_a_constrained_request_with_length(tok, config):
    engine = new_engine(tok, config)
    spec = StructuredOutputs(regex="[a-z]{50,60}")
    (result,) = engine.generate(["x"], SamplingParams(temperature=1.0, seed=1, max_tokens=5, structured=spec))
    assert result.outputs[0].finish_reason == "length" and len(result.outputs[0].token_ids) == 5


def test_stop_strings_cut_a_constrained_output(tok, config):
    engine = new_engine(tok, config)
    spec = StructuredOutputs(regex="(ab|cd)+;")
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=60, stop=["cd"], structured=spec)
    (result,) = engine.generate(["x"], params)
    c = result.outputs[0]
    assert c.finish_reason == "stop" and "cd" not in c.text and re.fullmatch("(ab)*(ab;)?", c.text), c.text


def _requests(rng, specs, num=10):
    return [
        (
            [int(t) for t in rng.integers(2, 290, rng.integers(3, 40))],
            SamplingParams(temperature=0, max_tokens=int(rng.integers(10, 60)), structured=specs[i % len(specs)]),
        )
        for i in range(num)
    ]


@pytest.mark.parametrize("seed", [0, 1])
def test_greedy_is_the_same_with_speculation_prefix_caching_and_preemption(tok, config, seed):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(2, 290, 40)]  # a common prefix: prefix-cache hits
    requests = [(shared + p, s) for p, s in _requests(rng, SPECS)]
    arrivals = [int(a) for a in rng.integers(0, 8, len(requests))]
    runs = {
        "plain": dict(enable_prefix_caching=False),
        "prefix cache": dict(enable_prefix_caching=True),
        "ngram k=4": dict(speculative=SpeculativeConfig("ngram", 4)),
        "preempted": dict(num_blocks=12, max_num_batched_tokens=32),
    }
    got = {}
    for name, kw in runs.items():
        engine = new_engine(tok, config, **kw)
        got[name] = run_with_arrivals(engine, requests, arrivals)
        if name == "preempted":
            assert engine.stats().num_preemptions > 0
        if name == "prefix cache":
            assert engine.stats().prefix_cache_hits > 0
        if name == "ngram k=4":
            assert engine.stats().spec_num_draft_tokens > 0
    for name in runs:
        assert got[name] == got["plain"], name
    for i, (_, params) in enumerate(requests):
        ids, reason = got["plain"][i]
        if reason == "stop":
            check(params.structured, tok.decode(ids))


@pytest.mark.parametrize(
    "spec, param, reason",
    [
        (StructuredOutputs(regex="[a-z"), "regex", "unclosed character class"),
        (StructuredOutputs(regex="(?<=a)b"), "regex", ""),
        (StructuredOutputs(json={"type": "strange"}), "json", "strange"),
        (StructuredOutputs(json="{not json"), "json", "not JSON"),
        (StructuredOutputs(json="[1, 2]"), "json", "object"),
        (StructuredOutputs(grammar="start: undefined_rule"), "grammar", "undefined_rule"),
        (StructuredOutputs(grammar="root ::= ("), "grammar", ""),
    ],
)
def test_a_constraint_that_cannot_compile_is_a_request_error_naming_it(tok, config, spec, param, reason):
    engine = new_engine(tok, config)
    with pytest.raises(RequestError, match=f"{spec.kind} constraint cannot be compiled.*{re.escape(reason)}") as e:
        engine.add_request([5, 6], SamplingParams(structured=spec))
    assert e.value.param == param and "\n" not in str(e.value)
    assert not engine.has_unfinished()


@pytest.mark.parametrize(
    "fields, param",
    [
        (dict(), "structured_outputs"),
        (dict(regex="a", choice=["a"]), "structured_outputs"),
        (dict(choice=[]), "choice"),
        (dict(choice=["a", ""]), "choice"),
        (dict(json=7), "json"),
        (dict(regex="a" * (256 * 1024 + 1)), "regex"),
    ],
)
def test_malformed_structured_outputs_are_refused(fields, param):
    with pytest.raises(RequestError) as e:
        StructuredOutputs(**fields)
    assert e.value.param == param


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "(a{1,100}){1,100}(b{1,100}){1,100}"},
        {"type": "string", "pattern": "((((a|b|c|d)*)*)*)*x{1000}"},
        {
            "anyOf": [
                {"type": "object", "properties": {f"k{i}": {"type": "integer"}}, "required": [f"k{i}"]}
                for i in range(300)
            ]
        },  # fmt: skip
        {"type": "array", "items": {"type": "string", "pattern": "[a-z]{1,200}"}, "minItems": 500},
    ],
)
def test_a_pathological_schema_compiles_or_is_refused_within_seconds(tok, config, schema):
    engine = new_engine(tok, config)
    start = time.perf_counter()
    try:
        engine.check_request([5], SamplingParams(structured=StructuredOutputs(json=schema)))
    except RequestError as e:
        assert e.param == "json"
    assert time.perf_counter() - start < 10


def test_grammars_are_compiled_once_per_constraint_and_tokenizer(tok, config):
    spec = StructuredOutputs(json={**PERSON, "title": "once"})  # a schema no other test compiles
    engine = new_engine(tok, config)
    compiler = engine.structured.compiler()
    before = compiler.num_compiled
    for _ in range(3):
        engine.generate(["a"], SamplingParams(temperature=0, max_tokens=30, n=2, structured=spec))
    as_text = StructuredOutputs(json=json.dumps(spec.json))
    engine.generate(["a"], SamplingParams(max_tokens=5, structured=as_text))
    another = new_engine(tok, config)  # a second engine over the same tokenizer shares the compiled grammars
    another.generate(["b"], SamplingParams(max_tokens=5, structured=spec))
    assert another.structured.compiler() is compiler and compiler.num_compiled == before + 1
    assert engine.stats().structured_requests == 4 and engine.stats().grammar_mask_steps > 0


def test_structured_output_needs_a_tokenizer(config):
    engine = LLMEngine(FakeModel(config), None)
    with pytest.raises(RequestError, match="needs a tokenizer"):
        engine.add_request([5], SamplingParams(structured=StructuredOutputs(regex="a")))


@pytest.mark.parametrize("rows", [[0, 1, 2], [0, 3]])
def test_mask_biases_exclude_exactly_the_unset_bits_of_the_rows_given(rows):
    rng = np.random.default_rng(len(rows))
    num_rows, vocab = 5, 77  # a tail word
    allowed = rng.random((num_rows, vocab)) < 0.3
    words = np.zeros((num_rows, (vocab + 31) // 32), dtype=np.uint32)
    for r, t in zip(*np.nonzero(allowed), strict=True):
        words[r, t // 32] |= np.uint32(1 << (t % 32))
    logits = rng.standard_normal((num_rows, vocab)).astype(np.float32)
    expect = logits.copy()
    expect[rows] = np.where(allowed[rows], logits[rows], -np.inf)
    filler = MaskFiller(num_rows, vocab)
    filler.bitmask[:] = words.view(np.int32)
    matchers = [GrammarMatcher(_AnyMatcher()) for _ in rows]
    filler._executor = _NoExecutor()
    bias, filled = filler.fill([(m, r, []) for m, r in zip(matchers, rows, strict=True)])
    assert filled == rows
    add_mask_biases(logits, bias, filled)
    np.testing.assert_array_equal(logits, expect)


class _AnyMatcher:
    """An llguidance matcher's stand-in for MaskFiller: the test writes the masks itself."""

    def validate_tokens(self, tokens):
        return len(tokens)


class _NoExecutor:
    def unsafe_compute_mask_ptr(self, *args):
        pass


def test_constrained_schema_closes_objects_and_bounds_numbers_within_the_callers_schema():
    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "object", "properties": {"b": {"type": "integer"}}},
            "n": {"type": ["number", "null"], "maximum": 3},
            "m": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 0},
        },
        "$defs": {"x": {"properties": {"c": {}}}},
        "allOf": [{"type": "object", "properties": {"d": {}}}],
        "items": {"type": "object", "additionalProperties": {"type": "object"}},
    }
    out = constrained_schema(schema)
    assert out["additionalProperties"] is False and out["properties"]["a"]["additionalProperties"] is False
    assert out["$defs"]["x"]["additionalProperties"] is False
    assert "additionalProperties" not in out["allOf"][0]
    assert out["items"]["additionalProperties"] == {"type": "object", "additionalProperties": False}
    b, n, m = (out["properties"]["a"]["properties"]["b"], out["properties"]["n"], out["properties"]["m"])
    assert (b["minimum"], b["maximum"], "multipleOf" in b) == (-(2**53 - 1), 2**53 - 1, False)
    assert (n["minimum"], n["maximum"], n["multipleOf"]) == (-(2**53 - 1), 3, 1e-10)
    assert "minimum" not in m and m["multipleOf"] == 0.5 and m["maximum"] == 2**53 - 1
    assert "additionalProperties" not in schema and "minimum" not in schema["properties"]["n"], "left as it was"
