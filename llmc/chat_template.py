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

A template is code from the checkpoint, so it runs under bounds (`TemplateLimits`). The sandbox refuses
Python internals (`__class__`, `mro`, ...) and caps `range` at 100000 items. On top of it: a template larger
than `max_template_chars` is refused at load; jinja's compile-time constant folding is off, so no
expression runs before a render. Every operation that builds a value of a size the template chooses has that
size checked before it runs, since it is one C call that holds the GIL (no timeout interrupts it) and can
exhaust memory before any later check: `*`, `**` and `+` on integers build at most `max_int_bits` bits
(`**`'s result has about exponent x log2(base) bits); `*`, `+`, `~` (jinja compiles it to a join of its own,
so the code generator sends it to `bounded_concat`), the join filter and str.join build at most
`max_output_chars` items; so do `%`, str.format specs, the padding methods (center, ljust, rjust, zfill,
expandtabs) and the format, center and indent filters.

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
import datetime
import functools
import json
import math
import os
import re
import select
import signal
import string
import subprocess
import sys
import threading
import time
from pathlib import Path

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

from llmc.errors import ArtifactError, LlmcError, RequestError

try:
    import resource
except ImportError:  # not a POSIX system: no memory or CPU limit on a render process
    resource = None

NO_TEMPLATE_NOTICE = (
    "this model has no chat template; chat prompts are a plain 'role: content' transcript, "
    "which a model not trained on it may continue poorly"
)


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


@dataclasses.dataclass(frozen=True)
class TemplateLimits:
    """Bounds on one chat template: far above what real templates need (they are a few KiB and render in ms)."""

    max_template_chars: int = 1 << 20
    max_output_chars: int = 8 << 20  # the output, and every string or list one operation builds
    max_int_bits: int = 1 << 16  # every integer one operation builds: one such operation takes well under 1 ms
    max_memory_bytes: int = 1 << 30  # the memory a render may add to its process
    timeout_s: float = 5.0


DEFAULT_LIMITS = TemplateLimits()


class _TemplateOutputTooLarge(jinja2.exceptions.SecurityError):
    pass


# A width or precision in a format spec, a printf conversion or a padding method's argument is the size of a
# string built inside one C call, before any output budget sees it: each is checked against the budget first.
_PRINTF_SIZES = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_PADDING_METHODS = frozenset(["center", "ljust", "rjust", "zfill", "expandtabs"])


class _CodeGenerator(jinja2.compiler.CodeGenerator):
    """jinja's code generator, with `~` sent through the environment's bounded_concat (jinja compiles it to a
    call of jinja2.runtime.str_join, which no sandbox hook sees)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame) -> None:
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class _BoundedEnvironment(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, with every operation that builds a value of a size the template chooses bounded before it
    runs: `*`, `**`, `+`, `~` and `%`, join, str.format specs, the padding methods and the `format`, `center`
    and `indent` filters."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset(["*", "**", "+", "%"])

    def __init__(self, max_value_chars: int, max_int_bits: int, **kw):
        super().__init__(**kw)
        self.max_value_chars = max_value_chars
        self.max_int_bits = max_int_bits
        self.filters["format"] = self._bounded_filter(jinja2.filters.do_format, "format")
        self.filters["center"] = self._bounded_filter(jinja2.filters.do_center, "center")
        self.filters["indent"] = self._bounded_filter(jinja2.filters.do_indent, "indent")
        self.filters["join"] = self._bounded_join

    def check_size(self, size, what: str) -> None:
        if isinstance(size, int) and not isinstance(size, bool) and size > self.max_value_chars:
            raise _TemplateOutputTooLarge(f"{what} asks for {size:,} characters")

    def check_result(self, size: int, what: str, unit: str = "characters") -> None:
        limit = self.max_int_bits if unit == "bits" else self.max_value_chars
        if size > limit:
            raise _TemplateOutputTooLarge(f"{what} would build {size:,.0f} {unit}, more than the {limit:,} allowed")

    def check_printf(self, fmt, args) -> None:
        if not isinstance(fmt, str):
            return
        star_args = args if isinstance(args, tuple) else (args,)
        for width, precision in _PRINTF_SIZES.findall(fmt):
            for size in (width, precision):
                if size == "*":
                    for arg in star_args:
                        self.check_size(arg, "a '%' conversion")
                elif size:
                    self.check_size(int(size), "a '%' conversion")

    def _bounded_filter(self, jinja_filter, name: str):
        def bounded(value, *args, **kwargs):
            if name == "format":
                self.check_printf(value, kwargs or args)
            else:
                for size in (*args, *kwargs.values()):
                    self.check_size(size, f"the {name} filter")
            return jinja_filter(value, *args, **kwargs)

        return bounded

    @jinja2.pass_eval_context
    def _bounded_join(self, eval_ctx, value, d="", attribute=None):
        items = list(value)
        if attribute is not None:
            getter = jinja2.filters.make_attrgetter(self, attribute)
            items = [getter(x) for x in items]
        self.check_result(sum(len(str(x)) for x in items) + len(str(d)) * max(len(items) - 1, 0), "the join filter")
        return jinja2.filters.do_join(eval_ctx, items, d)

    def bounded_concat(self, args: tuple) -> str:
        """The `~` operator: its operands as strings, joined once their total length is known to fit."""
        parts = [str(x) for x in args]
        self.check_result(sum(map(len, parts)), "'~'")
        if any(hasattr(x, "__html__") for x in args):  # inside {% autoescape %}: jinja's own, which escapes
            return jinja2.runtime.markup_join(args)
        return "".join(parts)

    def check_binop(self, operator: str, left, right) -> None:
        """The size of the result of `left operator right`, checked before it is built: bits for integers (one
        big-integer operation is one C call that holds the GIL), items for strings, lists and tuples."""
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0 and abs(left) > 1:
            self.check_result(right * math.log2(abs(left)), "'**'", "bits")
        elif operator == "*" and _is_int(left) and _is_int(right):
            self.check_result(left.bit_length() + right.bit_length(), "'*'", "bits")
        elif operator == "*":
            for seq, count in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and _is_int(count):
                    self.check_size(len(seq) * count, "'*'")
        elif operator == "+" and _is_int(left) and _is_int(right):
            self.check_result(max(left.bit_length(), right.bit_length()) + 1, "'+'", "bits")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            self.check_result(len(left) + len(right), "'+'")

    def call_binop(self, context, operator: str, left, right):
        self.check_binop(operator, left, right)
        if operator == "%":
            self.check_printf(left, right)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str) and len(result) > self.max_value_chars:
            raise _TemplateOutputTooLarge(f"'{operator}' built {len(result):,} characters")
        return result

    # jinja's own signature: the template's keyword arguments may be named `self` or `context`
    def call(__self, __context, __obj, *args, **kwargs):
        owner, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", "")
        if isinstance(owner, str) and name in _PADDING_METHODS:
            for size in (*args, *kwargs.values()):
                __self.check_size(size, f"str.{name}")
        if isinstance(owner, str) and name == "join" and len(args) == 1 and not kwargs:
            items = list(args[0])  # an iterator is read once: str.join gets the list
            sizes = sum(len(x) if isinstance(x, str) else 0 for x in items) + len(owner) * max(len(items) - 1, 0)
            __self.check_result(sizes, "str.join")
            args = (items,)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            try:
                specs = [spec for _, _, spec, _ in string.Formatter().parse(value.__self__) if spec]
            except ValueError:
                specs = []  # str.format itself reports the malformed string
            for spec in specs:
                if "{" in spec:
                    raise _TemplateOutputTooLarge("str.format with a nested width or precision")
                for size in re.findall(r"\d+", spec):
                    self.check_size(int(size), "a str.format spec")
        return wrapped


class _Refused(ArtifactError):
    """The template broke its bounds (time, memory, output, the sandbox) or does not parse: whatever the
    conversation, it is at fault."""


def _template_error(what: str, error=ArtifactError) -> ArtifactError:
    return error(f"the model's chat template {what}",
                 "fix chat_template in the checkpoint's tokenizer_config.json and compile again")  # fmt: skip


@functools.lru_cache(maxsize=8)
def compile_template(template: str, limits: TemplateLimits = DEFAULT_LIMITS) -> jinja2.Template:
    """The template compiled as transformers compiles it, under `limits`. Its faults are the checkpoint's."""
    if len(template) > limits.max_template_chars:
        raise _template_error(f"has {len(template):,} characters, more than the {limits.max_template_chars:,} allowed",
                              _Refused)  # fmt: skip
    # optimized=False: jinja's optimizer evaluates constant expressions and filters at compile time, unbounded
    env = _BoundedEnvironment(limits.max_output_chars, limits.max_int_bits, trim_blocks=True, lstrip_blocks=True,
                              optimized=False, extensions=[jinja2.ext.loopcontrols])  # fmt: skip
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise _template_error(f"does not parse: {e.message} (line {e.lineno})", _Refused) from e


def _render_here(template: jinja2.Template, limits: TemplateLimits, variables: dict) -> str:
    """template.render(**variables) in this process, stopped when its output passes limits.max_output_chars;
    what goes wrong is an LlmcError. Only a render process calls it: no timeout could stop it here."""
    try:
        parts, size = [], 0
        for part in template.generate(**variables):
            size += len(part)
            if size > limits.max_output_chars:
                raise _TemplateOutputTooLarge(f"its output passed {limits.max_output_chars:,} characters")
            parts.append(part)
        return "".join(parts)
    except MemoryError:
        raise _template_error(f"ran out of the {limits.max_memory_bytes:,} bytes of memory a render may take",
                              _Refused) from None  # fmt: skip
    except (jinja2.exceptions.SecurityError, RecursionError) as e:
        raise _template_error(f"was refused by the sandbox: {e}", _Refused) from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception, an undefined variable: the conversation's
        raise RequestError(f"the chat template rejected the conversation: {e}", "check the messages' roles and order",
                           param="messages") from None  # fmt: skip
    except Exception as e:  # noqa: BLE001  (a TypeError, a ValueError: the template's code failed on this input)
        raise _template_error(f"failed on this conversation: {type(e).__name__}: {e}") from None


# -- render processes ---------------------------------------------------------------------------------------
# A render runs in a process of its own, so that nothing it does (one C call that holds its GIL for a minute,
# an allocation of gigabytes) can stall or starve the caller's. A few idle ones are kept and reused; one that
# runs past its timeout is killed, and a fresh one is started in its place. Requests and replies are one JSON
# line each over the process's stdin and stdout: the caller never unpickles what a template produced.

_WORKER_COMMAND = "from llmc.chat_template import _render_process_main; _render_process_main()"
_START_TIMEOUT_S = 60.0  # a cold start on a loaded machine (python and jinja2 imports); not the render's budget
_IDLE_PROCESSES = 4
_ERRORS = {"RequestError": RequestError, "ArtifactError": ArtifactError, "_Refused": _Refused}


class _ProcessFailed(Exception):
    pass


class _RenderProcess:
    """One render process and its pipes. Used by one thread at a time (the pool hands it out)."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", _WORKER_COMMAND], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)  # fmt: skip
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
        raise ArtifactError(f"the chat template's render process {e}",
                            "check that this Python can run `python -c 'import llmc.chat_template'`") from None  # fmt: skip
    if reply is None:
        process.kill()
        _POOL.warm()  # its replacement starts now, not at the next request
        raise _template_error(f"took more than {limits.timeout_s:g} s to render; it was stopped", _Refused)
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
    for which, soft in ((resource.RLIMIT_AS, used_bytes + limits.max_memory_bytes),
                        (resource.RLIMIT_CPU, math.ceil(used_s + limits.timeout_s) + 2)):  # fmt: skip
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
            reply = {"text": _render_here(compile_template(request["template"], limits), limits, request["variables"])}
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
) -> str:
    """The prompt text for `messages` ([{"role", "content"}, ...]). template None: plain transcript.

    A template that rejects the conversation (raise_exception, e.g. "roles must alternate") raises
    RequestError: the request is at fault, not the server. One that fails on it (a TypeError in its code) or
    breaks its bounds (time, memory, output size, the sandbox) raises ArtifactError: the checkpoint is at fault.
    The render runs in a render process (above); the caller's thread waits for it without holding the GIL.
    """
    template = pick_template(template)
    if template is None:
        text = bos_token + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant:" if add_generation_prompt else text
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                     eos_token=eos_token, tools=None, documents=None)  # fmt: skip
    compile_template(template, limits)  # one that does not parse or is too large fails here, not in a process
    return _render_in_process(template, limits, variables)


# What compile renders each checkpoint's template on, before it ships it: a template has to render one of them.
# Several, since real templates refuse some: Gemma's raises on a system turn, Mistral's wants user first.
SAMPLE_CONVERSATIONS = (
    [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hello!"},
     {"role": "assistant", "content": "Hi! How can I help?"}, {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}],
    [{"role": "user", "content": "Hello!"}],
)  # fmt: skip


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
        except _Refused:
            raise
        except LlmcError as e:
            problems.append(e.what.removeprefix("the model's chat template ").removeprefix("the chat template "))
    raise _template_error(f"rendered none of {len(problems)} sample conversations; the first {problems[0]}")
