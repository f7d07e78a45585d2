"""Structured output over the OpenAI API (response_format, vLLM's structured_outputs), driven by the `openai`
client against the fake model: outputs parse and validate, greedy answers equal the sync engine's, and a
constraint that cannot compile is a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmc.runtime.engine import LLMEngine
from llmc.sampling_params import SamplingParams, StructuredOutputs
from tests.runtime.test_server import MODEL, chat_ids, fake_server, new_model


class Pet(BaseModel):
    name: str = Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = Field(ge=0, le=30)
    tags: list[Literal["small", "loud", "old"]] = Field(max_length=3)


@pytest.fixture(scope="module")
def served():
    with fake_server() as parts:
        yield parts


def test_parse_with_a_pydantic_model(served):
    client, *_ = served
    for seed in range(4):
        completion = client.chat.completions.parse(
            model=MODEL,
            messages=[{"role": "user", "content": f"a pet, please ({seed})"}],
            response_format=Pet,
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        choice = completion.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Pet)


def test_json_schema_greedy_equals_the_sync_engine_streaming_or_not(served):
    client, _, tok, config = served
    schema = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"enum": ["a", "b"]}}, "required": ["x"]}
    messages = [{"role": "user", "content": "coordinates"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": schema, "strict": True}}
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=60
    )
    chunks = client.chat.completions.create(
        model=MODEL, messages=messages, response_format=fmt, temperature=0, max_tokens=60, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    params = SamplingParams(temperature=0, max_tokens=60, structured=StructuredOutputs(json=schema))
    reference = LLMEngine(new_model(config), tok, seed=0).generate([chat_ids(tok, messages)], params)[0].outputs[0]
    assert whole.choices[0].message.content == streamed == reference.text
    jsonschema.validate(json.loads(streamed), schema)


def test_json_object(served):
    client, *_ = served
    completion = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "json"}],
        response_format={"type": "json_object"},
        temperature=0.7,
        seed=3,
        max_tokens=200,
    )
    if completion.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(completion.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "structured, matches",
    [
        ({"regex": r"[a-c]{2}\d{1,3}"}, lambda t: re.fullmatch(r"[a-c]{2}\d{1,3}", t)),
        ({"choice": ["alpha", "beta", "gamma delta"]}, lambda t: t in ("alpha", "beta", "gamma delta")),
        ({"grammar": 'start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]/'}, lambda t: re.fullmatch(r"\(\d(,\d)*\)", t)),
        ({"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}}, None),
    ],
)
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_structured_outputs_on_both_endpoints(served, structured, matches, endpoint):
    client, *_ = served
    kw = dict(model=MODEL, temperature=1.0, seed=5, max_tokens=80, n=2, extra_body={"structured_outputs": structured})
    if endpoint == "completions":
        texts = [c.text for c in client.completions.create(prompt="once upon", **kw).choices]
    else:
        messages = [{"role": "user", "content": "go"}]
        texts = [c.message.content for c in client.chat.completions.create(messages=messages, **kw).choices]
    for text in texts:
        if matches is None:
            jsonschema.validate(json.loads(text), structured["json"])
        else:
            assert matches(text), text


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex constraint cannot be compiled"),
        ({"structured_outputs": {"grammar": "start: nothing_here"}}, "structured_outputs.grammar", "nothing_here"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "list of 1 to"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
            "response_format",
            "nope",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", "needs its json_schema"),
        ({"response_format": {"type": "xml"}}, "response_format", "response_format.type"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
            "structured_outputs",
            "not both",
        ),
    ],
)
def test_a_bad_constraint_is_a_400_naming_the_field(served, extra, param, words):
    client, *_ = served
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5, extra_body=extra
        )
    error = e.value.body
    assert error["param"] == param and words in error["message"], error
    # and the server goes on
    ok = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_metrics_count_structured_requests(served):
    client, engine, *_ = served
    before = engine.stats().structured_requests
    client.completions.create(
        model=MODEL, prompt="x", max_tokens=5, extra_body={"structured_outputs": {"regex": "[0-9]{3}"}}
    )
    with openai.OpenAI(base_url=str(client.base_url).removesuffix("v1/"), api_key="unused") as root:
        text = root.get("/metrics", cast_to=str)
    assert engine.stats().structured_requests == before + 1
    assert re.search(r"^llmc:structured_requests_total\{[^}]*\} (\d+)", text, re.M)
    assert re.search(r"^llmc:grammar_mask_seconds_total\{[^}]*\} [0-9.e-]+", text, re.M)
