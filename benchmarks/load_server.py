"""The server side of benchmarks/load_test.py: the run's configuration and tally, the bundled model compiled
with the template bombs' branches in its chat template, and `llmc serve` in a subprocess on a free loopback port."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = [
    "The list type",
    "Lists may be constructed",
    "A dictionary maps",
    "for x in range(3):",
    "Strings are immutable",
    "The with statement",
    "import sys",
    "def main():",
    "class Node:",
    "Exceptions are raised",
]
MAX_BODY = 64 << 10
MAX_N = 4
HEADER_TIMEOUT_S = 2.0
BOMBS = {  # a message's "bomb" -> the template branch it takes (every one is refused: a 500 naming the template)
    "int": "{{ ((10 ** 1024) ** 1024) ** 32 }}",
    "concat": "{% set ns = namespace(s='x') %}{% for i in range(28) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"
    "{{ ns.s }}",
    "loop": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
}
STARTUP_TIMEOUT_S = 180.0  # includes compiling nothing (the artifact is compiled first) and loading the model


@dataclasses.dataclass(frozen=True)
class LoadConfig:
    duration_s: float = 60.0
    warmup_s: float = 3.0
    concurrency: int = 64
    kv_blocks: int = 40  # 640 tokens: more than one full context (512), far less than 64 clients need
    max_num_seqs: int = 64
    seed: int = 0
    request_timeout_s: float = 120.0
    max_requests_per_client: int = 100_000  # a bound besides the deadline
    ray_replicas: int = 0  # > 0: `llmc serve --ray` with this many replicas (local Ray), the cores split among them
    hostile: bool = True  # template bombs, cross-site requests and slowloris connections mixed in
    slowloris: int = 32  # connections trickling their headers at any time


@dataclasses.dataclass
class Tally:
    valid_ok: int = 0
    failures: list[str] = dataclasses.field(default_factory=list)  # valid requests without a right answer
    limits_enforced: int = 0
    limits_not_enforced: list[str] = dataclasses.field(default_factory=list)
    cancelled: int = 0
    generated_tokens: int = 0
    ttft: list[float] = dataclasses.field(default_factory=list)
    tpot: list[float] = dataclasses.field(default_factory=list)
    hostile_refused: dict[str, int] = dataclasses.field(default_factory=dict)  # kind -> refusals as they should be
    hostile_not_refused: list[str] = dataclasses.field(default_factory=list)
    slowloris_closed: int = 0
    slowloris_held: list[float] = dataclasses.field(default_factory=list)  # seconds until the server closed each


# -- the server ---------------------------------------------------------------------------------------------


def bundled_artifact(hostile: bool = True) -> Path:
    """The bundled checkpoint compiled for this CPU (cached); hostile: with the template bombs' branches."""
    from llmc.examples import bundled_checkpoint
    from llmc.host import cache_root
    from llmc.tools.build import cached_artifact

    ckpt = bundled_checkpoint()
    if not hostile:
        return cached_artifact(ckpt)
    copy = cache_root() / "load_test" / "pystdlib-5m-bombs"  # by content: cached_artifact compiles it once
    copy.mkdir(parents=True, exist_ok=True)
    for f in ckpt.iterdir():
        if f.is_file() and f.name != "tokenizer_config.json" and not (copy / f.name).exists():
            shutil.copyfile(f, copy / f.name)
    config = json.loads((ckpt / "tokenizer_config.json").read_text())
    branches = "".join(
        f"{{% {'if' if i == 0 else 'elif'} message.bomb == '{name}' %}}{branch}"
        for i, (name, branch) in enumerate(BOMBS.items())
    )
    config["chat_template"] = config["chat_template"].replace(
        "{% for message in messages %}", "{% for message in messages %}" + branches + "{% endif %}", 1
    )
    assert "message.bomb" in config["chat_template"], "the bundled chat template changed: place the bombs anew"
    (copy / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return cached_artifact(copy)


def kv_cache_bytes(artifact: Path, num_blocks: int) -> int:
    from llmc.artifact import load_artifact
    from llmc.runtime.kv_cache import kv_bytes_per_block

    a = load_artifact(artifact)
    c = a.config
    return num_blocks * kv_bytes_per_block(c.num_layers, c.num_kv_heads, c.head_dim, a.block_size, a.kv_dtype)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, base: str, name: str, log_tail) -> None:
    """Until the server at base answers /health with 200: RuntimeError (with log_tail()) if it exits first or takes
    longer than STARTUP_TIMEOUT_S."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode}:\n{log_tail()}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{name} did not answer /health in {STARTUP_TIMEOUT_S:.0f} s:\n{log_tail()}")


def terminate(proc: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL after 30 s; the exit code (negative: killed by that signal)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)
    return proc.returncode


class Server:
    """`llmc serve` in a subprocess on a loopback port; its output goes to `log`."""

    def __init__(self, artifact: Path, cfg: LoadConfig, log: Path):
        self.port, self.log, self.api_key = free_port(), log, secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        kv_bytes = kv_cache_bytes(artifact, cfg.kv_blocks)
        options = f"--host 127.0.0.1 --port {self.port} --kv-cache-memory {kv_bytes} --max-num-seqs {cfg.max_num_seqs} "
        options += f"--max-body-size {MAX_BODY} --max-n {MAX_N}"
        cmd = [sys.executable, "-m", "llmc.tools.cli", "serve", str(artifact), *options.split()]
        if not cfg.ray_replicas:
            cmd += ["--header-timeout", str(HEADER_TIMEOUT_S)]
        if cfg.ray_replicas:
            threads = max(1, (os.cpu_count() or 1) // cfg.ray_replicas)
            cmd += ["--ray", "--replicas", str(cfg.ray_replicas), "--threads-per-replica", str(threads)]
        env = {**os.environ, "LLMC_API_KEY": self.api_key, "PYTHONUNBUFFERED": "1"}
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env)

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def wait_up(self) -> None:
        wait_healthy(self.proc, self.base, "llmc serve", self.log_tail)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc/<pid>/status")

    def metrics(self) -> dict[str, float]:
        """{sample name: value}, labels dropped except finished_reason (every series here has one model)."""
        text = httpx.get(f"{self.base}/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                reason = s.labels.get("finished_reason")
                out[s.name if reason is None else f"{s.name}{{{reason}}}"] = s.value
        return out

    def stop(self) -> int:
        return terminate(self.proc)
