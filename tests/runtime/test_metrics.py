"""GET /metrics: Prometheus text that parses, counters that move with the requests served, and gauges that show
the engine's load (KV blocks in use while a request runs, all of them free once it is done)."""

import json
import threading
import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import create_app
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

MODEL = "tiny-fake"
NUM_BLOCKS = 64


class SlowModel(FakeModel):
    delay = 0.0

    def step(self, batch):
        time.sleep(self.delay)
        return super().step(batch)


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


def new_app(tok, name=MODEL):
    model = SlowModel(FakeConfig(vocab_size=tok.get_vocab_size()), num_blocks=NUM_BLOCKS, block_size=16)
    return create_app(AsyncLLMEngine(LLMEngine(model, tok, seed=0)), tok, name, None), model


def scrape(http) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels without model_name): value} of one GET /metrics, parsed as Prometheus does."""
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            samples[(s.name, labels)] = s.value
    return samples


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_counters_and_histograms_move_with_requests(tok):
    app, _ = new_app(tok)
    with TestClient(app) as http:
        before = scrape(http)
        assert before[("llmc:prompt_tokens_total", ())] == 0
        assert before[("llmc:kv_cache_free_blocks", ())] == before[("llmc:kv_cache_blocks", ())] == NUM_BLOCKS
        r = http.post("/v1/completions", json={"prompt": "hello world", "max_tokens": 5, "ignore_eos": True})
        usage = r.json()["usage"]
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as s:
            lines = [line for line in s.iter_lines() if line.startswith("data: {")]
        chat_usage = json.loads(lines[-1][len("data: ") :])["usage"]
        wait_until(lambda: scrape(http)[("llmc:kv_cache_free_blocks", ())] == NUM_BLOCKS, what="blocks freed")
        after = scrape(http)

    prompt = usage["prompt_tokens"] + chat_usage["prompt_tokens"]
    generated = usage["completion_tokens"] + chat_usage["completion_tokens"]
    assert (usage["completion_tokens"], chat_usage["completion_tokens"]) == (5, 3)
    assert after[("llmc:prompt_tokens_total", ())] == prompt
    assert after[("llmc:generation_tokens_total", ())] == generated
    assert after[("llmc:request_success_total", (("finished_reason", "length"),))] == 2
    assert after[("llmc:time_to_first_token_seconds_count", ())] == 2
    assert after[("llmc:e2e_request_latency_seconds_count", ())] == 2
    assert after[("llmc:inter_token_latency_seconds_count", ())] == generated - 2  # the first tokens are TTFT
    assert after[("llmc:e2e_request_latency_seconds_sum", ())] >= after[("llmc:time_to_first_token_seconds_sum", ())]
    assert after[("llmc:num_requests_running", ())] == after[("llmc:num_requests_waiting", ())] == 0
    assert after[("llmc:kv_cache_usage_perc", ())] == 0.0


def test_gauges_show_a_running_request_and_its_blocks(tok):
    app, model = new_app(tok)
    model.delay = 0.02
    with TestClient(app) as http:
        done = []
        job = threading.Thread(
            target=lambda: done.append(
                http.post(
                    "/v1/completions", json={"prompt": "the quick brown fox " * 8, "max_tokens": 40, "ignore_eos": True}
                )
            )
        )
        job.start()
        try:
            wait_until(lambda: scrape(http)[("llmc:num_requests_running", ())] == 1, what="the request to run")
            busy = scrape(http)
        finally:
            job.join(timeout=30)
        assert done and done[0].status_code == 200
        wait_until(lambda: scrape(http)[("llmc:kv_cache_free_blocks", ())] == NUM_BLOCKS, what="blocks freed")
    assert busy[("llmc:kv_cache_free_blocks", ())] < NUM_BLOCKS
    assert busy[("llmc:kv_cache_usage_perc", ())] == pytest.approx(
        1 - busy[("llmc:kv_cache_free_blocks", ())] / NUM_BLOCKS
    )


def test_two_apps_in_one_process_count_apart(tok):
    """Each app has its own registry: a second app neither collides with the first nor shares its counts."""
    (a, _), (b, _) = new_app(tok, "a"), new_app(tok, "b")
    with TestClient(a) as http_a, TestClient(b) as http_b:
        assert (
            http_a.post("/v1/completions", json={"prompt": "hello", "max_tokens": 2, "ignore_eos": True}).status_code
            == 200
        )
        assert scrape(http_a)[("llmc:request_success_total", (("finished_reason", "length"),))] == 1
        assert scrape(http_b)[("llmc:request_success_total", (("finished_reason", "length"),))] == 0
        assert 'model_name="b"' in http_b.get("/metrics").text
