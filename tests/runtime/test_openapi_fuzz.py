"""The server fuzzed from its own OpenAPI schema (schemathesis, in process over ASGI, over the fake model).

Every endpoint gets valid and invalid requests generated from /openapi.json. Each answer must have a status
the schema documents, never a 5xx, the content type and body schema documented for that status; invalid
requests must be refused with a 4xx. Then the server must still answer right, with every KV block free.
"""

import dataclasses

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import create_app
from llmc.sampling_params import SamplingParams
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

NUM_BLOCKS = 64
MAX_MODEL_LEN = 96  # bounds a fuzzed request that asks for every token the context holds
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}<|assistant|>"
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
    app = create_app(AsyncLLMEngine(engine), tok, "fuzzed", TEMPLATE)
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
        assert set(responses) == {"200", "400", "404", "413", "429", "500", "503"}
        for status in set(responses) - {"200"}:
            assert responses[status]["content"]["application/json"]["schema"] == ref, (path, status)
        assert "Retry-After" in responses["429"]["headers"]
        assert set(responses["200"]["content"]) == {"application/json", "text/event-stream"}
    assert set(api_schema.raw_schema["paths"]["/health"]["get"]["responses"]) == {"200", "503"}
