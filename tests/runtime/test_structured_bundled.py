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
