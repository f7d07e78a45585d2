"""--api-key: every /v1 request needs `Authorization: Bearer <key>`, checked before its body is read, in constant
time; the answer otherwise is a 401 with OpenAI's error body. /health and /metrics stay open."""

import pytest
from fastapi.testclient import TestClient

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import ServerLimits, create_app
from llmc.runtime.server import auth as server_auth
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

KEY = "sk-llmc-test-0123456789"
COMPLETION = ("/v1/completions", {"prompt": "hello", "max_tokens": 2})
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


def new_app(tok, api_key):
    model = FakeModel(FakeConfig(vocab_size=tok.get_vocab_size()))
    return create_app(AsyncLLMEngine(LLMEngine(model, tok, seed=0)), tok, "m", None, api_key=api_key)


@pytest.fixture(scope="module")
def http(tok):
    with TestClient(new_app(tok, KEY)) as client:
        yield client


def check_401(r):
    assert r.status_code == 401, r.text
    assert r.headers["www-authenticate"] == "Bearer"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["code"]) == ("invalid_request_error", "invalid_api_key")
    assert KEY not in r.text


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": "Bearer"},
        {"Authorization": KEY},
    ],
)
def test_no_key_or_a_wrong_one_gets_401_on_every_v1_endpoint(http, headers):
    for path, body in (COMPLETION, CHAT):
        check_401(http.post(path, json=body, headers=headers))
    check_401(http.get("/v1/models", headers=headers))


def test_the_key_is_checked_before_the_body_is_read(http):
    check_401(http.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"}))
    huge = b"x" * (ServerLimits().max_body_bytes + 1)
    check_401(http.post("/v1/completions", content=huge, headers={"content-type": "application/json"}))


def test_the_right_key_serves_and_health_and_metrics_stay_open(http):
    auth = {"Authorization": f"Bearer {KEY}"}
    for path, body in (COMPLETION, CHAT):
        r = http.post(path, json=body, headers=auth)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert http.get("/v1/models", headers=auth).json()["data"][0]["id"] == "m"
    assert http.get("/health").status_code == 200
    assert http.get("/metrics").status_code == 200


def test_the_key_is_compared_in_constant_time(http, monkeypatch):
    compared = []

    def compare_digest(a, b):
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(server_auth.hmac, "compare_digest", compare_digest)
    check_401(http.get("/v1/models", headers={"Authorization": "Bearer guess"}))
    assert compared == [(b"guess", KEY.encode())]


def test_without_a_key_v1_is_open_and_the_schema_documents_the_key_only_when_set(tok, http):
    with TestClient(new_app(tok, None)) as open_http:
        assert open_http.post(COMPLETION[0], json=COMPLETION[1]).status_code == 200
        open_schema = open_http.get("/openapi.json").json()
    schema = http.get("/openapi.json").json()
    assert "securitySchemes" in schema["components"] and "securitySchemes" not in open_schema.get("components", {})
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert "401" in schema["paths"][path]["post"]["responses"]
        assert "401" not in open_schema["paths"][path]["post"]["responses"]
    assert "security" not in schema["paths"]["/health"]["get"] and "security" not in schema["paths"]["/metrics"]["get"]
