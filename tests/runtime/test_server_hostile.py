"""The server against a hostile client (issue 33): cross-site requests and DNS rebinding, prompts too long to
tokenize, unbounded lists, connections that trickle their request (slowloris), and the small things a probe
found (metrics that counted sequences as requests, an echoed model name, a wrong `param`, n and the 429).

Every refusal is a 4xx with OpenAI's error body, and the server goes on serving.
"""

import contextlib
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import ServerLimits, create_app
from tests.runtime.runtime_fakes import byte_level_bpe
from tests.runtime.test_server import (
    MODEL,
    NUM_BLOCKS,
    TEMPLATE,
    Config,
    SlowModel,
    check_raw_error,
    new_model,
    running,
    wait_until,
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


class CountingTokenizer:
    """The tokenizer, with the length of every text it encodes recorded; `slow_over` chars or more sleep `delay`."""

    def __init__(self, tok, delay=0.0, slow_over=None):
        self.tok, self.delay, self.slow_over = tok, delay, slow_over
        self.encoded: list[int] = []

    def _seen(self, text):
        self.encoded.append(len(text))
        if self.slow_over is not None and len(text) >= self.slow_over:
            time.sleep(self.delay)

    def encode(self, text, *args, **kw):
        self._seen(text)
        return self.tok.encode(text, *args, **kw)

    def encode_batch(self, texts, *args, **kw):
        for text in texts:
            self._seen(text)
        return self.tok.encode_batch(texts, *args, **kw)

    def __getattr__(self, name):
        return getattr(self.tok, name)


# -- item 2: cross-site requests and DNS rebinding ---------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x", None]
)
def test_a_body_not_sent_as_json_gets_415(tok, config, content_type):
    """A form POST or a text/plain fetch from any web page needs no CORS preflight: such bodies are never parsed."""
    with TestClient(new_app(tok, config)) as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            headers = {"content-type": content_type} if content_type else {}
            r = http.post(path, content=json.dumps(body).encode(), headers=headers)
            err = check_raw_error(r, 415)
            assert err["code"] == "unsupported_media_type" and err["type"] == "invalid_request_error"
        r = http.post("/v1/completions", json=COMPLETION, headers={"content-type": "Application/JSON; charset=utf-8"})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "bind, good, bad",
    [
        (
            "127.0.0.1",
            ["127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "localhost."],
            ["evil.example.com", "evil.example.com:8000", "127.0.0.1.evil.example.com", "10.0.0.5", "", "[::1"],
        ),
        ("localhost", ["localhost:8000", "127.0.0.1"], ["evil.example.com:8000"]),
        ("10.1.2.3", ["10.1.2.3:8000"], ["localhost:8000", "evil.example.com", "10.1.2.4"]),
        ("0.0.0.0", ["localhost:8000", "10.1.2.3:8000", "[fe80::1]:8000", "127.0.0.1"], ["evil.example.com"]),
    ],
)
def test_the_host_check_follows_the_bound_address(tok, config, bind, good, bad):
    """A DNS-rebinding page sends its own name as Host: only the names the server is served under are answered."""
    from llmc.runtime.server.sites import hosts_for

    with TestClient(new_app(tok, config, sites=hosts_for(bind))) as http:
        for host in good:
            assert http.get("/health", headers={"host": host}).status_code == 200, host
            r = http.post("/v1/completions", json=COMPLETION, headers={"host": host})
            assert r.status_code == 200, (host, r.text)
        for host in bad:
            for r in (
                http.get("/health", headers={"host": host}),
                http.get("/v1/models", headers={"host": host}),
                http.post("/v1/completions", json=COMPLETION, headers={"host": host}),
            ):
                assert check_raw_error(r, 400)["code"] == "invalid_host", host


def test_allowed_hosts_add_names_and_a_star_allows_any(tok, config):
    from llmc.runtime.server.sites import hosts_for

    with TestClient(new_app(tok, config, sites=hosts_for("127.0.0.1", ["llm.internal", "*.corp.example"]))) as http:
        for host in ("llm.internal:8000", "a.corp.example", "b.a.corp.example:1", "localhost"):
            assert http.get("/health", headers={"host": host}).status_code == 200, host
        for host in ("corp.example", "llm.internal.evil.example.com", "x" * 100_000):
            r = http.get("/health", headers={"host": host})
            assert check_raw_error(r, 400)["code"] == "invalid_host" and len(r.text) < 1000
    with TestClient(new_app(tok, config, sites=hosts_for("127.0.0.1", ["*"]))) as http:
        assert http.get("/health", headers={"host": "anything.example.com"}).status_code == 200


def test_cors_is_off_by_default_and_on_for_the_origins_named(tok, config):
    from llmc.runtime.server.sites import SitePolicy

    preflight = {
        "origin": "https://evil.example.com",
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    with TestClient(new_app(tok, config)) as http:
        r = http.options("/v1/completions", headers=preflight)
        assert r.status_code >= 400 and "access-control-allow-origin" not in r.headers
        r = http.post("/v1/completions", json=COMPLETION, headers={"origin": "https://evil.example.com"})
        assert "access-control-allow-origin" not in r.headers
    sites = SitePolicy(allowed_origins=("https://app.example.com",))
    with TestClient(new_app(tok, config, sites=sites)) as http:
        r = http.options("/v1/completions", headers={**preflight, "origin": "https://app.example.com"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"
        r = http.options("/v1/completions", headers=preflight)
        assert "access-control-allow-origin" not in r.headers
        r = http.post("/v1/completions", json=COMPLETION, headers={"origin": "https://app.example.com"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example.com"


# -- item 5: a prompt too long to fit is refused before it is tokenized ------------------------------------


def test_a_prompt_too_long_for_the_context_is_refused_without_tokenizing_it(tok, config):
    counting = CountingTokenizer(tok)
    huge = "the quick brown fox " * 195_000  # 3.9 MB: seconds of tokenizing
    with TestClient(new_app(tok, config, tokenizer=counting)) as http:
        for path, body, param in (
            ("/v1/completions", {"prompt": huge}, "prompt"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}, "messages"),
        ):
            start = time.monotonic()
            err = check_raw_error(http.post(path, json=body), 400, param)
            assert "characters long" in err["message"] and time.monotonic() - start < 2.0
        assert max(counting.encoded, default=0) < len(huge), "the long prompt was tokenized"
        assert http.post("/v1/completions", json=COMPLETION).status_code == 200


def test_long_prompts_are_tokenized_off_the_pool_that_other_requests_wait_on(tok, config):
    """Eight long prompts whose tokenizing takes a second each: a small chat request still answers at once."""
    counting = CountingTokenizer(tok, delay=1.0, slow_over=1000)
    long_prompt = "the quick brown fox jumps over the lazy dog " * 23  # 1012 characters, about 700 tokens
    config = Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=2048, eos_token_ids=(1,))
    limits = ServerLimits(tokenize_on_loop_chars=500)  # shorter prompts are tokenized at once, on the event loop
    with running(new_app(tok, config, tokenizer=counting, limits=limits)) as (base, _, _):
        with httpx.Client(base_url=base, timeout=30) as http:
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200  # warm
        results = []

        def post_long():
            with httpx.Client(base_url=base, timeout=60) as http:
                results.append(http.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 2}).status_code)

        threads = [threading.Thread(target=post_long) for _ in range(8)]
        for t in threads:
            t.start()
        wait_until(lambda: sum(n >= 1000 for n in counting.encoded) >= 1, what="a long prompt to be tokenized")
        with httpx.Client(base_url=base, timeout=30) as http:
            start = time.monotonic()
            assert http.post("/v1/chat/completions", json=CHAT).status_code == 200
            assert http.get("/health").status_code == 200
            waited = time.monotonic() - start
        for t in threads:
            t.join(timeout=60)
        assert results == [200] * 8
        assert waited < 0.9, f"a small chat request waited {waited:.2f} s behind long prompts"


# -- item 6: stop_token_ids is capped ----------------------------------------------------------------------


def test_stop_token_ids_past_the_cap_get_400(tok, config):
    with TestClient(new_app(tok, config, limits=ServerLimits(max_stop_token_ids=8))) as http:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            assert http.post(path, json={**body, "stop_token_ids": list(range(8))}).status_code == 200
            r = http.post(path, json={**body, "stop_token_ids": list(range(9)), "n": 16})
            assert "limit of 8" in check_raw_error(r, 400, "stop_token_ids")["message"]
    with TestClient(
        new_app(tok, config)
    ) as http:  # the default: far more than a model's stop tokens, far fewer than 500K
        r = http.post("/v1/completions", json={**COMPLETION, "stop_token_ids": [7] * 500_000, "n": 16})
        err = check_raw_error(r, 400, "stop_token_ids")
        assert len(err["message"]) < 500


# -- item 7: slowloris -------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(app, **config_kw):
    """(host, port) of the app under uvicorn as `serve` configures it, in a background thread."""
    from llmc.runtime.server import app as app_module

    uv = uvicorn.Server(app_module.uvicorn_config(app, "127.0.0.1", 0, log_level="warning", **config_kw))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: uv.started or not thread.is_alive(), what="uvicorn to start")
    assert uv.started
    try:
        yield uv.servers[0].sockets[0].getsockname()[:2]
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
    assert not thread.is_alive()


def closed_by_server(sock: socket.socket, timeout: float, trickle: bytes = b"") -> tuple[bool, bytes]:
    """(True, what it sent) once the server closes `sock`, sending `trickle` a byte each 0.1 s meanwhile."""
    sock.settimeout(0.1)
    got, deadline = b"", time.monotonic() + timeout
    for i in range(10**6):
        if time.monotonic() > deadline:
            return False, got
        with contextlib.suppress(OSError):
            if i < len(trickle):
                sock.sendall(trickle[i : i + 1])
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return True, got
        if not chunk:
            return True, got
        got += chunk
    return False, got


def test_slow_headers_and_bodies_time_out_and_the_server_goes_on(tok, config):
    limits = ServerLimits(header_timeout_s=0.5, body_timeout_s=1.0)
    with serving(new_app(tok, config, limits=limits)) as (host, port):
        idle = socket.create_connection((host, port))
        trickling = socket.create_connection((host, port))
        slow_body = socket.create_connection((host, port))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\ncontent-type: application/json\r\n"
        slow_body.sendall(f"{head}content-length: 1000\r\n\r\n{{".encode())
        start = time.monotonic()
        closed, sent = closed_by_server(
            trickling, 3.0, trickle=f"GET /health HTTP/1.1\r\nHost: {host}\r\n".encode() * 9
        )
        assert closed and time.monotonic() - start < 2.0, "a connection trickling its headers stayed open"
        assert b" 408 " in sent.split(b"\r\n")[0]
        assert closed_by_server(idle, 2.0)[0], "a connection that sent nothing stayed open"
        closed, sent = closed_by_server(slow_body, 3.0)
        assert closed and time.monotonic() - start < 3.0, "a connection trickling its body stayed open"
        status, _, rest = sent.partition(b"\r\n")
        assert b" 408 " in status and json.loads(rest.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        for s in (idle, trickling, slow_body):
            s.close()
        r = httpx.post(f"http://{host}:{port}/v1/completions", json=COMPLETION, timeout=10)
        assert r.status_code == 200
        # a kept-alive connection that has been answered may go on sending requests
        with httpx.Client(base_url=f"http://{host}:{port}", timeout=10) as http:
            for _ in range(3):
                assert http.get("/health").status_code == 200
                time.sleep(0.3)


def test_an_idle_kept_alive_connection_closes_after_keep_alive_s_and_not_before(tok, config):
    assert ServerLimits().keep_alive_s > httpx.Limits().keepalive_expiry  # else httpx reuses what the server closes
    with serving(new_app(tok, config, limits=ServerLimits(keep_alive_s=1.5))) as (host, port):
        sock = socket.create_connection((host, port))
        sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        answered = time.monotonic()
        closed, sent = closed_by_server(sock, 0.8)
        assert not closed and b" 200 " in sent.split(b"\r\n")[0], "closed before keep_alive_s"
        closed, _ = closed_by_server(sock, 3.0)
        assert closed and 1.4 < time.monotonic() - answered < 3.5
        sock.close()


def test_past_max_connections_a_request_gets_503_until_one_closes(tok, config):
    limits = ServerLimits(max_connections=4, header_timeout_s=30)
    with serving(new_app(tok, config, limits=limits)) as (host, port):
        held = [socket.create_connection((host, port)) for _ in range(4)]
        time.sleep(0.2)
        r = httpx.get(f"http://{host}:{port}/health", timeout=10)
        err = check_raw_error(r, 503)
        assert err["code"] == "too_many_connections" and err["type"] == "server_error"
        for s in held:
            s.close()
        wait_until(
            lambda: httpx.get(f"http://{host}:{port}/health", timeout=10).status_code == 200,
            what="the server to take connections again",
        )


# -- item 11: small things ---------------------------------------------------------------------------------


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


def test_a_404_does_not_echo_a_huge_model_name(tok, config):
    with TestClient(new_app(tok, config)) as http:
        r = http.post("/v1/completions", json={**COMPLETION, "model": "m" * 1_000_000})
        err = check_raw_error(r, 404, "model")
        assert err["code"] == "model_not_found" and len(r.content) < 1000


def test_chat_errors_name_top_logprobs_and_tool_choice(tok, config):
    with TestClient(new_app(tok, config)) as http:
        r = http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 99})
        assert "top_logprobs" in check_raw_error(r, 400, "top_logprobs")["message"]
        for choice in ("auto", "none", {"type": "function", "function": {"name": "f"}}):
            r = http.post("/v1/chat/completions", json={**CHAT, "tool_choice": choice})
            check_raw_error(r, 400, "tool_choice")
        assert http.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "top_logprobs": 2}).status_code == 200


def test_the_429_limit_counts_each_requests_choices(tok, config):
    model = SlowModel(config, num_blocks=NUM_BLOCKS, block_size=16, max_num_tokens=256, max_num_seqs=1)
    model.delay = 0.01
    engine = LLMEngine(model, tok)
    app = create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE, limits=ServerLimits(max_waiting_requests=1))
    with running(app) as (base, _, _), httpx.Client(base_url=base, timeout=60) as http:
        done = []
        long = threading.Thread(
            target=lambda: done.append(
                http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 300, "ignore_eos": True})
            )
        )
        long.start()
        wait_until(lambda: engine.scheduler.num_running == 1, what="the first request to run")
        r = http.post("/v1/completions", json={**COMPLETION, "n": 2})  # 1 + 2 sequences: more than 1 + 1
        assert check_raw_error(r, 429)["code"] == "queue_full"
        model.delay = 0.0
        long.join(timeout=60)
        assert done[0].status_code == 200
        assert http.post("/v1/completions", json={**COMPLETION, "n": 2}).status_code == 200  # alone, it runs
