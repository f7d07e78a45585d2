"""Structured output and tools against a live `llmc serve` of the bundled model (tiny, and never trained to call
tools): the openai client's parse with a pydantic model, a tool round trip streamed and not, and the OpenAI
Agents SDK's own loop (a tool call, the tool run, the final answer) pointed at the server."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import pytest
from pydantic import BaseModel, Field

from llmc.examples import bundled_checkpoint
from llmc.tools.build import cached_artifact
from tests.runtime.test_tool_calls import WEATHER
from tests.test_serve_live import _serving


class Module(BaseModel):
    name: str = Field(max_length=20)
    kind: Literal["builtin", "stdlib", "third-party"]
    functions: list[str] = Field(max_length=3)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    artifact = cached_artifact(bundled_checkpoint(), progress=False)
    with _serving(artifact, tmp_path_factory.mktemp("serve"), ("--kv-cache-memory", "64MiB")) as (server,):
        yield server, artifact.resolve().name


def test_parse_with_a_pydantic_model(server):
    live, model = server
    with live.client() as client:
        for seed in range(3):
            completion = client.chat.completions.parse(
                model=model,
                messages=[{"role": "user", "content": "Describe the json module."}],
                response_format=Module,
                temperature=0.8,
                seed=seed,
                max_tokens=200,
            )
            assert completion.choices[0].finish_reason == "stop"
            assert isinstance(completion.choices[0].message.parsed, Module)


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_round_trip(server, stream):
    live, model = server
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    with live.client() as client:
        kw = dict(model=model, tools=[WEATHER], max_tokens=120, parallel_tool_calls=False)
        if stream:
            name, arguments, finish, call_id = "", "", None, None
            for chunk in client.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kw):
                for choice in chunk.choices:
                    for tc in choice.delta.tool_calls or []:
                        name += tc.function.name or ""
                        arguments += tc.function.arguments or ""
                        call_id = tc.id or call_id
                    finish = choice.finish_reason or finish
            calls = [{"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
        else:
            first = client.chat.completions.create(messages=messages, tool_choice="required", **kw)
            finish = first.choices[0].finish_reason
            (call,) = first.choices[0].message.tool_calls
            name, arguments, call_id = call.function.name, call.function.arguments, call.id
            messages.append(first.choices[0].message.model_dump(exclude_none=True))
        assert finish == "tool_calls" and name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER["function"]["parameters"])
        messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps({"celsius": 18})})
        final = client.chat.completions.create(messages=messages, **kw)
        assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content


def test_the_openai_agents_sdk_loop(server):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    live, model = server
    seen: list[tuple[str, str]] = []

    @agents.function_tool
    def get_weather(city: str, unit: Literal["celsius", "fahrenheit"]) -> str:
        """The current weather of a city."""
        seen.append((city, unit))
        return f"18 degrees {unit} in {city}"

    client = AsyncOpenAI(base_url=f"{live.base}/v1", api_key="x", max_retries=0, timeout=30)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=agents.OpenAIChatCompletionsModel(model=model, openai_client=client),
        # greedy, and room for the call in the 512-token context: the SDK leaves `city` unbounded, a cut call is none
        model_settings=agents.ModelSettings(
            tool_choice="required", temperature=0, max_tokens=100, parallel_tool_calls=False
        ),
    )
    agents.set_tracing_disabled(True)
    result = agents.Runner.run_sync(agent, "What is the weather in Paris?", max_turns=4)
    assert seen, "the agent's loop called the tool"
    assert isinstance(result.final_output, str) and result.final_output
