"""Structured output: each constrained sequence carries a grammar matcher, and every step masks its logits rows
with the tokens that keep its output valid before they are sampled.

The grammar engine is llguidance (a Rust Earley parser over the tokenizer's token trie, no dependencies). This
module is the seam to it:
  - `GrammarCompiler`, one per tokenizer (shared_compiler), so one per model whatever the number of engines
    over it: the tokenizer's token trie, built once; each constraint (a
    SamplingParams' StructuredOutputs) compiled once into a matcher in its start state, kept in an LRU cache
    and copied for every sequence that uses it. A constraint the engine cannot compile is a RequestError that
    names it and the reason; llguidance's fuel limits bound the time any grammar takes.
  - `GrammarMatcher`, one per sequence: the tokens it has output so far, nothing else, so preemption (which
    recomputes the cache but keeps the output), chunked prefill and prefix-cache hits leave it as it is.
  - `MaskFiller` computes the step's masks into one [rows, ceil(V/32)] int32 bitmask on llguidance's own
    threads (the GIL released) and widens them into additive biases, all beside the model step;
    `add_mask_biases` then sets the logits of the tokens a row's mask excludes to -inf in one pass.

EOS is in a mask only where the grammar can end, and a grammar that has ended allows nothing but EOS; the
engine ends such a sequence at once (finish_reason "stop") rather than spending a step on the EOS.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import threading
import time

import llguidance as llg
import numpy as np

from llmc.errors import RequestError
from llmc.sampling_params import StructuredOutputs

# llguidance's defaults but for the initial lexer fuel, a quarter of theirs: a schema or regex that needs more
# is pathological (its compile would take seconds), and it is refused instead.
_LIMITS = llg.LLParserLimits(initial_lexer_fuel=250_000, verbose_errors=False)
_CACHE_SIZE = 256


class StructuredOutput:
    """An engine's structured output: its grammar compiler and mask filler, each made on first use (the token
    trie takes a while for a large vocabulary), and the thread that fills a step's masks beside the model step."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, max_rows: int):
        self._tokenizer, self._vocab_size, self._eos_token_ids = tokenizer, vocab_size, tuple(eos_token_ids)
        self._max_rows = max_rows
        self._compiler: GrammarCompiler | None = None
        self._masks: MaskFiller | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self.num_requests = 0

    def compiler(self) -> GrammarCompiler:
        """Raises RequestError without a tokenizer."""
        if self._tokenizer is None:
            raise RequestError(
                "structured output needs a tokenizer", "load the engine with the model's tokenizer", param="structured"
            )
        with self._lock:
            if self._compiler is None:
                self._compiler = shared_compiler(self._tokenizer, self._vocab_size, self._eos_token_ids)
            return self._compiler

    def start_masks(self, rows: list[tuple[GrammarMatcher, int, list[int]]]) -> concurrent.futures.Future:
        """Fill the masks of `rows` on the mask thread; the future's result is MaskFiller.fill's."""
        if self._masks is None:
            self._masks = MaskFiller(self._max_rows, self._vocab_size)
            self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="llmc-grammar-masks")
        return self._thread.submit(self._masks.fill, rows)

    def stats(self) -> dict:
        """EngineStats' structured-output counters."""
        compiler, masks = self._compiler, self._masks
        return {
            "structured_requests": self.num_requests,
            "grammar_compiles": 0 if compiler is None else compiler.num_compiled,
            "grammar_compile_seconds": 0.0 if compiler is None else compiler.compile_seconds,
            "grammar_mask_steps": 0 if masks is None else masks.num_fills,
            "grammar_mask_seconds": 0.0 if masks is None else masks.seconds,
        }


_COMPILERS: collections.OrderedDict[tuple, tuple[object, GrammarCompiler]] = collections.OrderedDict()
_COMPILERS_LOCK = threading.Lock()


def shared_compiler(tokenizer, vocab_size: int, eos_token_ids) -> GrammarCompiler:
    """The grammar compiler of a tokenizer, shared by every engine over it (bench and the server's replicas make
    several): its token trie is built, and each constraint compiled, once per model. The few latest are kept,
    each with its tokenizer, so that an id is never taken for another tokenizer's."""
    key = (id(tokenizer), int(vocab_size), tuple(eos_token_ids))
    with _COMPILERS_LOCK:
        if key in _COMPILERS:
            _COMPILERS.move_to_end(key)
            return _COMPILERS[key][1]
    compiler = GrammarCompiler(tokenizer, vocab_size, eos_token_ids)
    with _COMPILERS_LOCK:
        _COMPILERS[key] = (tokenizer, compiler)
        while len(_COMPILERS) > 4:
            _COMPILERS.popitem(last=False)
    return compiler


class GrammarCompiler:
    """Constraints compiled against one tokenizer, cached. Thread-safe: the server checks requests on its threads
    while the engine's thread adds them."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        """tokenizer: a `tokenizers.Tokenizer`; vocab_size: the model's logits width (it may pass the tokenizer's)."""
        self.vocab_size = int(vocab_size)
        self._tokenizer = llg.LLTokenizer(tokenizer.to_str(), n_vocab=self.vocab_size, eos_token=list(eos_token_ids))
        self._cache: collections.OrderedDict[tuple[str, str], llg.LLMatcher] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0
        self.compile_seconds = 0.0  # summed over the compiles

    def matcher(self, spec: StructuredOutputs) -> GrammarMatcher:
        """A fresh matcher for one sequence; compiles `spec` on a cache miss. Raises RequestError."""
        return GrammarMatcher(self._compiled(spec).deep_copy())

    def check(self, spec: StructuredOutputs) -> None:
        """Raise RequestError unless `spec` compiles (and cache it)."""
        self._compiled(spec)

    def _compiled(self, spec: StructuredOutputs) -> llg.LLMatcher:
        key = (spec.kind, spec.text)
        with self._lock:
            if (hit := self._cache.get(key)) is not None:
                self._cache.move_to_end(key)
                return hit
        start = time.perf_counter()
        matcher = llg.LLMatcher(self._tokenizer, _grammar(spec), log_level=0, limits=_LIMITS)  # drops the GIL
        if matcher.is_error():
            raise RequestError(
                f"the {spec.kind} constraint cannot be compiled: {_one_line(matcher.get_error())}",
                _HINTS[spec.kind],
                param=spec.kind,
            )
        with self._lock:
            self.num_compiled += 1
            self.compile_seconds += time.perf_counter() - start
            self._cache[key] = matcher
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return matcher


_HINTS = {
    "json": "pass a valid JSON schema (draft 2020-12 keywords; see llguidance's JSON schema support)",
    "json_object": "",
    "regex": "pass a regular expression in Rust regex syntax (no look-around or backreferences)",
    "choice": "pass a list of non-empty strings",
    "grammar": "pass a Lark grammar with a `start` rule, or a GBNF grammar with a `root` rule",
}


def _grammar(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint. JSON is compact (no whitespace between tokens): a model can
    otherwise pad a value with whitespace until max_tokens."""
    try:
        if spec.kind in ("json", "json_object"):
            schema = {"type": "object"} if spec.kind == "json_object" else constrained_schema(_schema_object(spec.json))
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if spec.kind == "regex":
            return llg.LLMatcher.grammar_from_regex(spec.regex)
        if spec.kind == "choice":
            return llg.grammar_from("choice", spec.text)
        return llg.grammar_from("grammar", spec.grammar)
    except (ValueError, TypeError) as e:  # JSON that is no object, a GBNF that does not convert
        raise RequestError(
            f"the {spec.kind} constraint cannot be compiled: {_one_line(str(e))}", _HINTS[spec.kind], param=spec.kind
        ) from None


def _schema_object(schema: dict | str) -> dict | bool:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise ValueError(f"the schema is not JSON ({e})") from None
    if not isinstance(schema, dict | bool):
        raise ValueError("a JSON schema is an object (or true / false)")
    return schema


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
# I-JSON (RFC 7493): a number's interoperable range and precision are IEEE 754 double's. Past them a JSON reader
# keeps nothing more; a weak model would otherwise write digits until max_tokens.
SAFE_INTEGER = 2**53 - 1
NUMBER_STEP = 1e-10  # the finest multipleOf llguidance takes; a double's 15 significant digits need no finer


def constrained_schema(schema, in_all_of: bool = False):
    """The schema a JSON constraint compiles (the caller's is left as it is): each output valid against it is
    valid against the caller's, and ends.
      - Objects that do not say otherwise are closed (`additionalProperties: false`, as OpenAI's strict mode
        requires and xgrammar's strict mode assumes): else a model may add keys of its own without end. allOf's
        branches stay open, since each must admit the others' properties.
      - Numbers without bounds keep to I-JSON's range (integers within +-(2**53 - 1)), and numbers that need not
        be integers to ten decimal places (no exponent)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [constrained_schema(s, in_all_of or key == "allOf") for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: constrained_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if key in out:
            out[key] = constrained_schema(out[key])
    types = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    if ("object" in types or "properties" in out) and not in_all_of:
        if not {"additionalProperties", "unevaluatedProperties"} & out.keys():
            out["additionalProperties"] = False
    if "integer" in types or "number" in types:
        if not {"minimum", "exclusiveMinimum"} & out.keys():
            out["minimum"] = -SAFE_INTEGER
        if not {"maximum", "exclusiveMaximum"} & out.keys():
            out["maximum"] = SAFE_INTEGER
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = NUMBER_STEP
    return out


def _one_line(message: str, limit: int = 300) -> str:
    """llguidance's message (several lines, with a caret under the place) as one line, cut short."""
    line = " ".join(message.split()) or "unknown error"
    return line if len(line) <= limit else line[: limit - 3] + "..."


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llg.LLMatcher):
        self._matcher = matcher

    def accept(self, token_ids: list[int]) -> None:
        """Advance over tokens the sequence output (each was allowed by its mask)."""
        if not self._matcher.consume_tokens(token_ids):
            raise RuntimeError(f"the grammar matcher refused an output token: {self._matcher.get_error()}")

    def num_valid(self, token_ids: list[int]) -> int:
        """How many of `token_ids` (a speculative proposal) the grammar takes in a row from here."""
        return self._matcher.validate_tokens(token_ids)

    @property
    def is_finished(self) -> bool:
        """The grammar has ended: nothing but EOS may follow."""
        return self._matcher.is_stopped()

    @property
    def llg_matcher(self) -> llg.LLMatcher:
        return self._matcher


# A mask's byte b -> the additive logit biases of its 8 tokens (bit i set: token allowed, bias 0; else -inf)
_BYTE_BIASES = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1, 0.0, -np.inf
).astype(np.float32)


class MaskFiller:
    """A step's grammar masks: filled as bits [rows, ceil(V/32)] on llguidance's threads, then widened into
    additive biases (0 or -inf per token), all on the mask thread while the model step runs; adding them to the
    logits afterwards is one pass over the constrained rows."""

    def __init__(self, max_rows: int, vocab_size: int):
        self.bitmask = np.full((max_rows, (vocab_size + 31) // 32), -1, dtype=np.int32)
        self._bias = np.empty((0, self.bitmask.shape[1] * 32), dtype=np.float32)  # grown to the rows a step needs
        self._executor = llg.LLExecutor()
        self.num_fills = 0
        self.seconds = 0.0  # summed over the fills

    def fill(self, rows: list[tuple[GrammarMatcher, int, list[int]]]) -> tuple[np.ndarray, list[int]]:
        """rows: (matcher, first row, proposal): the mask at `first row` is the matcher's next token's, and
        first row + 1 + i the one after the proposal's first i + 1 tokens. Returns the biases [n, >= V] and the n
        logits rows they belong to. llguidance fills a proposal's rows only as far as the grammar takes its
        tokens; the rows past the first one it refuses keep stale masks, and the engine never reads them (it cuts
        the proposal there)."""
        start = time.perf_counter()
        plain = [(m.llg_matcher, row) for m, row, draft in rows if not draft]
        drafted = [(m.llg_matcher, row, draft) for m, row, draft in rows if draft]
        one_mask = self.bitmask.shape[1] * 4
        if plain:
            self._executor.unsafe_compute_mask_ptr(plain, self.bitmask.ctypes.data, one_mask, self.bitmask.shape[0])
        if drafted:
            self._executor.unsafe_compute_mask_ptr_with_draft_token(
                drafted, self.bitmask.ctypes.data, one_mask, self.bitmask.shape[0]
            )
        filled = [r for _, first, draft in rows for r in range(first, first + 1 + len(draft))]
        if len(filled) > self._bias.shape[0]:
            self._bias = np.empty((len(filled), self._bias.shape[1]), dtype=np.float32)
        bias = self._bias[: len(filled)]
        np.take(_BYTE_BIASES, self.bitmask[filled].view(np.uint8), axis=0, out=bias.reshape(len(filled), -1, 8))
        self.num_fills += 1
        self.seconds += time.perf_counter() - start
        return bias, filled


def add_mask_biases(logits: np.ndarray, bias: np.ndarray, rows: list[int]) -> None:
    """logits [N, V] += the biases of `rows` (MaskFiller.fill's), in place: -inf where a mask excludes the token."""
    if not rows:
        return
    vocab = logits.shape[1]
    if rows == list(range(rows[0], rows[0] + len(rows))):  # the usual case: a view, no copy
        logits[rows[0] : rows[0] + len(rows)] += bias[:, :vocab]
    else:
        logits[rows] += bias[:, :vocab]
