"""The OpenAI-compatible server, driven by the official `openai` client against uvicorn on a free port.

Every answer is checked against the same request run alone through a sync LLMEngine (greedy, or seeded).
"""

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import json
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from llmc.chat_template import TemplateLimits
from llmc.errors import ArtifactError
from llmc.runtime.async_engine import AsyncLLMEngine
from llmc.runtime.chat_template import chat_prompt_ids
from llmc.runtime.engine import LLMEngine
from llmc.runtime.server import ServerLimits, create_app
from llmc.sampling_params import SamplingParams
from tests.openai_ask import ask
from tests.runtime.runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

MODEL = "tiny-fake"
NUM_BLOCKS = 128
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = ["hello world", "the quick brown fox", "naïve café", "emoji 🙂 and", "日本語", "this is a small"]


@dataclasses.dataclass(frozen=True)
class Config(FakeConfig):
    bos_token_id: int = 0


class SlowModel(FakeModel):
    """The fake model, with an optional sleep per step so that a test can act while a request runs, and a
    poison token: a step that holds it raises, as a model bug would."""

    delay = 0.0
    poison_token: int | None = None

    def step(self, batch):
        if self.delay:
            time.sleep(self.delay)
        if self.poison_token is not None and self.poison_token in batch.token_ids:
            raise RuntimeError("the model failed on this batch")
        return super().step(batch)


def wait_until(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def tok():
    return byte_level_bpe()


@pytest.fixture(scope="module")
def config(tok):
    return Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=512, eos_token_ids=(1,))


def new_model(config):
    return SlowModel(config, num_blocks=NUM_BLOCKS, block_size=16, max_num_tokens=256, max_num_seqs=16)


@contextlib.contextmanager
def running(app):
    """(base_url, uvicorn server, its event loop): the app served in a background thread until the block ends."""
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    loops = []

    def run():
        loop = asyncio.new_event_loop()
        loops.append(loop)
        loop.run_until_complete(uv.serve())

    thread = threading.Thread(target=run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: uv.started or not thread.is_alive(), what="uvicorn to start")
    assert uv.started, "uvicorn did not start"
    port = uv.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", uv, loops[0]
    finally:
        uv.should_exit = True
        thread.join(timeout=15)
    assert not thread.is_alive(), "uvicorn did not stop"


@contextlib.contextmanager
def fake_server(context: int = 512):
    """(openai client, engine, tokenizer, config): the fake model served in a background thread; on exit the
    engine must be idle."""
    tok = byte_level_bpe()
    config = Config(vocab_size=tok.get_vocab_size(), max_position_embeddings=context, eos_token_ids=(1,))
    engine = LLMEngine(new_model(config), tok, seed=0)
    with running(create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE)) as (base, _, _):
        with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30) as client:
            yield client, engine, tok, config
    wait_until(lambda: not engine.has_unfinished(), what="the engine to go idle")


@pytest.fixture(scope="module")
def server(tok, config):
    """(base_url, engine, model): uvicorn in a background thread, stopped at the end of the module."""
    engine = LLMEngine(new_model(config), tok, seed=0)
    with running(create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE)) as (base, _, _):
        yield base, engine, engine.model


@pytest.fixture
def client(server):
    base, engine, model = server
    model.delay, model.poison_token = 0.0, None
    with openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c
    # every test leaves the engine idle with all blocks free
    wait_until(lambda: not engine.has_unfinished(), what="the engine to go idle")
    assert engine.kv_cache.num_free_blocks == NUM_BLOCKS


def reference(tok, config, prompt_ids, params):
    """The same request alone through a fresh sync engine."""
    engine = LLMEngine(new_model(config), tok, seed=0)
    return engine.generate([prompt_ids], params)[0].outputs


def chat_ids(tok, messages):
    return chat_prompt_ids(tok, TEMPLATE, messages, "<s>", "</s>")


GREEDY = dict(temperature=0.0)


# -- basics ------------------------------------------------------------------------------------------------


def test_models_and_health(server, client):
    base, engine, _ = server
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    r = httpx.get(f"{base}/health", timeout=10)
    assert r.status_code == 200


@pytest.mark.parametrize("as_ids", [False, True])
def test_completion_matches_the_sync_engine(client, tok, config, as_ids):
    prompt_ids = tok.encode(PROMPTS[1]).ids
    r = client.completions.create(model=MODEL, prompt=prompt_ids if as_ids else PROMPTS[1], max_tokens=12, **GREEDY)
    (want,) = reference(tok, config, prompt_ids, SamplingParams(max_tokens=12, **GREEDY))
    assert r.object == "text_completion" and r.model == MODEL
    assert r.choices[0].text == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert r.usage.prompt_tokens == len(prompt_ids)
    assert r.usage.completion_tokens == len(want.token_ids)
    assert r.usage.total_tokens == len(prompt_ids) + len(want.token_ids)


def test_completion_stream(client, tok, config):
    prompt_ids = tok.encode(PROMPTS[0]).ids
    params = SamplingParams(max_tokens=20, ignore_eos=True, **GREEDY)
    (want,) = reference(tok, config, prompt_ids, params)
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS[0],
            max_tokens=20,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1
    assert "".join(c.choices[0].text for c in text_chunks) == want.text
    assert [c.choices[0].finish_reason for c in text_chunks] == [None] * (len(text_chunks) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == len(prompt_ids)


def test_chat_matches_the_sync_engine(client, tok, config):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[2]}]
    prompt_ids = chat_ids(tok, messages)
    assert tok.decode(prompt_ids[:1], skip_special_tokens=False) == "<s>"  # bos_token from config.bos_token_id
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=15, **GREEDY)
    (want,) = reference(tok, config, prompt_ids, SamplingParams(max_tokens=15, **GREEDY))
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.choices[0].finish_reason == want.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids), len(want.token_ids))


def test_chat_stream_role_then_content_then_finish(client, tok, config):
    messages = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[3]}]}]
    prompt_ids = chat_ids(tok, [{"role": "user", "content": PROMPTS[3]}])
    (want,) = reference(tok, config, prompt_ids, SamplingParams(max_tokens=25, ignore_eos=True, **GREEDY))
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=25, stream=True, extra_body={"ignore_eos": True}, **GREEDY
        )
    )
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_stop_string_and_max_tokens(client, tok, config):
    prompt_ids = tok.encode(PROMPTS[4]).ids
    (long,) = reference(tok, config, prompt_ids, SamplingParams(max_tokens=40, ignore_eos=True, **GREEDY))
    stop = long.text[len(long.text) // 2 : len(long.text) // 2 + 2]
    assert stop.strip() and "\ufffd" not in stop
    cut = long.text.index(stop)
    for stream in (False, True):
        r = client.completions.create(
            model=MODEL,
            prompt=PROMPTS[4],
            max_tokens=40,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        if stream:
            chunks = list(r)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (long.text[:cut], "stop")

    r = client.completions.create(
        model=MODEL, prompt=PROMPTS[4], max_tokens=5, extra_body={"ignore_eos": True}, **GREEDY
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert long.text.startswith(r.choices[0].text)


def test_n_and_seed_and_logprobs(client, tok, config):
    prompt_ids = tok.encode(PROMPTS[5]).ids
    params = SamplingParams(n=3, temperature=0.9, top_k=20, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    want = reference(tok, config, prompt_ids, params)
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPTS[5],
        n=3,
        temperature=0.9,
        seed=7,
        max_tokens=10,
        logprobs=2,
        extra_body={"top_k": 20, "ignore_eos": True},
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.text == want[c.index].text
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
        assert lp.token_logprobs == pytest.approx(
            [d[t] for t, d in zip(want[c.index].token_ids, want[c.index].logprobs, strict=True)]
        )
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert r.usage.completion_tokens == 30

    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
        **GREEDY,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the sampled token is the top one
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


# -- errors ------------------------------------------------------------------------------------------------


def check_error(exc_info, status, param=None):
    assert exc_info.value.status_code == status
    body = exc_info.value.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


@pytest.mark.parametrize(
    "kwargs, param",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n"),
        (dict(extra_body={"max_tokens": "many"}), "max_tokens"),
        (dict(extra_body={"stop_token_ids": "x"}), "stop_token_ids"),
        (dict(extra_body={"min_tokens": 10}, max_tokens=5), "min_tokens"),
        (dict(logprobs=99), "logprobs"),
        (dict(extra_body={"prompt": list(range(600))}), "prompt"),  # longer than the context of 512
        (dict(extra_body={"prompt": [5, 100000]}), "prompt"),  # outside the vocabulary
        (dict(extra_body={"prompt": []}), "prompt"),
        (dict(extra_body={"prompt": ["a", "b"]}), "prompt"),
        (dict(echo=True), "echo"),
    ],
)
@pytest.mark.parametrize("stream", [False, True])
def test_bad_completion_requests_get_400_and_the_server_goes_on(client, tok, config, kwargs, param, stream):
    kwargs = {"model": MODEL, "prompt": "hello", "max_tokens": 4, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc_info:
        r = client.completions.create(stream=stream, **kwargs)
        list(r) if stream else None
    check_error(exc_info, 400, param)
    r = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, **GREEDY)
    assert r.usage.completion_tokens >= 1


def test_bad_chat_requests_and_raw_http(server, client):
    base, _, _ = server
    for kwargs, param in (
        (dict(messages=[]), "messages"),
        (dict(messages=[{"role": "user", "content": "x"}], temperature=-0.5), "temperature"),
        (dict(messages=[{"role": "user", "content": "x"}], extra_body={"top_logprobs": 2}), "top_logprobs"),
        (
            dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
            "messages.0.content",
        ),
        (dict(messages=[{"role": "user"}] * 2 + [{"role": "user", "content": "z" * 3000}]), "messages"),  # too long
        (dict(messages=[{"role": "user", "content": "x"}], extra_body={"tools": [{"type": "function"}]}), "tools"),
    ):
        with pytest.raises(openai.BadRequestError) as exc_info:
            client.chat.completions.create(model=MODEL, **kwargs)
        check_error(exc_info, 400, param)

    with pytest.raises(openai.NotFoundError) as exc_info:
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert exc_info.value.response.json()["error"]["code"] == "model_not_found"

    url = f"{base}/v1/completions"
    for body, headers in [
        (b"{not json", {"content-type": "application/json"}),
        (b'["a list"]', {"content-type": "application/json"}),
        (b'{"prompt": "hi", "temperature": "hot"}', {"content-type": "application/json"}),
        (b'{"temperature": 0}', {"content-type": "application/json"}),  # no prompt
    ]:
        r = httpx.post(url, content=body, headers=headers, timeout=10)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    for body, headers in [
        (b'{"prompt": "hi"}', {"content-type": "text/plain"}),  # never parsed: a page's form or fetch
        (b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ]:
        r = httpx.post(url, content=body, headers=headers, timeout=10)
        assert r.status_code == 415, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    r = httpx.get(f"{base}/v1/nothing", timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(url, json={"prompt": "hi", "max_tokens": 2}, timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


# -- cancellation and concurrency --------------------------------------------------------------------------


def test_client_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    base, engine, model = server
    model.delay = 0.01  # 400 tokens would take >= 4 s
    steps_before = model.num_steps
    stream = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    got = 0
    for chunk in stream:
        got += len(chunk.choices[0].text)
        if got >= 3:
            break
    assert engine.has_unfinished()
    stream.close()  # the client hangs up
    wait_until(lambda: not engine.has_unfinished(), what="the aborted request to leave the engine")
    assert engine.kv_cache.num_free_blocks == NUM_BLOCKS
    assert model.num_steps - steps_before < 300, "the request ran on after the client left"


def test_client_disconnect_while_waiting_aborts(server, client):
    base, engine, model = server
    model.delay = 0.01
    steps_before = model.num_steps
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{base}/v1/completions",
            json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True},
            timeout=httpx.Timeout(10, read=0.5),
        )
    wait_until(lambda: not engine.has_unfinished(), what="the aborted request to leave the engine")
    assert engine.kv_cache.num_free_blocks == NUM_BLOCKS
    assert model.num_steps - steps_before < 300


def test_32_concurrent_clients_each_get_their_own_answer(server, client, tok, config):
    _, _, model = server
    model.delay = 0.002  # let requests pile up, so that they share steps
    model.max_batch_seen = 0
    jobs = []
    for i in range(32):
        prompt = f"{PROMPTS[i % len(PROMPTS)]} {i}"
        jobs.append((prompt, 8 + i % 13, i % 2 == 1, i % 4 >= 2))  # prompt, max_tokens, stream, chat

    def expected(prompt, max_tokens, chat):
        ids = chat_ids(tok, [{"role": "user", "content": prompt}]) if chat else tok.encode(prompt).ids
        (want,) = reference(tok, config, ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
        return want.text, want.finish_reason

    def run(job):
        prompt, max_tokens, stream, chat = job
        return ask(client, MODEL, prompt, max_tokens=max_tokens, stream=stream, chat=chat, **GREEDY)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        futures = [pool.submit(run, job) for job in jobs]
        got = [f.result(timeout=120) for f in futures]
    assert model.max_batch_seen > 2, "the requests did not run batched"
    for job, answer in zip(jobs, got, strict=True):
        assert answer == expected(job[0], job[1], job[3]), job


def test_health_turns_503_when_the_engine_loop_failed(tok, config):
    from fastapi.testclient import TestClient

    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    with TestClient(create_app(engine, tok, MODEL, TEMPLATE)) as http:
        assert http.get("/health").status_code == 200
        engine._error = RuntimeError("a step raised")  # what the loop records when a step fails
        response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "error"


# -- hardening: a bad request fails alone ------------------------------------------------------------------


def post(base, path, body, timeout=30):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{base}{path}", content=content, headers={"content-type": "application/json"}, timeout=timeout)


def check_raw_error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def check_still_serving(base):
    r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200


@pytest.mark.parametrize(
    "path, extra",
    [
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
@pytest.mark.parametrize(
    "fields, param",
    [
        ({"seed": -1}, "seed"),  # once raised inside the engine loop and took the server down for good
        ({"seed": 2**64}, "seed"),
        ({"n": 17}, "n"),  # past ServerLimits.max_n
        ({"n": 100000}, "n"),
        ({"temperature": 1e30}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"presence_penalty": float("-inf")}, "presence_penalty"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": "y" * 257}, "stop"),
        ({"max_tokens": 600}, "max_tokens"),  # prompt + max_tokens past the context of 512
        ({"stop_token_ids": [10**30]}, "stop_token_ids"),  # once an overflow deep in the sampler
    ],
)
def test_bad_values_get_400_naming_the_param_and_the_engine_lives_on(server, client, path, extra, fields, param):
    base, _, _ = server
    for stream in (False, True):
        check_raw_error(post(base, path, {**extra, **fields, "stream": stream}), 400, param)
    check_still_serving(base)


def test_non_finite_json_numbers_and_lone_surrogates_get_400(server, client):
    base, _, _ = server
    for raw in (
        b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "hi", "temperature": 1e999}',
        b'{"prompt": "a\\ud800b"}',
        b'{"messages": [{"role": "user", "content": "\\udfff"}]}',
    ):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        check_raw_error(post(base, path, raw), 400)
    check_still_serving(base)


def test_a_request_whose_step_fails_fails_alone(server, client, tok):
    base, _, model = server
    model.poison_token = tok.encode("rockets").ids[0]
    for stream in (False, True):  # the failure comes with the first output, before a stream starts
        r = post(base, "/v1/completions", {"prompt": "rockets", "max_tokens": 4, "stream": stream})
        err = check_raw_error(r, 500)
        assert err["type"] == "server_error" and "the model failed" in err["message"]
    model.poison_token = None
    check_still_serving(base)


def test_body_over_the_limit_gets_413_by_length_and_by_count(tok, config):
    from fastapi.testclient import TestClient

    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    app = create_app(engine, tok, MODEL, TEMPLATE, limits=ServerLimits(max_body_bytes=1000))
    big = json.dumps({"prompt": "x" * 2000}).encode()
    with TestClient(app) as http:
        r = http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
        assert check_raw_error(r, 413)["code"] == "request_too_large"
        r = http.post(
            "/v1/completions",
            content=iter([big[:600], big[600:]]),  # chunked: no Content-Length
            headers={"content-type": "application/json"},
        )
        check_raw_error(r, 413)
        r = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200


def test_a_full_queue_gets_429_with_retry_after(tok, config):
    model = SlowModel(config, num_blocks=NUM_BLOCKS, block_size=16, max_num_tokens=256, max_num_seqs=1)
    model.delay = 0.01
    engine = LLMEngine(model, tok)
    app = create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE, limits=ServerLimits(max_waiting_requests=1))
    with running(app) as (base, _, _), concurrent.futures.ThreadPoolExecutor(2) as pool:
        long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
        busy = [pool.submit(post, base, "/v1/completions", long) for _ in range(2)]  # one running, one waiting
        wait_until(lambda: engine.scheduler.num_waiting == 1, what="a request to wait")
        r = post(base, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert check_raw_error(r, 429)["code"] == "queue_full"
        assert r.headers["retry-after"] == "1"
        model.delay = 0.0
        assert [f.result(timeout=60).status_code for f in busy] == [200, 200]
        check_still_serving(base)


HOSTILE_TEMPLATES = {
    "python internals": "{{ messages.__class__.__mro__[1].__subclasses__() }}",
    "a huge loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "a huge literal": "{{ 'a' * 1000000000 }}",
    "a huge output": "{% for i in range(100000) %}{{ messages }}{{ 'x' * 100000 }}{% endfor %}",
    # 10^10 comparisons in one C call: a render in the server's process would hold the GIL for seconds
    "one long C call": "{% set a = ['x'] * 100000 %}{% set b = ['x'] * 100000 %}{{ [a] * 100000 == [b] * 100000 }}",
}


@pytest.mark.parametrize("name", HOSTILE_TEMPLATES)
def test_a_hostile_chat_template_is_refused_and_the_server_keeps_answering(tok, config, name):
    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    limits = ServerLimits(chat_template=TemplateLimits(timeout_s=0.5))
    app = create_app(engine, tok, MODEL, HOSTILE_TEMPLATES[name], limits=limits)
    with running(app) as (base, _, _):
        start = time.monotonic()
        r = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert time.monotonic() - start < 5
        err = check_raw_error(r, 500)
        assert "chat template" in err["message"], err
        check_still_serving(base)


def test_a_chat_template_that_cannot_compile_is_refused_at_load(tok, config):
    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    with pytest.raises(ArtifactError, match="does not parse"):
        create_app(engine, tok, MODEL, "{% for %}")
    with pytest.raises(ArtifactError, match="characters, more than"):
        create_app(
            engine, tok, MODEL, "x" * 2000, limits=ServerLimits(chat_template=TemplateLimits(max_template_chars=1000))
        )


def test_shutdown_refuses_new_requests_and_cuts_the_rest_with_an_error(tok, config):
    model = new_model(config)
    model.delay = 0.01
    engine = LLMEngine(model, tok)
    app = create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE)
    long = {"prompt": "hi", "max_tokens": 400, "ignore_eos": True}
    with running(app) as (base, _, loop), concurrent.futures.ThreadPoolExecutor(2) as pool:

        def stream_lines():
            with httpx.stream("POST", f"{base}/v1/completions", json={**long, "stream": True}, timeout=30) as r:
                return [line for line in r.iter_lines() if line]

        streamed = pool.submit(stream_lines)
        waited = pool.submit(post, base, "/v1/completions", long)
        wait_until(lambda: len(engine.scheduler.running) == 2, what="both requests to run")
        loop.call_soon_threadsafe(app.state.llmc.begin_shutdown, 0.3)
        wait_until(lambda: app.state.llmc.draining, what="the shutdown to begin")
        assert check_raw_error(post(base, "/v1/completions", {"prompt": "hi"}), 503)["code"] == "shutting_down"
        assert httpx.get(f"{base}/health", timeout=10).status_code == 503
        r = waited.result(timeout=30)
        assert check_raw_error(r, 503)["code"] == "shutting_down"
        lines = streamed.result(timeout=30)
        assert lines[-1] == "data: [DONE]"
        assert json.loads(lines[-2].removeprefix("data: "))["error"]["code"] == "shutting_down"
        wait_until(lambda: not engine.has_unfinished(), what="the cut requests to leave the engine")
        assert engine.kv_cache.num_free_blocks == NUM_BLOCKS


def test_fuzzed_request_fields_never_get_a_500(tok, config):
    """Any JSON value in any field: a 200 or a 4xx with OpenAI's error body, and the engine stays healthy."""
    from fastapi.testclient import TestClient
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    fields = [
        "n",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "stop",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "stop_token_ids",
        "min_tokens",
        "ignore_eos",
        "max_tokens",
        "logprobs",
        "top_logprobs",
        "stream",
        "best_of",
        "echo",
        "model",
        "max_completion_tokens",
    ]
    scalars = st.one_of(
        st.none(),
        st.booleans(),
        st.integers(-3, 40),
        st.sampled_from([2**63, -(2**63), 10**30]),
        st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=5),
    )
    values = st.one_of(scalars, st.lists(scalars, max_size=3))
    prompts = st.one_of(st.text(max_size=20), st.lists(st.integers(-2, 400), max_size=8))
    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    app = create_app(engine, tok, MODEL, TEMPLATE)

    with TestClient(app) as http:

        @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
        @given(st.dictionaries(st.sampled_from(fields), values, max_size=5), prompts, st.booleans())
        def check(body, prompt, chat):
            path = "/v1/chat/completions" if chat else "/v1/completions"
            body = (
                {**body, "messages": [{"role": "user", "content": str(prompt)}]} if chat else {**body, "prompt": prompt}
            )
            r = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert r.status_code in (200, 400, 404), (body, r.status_code, r.text)
            if r.status_code != 200:
                assert r.json()["error"]["message"]
            assert engine.healthy

        check()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_request_waits_in_the_queue_aborts_it(tok, config, stream):
    model = SlowModel(config, num_blocks=NUM_BLOCKS, block_size=16, max_num_tokens=256, max_num_seqs=1)
    model.delay = 0.01
    engine = LLMEngine(model, tok)
    app = create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE)
    long = {"prompt": "hi", "max_tokens": 300, "ignore_eos": True}
    with running(app) as (base, _, _), concurrent.futures.ThreadPoolExecutor(1) as pool:
        running_one = pool.submit(post, base, "/v1/completions", long)
        wait_until(lambda: engine.scheduler.num_running == 1, what="the first request to run")
        with pytest.raises(httpx.ReadTimeout):  # never gets a place while the first runs; gives up
            post(base, "/v1/completions", {**long, "stream": stream}, timeout=httpx.Timeout(10, read=0.5))
        wait_until(lambda: engine.scheduler.num_waiting == 0, what="the waiting request to be aborted")
        assert engine.scheduler.num_running == 1
        model.delay = 0.0
        assert running_one.result(timeout=60).status_code == 200
