"""Chat prompts: a conversation rendered with the checkpoint's chat template, then encoded.

The renderer and its bounds are llmc/chat_template.py (the compiler renders each checkpoint's template with it
too); here is the tokenizer's side: the special tokens' texts the template is given, and the encoding of its
text with `add_special_tokens=False` (the template placed them itself).
"""

from __future__ import annotations

from llmc.chat_template import DEFAULT_LIMITS, TemplateLimits, render_chat


def special_tokens(tokenizer, bos_token_id: int | None, eos_token_ids) -> tuple[str, str]:
    """(bos_token, eos_token) strings for the template, from the model's token ids; "" where unknown."""

    def name(token_id) -> str:
        return (tokenizer.id_to_token(int(token_id)) or "") if token_id is not None else ""

    eos_ids = list(eos_token_ids or ())
    return name(bos_token_id), name(eos_ids[0] if eos_ids else None)


def chat_prompt_ids(
    tokenizer,
    template: str | None,
    messages: list[dict],
    bos_token: str,
    eos_token: str,
    limits: TemplateLimits = DEFAULT_LIMITS,
) -> list[int]:
    """Render and encode; the template placed the special tokens itself, so none are added.

    encode_batch, not encode: it lets go of the GIL, so a server that calls this in a worker thread goes on
    serving while a long conversation is tokenized.
    """
    text = render_chat(template, messages, bos_token, eos_token, add_generation_prompt=True, limits=limits)
    (encoding,) = tokenizer.encode_batch([text], add_special_tokens=False)
    return encoding.ids
