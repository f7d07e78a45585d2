"""Chat templates: a conversation rendered with the checkpoint's own chat template, the one place for it.

It stands on the ground (it needs only jinja2): the runtime renders prompts with it (runtime/chat_template.py
adds the tokenizer's side), and the compiler's frontend renders each checkpoint's template once with it
(`check_template`, on SAMPLE_CONVERSATIONS), so that one that could not serve is refused at compile.

Hugging Face checkpoints ship a Jinja2 chat template (tokenizer_config.json "chat_template"). It is rendered
as transformers' `apply_chat_template` does: a sandboxed environment with trim_blocks / lstrip_blocks and
loop controls, `raise_exception`, `strftime_now` and a `tojson` filter that keeps non-ASCII text, and the
variables `messages`, `add_generation_prompt`, `bos_token` and `eos_token`. The rendered text already holds
the special tokens the template wants, so the runtime encodes it with `add_special_tokens=False`.

A checkpoint without a template gets a plain "role: content" transcript (`NO_TEMPLATE_NOTICE` says so; the
server logs it once at start, the REPL prints it once).

A template is code from the checkpoint, so it renders in a sandbox under bounds (llmc/template_sandbox.py).

A render runs in a render process, not in the caller's: some C calls no bound above sizes (comparing two
lists of lists is 10^10 steps within them) and one such call holds its process's GIL until it returns, so a
thread of the server could neither be stopped nor let the event loop run. A few processes are kept and
reused (a render costs one round trip over a pipe, a few tenths of a ms); the caller's thread waits for the
reply without the GIL. A render stops when its output passes `max_output_chars`, when it allocates more than
`max_memory_bytes` (an address-space limit on its process) or when it runs longer than `timeout_s`: its
process is then killed and replaced. Each refusal is an LlmcError; the caller's process goes on.
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from llmc.errors import ArtifactError, LlmcError, RequestError

try:
    import resource
except ImportError:  # not a POSIX system: no memory or CPU limit on a render process
    resource = None

from .template_sandbox import (
    DEFAULT_LIMITS,
    TemplateLimits,
    TemplateRefused,
    compile_template,
    render_in_this_process,
    template_error,
)

NO_TEMPLATE_NOTICE = (
    "this model has no chat template; chat prompts are a plain 'role: content' transcript, "
    "which a model not trained on it may continue poorly"
)


# -- render processes ---------------------------------------------------------------------------------------
# A render runs in a process of its own, so that nothing it does (one C call that holds its GIL for a minute,
# an allocation of gigabytes) can stall or starve the caller's. A few idle ones are kept and reused; one that
# runs past its timeout is killed, and a fresh one is started in its place. Requests and replies are one JSON
# line each over the process's stdin and stdout: the caller never unpickles what a template produced.

_WORKER_COMMAND = "from llmc.chat_template import _render_process_main; _render_process_main()"
_START_TIMEOUT_S = 60.0  # a cold start on a loaded machine (python and jinja2 imports); not the render's budget
_IDLE_PROCESSES = 4
_ERRORS = {"RequestError": RequestError, "ArtifactError": ArtifactError, "TemplateRefused": TemplateRefused}


class _ProcessFailed(Exception):
    pass


class _RenderProcess:
    """One render process and its pipes. Used by one thread at a time (the pool hands it out)."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_COMMAND], stdin=subprocess.PIPE, stdout=subprocess.PIPE
        )
        self.started = False

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line the process writes (it writes one per request, nothing else); None past the deadline."""
        fd, chunks = self.proc.stdout.fileno(), []
        while not chunks or not chunks[-1].endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                raise _ProcessFailed(f"exited with status {self.proc.wait()}")
            chunks.append(chunk)
        return b"".join(chunks)

    def ask(self, request: bytes, timeout_s: float) -> dict | None:
        """The reply to `request` (one JSON line); None when it did not come within timeout_s."""
        if not self.started:
            if self._read_line(time.monotonic() + _START_TIMEOUT_S) != b"ready\n":
                raise _ProcessFailed(f"did not start within {_START_TIMEOUT_S:g} s")
            self.started = True
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
        except OSError as e:
            raise _ProcessFailed(f"took no request ({e})") from None
        reply = self._read_line(time.monotonic() + timeout_s)
        return None if reply is None else json.loads(reply)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()

    def close(self) -> None:
        """Ends an idle process: it exits when its stdin closes; killed if it has not within a second."""
        try:
            self.proc.stdin.close()
            self.proc.wait(1.0)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()


class _Pool:
    """Idle render processes, at most `keep`; a caller that finds none starts one."""

    def __init__(self, keep: int):
        self.keep = keep
        self.idle: list[_RenderProcess] = []
        self.lock = threading.Lock()
        atexit.register(self.close)

    def take(self) -> _RenderProcess:
        with self.lock:
            if self.idle:
                return self.idle.pop()
        return _RenderProcess()

    def give(self, process: _RenderProcess) -> None:
        with self.lock:
            if len(self.idle) < self.keep:
                self.idle.append(process)
                return
        process.close()

    def warm(self) -> None:
        """At least one process started (not waited for), so that the next render does not start one."""
        with self.lock:
            if self.idle:
                return
        self.give(_RenderProcess())

    def close(self) -> None:
        with self.lock:
            idle, self.idle = self.idle, []
        for process in idle:
            process.close()


_POOL = _Pool(_IDLE_PROCESSES)


def _forget_pool_in_child() -> None:
    """A forked child must not share its parent's render processes (their pipes are the parent's)."""
    for process in _POOL.idle:
        process.proc.stdin.close()
        process.proc.stdout.close()
    _POOL.idle, _POOL.lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_in_child)


def warm_render_processes() -> None:
    """Start a render process now, so that the first render does not wait for one (a server calls it at start)."""
    _POOL.warm()


def _render_in_process(template: str, limits: TemplateLimits, variables: dict) -> str:
    """The template rendered by a render process within limits.timeout_s; the process is killed past it."""
    request = json.dumps({"template": template, "limits": dataclasses.asdict(limits), "variables": variables})
    process = _POOL.take()
    try:
        reply = process.ask(request.encode() + b"\n", limits.timeout_s)
    except _ProcessFailed as e:
        process.kill()
        raise ArtifactError(
            f"the chat template's render process {e}",
            "check that this Python can run `python -c 'import llmc.chat_template'`",
        ) from None
    if reply is None:
        process.kill()
        _POOL.warm()  # its replacement starts now, not at the next request
        raise template_error(f"took more than {limits.timeout_s:g} s to render; it was stopped", TemplateRefused)
    _POOL.give(process)
    if "text" in reply:
        return reply["text"]
    error = _ERRORS[reply["error"]]
    raise error(reply["what"], reply["hint"], **({"param": reply["param"]} if error is RequestError else {}))


def _limit_resources(limits: TemplateLimits) -> None:
    """In a render process, before a render: the memory it may add, and a CPU time past which the kernel ends
    the process (should its caller be gone: the caller itself kills it at limits.timeout_s of wall time)."""
    if resource is None:
        return
    try:
        used_bytes = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # no /proc: the address space python starts with is well under 1 GiB
        used_bytes = 1 << 30
    used_s = sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
    for which, soft in (
        (resource.RLIMIT_AS, used_bytes + limits.max_memory_bytes),
        (resource.RLIMIT_CPU, math.ceil(used_s + limits.timeout_s) + 2),
    ):
        hard = resource.getrlimit(which)[1]
        resource.setrlimit(which, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _render_process_main() -> None:
    """A render process (_RenderProcess starts it): one request line in, one reply line out, until stdin ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C at a terminal is its caller's to handle
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # nothing else printed can reach the replies
    if resource is not None:
        resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    replies.write(b"ready\n")
    replies.flush()
    for line in sys.stdin.buffer:
        request = json.loads(line)
        limits = TemplateLimits(**request["limits"])
        try:
            _limit_resources(limits)
            reply = {
                "text": render_in_this_process(
                    compile_template(request["template"], limits), limits, request["variables"]
                )
            }
        except LlmcError as e:
            reply = {"error": type(e).__name__, "what": e.what, "hint": e.hint, "param": getattr(e, "param", None)}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


def pick_template(chat_template) -> str | None:
    """tokenizer_config.json may hold a string or a list of {"name", "template"}: take "default" (or the first)."""
    if chat_template is None or isinstance(chat_template, str):
        return chat_template or None
    named = {t["name"]: t["template"] for t in chat_template}
    return named.get("default", next(iter(named.values()), None))


def render_chat(
    template: str | None,
    messages: list[dict],
    bos_token: str = "",
    eos_token: str = "",
    add_generation_prompt: bool = True,
    limits: TemplateLimits = DEFAULT_LIMITS,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text for `messages` ([{"role", "content"}, ...]). template None: plain transcript. tools:
    OpenAI's tool definitions, the template's `tools` variable. template_kwargs: more variables the template
    reads (Qwen3's and SmolLM3's `enable_thinking`); RequestError for one that names a variable set here.

    A template that rejects the conversation (raise_exception, e.g. "roles must alternate") raises
    RequestError: the request is at fault, not the server. One that fails on it (a TypeError in its code) or
    breaks its bounds (time, memory, output size, the sandbox) raises ArtifactError: the checkpoint is at fault.
    The render runs in a render process (above); the caller's thread waits for it without holding the GIL.
    """
    template = pick_template(template)
    if template is None:
        text = bos_token + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant:" if add_generation_prompt else text
    variables = dict(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        tools=tools,
        documents=None,
    )
    clash = sorted(set(template_kwargs or ()) & set(variables))
    if clash:
        raise RequestError(f"chat_template_kwargs may not set {', '.join(clash)}", param="chat_template_kwargs")
    variables.update(template_kwargs or {})
    compile_template(template, limits)  # one that does not parse or is too large fails here, not in a process
    return _render_in_process(template, limits, variables)


# What compile renders each checkpoint's template on, before it ships it: a template has to render one of them.
# Several, since real templates refuse some: Gemma's raises on a system turn, Mistral's wants user first.
SAMPLE_CONVERSATIONS = (
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
    [{"role": "user", "content": "Hello!"}],
)


def check_template(template, bos_token: str = "", eos_token: str = "", limits: TemplateLimits = DEFAULT_LIMITS):
    """Render `template` on the SAMPLE_CONVERSATIONS (add_generation_prompt=True), as compile does before it ships
    one. Raises ArtifactError when it does not parse or breaks its bounds on any of them (time, memory, size,
    the sandbox), or when it renders none of them; a template that rejects some conversations is kept."""
    template = pick_template(template)
    if template is None:
        return
    problems = []
    for messages in SAMPLE_CONVERSATIONS:
        try:
            render_chat(template, messages, bos_token, eos_token, add_generation_prompt=True, limits=limits)
            return
        except TemplateRefused:
            raise
        except LlmcError as e:
            problems.append(e.what.removeprefix("the model's chat template ").removeprefix("the chat template "))
    raise template_error(f"rendered none of {len(problems)} sample conversations; the first {problems[0]}")
