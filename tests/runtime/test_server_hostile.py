"""The server against a hostile client (issue 33): metrics that counted sequences as requests."""

import pytest
from fastapi.testclient import TestClient

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import create_app
from tests.runtime.runtime_fakes import byte_level_bpe
from tests.runtime.test_server import (
    MODEL,
    TEMPLATE,
    Config,
    new_model,
)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def config(tok):
    return Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=512, eos_token_ids=(1,))


def new_app(tok, config, **kw):
    engine = LLMEngine(new_model(config), tok, **kw.pop("engine_kw", {}))
    return create_app(AsyncLLMEngine(engine), kw.pop("tokenizer", tok), MODEL, kw.pop("template", TEMPLATE), **kw)


# -- item 11: metrics -------------------------------------------------------------------------------------


def scrape(http) -> dict:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            out[(s.name, s.labels.get("finished_reason"))] = s.value
    return out


def test_request_success_counts_requests_as_ttft_and_e2e_do(tok, config):
    with TestClient(new_app(tok, config)) as http:
        r = http.post("/v1/completions", json={"prompt": "hello", "n": 3, "max_tokens": 4, "ignore_eos": True})
        assert r.status_code == 200 and len(r.json()["choices"]) == 3
        m = scrape(http)
    assert m[("llmc:request_success_total", "length")] == 1
    assert m[("llmc:time_to_first_token_seconds_count", None)] == 1
    assert m[("llmc:e2e_request_latency_seconds_count", None)] == 1


@pytest.mark.parametrize("caching", [False, True])
def test_prefix_cache_queries_are_counted_only_with_caching_on(tok, config, caching):
    with TestClient(new_app(tok, config, engine_kw={"enable_prefix_caching": caching})) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json={"prompt": "hello world " * 5, "max_tokens": 2}).status_code == 200
        m = scrape(http)
    assert (m[("llmc:prefix_cache_queries_total", None)] > 0) == caching
    assert (m[("llmc:prefix_cache_hits_total", None)] > 0) == caching
