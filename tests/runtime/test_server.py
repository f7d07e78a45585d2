"""The OpenAI-compatible server, driven by the official `openai` client against uvicorn on a free port.

Every answer is checked against the same request run alone through a sync LLMEngine (greedy, or seeded).
"""

import concurrent.futures
import dataclasses
import threading
import time

import httpx
import openai
import pytest
import uvicorn
from openai_ask import ask
from runtime_fakes import FakeConfig, FakeModel, byte_level_bpe

from llmc.runtime.chat_template import chat_prompt_ids
from llmc.runtime.engine import AsyncLLMEngine, LLMEngine
from llmc.runtime.sampling import SamplingParams
from llmc.runtime.server import create_app

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
    """The fake model, with an optional sleep per step so that a test can act while a request runs."""

    delay = 0.0

    def step(self, batch):
        if self.delay:
            time.sleep(self.delay)
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


@pytest.fixture(scope="module")
def server(tok, config):
    """(base_url, engine, model): uvicorn in a background thread, stopped at the end of the module."""
    engine = LLMEngine(new_model(config), tok, seed=0)
    app = create_app(AsyncLLMEngine(engine), tok, MODEL, TEMPLATE)
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    wait_until(lambda: uv.started or not thread.is_alive(), what="uvicorn to start")
    assert uv.started, "uvicorn did not start"
    port = uv.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}", engine, engine.model
    uv.should_exit = True
    thread.join(timeout=15)
    assert not thread.is_alive(), "uvicorn did not stop"


@pytest.fixture
def client(server):
    base, engine, model = server
    model.delay = 0.0
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
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=20, stream=True,
                                            extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
                                            **GREEDY))  # fmt: skip
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
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=25, stream=True,
                                                 extra_body={"ignore_eos": True}, **GREEDY))  # fmt: skip
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
        r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=40, stop=[stop], stream=stream,
                                      extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
        if stream:
            chunks = list(r)
            text, finish = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert (text, finish) == (long.text[:cut], "stop")

    r = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=5, extra_body={"ignore_eos": True},
                                  **GREEDY)  # fmt: skip
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    assert long.text.startswith(r.choices[0].text)


def test_n_and_seed_and_logprobs(client, tok, config):
    prompt_ids = tok.encode(PROMPTS[5]).ids
    params = SamplingParams(n=3, temperature=0.9, top_k=20, seed=7, max_tokens=10, ignore_eos=True, logprobs=2)
    want = reference(tok, config, prompt_ids, params)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[5], n=3, temperature=0.9, seed=7, max_tokens=10,
                                  logprobs=2, extra_body={"top_k": 20, "ignore_eos": True})  # fmt: skip
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    for c in r.choices:
        assert c.text == want[c.index].text
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 10
        assert lp.token_logprobs == pytest.approx([d[t] for t, d in zip(want[c.index].token_ids, want[c.index].logprobs)])
        assert all(len(top) <= 2 for top in lp.top_logprobs)
    assert r.usage.completion_tokens == 30

    messages = [{"role": "user", "content": "hi"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
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
        (dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
         "messages.0.content"),
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
        (b"prompt=hi", {"content-type": "text/plain"}),
        (b'{"prompt": "hi", "temperature": "hot"}', {"content-type": "application/json"}),
        (b'{"temperature": 0}', {"content-type": "application/json"}),  # no prompt
    ]:
        r = httpx.post(url, content=body, headers=headers, timeout=10)
        assert r.status_code == 400, (body, r.text)
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
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=400, stream=True,
                                       extra_body={"ignore_eos": True}, **GREEDY)  # fmt: skip
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
        httpx.post(f"{base}/v1/completions", json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True},
                   timeout=httpx.Timeout(10, read=0.5))  # fmt: skip
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
    for job, answer in zip(jobs, got):
        assert answer == expected(job[0], job[1], job[3]), job


def test_health_turns_503_when_the_engine_loop_failed(tok, config):
    from fastapi.testclient import TestClient

    engine = AsyncLLMEngine(LLMEngine(new_model(config), tok))
    with TestClient(create_app(engine, tok, MODEL, TEMPLATE)) as http:
        assert http.get("/health").status_code == 200
        engine._error = RuntimeError("a step raised")  # what the loop records when a step fails
        response = http.get("/health")
    assert response.status_code == 503 and response.json()["status"] == "error"
