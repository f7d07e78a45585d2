"""`llmc serve` end to end: a real compiled artifact, served by the CLI in a subprocess, driven by the `openai` client.

The tiny random Qwen2 checkpoint is compiled once for this CPU. Two servers run on loopback ports:
- `server`: `--kv-cache-memory 16MiB` (1024 blocks: the cache never binds), for answers and concurrency;
- `small_server`: a cache of exactly one full context (16 blocks of 16 tokens = 256 tokens), so a request
  that needs the whole context can only run once every block is free again: a leak would make it wait
  forever (here: time out). The cancellation tests also read the free blocks from /metrics.

Every answer is compared with the same request run alone through an in-process LLMEngine on the same
artifact. Every wait is bounded; each server is stopped with SIGTERM (killed if it hangs) and must exit by
it, without a traceback in its log.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from llmc.chat_template import pick_template
from llmc.runtime.chat_template import chat_prompt_ids
from llmc.runtime.engine import LLMEngine
from llmc.runtime.module import CompiledModel, load_tokenizer
from llmc.sampling_params import SamplingParams
from tests.openai_ask import ask

KV = "16MiB"
CONTEXT = 256  # the checkpoint's max_position_embeddings
SMALL_KV = str(16 * 2 * 2 * 16 * 2 * 16 * 4)  # 16 blocks x (k+v, 2 layers, 16 tokens, 2 kv heads, head_dim 16, fp32)
STARTUP_TIMEOUT = 60.0
REQUEST_TIMEOUT = 30.0
GREEDY = dict(temperature=0.0)
PROMPTS = [
    "The list type",
    "Lists may be constructed",
    "A dictionary maps",
    "for x in range(3):",
    "Strings are immutable",
    "The with statement",
    "import sys",
    "naïve café 🙂",
]


# -- the artifact, the reference engine, the servers -------------------------------------------------------


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, checkpoint_dir) -> Path:
    from llmc.compiler.compile import compile_checkpoint

    out = tmp_path_factory.mktemp("live") / "tiny.cpu"
    return compile_checkpoint(checkpoint_dir("qwen2"), target="cpu", output=out)


@pytest.fixture(scope="module")
def ref_model(artifact):
    with CompiledModel.load(artifact, kv_cache_memory=KV, max_num_seqs=4) as model:
        yield model


@pytest.fixture(scope="module")
def tok(ref_model):
    return load_tokenizer(ref_model.tokenizer_path)


@pytest.fixture(scope="module")
def reference(ref_model, tok):
    """reference(prompt_ids, params) -> the Completion of that request alone through a fresh in-process engine."""

    def run(prompt_ids, params):
        (result,) = LLMEngine(ref_model, tok).generate([list(prompt_ids)], params)
        (completion,) = result.outputs
        return completion

    return run


@pytest.fixture(scope="module")
def chat_ids(ref_model, tok):
    template = pick_template(ref_model.chat_template)
    return lambda messages: chat_prompt_ids(tok, template, messages, ref_model.bos_token, ref_model.eos_token)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key="x", max_retries=0, timeout=REQUEST_TIMEOUT)


def _launch(artifact: Path, log_dir: Path, extra: tuple[str, ...]) -> LiveServer:
    port = _free_port()
    log = log_dir / f"serve-{port}.log"
    cmd = [
        sys.executable,
        "-m",
        "llmc.tools.cli",
        "serve",
        str(artifact),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    return LiveServer(proc, port, log)


def _wait_up(server: LiveServer) -> bool:
    """True once /health answers; False if the process exited first; fails the test after STARTUP_TIMEOUT."""
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while server.proc.poll() is None:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{server.base}/health", timeout=2).status_code == 200:
                return True
        if time.monotonic() > deadline:
            pytest.fail(
                f"llmc serve did not answer /health within {STARTUP_TIMEOUT:.0f} s; its output:\n{server.log_text()}"
            )
        time.sleep(0.1)
    return False


def _stop(server: LiveServer) -> bool:
    """SIGTERM, then SIGKILL if it has not exited within 15 s; True if it exited by itself."""
    if server.proc.poll() is not None:
        return True
    server.proc.terminate()
    try:
        server.proc.wait(timeout=15)
        return True
    except subprocess.TimeoutExpired:
        server.proc.kill()
        server.proc.wait(timeout=15)
        return False


@contextlib.contextmanager
def _serving(artifact: Path, log_dir: Path, *configs: tuple[str, ...]):
    """One `llmc serve` subprocess per config (its extra CLI arguments), started together, all answering
    /health; on exit each gets SIGTERM and must shut down cleanly. A port taken meanwhile is retried."""
    servers = [_launch(artifact, log_dir, extra) for extra in configs]
    try:
        for i, extra in enumerate(configs):
            for attempt in range(3):
                if _wait_up(servers[i]):
                    break
                if "address already in use" in servers[i].log_text().lower() and attempt < 2:
                    servers[i] = _launch(artifact, log_dir, extra)  # another process took the free port first
                    continue
                pytest.fail(
                    f"llmc serve exited with {servers[i].proc.returncode} before it came up; its output:\n"
                    f"{servers[i].log_text()}"
                )
        yield servers
    finally:
        exited = [_stop(s) for s in servers]
    for server, ok in zip(servers, exited, strict=True):
        log = server.log_text()
        assert ok, f"llmc serve ignored SIGTERM for 15 s and was killed; its output:\n{log}"
        rc = server.proc.returncode
        assert rc == 0, f"llmc serve exited with {rc}; its output:\n{log}"
        assert "Traceback" not in log, f"llmc serve logged a traceback:\n{log}"


@pytest.fixture(scope="module")
def servers(artifact, tmp_path_factory):
    with _serving(
        artifact,
        tmp_path_factory.mktemp("serve"),
        ("--kv-cache-memory", KV, "--header-timeout", "1", "--keep-alive-timeout", "20"),
        ("--kv-cache-memory", SMALL_KV, "--max-num-seqs", "4"),
    ) as both:
        yield both


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def small_server(servers):
    return servers[1]


@pytest.fixture
def client(server):
    with server.client() as c:
        yield c


def _model_name(artifact: Path) -> str:
    return artifact.resolve().name


def _metrics(server: LiveServer) -> dict[str, float]:
    """/metrics samples by name, those with a label other than model_name left out."""
    r = httpx.get(f"{server.base}/metrics", timeout=10)
    assert r.status_code == 200
    samples = (s for family in text_string_to_metric_families(r.text) for s in family.samples)
    return {s.name: s.value for s in samples if set(s.labels) <= {"model_name"}}


def _wait_all_blocks_free(server: LiveServer, timeout: float = 10.0) -> None:
    """Every KV block back in the pool, as /metrics reports it, within `timeout` (aborts land before a step)."""
    deadline = time.monotonic() + timeout
    while (m := _metrics(server))["llmc:kv_cache_free_blocks"] != m["llmc:kv_cache_blocks"]:
        assert time.monotonic() < deadline, f"KV blocks still in use {timeout:.0f} s after the requests ended: {m}"
        time.sleep(0.05)


# -- answers -----------------------------------------------------------------------------------------------


def test_health_and_models(server, artifact):
    r = httpx.get(f"{server.base}/health", timeout=10)
    assert r.status_code == 200 and r.json() == {"status": "ok"}
    with server.client() as c:
        (card,) = c.models.list().data
    assert card.id == _model_name(artifact)
    assert card.model_extra["max_model_len"] == CONTEXT
    assert "1024 KV blocks of 16 tokens" in server.log_text()


def test_completions_match_the_in_process_engine(client, artifact, tok, reference):
    for prompt in PROMPTS[:3]:
        ids = tok.encode(prompt).ids
        want = reference(ids, SamplingParams(max_tokens=16, logprobs=1, **GREEDY))
        r = client.completions.create(model=_model_name(artifact), prompt=prompt, max_tokens=16, logprobs=1, **GREEDY)
        (choice,) = r.choices
        assert choice.text == want.text, prompt
        assert choice.finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.token_ids))
        # the tokens themselves (logprobs name them) and their log-probabilities
        assert choice.logprobs.tokens == [tok.decode([t], skip_special_tokens=False) for t in want.token_ids]
        assert choice.logprobs.token_logprobs == pytest.approx(
            [d[t] for t, d in zip(want.token_ids, want.logprobs, strict=True)], abs=1e-4
        )

    # the same prompt as token ids
    ids = tok.encode(PROMPTS[0]).ids
    want = reference(ids, SamplingParams(max_tokens=16, **GREEDY))
    r = client.completions.create(model=_model_name(artifact), prompt=ids, max_tokens=16, **GREEDY)
    assert r.choices[0].text == want.text


def test_chat_streaming_equals_non_streaming(client, artifact, reference, chat_ids):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": PROMPTS[3]}]
    ids = chat_ids(messages)
    name = _model_name(artifact)
    for sampling in (GREEDY, dict(temperature=0.8, top_p=0.9, seed=1234)):
        want = reference(ids, SamplingParams(max_tokens=24, **sampling))
        r = client.chat.completions.create(model=name, messages=messages, max_tokens=24, **sampling)
        (choice,) = r.choices
        assert choice.message.role == "assistant"
        assert choice.message.content == want.text, sampling
        assert choice.finish_reason == want.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), len(want.token_ids))

        chunks = list(
            client.chat.completions.create(model=name, messages=messages, max_tokens=24, stream=True, **sampling)
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == choice.message.content
        assert [c.choices[0].finish_reason for c in chunks] == [None] * (len(chunks) - 1) + [choice.finish_reason]


def _clean_stop_string(text: str) -> str:
    """A 2-character printable ASCII piece of the second half of `text`, first seen after its start."""
    for i in range(len(text) // 2, len(text) - 1):
        s = text[i : i + 2]
        if s.isascii() and s.isprintable() and not s.isspace() and text.index(s) > 0:
            return s
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_strings_and_max_tokens(client, artifact, tok, reference):
    name = _model_name(artifact)
    ids = tok.encode(PROMPTS[4]).ids
    long = reference(ids, SamplingParams(max_tokens=48, ignore_eos=True, **GREEDY))
    assert len(long.token_ids) == 48 and long.finish_reason == "length"
    stop = _clean_stop_string(long.text)
    cut = long.text.index(stop)
    for stream in (False, True):
        r = client.completions.create(
            model=name,
            prompt=PROMPTS[4],
            max_tokens=48,
            stop=[stop],
            stream=stream,
            extra_body={"ignore_eos": True},
            **GREEDY,
        )
        if stream:
            chunks = list(r)
            text, last = "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0]
        else:
            text, last = r.choices[0].text, r.choices[0]
            assert r.usage.completion_tokens < 48
        assert (text, last.finish_reason) == (long.text[:cut], "stop"), (stop, stream)
        assert last.model_extra.get("stop_reason") == stop

    for max_tokens in (1, 5):
        want = reference(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **GREEDY))
        r = client.completions.create(
            model=name, prompt=PROMPTS[4], max_tokens=max_tokens, extra_body={"ignore_eos": True}, **GREEDY
        )
        assert (r.choices[0].finish_reason, r.usage.completion_tokens) == ("length", max_tokens)
        assert r.choices[0].text == want.text

    # a long generation stops at the context: prompt + completion == max_model_len
    r = client.completions.create(model=name, prompt=ids, max_tokens=None, extra_body={"ignore_eos": True}, **GREEDY)
    assert r.choices[0].finish_reason == "length" and r.usage.total_tokens == CONTEXT


# -- errors ------------------------------------------------------------------------------------------------


def _bad(call, param):
    with pytest.raises(openai.BadRequestError) as e:
        r = call()
        if isinstance(r, openai.Stream):
            list(r)
    assert e.value.status_code == 400
    err = e.value.response.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param, err


def test_bad_requests_get_400_and_the_server_goes_on(client, artifact, tok, reference):
    name = _model_name(artifact)
    ok_ids = tok.encode(PROMPTS[5]).ids
    want = reference(ok_ids, SamplingParams(max_tokens=8, **GREEDY))

    def ok():
        r = client.completions.create(model=name, prompt=PROMPTS[5], max_tokens=8, **GREEDY)
        assert r.choices[0].text == want.text

    for stream in (False, True):
        _bad(
            lambda s=stream: client.completions.create(model=name, prompt="hi", max_tokens=4, temperature=-1, stream=s),
            "temperature",
        )
        ok()
        _bad(
            lambda s=stream: client.completions.create(
                model=name, prompt=list(range(CONTEXT + 44)), max_tokens=4, stream=s
            ),
            "prompt",
        )
        ok()
    _bad(lambda: client.completions.create(model=name, prompt="hi", extra_body={"max_tokens": "many"}), "max_tokens")
    _bad(lambda: client.completions.create(model=name, prompt=[5, 10_000], max_tokens=2), "prompt")  # not in the vocab
    _bad(
        lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "list " * 400}]),
        "messages",
    )
    _bad(
        lambda: client.chat.completions.create(model=name, messages=[{"role": "user", "content": "x"}], top_p=0),
        "top_p",
    )
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-this-one", prompt="hi", max_tokens=2)
    ok()


# -- cancellation ------------------------------------------------------------------------------------------


def test_clients_that_hang_up_leave_the_whole_cache_free(small_server, artifact, tok, reference):
    """Hang-ups mid-stream and mid-wait; then requests that each need every KV block run and are right."""
    full = [list(tok.encode(p).ids * 200)[:200] for p in PROMPTS[:4]]  # 200 + 56 tokens = the whole cache
    want = [reference(ids, SamplingParams(max_tokens=56, ignore_eos=True, **GREEDY)) for ids in full]
    name = _model_name(artifact)
    long_job = dict(model=name, prompt=PROMPTS[0], max_tokens=CONTEXT - 10, extra_body={"ignore_eos": True}, **GREEDY)

    with small_server.client() as c:
        (card,) = c.models.list().data
        assert card.model_extra["max_model_len"] == CONTEXT  # the cache holds exactly one full context
        assert "16 KV blocks of 16 tokens" in small_server.log_text()

        for _ in range(2):  # streaming clients that leave after the first chunk
            stream = c.completions.create(stream=True, **long_job)
            first = next(iter(stream))
            assert first.choices[0].finish_reason is None
            stream.close()
        with contextlib.suppress(httpx.ReadTimeout):  # a non-streaming client that gives up waiting
            httpx.post(
                f"{small_server.base}/v1/completions",
                json={"prompt": PROMPTS[0], "max_tokens": CONTEXT - 10, "ignore_eos": True, "temperature": 0},
                timeout=httpx.Timeout(10, read=0.02),
            )
        _wait_all_blocks_free(small_server)

        def run(i):
            return c.completions.create(
                model=name, prompt=full[i], max_tokens=56, extra_body={"ignore_eos": True}, **GREEDY
            )

        try:
            r = run(0)
        except (openai.APITimeoutError, openai.InternalServerError) as e:
            pytest.fail(
                f"a request needing the whole KV cache failed ({type(e).__name__}): a client that hung up left "
                f"blocks allocated? Server output:\n{small_server.log_text()}"
            )
        assert (r.choices[0].text, r.usage.completion_tokens) == (want[0].text, 56)

        # a burst: 4 at once, each needing the whole cache (they queue or preempt each other)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(run, range(4), timeout=2 * REQUEST_TIMEOUT))
        for i, r in enumerate(got):
            assert (r.choices[0].text, r.usage.completion_tokens) == (want[i].text, 56), i
        assert httpx.get(f"{small_server.base}/health", timeout=10).status_code == 200
        _wait_all_blocks_free(small_server)
        assert _metrics(small_server)["llmc:kv_cache_blocks"] == 16


def test_streaming_hang_up_on_the_main_server(client, artifact, tok, reference):
    name = _model_name(artifact)
    messages = [{"role": "user", "content": PROMPTS[6]}]
    stream = client.chat.completions.create(
        model=name, messages=messages, max_tokens=200, stream=True, extra_body={"ignore_eos": True}, **GREEDY
    )
    next(iter(stream))
    stream.close()
    want = reference(tok.encode(PROMPTS[6]).ids, SamplingParams(max_tokens=12, **GREEDY))
    r = client.completions.create(model=name, prompt=PROMPTS[6], max_tokens=12, **GREEDY)
    assert r.choices[0].text == want.text


# -- concurrency -------------------------------------------------------------------------------------------


def test_32_concurrent_clients_each_get_their_own_answer(server, artifact, tok, reference, chat_ids):
    name = _model_name(artifact)
    jobs = [(f"{PROMPTS[i % len(PROMPTS)]} {i}", 8 + i % 9, i % 2 == 1, i % 4 >= 2) for i in range(32)]
    # (prompt, max_tokens, stream, chat), every prompt different

    def expected(prompt, max_tokens, chat):
        ids = chat_ids([{"role": "user", "content": prompt}]) if chat else tok.encode(prompt).ids
        want = reference(ids, SamplingParams(max_tokens=max_tokens, **GREEDY))
        return want.text, want.finish_reason

    start = threading.Barrier(len(jobs), timeout=30)

    def run(job):
        prompt, max_tokens, stream, chat = job
        with server.client() as c:  # a client (and connection) per thread, as 32 separate users would have
            start.wait()  # all 32 requests go out together
            return ask(c, name, prompt, max_tokens=max_tokens, stream=stream, chat=chat, **GREEDY)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        got = list(pool.map(run, jobs, timeout=60))
    for job, answer in zip(jobs, got, strict=True):
        assert answer == expected(job[0], job[1], job[3]), job


# -- hostile clients ---------------------------------------------------------------------------------------


def _slowloris(server: LiveServer, stop: threading.Event, held: list[float]) -> None:
    """Connections that trickle their headers a byte each 0.1 s, one after another: each time until closed."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: a\r\n" * 1000
    while not stop.is_set():
        with socket.create_connection(("127.0.0.1", server.port), timeout=0.1) as sock:
            start = time.monotonic()
            for i in range(len(head)):
                try:
                    sock.sendall(head[i : i + 1])
                    if sock.recv(4096) == b"":
                        break
                except TimeoutError:
                    continue
                except OSError:
                    break
                if time.monotonic() - start > 10:
                    break
            held.append(time.monotonic() - start)


def _cross_site(server: LiveServer, stop: threading.Event, answers: list[tuple[str, int, str]]) -> None:
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    kinds = [
        ("wrong host", {"host": "evil.example.com", "content-type": "application/json"}, body),
        ("text/plain", {"content-type": "text/plain"}, body),
        ("form", {"content-type": "application/x-www-form-urlencoded"}, b"prompt=hi"),
        (
            "stop_token_ids",
            {"content-type": "application/json"},
            json.dumps({"prompt": "hi", "stop_token_ids": [3] * 100_000, "n": 16}).encode(),
        ),
        ("huge prompt", {"content-type": "application/json"}, json.dumps({"prompt": "list " * 700_000}).encode()),
    ]
    with httpx.Client(base_url=server.base, timeout=REQUEST_TIMEOUT) as http:
        for i in itertools.count():
            if stop.is_set():
                return
            what, headers, content = kinds[i % len(kinds)]
            r = http.post("/v1/completions", content=content, headers=headers)
            answers.append((what, r.status_code, r.json()["error"].get("code") or ""))


_HEALTH_PROBE = """
import http.client, json, sys, time
port, seconds = int(sys.argv[1]), float(sys.argv[2])
latencies, end = [], time.monotonic() + seconds
while time.monotonic() < end:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200
    latencies.append(time.perf_counter() - start)
    conn.close()
    time.sleep(0.02)
print(json.dumps(sorted(latencies)))
"""


def test_health_stays_fast_with_slowloris_and_cross_site_requests_mixed_in(server, artifact, tok, reference):
    """Four seconds of clients that get answers, slowloris connections and refused requests at once: /health
    answers within 100 ms at p99, every slowloris connection is closed by the server at its header timeout
    (1 s here), every hostile request is refused, and every answer is right."""
    stop, held, answers = threading.Event(), [], []
    want = reference(tok.encode(PROMPTS[1]).ids, SamplingParams(max_tokens=12, **GREEDY))
    name = _model_name(artifact)

    def valid() -> int:
        n = 0
        with server.client() as c:
            while not stop.is_set():
                r = c.completions.create(model=name, prompt=PROMPTS[1], max_tokens=12, **GREEDY)
                assert r.choices[0].text == want.text
                n += 1
        return n

    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        jobs = [pool.submit(valid) for _ in range(4)]
        jobs += [pool.submit(_slowloris, server, stop, held) for _ in range(8)]
        jobs += [pool.submit(_cross_site, server, stop, answers) for _ in range(2)]
        # timed from a process of its own: this one's client threads would add their waits for the GIL
        probe = subprocess.run(
            [sys.executable, "-c", _HEALTH_PROBE, str(server.port), "4"], capture_output=True, text=True, timeout=60
        )
        stop.set()
        served = [job.result(timeout=60) for job in jobs]
    assert probe.returncode == 0, probe.stderr
    assert sum(served[:4]) > 0
    latencies = json.loads(probe.stdout)
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"/health under the mix: p50 {latencies[len(latencies) // 2] * 1e3:.1f} ms, p99 {p99 * 1e3:.1f} ms")
    assert p99 < 0.1, latencies[-5:]
    assert held and max(held) < 3.0, f"slowloris connections held for up to {max(held):.1f} s"
    want_status = {
        "wrong host": (400, "invalid_host"),
        "text/plain": (415, "unsupported_media_type"),
        "form": (415, "unsupported_media_type"),
        "stop_token_ids": (400, ""),
        "huge prompt": (400, ""),
    }
    assert answers and all((status, code) == want_status[what] for what, status, code in answers), answers[:10]


# -- shutdown ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shutdown_timeout", ["20", "0"])
def test_sigterm_finishes_or_cleanly_cuts_requests_in_flight_and_exits_0(artifact, tmp_path, shutdown_timeout):
    """SIGTERM with requests in flight: with time to spare they finish; with none (0 s) a non-streaming client
    gets a JSON 503 and a stream an SSE error event, never a plain-text 500 or a cut connection."""
    long = {"prompt": PROMPTS[0], "max_tokens": CONTEXT - 10, "ignore_eos": True, "temperature": 0}
    with _serving(artifact, tmp_path, ("--kv-cache-memory", KV, "--shutdown-timeout", shutdown_timeout)) as (server,):
        url = f"{server.base}/v1/completions"

        def streamed() -> list[str]:
            with httpx.stream("POST", url, json={**long, "stream": True}, timeout=REQUEST_TIMEOUT) as r:
                assert r.status_code == 200
                lines = r.iter_lines()
                first = next(line for line in lines if line)
                got.set()  # the stream is running: the non-streaming request, sent first, is too
                return [first, *(line for line in lines if line)]

        got = threading.Event()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            waited = pool.submit(httpx.post, url, json={**long, "n": 4}, timeout=REQUEST_TIMEOUT)
            time.sleep(0.05)
            stream = pool.submit(streamed)
            assert got.wait(REQUEST_TIMEOUT), "the stream did not start"
            start = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            r, lines = waited.result(timeout=60), stream.result(timeout=60)
            server.proc.wait(timeout=float(shutdown_timeout) + 15)
            elapsed = time.monotonic() - start
        log = server.log_text()
        assert server.proc.returncode == 0, f"llmc serve exited with {server.proc.returncode}; its output:\n{log}"
        assert elapsed < float(shutdown_timeout) + 10, elapsed
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2].removeprefix("data: "))
        assert r.headers["content-type"] == "application/json", r.text
        if shutdown_timeout != "0":
            assert r.status_code == 200 and all(c["finish_reason"] == "length" for c in r.json()["choices"])
            assert last["choices"][0]["finish_reason"] == "length"
        else:  # cut: or finished in the moment before the signal, on a fast machine
            assert r.status_code == 200 or r.json()["error"]["code"] == "shutting_down", r.text
            assert "error" in last and last["error"]["code"] == "shutting_down" or last["choices"][0]["finish_reason"]
