"""One request through the official openai client, as text and finish reason, whatever its kind."""


def ask(client, model: str, prompt: str, *, max_tokens: int, stream: bool, chat: bool, **params):
    """(text, finish_reason) of a completion or chat request, streamed or not."""
    if chat:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, stream=stream, **params
        )
        if stream:
            chunks = list(r)
            return "".join(c.choices[0].delta.content or "" for c in chunks), chunks[-1].choices[0].finish_reason
        return r.choices[0].message.content, r.choices[0].finish_reason
    r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=stream, **params)
    if stream:
        chunks = list(r)
        return "".join(c.choices[0].text for c in chunks), chunks[-1].choices[0].finish_reason
    return r.choices[0].text, r.choices[0].finish_reason
