"""The chat-template sandbox: the Jinja2 environment a checkpoint's chat template is compiled and rendered in
(llmc/chat_template.py runs each render in a render process).

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
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import math
import re
import string

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.filters
import jinja2.nodes
import jinja2.runtime
import jinja2.sandbox

from llmc.errors import ArtifactError, RequestError


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' `{% generation %}...{% endgeneration %}` (SmolLM3's template has it): it marks the
    assistant's text for training masks. A render needs only its body, in a scope of its own as there."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


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


class TemplateRefused(ArtifactError):
    """The template broke its bounds (time, memory, output, the sandbox) or does not parse: whatever the
    conversation, it is at fault."""


def template_error(what: str, error=ArtifactError) -> ArtifactError:
    return error(
        f"the model's chat template {what}",
        "fix chat_template in the checkpoint's tokenizer_config.json and compile again",
    )


@functools.lru_cache(maxsize=8)
def compile_template(template: str, limits: TemplateLimits = DEFAULT_LIMITS) -> jinja2.Template:
    """The template compiled as transformers compiles it, under `limits`. Its faults are the checkpoint's."""
    if len(template) > limits.max_template_chars:
        raise template_error(
            f"has {len(template):,} characters, more than the {limits.max_template_chars:,} allowed", TemplateRefused
        )
    # optimized=False: jinja's optimizer evaluates constant expressions and filters at compile time, unbounded
    env = _BoundedEnvironment(
        limits.max_output_chars,
        limits.max_int_bits,
        trim_blocks=True,
        lstrip_blocks=True,
        optimized=False,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise template_error(f"does not parse: {e.message} (line {e.lineno})", TemplateRefused) from e


def render_in_this_process(template: jinja2.Template, limits: TemplateLimits, variables: dict) -> str:
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
        raise template_error(
            f"ran out of the {limits.max_memory_bytes:,} bytes of memory a render may take", TemplateRefused
        ) from None
    except (jinja2.exceptions.SecurityError, RecursionError) as e:
        raise template_error(f"was refused by the sandbox: {e}", TemplateRefused) from None
    except jinja2.exceptions.TemplateError as e:  # raise_exception, an undefined variable: the conversation's
        raise RequestError(
            f"the chat template rejected the conversation: {e}", "check the messages' roles and order", param="messages"
        ) from None
    except Exception as e:  # noqa: BLE001  (a TypeError, a ValueError: the template's code failed on this input)
        raise template_error(f"failed on this conversation: {type(e).__name__}: {e}") from None
