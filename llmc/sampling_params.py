"""The sampling parameters of a request: one dataclass, the one place for their defaults and their rules.

The runtime checks every request with it; the compiler checks a checkpoint's generation defaults with it, since
they become every request's defaults. Names and semantics follow vLLM and the OpenAI API.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math

from llmc.errors import RequestError

GREEDY_TEMPERATURE = 1e-5  # temperature below this samples greedily (argmax)
MAX_LOGPROBS = 20  # as vLLM's default max_logprobs and OpenAI's top_logprobs limit
# Far past any useful value (OpenAI stops at 2); beyond it the distribution is uniform to float precision.
MAX_TEMPERATURE = 100.0
MAX_REPETITION_PENALTY = 100.0
# Its mirror below 1: dividing a logit by a penalty near 0 overflows it to inf, and the softmax of an inf is NaN.
MIN_REPETITION_PENALTY = 1.0 / MAX_REPETITION_PENALTY
# numpy's SeedSequence takes non-negative integers only; 64 bits is every seed a client sends in practice.
MAX_SEED = 2**64 - 1
# A schema, regex or grammar's text: far past any real one, and a bound on what the grammar compiler is given
MAX_GRAMMAR_CHARS = 256 * 1024
MAX_CHOICES = 4096


_STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclasses.dataclass(frozen=True)
class StructuredOutputs:
    """What a request's output must match (vLLM's `structured_outputs`): exactly one of a JSON schema (a dict,
    or its text), any JSON object, a regular expression, a list of choices, or a grammar (Lark, or llama.cpp's
    GBNF). The runtime compiles it (runtime/structured.py) and masks every step's logits with it."""

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None and isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = self._given()
        if len(given) != 1:
            raise RequestError(
                "structured output takes exactly one of json, json_object, regex, choice and grammar"
                + (f", not {' and '.join(given)}" if given else ""),
                param="structured_outputs",
            )
        (kind,) = given
        value = getattr(self, kind)
        ok = {
            "json": isinstance(value, dict | str) and not isinstance(value, bool),
            "json_object": value is True,
            "regex": isinstance(value, str),
            "choice": isinstance(value, tuple)
            and 0 < len(value) <= MAX_CHOICES
            and all(isinstance(c, str) and c for c in value),
            "grammar": isinstance(value, str),
        }[kind]
        if not ok:
            raise RequestError(
                f"structured output {kind} must be "
                + {
                    "json": "a JSON schema (an object)",
                    "json_object": "true",
                    "regex": "a string",
                    "choice": f"a list of 1 to {MAX_CHOICES} non-empty strings",
                    "grammar": "a string (Lark or GBNF)",
                }[kind],
                param=kind,
            )
        if len(self.text) > MAX_GRAMMAR_CHARS:
            raise RequestError(f"structured output {kind} is longer than {MAX_GRAMMAR_CHARS:,} characters", param=kind)

    def _given(self) -> list[str]:
        return [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]

    @property
    def kind(self) -> str:
        return self._given()[0]

    @functools.cached_property  # every request looks its constraint up by it (structured.py's cache key)
    def text(self) -> str:
        """The constraint as one string: what the grammar cache is keyed by (a schema's canonical JSON, whether it
        came as an object or as text)."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                return value  # the compiler refuses it
        if isinstance(value, str):
            return value
        return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


@dataclasses.dataclass
class SamplingParams:
    n: int = 1  # independent sequences per prompt
    temperature: float = 1.0  # < 1e-5: greedy
    top_k: int = 0  # 0 (or -1): off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off; keep tokens with prob >= min_p * max prob
    repetition_penalty: float = 1.0  # > 1 discourages tokens in prompt or output (CTRL style)
    presence_penalty: float = 0.0  # subtracted once from the logit of every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)  # output text ends before the first match
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)  # stop after generating any of these
    max_tokens: int | None = 16  # None: until the context is full
    min_tokens: int = 0  # EOS, stop tokens and stop strings are held off until this many tokens
    logprobs: int | None = None  # return the sampled token's logprob and the top-n; None: none
    ignore_eos: bool = False
    skip_special_tokens: bool = True  # detokenization
    structured: StructuredOutputs | None = None  # the grammar every output must match; None: free text

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, value, hint: str) -> RequestError:
            return RequestError(f"invalid sampling parameter: {param}={value!r}", hint, param=param)

        def real(name: str) -> float:
            """The float field `name`, refused when it is not a finite number (inf and nan pass every range check)."""
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise bad(name, value, f"{name} must be a finite number")
            return value

        def integer(name: str, low: int, high: int | None = None, hint: str = "") -> None:
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < low
                or (high is not None and value > high)
            ):
                raise bad(
                    name, value, hint or f"{name} must be an integer in [{low}, {high if high is not None else 'inf'}]"
                )

        integer("n", 1, hint="n must be an integer >= 1")
        if not 0.0 <= real("temperature") <= MAX_TEMPERATURE:
            raise bad("temperature", self.temperature, f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 is greedy)")
        integer("top_k", 0, hint="top_k must be an integer >= 1, or 0 / -1 to turn it off")
        if not 0.0 < real("top_p") <= 1.0:
            raise bad("top_p", self.top_p, "top_p must be in (0, 1]")
        if not 0.0 <= real("min_p") <= 1.0:
            raise bad("min_p", self.min_p, "min_p must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= real("repetition_penalty") <= MAX_REPETITION_PENALTY:
            raise bad(
                "repetition_penalty",
                self.repetition_penalty,
                f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 is off)",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= real(name) <= 2.0:
                raise bad(name, getattr(self, name), f"{name} must be in [-2, 2]")
        if self.seed is not None:
            integer("seed", 0, MAX_SEED, "seed must be an integer in [0, 2**64 - 1], or null for a random one")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad("stop", self.stop, "stop must be a non-empty string or a list of them")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "stop_token_ids must be token ids >= 0")
        if self.max_tokens is not None:
            integer("max_tokens", 1, hint="max_tokens must be an integer >= 1, or None")
        integer("min_tokens", 0, hint="min_tokens must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise RequestError(
                f"invalid sampling parameter: min_tokens={self.min_tokens} > max_tokens={self.max_tokens}",
                "need min_tokens <= max_tokens",
                param="min_tokens",
            )
        if self.logprobs is not None:
            integer("logprobs", 0, MAX_LOGPROBS)
        if self.structured is not None and not isinstance(self.structured, StructuredOutputs):
            raise bad("structured", self.structured, "structured must be a StructuredOutputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
