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
    ToolCallStreamParser,
    call_grammar,
    check_tool_choice,
    check_tools,
    detect_tool_format,
    format_tool_calls,
    merge_deltas,
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
BOOK = {
    "type": "function",
    "function": {
        "name": "book-trip",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "legs": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 2,
                    "items": {
                        "type": "object",
                        "properties": {
                            "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
                            "class": {"enum": ["economy", "business"]},
                            "seat": {"type": ["integer", "null"], "minimum": 1, "maximum": 60},
                        },
                        "required": ["to", "class"],
                    },
                },
                "traveller": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 8}, "adult": {"type": "boolean"}},
                    "required": ["name"],
                },
            },
            "required": ["legs", "traveller"],
        },
    },
}


def _calls(*pairs):
    return [{"function": {"name": n, "arguments": json.dumps(a)}} for n, a in pairs]


@pytest.mark.parametrize(
    "template, fmt",
    [
        ("{% for t in tools %}<tool_call>{% endfor %}", "hermes"),
        ("[AVAILABLE_TOOLS]{{ tools }}[TOOL_CALLS]", "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>", "llama3_json"),
        ('Answer with {"name": function name, "parameters": ...} {{ tools }}', "llama3_json"),
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
        (
            "hermes",
            'A\n<tool_call>{"name": "now"}</tool_call>\n<tool_call>{"oops"}</tool_call>\n B  ',
            'A\n<tool_call>{"oops"}</tool_call>\n B',
            ["now"],
        ),
        (
            "hermes",
            '  <tool_call>{"name": "", "arguments": {}}</tool_call>',
            '  <tool_call>{"name": "", "arguments": {}}</tool_call>',
            [],
        ),
        (
            "hermes",
            '<tool_call>{"name": "now"}</tool_call>\n\n<tool_call>\n{"name": "no',
            '<tool_call>\n{"name": "no',
            ["now"],
        ),
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


def _call_json(fmt: str, name: str, args: dict) -> str:
    return json.dumps({"name": name, "parameters" if fmt == "llama3_json" else "arguments": args})


NAMES = st.sampled_from(["now", "get_weather", "search"])
ARGS = st.dictionaries(st.text("ab", max_size=2), st.integers() | st.text('x\n"é', max_size=3), max_size=2)
CALLS = st.lists(st.tuples(NAMES, ARGS), min_size=1, max_size=3)
# free text, with the markers' beginnings and whitespace that a parser must not mistake
TEXT = st.text(" \n<>{}[];aT_|/", max_size=8) | st.sampled_from(
    ["<tool_", "<tool_call>", "</tool_call>", "[TOOL_", "[TOOL_CALLS]", "<|python_tag|>", "{", "; ", "\n\n", "é"]
)


@st.composite
def _hermes_outputs(draw):
    parts = draw(st.lists(TEXT | CALLS.map(lambda c: c[0]) | st.just(None), max_size=6))
    return "".join(  # None: a block that does not parse
        '<tool_call>{"name": "x", "arguments": {</tool_call>'
        if p is None
        else p
        if isinstance(p, str)
        else f"<tool_call>\n{_call_json('hermes', *p)}\n</tool_call>\n"
        for p in parts
    )


@st.composite
def _llama3_outputs(draw):
    calls = "; ".join(_call_json("llama3_json", n, a) for n, a in draw(CALLS))
    return (
        draw(st.sampled_from(["", " ", "<|python_tag|>", "x "])) + calls + draw(st.sampled_from(["", "\n", ";", " x"]))
    )


@st.composite
def _mistral_outputs(draw):
    calls = draw(CALLS)
    array = json.dumps([{"name": n, "arguments": a} for n, a in calls])
    v11 = "[TOOL_CALLS]".join(f"{n}[ARGS]{json.dumps(a)}" for n, a in calls)
    body = draw(st.sampled_from([array, v11, array[:-1], "[TOOL_CALLS]"]))
    return draw(TEXT) + "[TOOL_CALLS]" + body


OUTPUTS = st.one_of(
    st.tuples(st.just("hermes"), _hermes_outputs()),
    st.tuples(st.just("llama3_json"), _llama3_outputs() | TEXT),
    st.tuples(st.just("mistral"), _mistral_outputs() | TEXT),
)


def _received(fragments: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """(content, calls as (name, arguments)) as a client joins a stream's fragments; checks each is well formed."""
    content, calls = "", []
    for fragment in fragments:
        assert list(fragment) in (["content"], ["tool_calls"]) and fragment.get("content") != ""
        for piece in fragment.get("tool_calls", []):
            if piece["index"] == len(calls):  # a call's first fragment: its id and name
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                assert piece["function"]["arguments"] == ""
                calls.append([piece["function"]["name"], ""])
            else:
                assert piece["index"] == len(calls) - 1 and "name" not in piece["function"]
                calls[-1][1] += piece["function"]["arguments"]
        content += fragment.get("content", "")
    return content, [tuple(c) for c in calls]


@settings(max_examples=400, deadline=None)
@given(OUTPUTS, st.data())
def test_the_stream_sends_what_the_whole_output_parses_to(case, data):
    fmt, text = case
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    stream = ToolCallStreamParser(fmt)
    fragments = [f for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True) for f in stream.feed(text[a:b])]
    content, calls = _received(fragments + stream.finish())
    whole = parse_tool_calls(fmt, text)
    assert calls == [(c.name, c.arguments) for c in whole.tool_calls]
    assert content == (whole.content or "")
    assert whole.tool_calls or whole.content == text


def test_free_text_streams_at_once_but_a_markers_beginning_and_trailing_blanks():
    stream = ToolCallStreamParser("hermes")
    assert stream.feed("Let me check. ") == [{"content": "Let me check."}]
    assert stream.feed("<tool_") == []
    assert stream.feed('call>{"name": "now"}') == []
    (opening,), (arguments,) = (f["tool_calls"] for f in stream.feed("</tool_call>"))
    assert opening["function"] == {"name": "now", "arguments": ""} and arguments["function"] == {"arguments": "{}"}
    assert stream.feed("\n") == [] and stream.finish() == []
    assert ToolCallStreamParser("llama3_json").feed(" Hi") == [{"content": " Hi"}]


def test_fragments_merge_into_one_delta():
    fragments = ToolCallStreamParser("hermes").feed('A<tool_call>{"name": "now"}</tool_call>B')
    assert merge_deltas(fragments) == {
        "content": "A\nB",
        "tool_calls": [
            {"index": 0, "id": fragments[1]["tool_calls"][0]["id"], "type": "function",
             "function": {"name": "now", "arguments": "{}"}},
        ],
    }  # fmt: skip
    assert merge_deltas([]) == {}


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
        ([{"type": "function", "function": {"name": "a", "parameters": 3}}], "object"),
        ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], "strict"),
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


def _random_walk(tok, lltok, grammar: str, rng, max_tokens: int = 400) -> str | None:
    """A random output the grammar allows (uniform over each step's allowed tokens, and ended half the time where
    it may end); None if not done in time."""
    matcher = llg.LLMatcher(lltok, grammar, log_level=0)
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
@pytest.mark.parametrize(
    "tools, mode, name, parallel",
    [
        (TOOLS, "required", None, True),
        (TOOLS, "required", None, False),
        (TOOLS, "named", "search", True),
        ([WEATHER, BOOK], "required", None, True),
        ([WEATHER, BOOK], "named", "book-trip", False),
    ],
)
def test_a_forced_call_parses_and_its_arguments_validate(llg_tokenizer, fmt, tools, mode, name, parallel):
    tok, lltok = llg_tokenizer
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    functions = [f for f in check_tools(tools) if mode == "required" or f["name"] == name]
    grammar = call_grammar(fmt, functions, parallel=parallel)
    rng = np.random.default_rng()
    done = 0
    for _ in range(10):
        text = _random_walk(tok, lltok, grammar, rng)
        if text is None:
            continue
        done += 1
        parsed = parse_tool_calls(fmt, text)
        assert parsed.tool_calls and parsed.content is None, text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            assert name is None or call.name == name
            jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    assert done >= 5


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
