"""Prefix-affinity replica choice for `llmc serve --ray` (ray_serve.py's request router), free of Ray.

A replica keeps the KV blocks of the prompts it served (prefix caching), so a prompt that shares a long
prefix with one a replica served last is cheapest there. `PrefixAffinity` remembers, in a character trie,
which replica most recently served each prompt prefix. For a new request:
- while load is balanced (the busiest and the idlest candidate differ by at most `imbalance` requests), the
  replica that most recently served the longest matching prefix comes first, if the match covers at least
  `min_match_fraction` of the prompt;
- otherwise (no such match, or imbalanced load) two random candidates, the less loaded first (the power of
  two choices).
The idea is Ray Serve LLM's PrefixCacheAffinityRouter's; this code is llmc's own.
"""

from __future__ import annotations

import collections
import json
import random
from collections.abc import Mapping


class _Node:
    __slots__ = ("children", "seen")

    def __init__(self):
        self.children: dict[str, _Node] = {}
        self.seen: dict[str, int] = {}  # replica -> stamp of its latest prompt through this node


class PrefixAffinity:
    """Ranks replicas (by id) for a prompt text; `record` tells it where each prompt went."""

    def __init__(
        self,
        *,
        imbalance: int = 8,
        min_match_fraction: float = 0.1,
        max_chars: int = 4096,
        max_records: int = 4096,
        rng: random.Random | None = None,
    ):
        """max_chars: characters of a prompt remembered (a prefix longer than a context says nothing more);
        max_records: prompts remembered, the oldest forgotten first."""
        self.imbalance, self.min_match_fraction, self.max_chars = imbalance, min_match_fraction, max_chars
        self.rng = rng or random.Random()
        self._root = _Node()
        self._stamp = 0
        self._records: collections.deque[tuple[str, str]] = collections.deque(maxlen=max_records)

    def choose(self, prompt: str, loads: Mapping[str, int]) -> list[list[str]]:
        """Ranks of candidate replicas, most preferred first; loads: every candidate's requests in flight."""
        if not loads:
            return []
        if max(loads.values()) - min(loads.values()) <= self.imbalance:
            match, length = self.longest_match(prompt, loads)
            if match is not None and length >= self.min_match_fraction * min(len(prompt), self.max_chars):
                rest = {r: n for r, n in loads.items() if r != match}
                return [[match]] + ([self._two_choices(rest)] if rest else [])
        return [self._two_choices(loads)]

    def _two_choices(self, loads: Mapping[str, int]) -> list[str]:
        pair = self.rng.sample(sorted(loads), min(2, len(loads)))
        return sorted(pair, key=lambda r: loads[r])

    def longest_match(self, prompt: str, candidates) -> tuple[str | None, int]:
        """The candidate that most recently served the longest prefix of `prompt` it shares, and that prefix's length."""
        node, best, length = self._root, None, 0
        for depth, ch in enumerate(prompt[: self.max_chars], 1):
            node = node.children.get(ch)
            if node is None:
                break
            owners = [(stamp, r) for r, stamp in node.seen.items() if r in candidates]
            if owners:
                best, length = max(owners)[1], depth
        return best, length

    def record(self, prompt: str, replica: str) -> None:
        prompt = prompt[: self.max_chars]
        if len(self._records) == self._records.maxlen:
            self._records.popleft()
            self._records.append((prompt, replica))
            self._rebuild()  # the oldest prompt's marks go; rebuilding is cheaper than tracking each mark's owner
            return
        self._records.append((prompt, replica))
        self._mark(prompt, replica)

    def forget(self, replica: str) -> None:
        """A replica that died: its cache died with it."""
        self._records = collections.deque(
            ((p, r) for p, r in self._records if r != replica), maxlen=self._records.maxlen
        )
        self._rebuild()

    def _mark(self, prompt: str, replica: str) -> None:
        self._stamp += 1
        node = self._root
        for ch in prompt:
            node = node.children.setdefault(ch, _Node())
            node.seen[replica] = self._stamp

    def _rebuild(self) -> None:
        self._root = _Node()
        for prompt, replica in self._records:
            self._mark(prompt, replica)


def routing_prompt(path: str, body: bytes) -> str:
    """The text a request's KV cache starts with, as far as the router can tell without the tokenizer: a
    completion's prompt, or a chat's messages in order. "" for anything else (that replica answers the error)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, UnicodeDecodeError):
        return ""
    if not isinstance(data, dict):
        return ""
    if path.endswith("/completions") and not path.endswith("/chat/completions"):
        prompt = data.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            return prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return "".join(f"{t}," for t in prompt)
        return ""
    messages = data.get("messages")
    if not isinstance(messages, list):
        return ""
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            return "".join(parts)
        content = m.get("content")
        if isinstance(content, list):
            content = "\n".join(
                p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        parts.append(f"{m.get('role')}\x1f{content if isinstance(content, str) else ''}\x1e")
    return "".join(parts)
