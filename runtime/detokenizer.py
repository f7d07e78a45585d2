"""Incremental detokenization and stop strings, one request at a time.

Decoding token by token is wrong in two ways that this module fixes:
- A character's UTF-8 bytes can be split across byte-level BPE tokens (or byte-fallback tokens). Until the
  last byte arrives, `decode` ends the text with U+FFFD; that text is held back until the character is
  complete.
- Decoders that depend on context (SentencePiece's leading-space strip, byte fusion) give a different
  result for a token alone than inside the sequence. So each step decodes a short window twice, from
  `prefix_offset` to `read_offset` (already emitted) and from `prefix_offset` to the end, and emits the
  difference (the technique of vLLM and TGI).

Stop strings are searched in the detokenized text, so they match across token boundaries. On a match the
text ends just before the stop string; while the text's end could still grow into a stop string, that
tail is held back from streaming.
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens kept as decoding context in front of the first generated token: enough for any decoder's
# context effect (vLLM uses 5).
INITIAL_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Text of one sequence's generated tokens, built token by token.

    tokenizer: a `tokenizers.Tokenizer` (anything with `decode(ids, skip_special_tokens=...)`).
    `update` adds tokens and checks stop strings; `take_delta` hands out the text not yet streamed.
    """

    def __init__(
        self,
        tokenizer,
        prompt_token_ids: Sequence[int],
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = tuple(stop)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        # Only the decoding window is kept: ids[prefix_offset:] of the full sequence, offsets relative to it.
        self._ids: list[int] = list(prompt_token_ids[-INITIAL_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.output_text = ""  # all generated text so far (cut before a stop string once one matched)
        self.stop_reason: str | None = None  # the stop string that matched
        self._num_sent = 0  # characters of output_text already handed out by take_delta

    def update(self, new_token_ids: Sequence[int], *, check_stop: bool = True, flush: bool = False) -> str | None:
        """Add generated tokens; return the stop string that now matches, else None.

        check_stop=False while min_tokens is not reached. flush=True on the last update of a finished
        sequence: text still held back for an incomplete character is emitted as it decodes (with U+FFFD).
        """
        assert self.stop_reason is None, "update after a stop string matched"
        text_before = len(self.output_text)
        for token_id in new_token_ids:
            self._ids.append(int(token_id))
            self.output_text += self._decode_step()
        if flush and self._read_offset < len(self._ids):
            self.output_text += self._decode_step(force=True)
        if check_stop and self.stop:
            self._check_stop(text_before)
        return self.stop_reason

    def take_delta(self, finished: bool = False) -> str:
        """Text not yet handed out. Unless finished, a tail that may begin a stop string is held back."""
        end = len(self.output_text)
        if not finished:
            end -= self._partial_stop_len()
        delta = self.output_text[self._num_sent : end] if end > self._num_sent else ""
        self._num_sent = max(self._num_sent, end)
        return delta

    def _decode_step(self, force: bool = False) -> str:
        decode, skip = self.tokenizer.decode, self.skip_special_tokens
        prefix_text = decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=skip)
        new_text = decode(self._ids[self._prefix_offset :], skip_special_tokens=skip)
        if force or (len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR)):
            # NOTE: if new_text does not start with prefix_text (a decoder rewrote the window), slicing
            # by length still gives the new characters, which is what vLLM does too.
            delta = new_text[len(prefix_text) :]
            del self._ids[: self._read_offset]  # the old prefix window is no longer needed
            self._prefix_offset, self._read_offset = 0, len(self._ids)
            return delta
        return ""  # incomplete character (or nothing visible yet): wait for the next token

    def _check_stop(self, text_before: int) -> None:
        # A match must end in the new text; it can start up to max_stop_len - 1 characters before it.
        start = max(0, text_before - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.output_text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            self.output_text = self.output_text[: best[0]]
            self._num_sent = min(self._num_sent, best[0])
            self.stop_reason = best[1]

    def _partial_stop_len(self) -> int:
        """Length of the longest tail of output_text that is a proper prefix of some stop string."""
        text = self.output_text
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
