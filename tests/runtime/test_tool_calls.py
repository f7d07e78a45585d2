"""Tool calling's pure parts (runtime/tool_calls.py): tool definitions checked, calls parsed out of each
family's format, the stream agreeing with the whole, and the grammar of a forced call admitting only calls that
parse and whose arguments validate (driven by random walks through the grammar's masks)."""

from __future__ import annotations

import json

import jsonschema
import llguidance as llg
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from llguidance.numpy import fill_next_token_bitmask

from llmc.errors import RequestError
from llmc.examples import bundled_checkpoint
from llmc.runtime.tool_calls import (
    FORMATS,
    ToolCallStream,
    call_grammar,
    check_tool_choice,
    check_tools,
    detect_tool_format,
    format_tool_calls,
    parse_tool_calls,
    tools_system_prompt,
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
        },
    },
}
SEARCH = {
    "type": "function",
    "function": {
        "name": "search",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 16},
                "filters": {
                    "type": "object",
                    "properties": {"year": {"type": "integer", "minimum": 1990, "maximum": 2030}},
                },
                "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
            },
            "required": ["query"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, SEARCH, NOW]


def _calls(*pairs):
    return [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in pairs]


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ("{{ messages }}", "hermes"),
        (None, "hermes"),
    ],
)
def test_the_format_is_read_from_the_template(template, fmt):
    assert detect_tool_format(template) == fmt


@pytest.mark.parametrize("fmt", FORMATS)
def test_calls_written_in_each_format_parse_back(fmt):
    calls = _calls(("get_weather", {"city": "Paris", "unit": "c"}), ("now", {}))
    parsed = parse_tool_calls(fmt, format_tool_calls(fmt, calls))
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("now", {}),
    ]
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in parsed.tool_calls)


@pytest.mark.parametrize(
    "fmt, text, content, names",
    [
        (
            "hermes",
            'Let me look.\n<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
            "Let me look.",
            ["now"],
        ),
        ("hermes", '<tool_call>{"name": "now", "arguments": "{}"}</tool_call>', None, ["now"]),
        ("hermes", "<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
        ("hermes", "no calls here", "no calls here", []),
        ("llama3_json", '<|python_tag|>{"name": "now", "parameters": {}}', None, ["now"]),
        ("llama3_json", '{"name": "now", "parameters": {}}; {"name": "now", "parameters": {}}', None, ["now", "now"]),
        ("llama3_json", 'The answer is {"name": "now"}', 'The answer is {"name": "now"}', []),
        ("mistral", '[TOOL_CALLS][{"name": "now", "arguments": {}}]', None, ["now"]),
        ("mistral", '[TOOL_CALLS]now[ARGS]{"x": 1}', None, ["now"]),
        ("mistral", "[TOOL_CALLS][{broken", "[TOOL_CALLS][{broken", []),
    ],
)
def test_parsing_keeps_text_that_is_not_a_call_as_content(fmt, text, content, names):
    parsed = parse_tool_calls(fmt, text)
    assert parsed.content == content and [c.name for c in parsed.tool_calls] == names


OUTPUTS = {
    "hermes": [
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>',
        "Just text, with a < sign and <tool but no call.",
    ],
    "llama3_json": ['{"name": "search", "parameters": {"query": "x"}}; {"name": "now", "parameters": {}}', "x { y"],
    "mistral": ['[TOOL_CALLS][{"name": "now", "arguments": {}}]', "plain [TOOL text"],
}


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([(f, t) for f, ts in OUTPUTS.items() for t in ts]), st.data())
def test_the_stream_sends_what_the_whole_output_parses_to(case, data):
    fmt, text = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ToolCallStream(fmt)
    content = "".join(stream.feed(p) for p in pieces)
    rest, calls = stream.finish()
    whole = parse_tool_calls(fmt, text)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]
    if whole.tool_calls:
        assert (content + rest).strip() == (whole.content or "")
    else:
        assert content + rest == text


@pytest.mark.parametrize(
    "tools, words",
    [
        ([], "non-empty list"),
        ("x", "non-empty list"),
        ([{"type": "function"}], '{"type": "function"'),
        ([{"type": "retrieval", "function": {"name": "a"}}], '{"type": "function"'),
        ([{"type": "function", "function": {"name": "bad name!"}}], "letters, digits"),
        ([{"type": "function", "function": {"name": "a" * 65}}], "letters, digits"),
        ([NOW, NOW], "given twice"),
        ([{"type": "function", "function": {"name": "a", "parameters": {"type": "array"}}}], "object"),
        ([{"type": "function", "function": {"name": "a", "description": 3}}], "description"),
        ([NOW] * 200, "more than"),
    ],
)
def test_malformed_tools_are_refused_naming_tools(tools, words):
    with pytest.raises(RequestError) as e:
        check_tools(tools)
    assert e.value.param == "tools" and words in str(e.value), str(e.value)


def test_tool_choice_modes():
    functions = check_tools(TOOLS)
    assert check_tool_choice(None, functions) == ("auto", None)
    assert check_tool_choice("required", functions) == ("required", None)
    assert check_tool_choice({"type": "function", "function": {"name": "now"}}, functions) == ("named", "now")
    for bad in ("always", {"type": "function", "function": {"name": "missing"}}, {"type": "function"}, 3):
        with pytest.raises(RequestError) as e:
            check_tool_choice(bad, functions)
        assert e.value.param == "tool_choice"


@pytest.fixture(scope="module")
def llg_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(bundled_checkpoint() / "tokenizer.json"))
    return tok, llg.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[1])


def _random_walk(tok, lltok, grammar: str, rng, max_tokens: int = 300) -> str | None:
    """A random output the grammar allows (uniform over each step's allowed tokens, and ended half the time where
    it may end); None if not done in time."""
    matcher = llg.LLMatcher(lltok, llg.grammar_from("grammar", grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    vocab = tok.get_vocab_size()
    mask = np.full((1, (vocab + 31) // 32), -1, dtype=np.int32)
    ids = []
    for _ in range(max_tokens):
        if matcher.is_stopped():
            return tok.decode(ids, skip_special_tokens=False)
        fill_next_token_bitmask(matcher, mask)
        allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little", count=vocab))
        if 1 in allowed and rng.random() < 0.5:  # EOS, where the grammar may end: half the time
            return tok.decode(ids, skip_special_tokens=False)
        token = int(rng.choice(allowed[allowed != 1]))
        assert matcher.consume_token(token)
        ids.append(token)
    return None


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("parallel", [True, False])
def test_a_forced_call_parses_and_its_arguments_validate(llg_tokenizer, fmt, parallel):
    tok, lltok = llg_tokenizer
    functions = check_tools(TOOLS)
    schemas = {f["name"]: f["parameters"] for f in functions}
    grammar = call_grammar(fmt, functions, parallel=parallel)
    rng = np.random.default_rng(len(fmt) + parallel)
    done = 0
    for _ in range(12):
        text = _random_walk(tok, lltok, grammar, rng)
        if text is None:
            continue
        done += 1
        parsed = parse_tool_calls(fmt, text)
        assert parsed.tool_calls and parsed.content is None, text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert done >= 6


def test_free_text_or_strict_calls(llg_tokenizer):
    tok, lltok = llg_tokenizer
    grammar = call_grammar("hermes", check_tools([WEATHER]), free_text=True)
    matcher = llg.LLMatcher(lltok, llg.grammar_from("grammar", grammar), log_level=0)
    for text, ok in [
        ("It is sunny.", True),
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome","unit":"c"}}\n</tool_call>', True),
        ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Rome"}}\n</tool_call>', False),  # unit required
    ]:
        m = matcher.deep_copy()
        ids = tok.encode(text, add_special_tokens=False).ids
        assert (m.try_consume_tokens(ids) == len(ids) and m.is_accepting()) == ok, text


def test_the_system_prompt_names_every_tool_and_shows_the_format():
    prompt = tools_system_prompt("hermes", check_tools(TOOLS))
    assert all(name in prompt for name in ("get_weather", "search", "now")) and "<tool_call>" in prompt
