#!/usr/bin/env python
"""Load test of `llmc serve`: concurrent clients against the bundled model, with cancellations and requests
past the limits, on a KV cache small enough to force preemption, and hostile clients mixed in (template
bombs, cross-site requests, slowloris connections) while /health is timed.

    python benchmarks/load_test.py [--duration 60] [--concurrency 64] [--kv-blocks 40] [--json]
    python benchmarks/load_test.py --ray-replicas 1,2 --concurrency 16 --kv-blocks 256   # llmc serve --ray

The bundled checkpoint (examples/) is compiled for this CPU through llmc's compile cache, its chat template
given branches that only a hostile message takes (`"bomb": "int"`, ...: the compile-time check renders
sample conversations, which never take them), then served by `llmc serve` in a subprocess on 127.0.0.1 (a
free port), with an API key given through $LLMC_API_KEY, a 64 KiB body limit, a 2 s header timeout, and a
KV cache of --kv-blocks blocks. Every client (httpx.AsyncClient, loopback only) loops until the deadline,
each request picked at random (seeded):
  valid      completions and chat, streaming or not, n = 1 or 2, ignore_eos with max_tokens in [4, 48], so
             each choice must end with finish_reason "length" after exactly max_tokens tokens: a token lost
             or repeated across a preemption shows up as a wrong count. A stream must end with its usage
             chunk and [DONE], and carry no error event.
  cancelled  a stream closed after its first chunk, or a non-streaming request given up after 50 ms.
  limits     prompt + max_tokens past the context (400), n past the server's limit (400), a body past the
             limit (413), a wrong API key (401), stop_token_ids past their cap (400), a prompt text too long
             for the context (400, untokenized): each must get exactly that status.
Besides them, hostile clients loop until the deadline too (with --no-hostile, none), each refusal checked:
  bombs      one client at a time sends a chat message that takes a template bomb: a huge integer power, a
             doubling string, a loop past the render timeout (5 s): each a 500 naming the chat template.
  cross-site a wrong Host (400 invalid_host), a text/plain, form or untyped body (415), a CORS preflight
             (no Access-Control-Allow-Origin).
  slowloris  --slowloris connections trickle their headers a byte at a time: the server must close each
             within the header timeout (plus 3 s); a new one replaces it.
  /health    a separate process opens a connection and GETs /health every 50 ms: p50 / p99 / max.
The first --warmup seconds run the same load uncounted, then the server's RSS is read (start); after the
deadline every request is awaited, the engine must drain (no request running or waiting, every KV block
free: read from /metrics), RSS is read again (end), /health must answer 200, and SIGTERM must end the
server with exit code 0.

Reported: throughput (valid requests/s, generated tokens/s), p50 / p99 of TTFT (stream start to its first
chunk) and TPOT ((last chunk - first chunk) / (tokens - 1), per stream), failures (valid requests that did
not get a right answer, limits or hostile requests not refused as they should be), preemptions, RSS at the
start and the end, and /health's latency. Goals: no failure, every KV block free at the end, RSS growth
under 5%, /health under 100 ms at p99. tests/test_load.py runs it for a few seconds (60 s: -m slow).

load_server.py holds the run's configuration and the server, load_hostile.py the hostile clients.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_hostile import bomber, cross_site, probe_health, slowloris  # noqa: E402
from load_server import (  # noqa: E402
    MAX_BODY,
    MAX_N,
    PROMPTS,
    LoadConfig,
    Server,
    Tally,
    bundled_artifact,
)

DRAIN_TIMEOUT_S = 30.0
KINDS = {  # kind -> weight
    "completion": 20,
    "completion_stream": 20,
    "chat": 12,
    "chat_stream": 12,
    "cancel_stream": 6,
    "cancel_wait": 4,
    "too_long": 3,
    "too_many_n": 3,
    "too_large": 2,
    "bad_key": 3,
    "too_many_stop_ids": 1,
    "too_long_text": 1,
}


# -- the clients --------------------------------------------------------------------------------------------


def _generation_body(rng: random.Random, chat: bool, stream: bool) -> tuple[dict, int, int]:
    """(body, n, max_tokens) of a valid request that must end with exactly max_tokens tokens per choice."""
    n, max_tokens = rng.choice((1, 1, 1, 2)), rng.randint(4, 48)
    body = {
        "max_tokens": max_tokens,
        "n": n,
        "ignore_eos": True,
        "temperature": 0.8,
        "seed": rng.randrange(1 << 30),
        "stream": stream,
    }
    prompt = rng.choice(PROMPTS)
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body, n, max_tokens


async def _valid(http: httpx.AsyncClient, rng: random.Random, tally: Tally, chat: bool, stream: bool) -> None:
    body, n, max_tokens = _generation_body(rng, chat, stream)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    what = f"{path} stream={stream} n={n} max_tokens={max_tokens}"
    start = time.perf_counter()
    try:
        if stream:
            error = await _check_stream(http, path, body, n, max_tokens, start, tally)
        else:
            r = await http.post(path, json=body)
            error = _check_response(r, n, max_tokens)
    except httpx.HTTPError as e:
        error = f"{type(e).__name__}: {e}"
    if error is None:
        tally.valid_ok += 1
        tally.generated_tokens += n * max_tokens
    else:
        tally.failures.append(f"{what}: {error}")


def _check_response(r: httpx.Response, n: int, max_tokens: int) -> str | None:
    if r.status_code != 200:
        return f"status {r.status_code}: {r.text[:200]}"
    out = r.json()
    reasons = sorted((c["index"], c["finish_reason"]) for c in out["choices"])
    if reasons != [(i, "length") for i in range(n)]:
        return f"choices ended {reasons}"
    if out["usage"]["completion_tokens"] != n * max_tokens:
        return f"{out['usage']['completion_tokens']} tokens, not {n * max_tokens}"
    return None


async def _check_stream(http, path, body, n, max_tokens, start, tally: Tally) -> str | None:
    first = last = None
    finished, usage, done = {}, None, False
    async with http.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return f"status {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if done:
                return "data after [DONE]"
            if line == "data: [DONE]":
                done = True
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                return f"error event: {chunk['error']}"
            now = time.perf_counter()
            first = now if first is None else first
            if chunk["choices"]:
                last = now
            for c in chunk["choices"]:
                if c["finish_reason"] is not None:
                    finished[c["index"]] = c["finish_reason"]
            usage = chunk.get("usage") or usage
    if not done:
        return "the stream ended without [DONE]"
    if finished != {i: "length" for i in range(n)}:
        return f"choices ended {finished}"
    if usage is None or usage["completion_tokens"] != n * max_tokens:
        return f"usage {usage}, not {n * max_tokens} tokens"
    tally.ttft.append(first - start)
    if max_tokens > 1:
        tally.tpot.append((last - first) / (max_tokens - 1))
    return None


async def _cancel(http: httpx.AsyncClient, rng: random.Random, tally: Tally, stream: bool) -> None:
    body = {"prompt": rng.choice(PROMPTS), "max_tokens": 200, "ignore_eos": True, "stream": stream}
    try:
        if stream:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    tally.failures.append(f"cancelled stream: status {r.status_code}")
                    return
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        break  # leaving the block closes the connection mid-stream
        else:
            with contextlib.suppress(httpx.ReadTimeout):
                await http.post("/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    except httpx.HTTPError as e:
        tally.failures.append(f"cancelled stream={stream}: {type(e).__name__}: {e}")
        return
    tally.cancelled += 1


async def _past_limit(http: httpx.AsyncClient, rng: random.Random, tally: Tally, kind: str) -> None:
    prompt, headers = rng.choice(PROMPTS), None
    if kind == "too_long":
        body, want = {"prompt": [100] * 500, "max_tokens": 100}, 400
    elif kind == "too_many_n":
        body, want = {"prompt": prompt, "n": MAX_N + 1, "max_tokens": 4}, 400
    elif kind == "too_large":
        body, want = {"prompt": prompt, "stop": ["x" * 10] * (MAX_BODY // 10), "max_tokens": 4}, 413
    elif kind == "too_many_stop_ids":
        body, want = {"prompt": prompt, "stop_token_ids": list(range(300)), "n": MAX_N, "max_tokens": 4}, 400
    elif kind == "too_long_text":  # far past what 512 tokens could hold: refused before it is tokenized
        body, want = {"prompt": "import sys\n" * 5000, "max_tokens": 4}, 400
    else:
        body, want, headers = {"prompt": prompt, "max_tokens": 4}, 401, {"Authorization": "Bearer wrong"}
    try:
        r = await http.post("/v1/completions", json=body, headers=headers)
        got = r.status_code if r.json().get("error") else f"{r.status_code} without an error body"
    except (httpx.HTTPError, ValueError) as e:
        got = f"{type(e).__name__}: {e}"
    if got == want:
        tally.limits_enforced += 1
    else:
        tally.limits_not_enforced.append(f"{kind}: got {got}, not {want}")


async def _client(http: httpx.AsyncClient, rng: random.Random, deadline: float, cfg: LoadConfig, tally: Tally) -> None:
    kinds, weights = list(KINDS), list(KINDS.values())
    for _ in range(cfg.max_requests_per_client):
        if time.monotonic() >= deadline:
            return
        kind = rng.choices(kinds, weights)[0]
        if kind in ("completion", "completion_stream", "chat", "chat_stream"):
            await _valid(http, rng, tally, chat=kind.startswith("chat"), stream=kind.endswith("stream"))
        elif kind.startswith("cancel"):
            await _cancel(http, rng, tally, stream=kind == "cancel_stream")
        else:
            await _past_limit(http, rng, tally, kind)


async def _drive(server: Server, cfg: LoadConfig, duration_s: float, seed: int) -> Tally:
    tally = Tally()
    headers = {"Authorization": f"Bearer {server.api_key}"}
    limits = httpx.Limits(max_connections=2 * cfg.concurrency, max_keepalive_connections=cfg.concurrency)
    async with httpx.AsyncClient(
        base_url=server.base, headers=headers, timeout=cfg.request_timeout_s, limits=limits
    ) as http:
        deadline = time.monotonic() + duration_s
        jobs = [_client(http, random.Random(seed * 1000 + i), deadline, cfg, tally) for i in range(cfg.concurrency)]
        if cfg.hostile:
            jobs += [bomber(http, deadline, tally), cross_site(http, random.Random(seed - 1), deadline, tally)]
            jobs += [slowloris(server.port, deadline, tally) for _ in range(0 if cfg.ray_replicas else cfg.slowloris)]
        await asyncio.gather(*jobs)
    return tally


# -- the run ------------------------------------------------------------------------------------------------


def _wait_drained(server: Server) -> dict[str, float]:
    """/metrics once no request runs or waits and every KV block is free, or after DRAIN_TIMEOUT_S."""
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    while True:
        m = server.metrics()
        idle = m["llmc:num_requests_running"] == m["llmc:num_requests_waiting"] == 0
        if (idle and m["llmc:kv_cache_free_blocks"] == m["llmc:kv_cache_blocks"]) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if len(values) < 2:
        return {"p50": values[0] if values else None, "p99": values[0] if values else None}
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": statistics.median(values), "p99": q[98]}


def run_load(cfg: LoadConfig, log_dir: Path) -> dict:
    """Serve the bundled model, drive it, stop it; the report (see the module docstring)."""
    artifact = bundled_artifact(hostile=cfg.hostile)
    server = Server(artifact, cfg, log_dir / "llmc-serve.log")
    try:
        server.wait_up()
        rss_loaded = server.rss_bytes()
        if cfg.warmup_s > 0:
            asyncio.run(_drive(server, cfg, cfg.warmup_s, seed=cfg.seed + 1))
        _wait_drained(server)
        before = server.metrics()
        rss_start = server.rss_bytes()
        t0 = time.perf_counter()
        probe = probe_health(server, cfg.duration_s)
        tally = asyncio.run(_drive(server, cfg, cfg.duration_s, seed=cfg.seed))
        elapsed = time.perf_counter() - t0
        probe_out, _ = probe.communicate(timeout=60)
        health = json.loads(probe_out)
        after = _wait_drained(server)
        rss_end = server.rss_bytes()
        health_end = httpx.get(f"{server.base}/health", timeout=10)
    finally:
        exit_code = server.stop()
    return {
        "duration_s": round(elapsed, 2),
        "concurrency": cfg.concurrency,
        "kv_blocks": int(after["llmc:kv_cache_blocks"]),
        "valid_ok": tally.valid_ok,
        "valid_failed": len(tally.failures),
        "failures": tally.failures[:20],
        "cancelled": tally.cancelled,
        "limits_enforced": tally.limits_enforced,
        "limits_not_enforced": tally.limits_not_enforced[:20],
        "requests_per_s": round(tally.valid_ok / elapsed, 2),
        "generated_tokens_per_s": round(tally.generated_tokens / elapsed, 1),
        "ttft_s": _percentiles(tally.ttft),
        "tpot_s": _percentiles(tally.tpot),
        "preemptions": int(after["llmc:num_preemptions_total"] - before["llmc:num_preemptions_total"]),
        "aborted": int(after["llmc:request_success_total{abort}"] - before["llmc:request_success_total{abort}"]),
        "kv_free_blocks_end": int(after["llmc:kv_cache_free_blocks"]),
        "running_end": int(after["llmc:num_requests_running"]),
        "waiting_end": int(after["llmc:num_requests_waiting"]),
        "rss_mib": {
            "loaded": round(rss_loaded / 2**20, 1),
            "start": round(rss_start / 2**20, 1),
            "end": round(rss_end / 2**20, 1),
        },
        "rss_growth_pct": round(100 * (rss_end - rss_start) / rss_start, 2),
        "hostile_refused": tally.hostile_refused,
        "hostile_not_refused": tally.hostile_not_refused[:20],
        "slowloris_closed": tally.slowloris_closed,
        "slowloris_held_s": {"max": round(max(tally.slowloris_held, default=0.0), 2)},
        "health_s": {
            **{k: v and round(v, 4) for k, v in _percentiles(health["latencies"]).items()},
            "max": round(max(health["latencies"], default=0.0), 4),
            "n": len(health["latencies"]),
        },
        "health_errors": health["errors"],
        "health_end": health_end.status_code,
        "exit_code": exit_code,
    }


def _compare_replicas(cfg: LoadConfig, counts: list[int], log_dir: Path, as_json: bool) -> int:
    """run_load per replica count (0: plain `llmc serve`), in the order given, so that repeating counts (1,2,1,2)
    interleaves them on a noisy machine. RSS there is the Ray driver's and /metrics one replica's, so only
    throughput, latency and failures are compared."""
    reports = [(n, run_load(dataclasses.replace(cfg, ray_replicas=n), log_dir)) for n in counts]
    keys = (
        "valid_ok",
        "valid_failed",
        "limits_enforced",
        "requests_per_s",
        "generated_tokens_per_s",
        "ttft_s",
        "tpot_s",
        "exit_code",
    )
    table = [{"replicas": n, **{k: r[k] for k in keys}} for n, r in reports]
    if as_json:
        print(json.dumps(table, indent=2))
    else:
        print(f"{'replicas':>8} {'req/s':>8} {'tokens/s':>9} {'TTFT p50':>9} {'TPOT p50':>9} {'ok':>6} {'failed':>6}")
        for r in table:
            print(
                f"{r['replicas']:>8} {r['requests_per_s']:>8} {r['generated_tokens_per_s']:>9} "
                f"{r['ttft_s']['p50'] or 0:>9.3f} {r['tpot_s']['p50'] or 0:>9.4f} {r['valid_ok']:>6} "
                f"{r['valid_failed']:>6}"
            )
        for n, r in reports:
            for failure in r["failures"][:5] + r["limits_not_enforced"][:5]:
                print(f"  {n} replica(s): {failure}")
    ok = all(not r["failures"] and not r["limits_not_enforced"] and r["exit_code"] == 0 for _, r in reports)
    return 0 if ok else 1


def main() -> int:
    d = LoadConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=d.duration_s, help="seconds of measured load")
    p.add_argument("--warmup", type=float, default=d.warmup_s, help="seconds of uncounted load first")
    p.add_argument("--concurrency", type=int, default=d.concurrency)
    p.add_argument("--kv-blocks", type=int, default=d.kv_blocks, help="KV cache blocks of the server")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--log-dir", type=Path, default=Path("."), help="where the server's log goes")
    p.add_argument(
        "--ray-replicas",
        default=None,
        help="comma-separated replica counts, e.g. 1,2: the same load against `llmc serve --ray` with each "
        "(local Ray), one after the other, and their throughput side by side",
    )
    p.add_argument("--no-hostile", action="store_true", help="no template bombs, cross-site requests, slowloris")
    p.add_argument("--slowloris", type=int, default=d.slowloris, help="slowloris connections at any time")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    cfg = LoadConfig(
        duration_s=a.duration,
        warmup_s=a.warmup,
        concurrency=a.concurrency,
        kv_blocks=a.kv_blocks,
        seed=a.seed,
        hostile=not a.no_hostile,
        slowloris=a.slowloris,
    )
    if a.ray_replicas:
        return _compare_replicas(cfg, [int(n) for n in a.ray_replicas.split(",")], a.log_dir, a.json)
    report = run_load(cfg, a.log_dir)
    if a.json:
        print(json.dumps(report, indent=2))
    else:
        for key, value in report.items():
            print(f"{key:24} {value}")
    ok = (
        not report["failures"]
        and not report["limits_not_enforced"]
        and not report["hostile_not_refused"]
        and (report["health_s"]["p99"] or 0) < 0.1
        and report["exit_code"] == 0
        and report["kv_free_blocks_end"] == report["kv_blocks"]
        and report["health_end"] == 200
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
