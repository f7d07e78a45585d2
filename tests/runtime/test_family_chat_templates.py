"""The chat templates of the families llmc compiles (chat_templates/: each family's template structure and the
Jinja it uses: namespaces, reversed slices, str methods, `is string`, strftime_now, tojson(indent=...),
`{% generation %}`, raise_exception) render in the sandbox as transformers renders them; a refusal is a 400
that carries the template's message; `chat_template_kwargs` reaches the template; the chat REPL runs with each."""

import io
from pathlib import Path

import pytest

from llmc.chat_template import render_chat
from llmc.errors import RequestError
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.chat import run_chat
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import create_app
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe
from tests.runtime.test_server import MODEL, check_raw_error, check_still_serving, new_model, post, running

TEMPLATES = {p.stem: p.read_text() for p in sorted((Path(__file__).parent / "chat_templates").glob("*.jinja"))}
NO_SYSTEM = {"gemma2"}  # its template refuses a system turn
RENDERS_TOOLS = {"qwen3", "granite3", "smollm3"}

SYSTEM = {"role": "system", "content": "You are terse. Answer in one line."}
TURNS = [
    {"role": "user", "content": "  What is 2 + 2? é 🙂 "},
    {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
    {"role": "user", "content": "And 3 + 3?"},
]
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ],
    },
    {"role": "tool", "content": '{"temp_c": 21}', "tool_call_id": "c1"},
]


def transformers_render(template, messages, **kwargs):
    cu = pytest.importorskip("transformers.utils.chat_template_utils")
    (text,), _ = cu.render_jinja_template(
        [messages], chat_template=template, bos_token="<s>", eos_token="</s>", **kwargs
    )
    return text


def conversations(family):
    yield TURNS[:1]
    yield TURNS
    if family not in NO_SYSTEM:
        yield [SYSTEM, *TURNS]
        yield [{"role": "system", "content": "Be brief. /no_think"}, *TURNS[:1]]


@pytest.mark.parametrize("family", TEMPLATES)
def test_renders_as_transformers(family):
    template = TEMPLATES[family]
    for messages in conversations(family):
        for add in (True, False):
            want = transformers_render(template, messages, add_generation_prompt=add)
            assert render_chat(template, messages, "<s>", "</s>", add_generation_prompt=add) == want, messages


@pytest.mark.parametrize("family", sorted(RENDERS_TOOLS))
def test_renders_tools_and_tool_turns_as_transformers(family):
    template = TEMPLATES[family]
    messages = TOOL_TURNS if family != "smollm3" else TOOL_TURNS[:1]
    want = transformers_render(template, messages, add_generation_prompt=True, tools=[TOOL])
    assert render_chat(template, messages, "<s>", "</s>", tools=[TOOL]) == want
    assert "get_weather" in want


@pytest.mark.parametrize("family", ["qwen3", "smollm3"])
def test_enable_thinking_reaches_the_template(family):
    template, messages = TEMPLATES[family], TURNS[:1]
    off = render_chat(template, messages, template_kwargs={"enable_thinking": False})
    assert off == transformers_render(template, messages, add_generation_prompt=True, enable_thinking=False)
    assert off != render_chat(template, messages) and off.endswith("<think>\n\n</think>\n" + "\n" * (family == "qwen3"))
    with pytest.raises(RequestError, match="may not set messages"):
        render_chat(template, messages, template_kwargs={"messages": []})


def test_gemma2_refuses_a_system_turn_with_its_own_message():
    with pytest.raises(RequestError, match="System role not supported"):
        render_chat(TEMPLATES["gemma2"], [SYSTEM, *TURNS])
    with pytest.raises(RequestError, match="roles must alternate"):
        render_chat(TEMPLATES["gemma2"], TURNS[:1] * 2)


def test_the_server_answers_a_refusal_400_with_the_template_message_and_takes_template_kwargs():
    tok = byte_level_bpe()
    config = FakeConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=512, eos_token_ids=(1,))
    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok, seed=0))
    with running(create_app(engine, tok, MODEL, TEMPLATES["gemma2"])) as (base, _, _):
        r = post(base, "/v1/chat/completions", {"messages": [SYSTEM, TURNS[0]], "max_tokens": 2})
        assert "System role not supported" in check_raw_error(r, 400)["message"]
        body = {"messages": TURNS[:1], "max_tokens": 2, "chat_template_kwargs": {"add_generation_prompt": False}}
        assert check_raw_error(post(base, "/v1/chat/completions", body), 400, "chat_template_kwargs")
        body = {"messages": TURNS[:1], "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
        assert post(base, "/v1/chat/completions", body).status_code == 200
        check_still_serving(base)


@pytest.mark.parametrize("family", TEMPLATES)
def test_the_chat_repl_runs_with_the_template(family):
    tok = byte_level_bpe()
    config = FakeConfig(vocab_size=tok.get_vocab_size(), max_position_embeddings=2048)
    engine = LLMEngine(FakeModel(config, num_blocks=128), tok, seed=0)
    out = io.StringIO()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    history = run_chat(engine, tok, TEMPLATES[family], params, input=io.StringIO("hi\nand then?\n"), output=out)
    assert [m["role"] for m in history] == ["user", "assistant"] * 2
    assert "error" not in out.getvalue()
