"""Structured output on the bundled model (tiny, and never trained on JSON): every output of a suite of JSON
schemas validates with `jsonschema`; regex, choice and Lark-grammar outputs match by their own matchers."""

from __future__ import annotations

import json
import re

import jsonschema
import lark
import pytest
from tokenizers import Tokenizer

from llmc.examples import bundled_checkpoint
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel
from llmc.sampling_params import SamplingParams, StructuredOutputs
from llmc.tools.build import cached_artifact
from tests.runtime.structured_schemas import SCHEMAS

PROMPTS = ["The list type", "def main(", "Return a JSON object describing", "class Queue:"]


@pytest.fixture(scope="module")
def engine():
    artifact = cached_artifact(bundled_checkpoint(), progress=False)
    with CompiledModel.load(artifact, max_num_seqs=32, max_num_tokens=512) as model:
        yield LLMEngine(model, Tokenizer.from_file(str(artifact / "tokenizer.json")), seed=0)


def test_the_suite_has_at_least_50_schemas_each_valid():
    assert len(SCHEMAS) >= 50
    for schema in SCHEMAS:
        jsonschema.Draft202012Validator.check_schema(schema)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_json_schema_output_validates(engine, temperature):
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=400, structured=StructuredOutputs(json=s))
        for i, s in enumerate(SCHEMAS)
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(SCHEMAS))]
    for i, result in enumerate(engine.generate(prompts, params)):
        c = result.outputs[0]
        assert c.finish_reason == "stop", (i, c.finish_reason, c.text[-200:])
        jsonschema.validate(json.loads(c.text), SCHEMAS[i], format_checker=jsonschema.FormatChecker())


GRAMMAR = r"""
start: call
call: NAME "(" [arg ("," arg)*] ")"
arg: NAME "=" (NUMBER | STRING)
NAME: /[a-z_][a-z0-9_]{0,11}/
NUMBER: /[0-9]{1,4}/
STRING: /"[a-z ]{0,12}"/
"""


@pytest.mark.parametrize(
    "spec, matches",
    [
        (StructuredOutputs(regex=r"[0-9]{3}-[a-z]{2,5}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t)),
        (
            StructuredOutputs(regex=r"(def|class) [A-Za-z_]{1,10}:"),
            lambda t: re.fullmatch(r"(def|class) [A-Za-z_]{1,10}:", t),
        ),
        (StructuredOutputs(choice=["list", "dict", "tuple", "set"]), lambda t: t in ("list", "dict", "tuple", "set")),
        (StructuredOutputs(grammar=GRAMMAR), lambda t: lark.Lark(GRAMMAR).parse(t)),
    ],
)
def test_regex_choice_and_grammar_outputs_match(engine, spec, matches):
    params = SamplingParams(temperature=1.0, seed=11, n=4, max_tokens=200, structured=spec)
    for result in engine.generate(PROMPTS, params):
        for c in result.outputs:
            assert c.finish_reason == "stop", c.text
            assert matches(c.text), c.text


def test_greedy_structured_output_is_the_same_with_speculation_prefix_caching_and_preemption():
    """On the compiled model: n-gram speculation (K = 4), prefix caching off, and a KV cache of 12 blocks (one
    request fits, eight do not: they are preempted and recomputed) all give the same tokens."""
    from llmc.runtime.spec_decode import SpeculativeConfig
    from tests.runtime.runtime_fakes import run_with_arrivals

    artifact = cached_artifact(bundled_checkpoint(), progress=False)
    tokenizer = Tokenizer.from_file(str(artifact / "tokenizer.json"))
    shared = tokenizer.encode("The list type is a mutable sequence, and ").ids
    requests = [
        (
            shared + tokenizer.encode(p, add_special_tokens=False).ids,
            SamplingParams(temperature=0, max_tokens=150, structured=StructuredOutputs(json=s)),
        )
        for p, s in zip(PROMPTS * 3, SCHEMAS[22:34], strict=True)
    ]
    arrivals = [0] * 8 + [2] * 4
    with CompiledModel.load(artifact, max_num_seqs=8) as model:
        per_block = model.kv_cache_bytes // model.num_blocks
    runs = {
        "plain": ({}, {}),
        "no prefix cache": ({}, dict(enable_prefix_caching=False)),
        "ngram k=4": ({}, dict(speculative=SpeculativeConfig("ngram", 4))),
        "preempted": (dict(kv_cache_memory=12 * per_block), {}),
    }
    got = {}
    for name, (load, kw) in runs.items():
        with CompiledModel.load(artifact, max_num_seqs=8, max_num_logits=8 * 5, **load) as model:
            engine = LLMEngine(model, tokenizer, **kw)
            got[name] = run_with_arrivals(engine, requests, arrivals)
            stats = engine.stats()
        assert name != "preempted" or stats.num_preemptions > 0, stats
        assert name != "ngram k=4" or stats.spec_num_accepted_tokens > 0, stats
    for name in runs:
        assert got[name] == got["plain"], name
    for i, (_, params) in enumerate(requests):
        ids, reason = got["plain"][i]
        if reason == "stop":
            jsonschema.validate(json.loads(tokenizer.decode(ids)), params.structured.json)
