"""The hostile clients of benchmarks/load_test.py, each looping until the deadline and checking that every
attempt is refused as it should be: template bombs, cross-site requests, slowloris connections; and the
separate process that times /health meanwhile."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import random
import subprocess
import sys
import time

import httpx
from load_server import BOMBS, HEADER_TIMEOUT_S, PROMPTS, Server, Tally

HEALTH_INTERVAL_S = 0.05


def _refused(tally: Tally, kind: str, ok: bool, got: str) -> None:
    if ok:
        tally.hostile_refused[kind] = tally.hostile_refused.get(kind, 0) + 1
    else:
        tally.hostile_not_refused.append(f"{kind}: {got}")


async def bomber(http: httpx.AsyncClient, deadline: float, tally: Tally) -> None:
    """One template bomb at a time, each kind in turn: a 500 naming the chat template."""
    for bomb in itertools.islice(itertools.cycle(BOMBS), 10_000):
        if time.monotonic() >= deadline:
            return
        body = {"messages": [{"role": "user", "content": "hi", "bomb": bomb}], "max_tokens": 4}
        try:
            r = await http.post("/v1/chat/completions", json=body)
            error = r.json().get("error") or {}
            ok, got = (
                r.status_code == 500 and "chat template" in error.get("message", ""),
                f"{r.status_code} {r.text[:200]}",
            )
        except (httpx.HTTPError, ValueError) as e:
            ok, got = False, f"{type(e).__name__}: {e}"
        _refused(tally, f"bomb_{bomb}", ok, got)


async def cross_site(http: httpx.AsyncClient, rng: random.Random, deadline: float, tally: Tally) -> None:
    """What a web page can send without the user's say: each refused before it runs."""
    body = json.dumps({"prompt": rng.choice(PROMPTS), "max_tokens": 4}).encode()
    kinds = {
        "wrong_host": (body, {"host": "evil.example.com", "content-type": "application/json"}, 400),
        "text_plain": (body, {"content-type": "text/plain"}, 415),
        "form": (b"prompt=hi&max_tokens=4", {"content-type": "application/x-www-form-urlencoded"}, 415),
        "untyped": (body, {"content-type": ""}, 415),
    }
    for _ in range(100_000):
        if time.monotonic() >= deadline:
            return
        kind = rng.choice([*kinds, "preflight"])
        try:
            if kind == "preflight":
                r = await http.options(
                    "/v1/completions",
                    headers={"origin": "https://evil.example.com", "access-control-request-method": "POST"},
                )
                ok = "access-control-allow-origin" not in r.headers
            else:
                content, headers, want = kinds[kind]
                r = await http.post("/v1/completions", content=content, headers=headers)
                ok = r.status_code == want and bool(r.json().get("error", {}).get("message"))
            got = f"{r.status_code} {r.text[:200]}"
        except (httpx.HTTPError, ValueError) as e:
            ok, got = False, f"{type(e).__name__}: {e}"
        _refused(tally, kind, ok, got)
        await asyncio.sleep(0.02)


async def slowloris(port: int, deadline: float, tally: Tally) -> None:
    """One connection that trickles its headers a byte each 0.2 s until the server closes it (timed)."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n" + b"X-Slow: a\r\n" * 10_000
    while time.monotonic() < deadline:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.1)
            continue
        start, closed = time.monotonic(), False
        try:
            for i in range(len(head)):
                writer.write(head[i : i + 1])
                await writer.drain()
                with contextlib.suppress(TimeoutError):
                    if await asyncio.wait_for(reader.read(4096), 0.2) == b"":
                        closed = True
                        break
                if time.monotonic() - start > HEADER_TIMEOUT_S + 3:
                    break
        except OSError:
            closed = True  # reset by the server
        finally:
            writer.close()
        held = time.monotonic() - start
        if closed:
            tally.slowloris_closed += 1
            tally.slowloris_held.append(held)
        elif held > HEADER_TIMEOUT_S + 3:
            tally.hostile_not_refused.append(f"slowloris: still open after {held:.1f} s")


_HEALTH_PROBE = """
import http.client, json, sys, time
port, seconds, interval = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])
latencies, errors, end = [], [], time.monotonic() + seconds
while time.monotonic() < end:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/health")
        r = conn.getresponse()
        r.read()
        if r.status == 200:
            latencies.append(time.perf_counter() - start)
        else:
            errors.append(r.status)
    except OSError as e:
        errors.append(repr(e))
    finally:
        conn.close()
    time.sleep(interval)
print(json.dumps({"latencies": latencies, "errors": errors[:20]}))
"""


def probe_health(server: Server, seconds: float) -> subprocess.Popen:
    """A process that GETs /health every HEALTH_INTERVAL_S for `seconds`, each on a new connection, and prints
    the latencies as JSON: apart from the clients, so that their own event loop does not add to them."""
    return subprocess.Popen(
        [sys.executable, "-c", _HEALTH_PROBE, str(server.port), str(seconds), str(HEALTH_INTERVAL_S)],
        stdout=subprocess.PIPE,
        text=True,
    )
