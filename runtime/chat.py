"""Interactive chat (`llmc run ARTIFACT` without --prompt): a REPL over the sync LLMEngine.

Each line read is a user turn. The whole conversation is rendered with the checkpoint's chat template
(chat_template.py) and the reply streams to the output as its tokens arrive. `/reset` starts a new
conversation, `/exit` or end of input quits, Ctrl-C during a reply stops that reply.
"""

from __future__ import annotations

import sys
from typing import TextIO

from llmc.chat_template import NO_TEMPLATE_NOTICE, pick_template, warm_render_processes
from llmc.errors import LlmcError, RequestError
from llmc.runtime.chat_template import chat_prompt_ids, special_tokens
from llmc.runtime.engine import LLMEngine
from llmc.sampling_params import SamplingParams

HELP = "Type a message. /reset starts a new conversation, /exit (or Ctrl-D) quits, Ctrl-C stops a reply."


def run_chat(
    engine: LLMEngine,
    tokenizer,
    chat_template: str | None,
    params: SamplingParams,
    input: TextIO | None = None,
    output: TextIO | None = None,
    *,
    system_prompt: str | None = None,
    bos_token: str | None = None,
    eos_token: str | None = None,
) -> list[dict]:
    """Run the REPL until /exit or end of input; returns the conversation as it stands at the end.

    engine: must hold the tokenizer (it detokenizes the reply); params: the sampling of every reply (n=1;
    max_tokens=None lets a reply run to EOS or the end of the context). bos_token / eos_token default to
    the tokens of the model config's bos_token_id and first eos_token_id.
    """
    input = sys.stdin if input is None else input
    output = sys.stdout if output is None else output
    if engine.tokenizer is None:
        raise LlmcError("chat needs the engine to hold the model's tokenizer", "create LLMEngine(model, tokenizer)")
    if params.n != 1:
        raise LlmcError(f"chat streams one reply, but n={params.n}", "use n=1")
    template = pick_template(chat_template)
    if template is not None:
        warm_render_processes()  # the first turn does not wait for one to start
    default_bos, default_eos = special_tokens(tokenizer, engine.bos_token_id, engine.eos_token_ids)
    bos = default_bos if bos_token is None else bos_token
    eos = default_eos if eos_token is None else eos_token
    interactive = getattr(input, "isatty", lambda: False)()
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def say(text: str) -> None:
        output.write(text)
        output.flush()

    def new_conversation() -> list[dict]:
        return [{"role": "system", "content": system_prompt}] if system_prompt else []

    say(HELP + "\n")
    if template is None:
        say(f"note: {NO_TEMPLATE_NOTICE}\n")
    messages = new_conversation()
    while True:
        if interactive:
            say(">>> ")
        try:
            line = input.readline()
        except KeyboardInterrupt:
            say("\n")
            break
        if not line:  # end of input
            if interactive:
                say("\n")
            break
        text = line.rstrip("\r\n")
        command = text.strip()
        if not command:
            continue
        if command == "/exit":
            break
        if command == "/reset":
            messages = new_conversation()
            say("(new conversation)\n")
            continue
        messages.append({"role": "user", "content": text})
        try:
            prompt_ids = chat_prompt_ids(tokenizer, template, messages, bos, eos)
            req_id = engine.add_request(prompt_ids, params)
        except RequestError as e:
            messages.pop()
            say(
                f"error: {e}\n"
                + ("(the conversation is too long: /reset starts a new one)\n" if "tokens" in e.what else "")
            )
            continue
        reply = _stream_reply(engine, req_id, say)
        messages.append({"role": "assistant", "content": reply})
    return messages


def _stream_reply(engine: LLMEngine, req_id: str, say) -> str:
    """Step the engine until the request finishes, writing each text delta as it comes; the reply text."""
    parts: list[str] = []
    try:
        finished = False
        while not finished and engine.has_unfinished():
            for out in engine.step():
                if out.req_id != req_id:
                    continue
                if out.error is not None:
                    raise out.error
                if out.new_text:
                    parts.append(out.new_text)
                    say(out.new_text)
                finished = out.finished
    except KeyboardInterrupt:
        engine.abort(req_id)
        say(" [stopped]")
    say("\n")
    return "".join(parts)
