"""Chat prompts: a conversation rendered with the checkpoint's own chat template, the one place for it.

Hugging Face checkpoints ship a Jinja2 chat template (tokenizer_config.json "chat_template"). It is rendered
as transformers' `apply_chat_template` does: a sandboxed environment with trim_blocks / lstrip_blocks and
loop controls, `raise_exception`, `strftime_now` and a `tojson` filter that keeps non-ASCII text, and the
variables `messages`, `add_generation_prompt`, `bos_token` and `eos_token`. The rendered text already holds
the special tokens the template wants, so it is encoded with `add_special_tokens=False` (`chat_prompt_ids`).

A checkpoint without a template gets a plain "role: content" transcript (`NO_TEMPLATE_NOTICE` says so; the
server logs it once at start, the REPL prints it once).
"""

from __future__ import annotations

import datetime
import functools
import json

import jinja2
import jinja2.ext
import jinja2.sandbox

from llmc.errors import ArtifactError, RequestError

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


@functools.lru_cache(maxsize=8)
def compile_template(template: str) -> jinja2.Template:
    """The template compiled as transformers compiles it. A syntax error is the checkpoint's fault."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ArtifactError(
            f"the model's chat template does not parse: {e.message} (line {e.lineno})",
            "fix chat_template in the checkpoint's tokenizer_config.json and compile again",
        ) from e


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
) -> str:
    """The prompt text for `messages` ([{"role", "content"}, ...]). template None: plain transcript.

    A template that rejects the conversation (raise_exception, e.g. "roles must alternate") or fails to
    render raises RequestError: the request is at fault, not the server.
    """
    template = pick_template(template)
    if template is None:
        text = bos_token + "".join(f"{m['role']}: {m['content']}\n" for m in messages)
        return text + "assistant:" if add_generation_prompt else text
    try:
        return compile_template(template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=bos_token,
            eos_token=eos_token,
            tools=None,
            documents=None,
        )
    except jinja2.exceptions.TemplateError as e:
        raise RequestError(f"the chat template rejected the conversation: {e}", "check the messages' roles and order") from e


def special_tokens(tokenizer, config) -> tuple[str, str]:
    """(bos_token, eos_token) strings for the template, from the config's token ids; "" where unknown."""

    def name(token_id) -> str:
        return (tokenizer.id_to_token(int(token_id)) or "") if token_id is not None else ""

    eos_ids = list(getattr(config, "eos_token_ids", ()) or ())
    return name(getattr(config, "bos_token_id", None)), name(eos_ids[0] if eos_ids else None)


def chat_prompt_ids(tokenizer, template: str | None, messages: list[dict], bos_token: str, eos_token: str) -> list[int]:
    """Render and encode; the template placed the special tokens itself, so none are added."""
    text = render_chat(template, messages, bos_token, eos_token, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False).ids
