"""Tool calling over the OpenAI API on the fake model: a forced call is a valid `tool_calls` whose arguments
validate, the same streamed (as `delta.tool_calls`) or not; a whole round trip with the tool's answer; bad tool
definitions and choices are 400s naming the field."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.runtime.test_server import MODEL, fake_server
from tests.runtime.test_tool_calls import NOW, SEARCH, WEATHER

TOOLS = [WEATHER, SEARCH, NOW]
SCHEMAS = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


@pytest.fixture(scope="module")
def client():
    with fake_server(context=2048) as (client, *_):  # the tools' system message is long in the fake tokenizer
        yield client


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _streamed(chunks):
    """(content, tool calls as (name, arguments), finish_reason) of a chat stream."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, ["", ""])
                entry[0] += tc.function.name or ""
                entry[1] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [tuple(calls[i]) for i in sorted(calls)], finish


@pytest.mark.parametrize("parallel", [True, False])
def test_required_gives_valid_calls_streamed_or_not(client, parallel):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=400,
              parallel_tool_calls=parallel)  # fmt: skip
    whole = client.chat.completions.create(**kw)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    _check_calls(choice.message.tool_calls)
    assert parallel or len(choice.message.tool_calls) == 1
    content, calls, finish = _streamed(client.chat.completions.create(**kw, stream=True))
    assert finish == "tool_calls" and not content
    assert calls == [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_a_named_function_is_the_one_called(client):
    for seed in range(3):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "search"}},
            temperature=1.0,
            seed=seed,
            max_tokens=300,
        )
        if r.choices[0].finish_reason != "length":
            assert len(r.choices[0].message.tool_calls) == 1
            _check_calls(r.choices[0].message.tool_calls, {"search"})


def test_a_round_trip_with_the_tools_answer(client):
    messages = list(ASK)
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300
    )
    (call,) = first.choices[0].message.tool_calls
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 7})})
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=20)
    assert final.choices[0].finish_reason in ("stop", "length", "tool_calls")
    none = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="none", max_tokens=8)
    assert none.choices[0].message.tool_calls is None


@pytest.mark.parametrize(
    "extra, param",
    [
        (dict(tools=[{"type": "function", "function": {"name": "bad name"}}]), "tools"),
        (dict(tools=[NOW, NOW]), "tools"),
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "missing"}}), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), "tool_choice"),
    ],
)
def test_bad_tools_and_choices_are_400s(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, extra_body=extra)
    assert e.value.body["param"] == param, e.value.body
