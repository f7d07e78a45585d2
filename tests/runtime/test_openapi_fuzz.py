"""The server fuzzed from its own OpenAPI schema (schemathesis, in process over ASGI, over the fake model).

Every endpoint gets valid and invalid requests generated from /openapi.json. Each answer must have a status
the schema documents, never a 5xx, the content type and body schema documented for that status; invalid
requests must be refused with a 4xx. Then the server must still answer right, with every KV block free.

The app answers only its Host names (as `llmc serve` does) and its chat template has branches that a hostile
message takes (template bombs). A second fuzz mixes hostile requests into fuzzed ones: the bombs, wrong
Hosts, bodies not sent as JSON (a web page's form or text/plain fetch), oversized lists and prompts. Each
gets its documented refusal with OpenAI's error body, never a traceback, and the server goes on.
"""

import dataclasses
import json

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmc.chat_template import TemplateLimits
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import ServerLimits, create_app, hosts_for
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

NUM_BLOCKS = 64
MAX_MODEL_LEN = 96  # bounds a fuzzed request that asks for every token the context holds
BOMBS = {  # a message's "bomb" -> the template branch it takes: each refused (a 500 naming the template)
    "int": "{{ ((10 ** 1024) ** 1024) ** 32 }}",
    "concat": "{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}
TEMPLATE = (
    "{% for m in messages %}"
    + "".join(f"{{% {'el' * bool(i)}if m.bomb == '{k}' %}}{v}" for i, (k, v) in enumerate(BOMBS.items()))
    + "{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
    "<|assistant|>"
)
HOST = "testserver"  # the Host the ASGI transport sends
LIMITS = ServerLimits(chat_template=TemplateLimits(timeout_s=0.3), max_stop_token_ids=64)
MAX_EXAMPLES = 100  # per operation and mode: the module runs in seconds
OPERATIONS = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/models", "GET"),
    ("/health", "GET"),
    ("/metrics", "GET"),
]
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@dataclasses.dataclass(frozen=True)
class Config(FakeConfig):
    bos_token_id: int = 0


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture
def served(tok):
    """(schema, engine): a fresh app per test, since schemathesis' pytest plugin ends the app's lifespan (and so
    its engine) after each test."""
    config = Config(vocab_size=tok.get_vocab_size())
    engine = LLMEngine(FakeModel(config, num_blocks=NUM_BLOCKS), tok, max_model_len=MAX_MODEL_LEN, seed=0)
    app = create_app(
        AsyncLLMEngine(engine), tok, "fuzzed", TEMPLATE, limits=LIMITS, sites=hosts_for("127.0.0.1", [HOST])
    )
    return schemathesis.openapi.from_asgi("/openapi.json", app), engine


def check_still_answers_right(api_schema, engine):
    """Through the same in-process transport as the fuzzing (its event loop holds the engine's loop task)."""
    health = api_schema["/health"]["GET"].Case().call()
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    prompt, params = [5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0)
    r = api_schema["/v1/completions"]["POST"].Case(body={"prompt": prompt, "max_tokens": 8, "temperature": 0}).call()
    assert r.status_code == 200, r.text
    reference = LLMEngine(FakeModel(engine.model.config), engine.tokenizer, max_model_len=MAX_MODEL_LEN)
    (want,) = reference.generate([prompt], params)
    assert r.json()["choices"][0]["text"] == want.outputs[0].text
    assert r.json()["usage"]["completion_tokens"] == len(want.outputs[0].token_ids)
    assert not engine.has_unfinished() and engine.kv_cache.num_free_blocks == NUM_BLOCKS


# hypothesis drives each operation's strategy here: schemathesis' lazy pytest loader (from_fixture) breaks on
# pytest 9, and an eager one would build the app at import
@pytest.mark.parametrize(
    "path, method, mode",
    [(*op, GenerationMode.POSITIVE) for op in OPERATIONS]
    + [(*op, GenerationMode.NEGATIVE) for op in OPERATIONS if op[1] == "POST"],
)
def test_every_answer_is_documented_and_none_is_a_server_error(served, path, method, mode):
    """Negative cases only where there is something to get wrong: the GETs take no parameters."""
    api_schema, engine = served

    @given(case=api_schema[path][method].as_strategy(mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case):
        case.call_and_validate(checks=CHECKS)

    fuzz()
    check_still_answers_right(api_schema, engine)


def test_the_schema_documents_every_operation(served):
    api_schema, _ = served
    assert sorted((op.path, op.method.upper()) for op in (r.ok() for r in api_schema.get_all_operations())) == sorted(
        OPERATIONS
    )


def test_the_schema_documents_the_error_statuses_with_openais_error_body(served):
    api_schema, _ = served
    ref = {"$ref": "#/components/schemas/ErrorResponse"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = api_schema.raw_schema["paths"][path]["post"]["responses"]
        assert set(responses) == {"200", "400", "404", "408", "413", "415", "429", "500", "503"}
        for status in set(responses) - {"200"}:
            assert responses[status]["content"]["application/json"]["schema"] == ref, (path, status)
        assert "Retry-After" in responses["429"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(api_schema.raw_schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}


HOSTILE = ["bomb", "wrong_host", "not_json", "stop_token_ids", "huge_prompt", "huge_model", "tool_choice"]
CHAT_ONLY = ("bomb", "tool_choice")  # a completion has no template, and takes no tools (the field is ignored)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_requests_mixed_into_fuzzed_ones_get_their_documented_refusal(served, path):
    """Each example: a fuzzed request (valid or not), then a hostile one; every answer a documented status with
    OpenAI's error body, the hostile ones refused as they should be; then the server still answers right."""
    api_schema, engine = served
    operation = api_schema[path]["POST"]
    documented = {int(s) for s in api_schema.raw_schema["paths"][path]["post"]["responses"]}
    chat = path.endswith("chat/completions")

    def hostile(kind: str, data) -> tuple[dict, dict | bytes, int, str | None]:
        """(headers, body, status, error code) of one hostile request of `kind`."""
        body = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        body["max_tokens"] = 2
        if kind == "bomb":
            body["messages"][0]["bomb"] = data.draw(st.sampled_from(sorted(BOMBS)))
            return {}, body, 500, None
        if kind == "wrong_host":
            host = data.draw(st.sampled_from(["evil.example.com", "evil.example.com:8000", "x" * 5000, "[::1"]))
            return {"host": host}, body, 400, "invalid_host"
        if kind == "not_json":
            ctype = data.draw(
                st.sampled_from(
                    [
                        "text/plain",
                        "application/x-www-form-urlencoded",
                        "",
                        "text/json",
                        "multipart/form-data; boundary=b",
                        "application/jsonx",
                    ]
                )
            )
            return {"content-type": ctype}, json.dumps(body).encode(), 415, "unsupported_media_type"
        if kind == "stop_token_ids":
            body["stop_token_ids"] = [data.draw(st.integers(0, 10**6))] * data.draw(st.integers(65, 50_000))
            return {}, body, 400, None
        if kind == "huge_prompt":
            text = data.draw(st.sampled_from(["x", "日本", "🙂 ", "a b"])) * data.draw(st.integers(20_000, 400_000))
            if chat:
                body["messages"][0]["content"] = text
            else:
                body["prompt"] = text
            # past the context (400), unless its JSON (an emoji is 12 bytes escaped) passes the body limit first
            return {}, body, 413 if len(json.dumps(body).encode()) > LIMITS.max_body_bytes else 400, None
        if kind == "huge_model":
            body["model"] = "m" * data.draw(st.integers(1000, 1_000_000))
            return {}, body, 404, "model_not_found"
        body["tool_choice"] = data.draw(st.sampled_from(["auto", "none", {"type": "function"}]))
        return {}, body, 400, None

    kinds = HOSTILE if chat else [k for k in HOSTILE if k not in CHAT_ONLY]

    @given(case=operation.as_strategy(GenerationMode.POSITIVE), kind=st.sampled_from(kinds), data=st.data())
    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def fuzz(case, kind, data):
        r = case.call()
        assert r.status_code in documented and r.status_code < 500, (r.status_code, r.text[:300])
        headers, body, status, code = hostile(kind, data)
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = operation.Case(headers={"content-type": "application/json", **headers}).call(data=content)
        assert r.status_code == status, (kind, r.status_code, r.text[:300])
        if status != 200:
            error = r.json()["error"]
            assert error["message"] and len(r.content) < 2000 and "Traceback" not in error["message"], error
            assert code is None or error["code"] == code, error
            assert status != 500 or "chat template" in error["message"], error

    fuzz()
    check_still_answers_right(api_schema, engine)
