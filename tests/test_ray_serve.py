"""`llmc serve --ray` on a local Ray instance: the bundled model, 2 replicas, driven by the `openai` client.

One Ray instance (loopback, 4 logical CPUs, 200 MB object store, no dashboard) and one deployment serve the
whole module: each replica runs one engine thread (OMP_NUM_THREADS=1) on a 2-core machine. Answers are
compared with the same greedy request run alone through an in-process LLMEngine on the same artifact.
The last test kills a replica mid-load, so it runs last (pytest keeps file order).
"""

from __future__ import annotations

import concurrent.futures
import functools
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

ray = pytest.importorskip("ray")

from llmc.examples import bundled_checkpoint  # noqa: E402
from llmc.runtime import ray_serve  # noqa: E402
from llmc.runtime.engine import LLMEngine  # noqa: E402
from llmc.runtime.module import CompiledModel, load_tokenizer  # noqa: E402
from llmc.runtime.server import ServerLimits  # noqa: E402
from llmc.sampling_params import SamplingParams  # noqa: E402
from llmc.tools.engine_setup import ray_replica_app  # noqa: E402

KV = "8MiB"
TIMEOUT = 60.0
REPLICA = ray_serve.REPLICA_HEADER


@pytest.fixture(scope="module")
def artifact(tmp_path_factory) -> Path:
    from llmc.tools.build import cached_artifact

    with pytest.MonkeyPatch.context() as mp:  # the bundled model, compiled by this tree
        mp.setenv("LLMC_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
        return cached_artifact(bundled_checkpoint()).resolve()


@pytest.fixture(scope="module")
def reference(artifact):
    """reference(prompt) -> the greedy text of max_tokens=16 for that prompt alone, in process."""
    with CompiledModel.load(artifact, kv_cache_memory=KV, max_num_seqs=2) as model:
        tok = load_tokenizer(model.tokenizer_path)

        def run(prompt: str, max_tokens: int = 16) -> str:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
            (result,) = LLMEngine(model, tok).generate([tok.encode(prompt).ids], params)
            return result.outputs[0].text

        yield run


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(artifact):
    """The base URL of 2 replicas of the bundled model on a local Ray instance, shut down after the module."""
    port = _free_port()
    app_kw = dict(
        path=artifact,
        name="bundled",
        limits=ServerLimits(),
        api_key=None,
        kv_cache_memory=KV,
        max_num_seqs=16,
        max_num_batched_tokens=512,
        no_prefix_caching=False,
        speculative=None,
        num_speculative_tokens=4,
        draft=None,
    )
    # imbalance=2: the fault test's six clients in flight always spread over both replicas
    options = ray_serve.RayServeOptions(
        replicas=2, num_cpus=1, env={"OMP_NUM_THREADS": "1"}, max_ongoing_requests=64, imbalance=2
    )
    ray_serve.start_ray(None, 4)
    try:
        ray_serve.deploy(functools.partial(ray_replica_app, **app_kw), options, host="127.0.0.1", port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        ray_serve.shutdown()


@pytest.fixture
def client(served):
    with openai.OpenAI(base_url=f"{served}/v1", api_key="x", max_retries=0, timeout=TIMEOUT) as c:
        yield c


def _replica_states() -> dict[str, int]:
    from ray import serve

    status = serve.status().applications[ray_serve.APP_NAME].deployments["LlmcReplica"]
    return dict(status.replica_states)


# -- answers ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
def test_completion_matches_the_engine_alone(client, reference, stream):
    prompt = "The list type"
    r = client.completions.create(model="bundled", prompt=prompt, max_tokens=16, temperature=0.0, stream=stream)
    text = "".join(c.choices[0].text for c in r) if stream else r.choices[0].text
    assert text == reference(prompt)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_streams_and_finishes(client, stream):
    messages = [{"role": "user", "content": "Lists may be constructed"}]
    r = client.chat.completions.create(
        model="bundled",
        messages=messages,
        max_tokens=7,
        temperature=0.0,
        stream=stream,
        extra_body={"ignore_eos": True},
    )
    if stream:
        chunks = list(r)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7


def test_server_errors_and_limits_come_from_the_shared_app(served):
    """A 404 for another model, the 400 for a bad body, /v1/models and /metrics: the server's, through Ray."""
    r = httpx.post(f"{served}/v1/completions", json={"model": "other", "prompt": "x"}, timeout=TIMEOUT)
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found" and r.headers[REPLICA]
    json_type = {"content-type": "application/json"}
    r = httpx.post(f"{served}/v1/completions", content=b"{not json", headers=json_type, timeout=TIMEOUT)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{served}/v1/completions", content=b'{"prompt": "x"}', timeout=TIMEOUT)  # a form's or a page's
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    r = httpx.post(f"{served}/v1/completions", content=b"x" * (ServerLimits().max_body_bytes + 1), timeout=TIMEOUT)
    assert r.status_code == 413
    assert httpx.get(f"{served}/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == "bundled"
    assert "llmc:num_requests_running" in httpx.get(f"{served}/metrics", timeout=TIMEOUT).text


# -- routing ----------------------------------------------------------------------------------------------


def test_the_same_prefix_goes_to_the_same_replica(client):
    """Sequential requests (balanced load): every request of a prefix goes where that prefix went first."""
    seen: dict[int, set[str]] = {}
    for i in range(12):
        group = i % 3
        prompt = f"{group} " + "Strings are immutable and the with statement " * 3 + f"tail {i}"
        raw = client.completions.with_raw_response.create(model="bundled", prompt=prompt, max_tokens=2)
        raw.parse()
        seen.setdefault(group, set()).add(raw.headers[REPLICA])
    assert all(len(replicas) == 1 for replicas in seen.values()), seen


# -- faults -----------------------------------------------------------------------------------------------


def _replica_actor(unique_id: str):
    for actor in ray.util.list_named_actors(all_namespaces=True):
        if actor["name"].endswith(f"#LlmcReplica#{unique_id}"):
            return ray.get_actor(actor["name"], namespace=actor["namespace"])
    raise AssertionError(f"no actor for replica {unique_id}")


def test_killing_a_replica_mid_load_loses_no_later_request_and_ray_restarts_it(served):
    killed_at: list[float] = []
    results: list[tuple[float, int, str, str]] = []  # (sent at, status, replica, error code)
    stop = threading.Event()

    def client_loop(i: int) -> None:
        # Each client's prompt starts with its own letter: no client's prompt shares a prefix with another's,
        # so each one's first request is placed by load (two choices) and the six spread over both replicas.
        body = {
            "prompt": f"{chr(ord('A') + i)}: client {i} asks about the list type",
            "max_tokens": 24,
            "ignore_eos": True,
        }
        with httpx.Client(base_url=served, timeout=TIMEOUT) as http:
            while not stop.is_set():
                sent = time.monotonic()
                r = http.post("/v1/completions", json=body)
                code = r.json().get("error", {}).get("code") if r.status_code != 200 else ""
                results.append((sent, r.status_code, r.headers.get(REPLICA, ""), code))

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(client_loop, i) for i in range(6)]
        try:
            deadline = time.monotonic() + TIMEOUT
            while len({rep for _, status, rep, _ in results if status == 200}) < 2 and time.monotonic() < deadline:
                time.sleep(0.1)
            served_by = {rep for _, status, rep, _ in results if status == 200}
            assert len(served_by) == 2, f"the load never reached both replicas: {results[-10:]}"
            victim = sorted(served_by)[0]
            actor = _replica_actor(victim)
            # For good: Ray restarting the actor itself could answer the call below before it fails (a flaky
            # timing); Serve's controller replaces the dead replica, which the end of the test waits for
            ray.kill(actor, no_restart=True)
            with pytest.raises(ray.exceptions.RayActorError):  # the kill has taken effect once a call fails
                ray.get(actor.__ray_ready__.remote(), timeout=TIMEOUT)
            killed_at.append(time.monotonic())
            time.sleep(4.0)
        finally:  # a failure above must not leave the clients looping: the pool's exit waits for them
            stop.set()
        for f in futures:
            f.result()

    after = [r for r in results if r[0] > killed_at[0]]
    assert len(after) > 5
    assert all(status == 200 for _, status, _, _ in after), [r for r in after if r[1] != 200]
    assert victim not in {rep for _, _, rep, _ in after}
    # those in flight at the kill: answered, or refused with the retryable 503
    during = [r for r in results if r[0] <= killed_at[0] and r[1] != 200]
    assert all(status == 503 and code == "replica_died" for _, status, _, code in during), during

    deadline = time.monotonic() + TIMEOUT
    while _replica_states().get("RUNNING", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _replica_states().get("RUNNING", 0) == 2, _replica_states()
