"""What each generation endpoint answers: per-choice state while generating (Choice), and per endpoint a Format
that builds whole choices, stream deltas and logprobs (/v1/completions: CompletionFormat, /v1/chat/completions:
ChatFormat). The generation path (serving.py) is shared; a new kind of delta (tool calls, say) is a Format's.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

from llmc.runtime.outputs import RequestOutput
from llmc.runtime.tool_calls import ToolCallStreamParser, merge_deltas, parse_tool_calls


@dataclasses.dataclass
class Choice:
    index: int
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: Any = None  # the format's accumulated logprobs of the whole choice
    text_offset: int = 0  # completions logprobs: characters of token text so far

    def update(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.num_tokens = out.num_output_tokens
        if out.finished:
            self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason


class Format(abc.ABC):
    """What differs between /v1/completions and /v1/chat/completions; the generation path is shared."""

    id_prefix: ClassVar[str]
    object: ClassVar[str]  # of a whole response
    chunk_object: ClassVar[str]  # of a stream chunk

    def __init__(self, token_text: Callable[[int], str], num_logprobs: int | None):
        self.token_text, self.num_logprobs = token_text, num_logprobs

    @abc.abstractmethod
    def logprobs(self, choice: Choice, out: RequestOutput):
        """The logprobs of out's new tokens (None when not asked for), also added to choice.logprobs."""

    def opening(self, choices: list[Choice]) -> list[dict]:
        """Choice entries of the stream's first chunks, before any token."""
        return []

    @abc.abstractmethod
    def choice(self, choice: Choice) -> dict:
        """A whole choice of a non-streaming response."""

    @abc.abstractmethod
    def delta(self, choice: Choice, out: RequestOutput, logprobs) -> dict | None:
        """The choice entry of one stream chunk; None when it has nothing to send yet."""


class CompletionFormat(Format):
    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def logprobs(self, choice: Choice, out: RequestOutput):
        """OpenAI's legacy logprobs object for the new tokens of `out`."""
        if self.num_logprobs is None:
            return None
        lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, dist in zip(out.new_token_ids, out.logprobs or [], strict=True):
            text = self.token_text(token)
            lp["tokens"].append(text)
            lp["token_logprobs"].append(dist[token])
            lp["top_logprobs"].append({self.token_text(t): v for t, v in list(dist.items())[: self.num_logprobs]})
            lp["text_offset"].append(choice.text_offset)
            choice.text_offset += len(text)
        choice.logprobs = choice.logprobs or {key: [] for key in lp}
        for key, values in lp.items():
            choice.logprobs[key].extend(values)
        return lp

    def choice(self, choice: Choice) -> dict:
        return self._entry(choice, choice.text, choice.logprobs)

    def delta(self, choice: Choice, out: RequestOutput, logprobs) -> dict:
        return self._entry(choice, out.new_text, logprobs)

    @staticmethod
    def _entry(choice: Choice, text: str, logprobs) -> dict:
        return {
            "index": choice.index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
        }


class ChatFormat(Format):
    """tool_format: with tools in the request, the calls of each choice are parsed from its text in that format
    (runtime/tool_calls.py) into message.tool_calls, or streamed as delta.tool_calls once they parse."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, token_text: Callable[[int], str], num_logprobs: int | None, tool_format: str | None = None):
        super().__init__(token_text, num_logprobs)
        self.tool_format = tool_format
        self._streams: dict[int, ToolCallStreamParser] = {}

    def logprobs(self, choice: Choice, out: RequestOutput):
        if self.num_logprobs is None:
            return None

        def entry(token: int, logprob: float) -> dict:
            text = self.token_text(token)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token, dist in zip(out.new_token_ids, out.logprobs or [], strict=True):
            top = [entry(t, v) for t, v in list(dist.items())[: self.num_logprobs]]
            content.append({**entry(token, dist[token]), "top_logprobs": top})
        choice.logprobs = choice.logprobs or {"content": []}
        choice.logprobs["content"].extend(content)
        return {"content": content}

    def opening(self, choices: list[Choice]) -> list[dict]:  # every choice opens with the role
        return [
            {"index": c.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            for c in choices
        ]

    def choice(self, choice: Choice) -> dict:
        message = {"role": "assistant", "content": choice.text}
        finish_reason = choice.finish_reason
        if self.tool_format is not None and (parsed := parse_tool_calls(self.tool_format, choice.text)).tool_calls:
            message = {
                "role": "assistant",
                "content": parsed.content,
                "tool_calls": [call.to_openai() for call in parsed.tool_calls],
            }
            finish_reason = _with_calls(finish_reason)
        return {
            "index": choice.index,
            "message": message,
            "logprobs": choice.logprobs,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }

    def delta(self, choice: Choice, out: RequestOutput, logprobs) -> dict | None:
        delta, finish_reason = ({"content": out.new_text} if out.new_text else {}), choice.finish_reason
        if self.tool_format is not None:
            stream = self._streams.setdefault(choice.index, ToolCallStreamParser(self.tool_format))
            delta = merge_deltas(stream.feed(out.new_text) + (stream.finish() if out.finished else []))
            if out.finished and stream.tool_calls:
                finish_reason = _with_calls(finish_reason)
        if not (delta or out.finished or logprobs is not None):
            return None  # the text is held back: it may be a call
        if not (delta or out.finished):
            delta = {"content": ""}
        return {
            "index": choice.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
            "stop_reason": choice.stop_reason,
        }


def _with_calls(finish_reason: str | None) -> str | None:
    """A choice that made tool calls finishes with "tool_calls" where it stopped by itself (not at a length)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason
