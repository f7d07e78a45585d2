"""Tool calling (OpenAI's `tools`): the tool definitions checked, the grammar that forces a call, and the calls
parsed out of a model's text, in the format of the model's family.

Formats, each as the family's chat template writes a call (and so as the model was trained to):
  hermes       Qwen2.5 / Qwen3, Hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, one block a
               call, free text before them.
  llama3_json  Llama 3.1+: the whole answer is `{"name": ..., "parameters": {...}}` (optionally after
               `<|python_tag|>`), several calls joined by "; ".
  mistral      Mistral: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`, or (v11+
               templates) `[TOOL_CALLS]name[ARGS]{...}` a call.
`detect_tool_format` reads which one from the chat template; a template that says nothing gets hermes, and the
server then describes the tools and that format in a system message itself (serving.py).

A forced call (tool_choice "required" or a named function: tool_call_grammar; a function with `"strict": true`:
call_grammar with free text) is a Lark grammar for llguidance (runtime/structured.py): the format's markers around
`%json` schemas whose arguments are the function's parameters (narrowed as every JSON constraint is,
structured.constrained_schema). Model output is never an error here: text that looks like a call but does not
parse stays content. A stream (ToolCallStreamParser) sends OpenAI's delta fragments, and in all exactly what
parse_tool_calls makes of the whole text, so a client sees the same answer streamed or not.
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string

from llmc.errors import RequestError
from llmc.runtime.structured import constrained_schema

FORMATS = ("hermes", "llama3_json", "mistral")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = dataclasses.field(default_factory=lambda: "call_" + _random_id())

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _random_id(n: int = 24) -> str:
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(n))


def detect_tool_format(chat_template: str | None) -> str:
    """The call format a chat template teaches: hermes where it says nothing."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<|python_tag|>" in template or "ipython" in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"
    return "hermes"


def template_renders_tools(chat_template: str | None) -> bool:
    """Whether a chat template puts the tools in the prompt itself (it reads the `tools` variable)."""
    return chat_template is not None and re.search(r"\btools\b", chat_template) is not None


# -- the request: tools and tool_choice ----------------------------------------------------------------------


def check_tools(tools) -> list[dict]:
    """The `function` objects of a request's tools. Malformed definitions are a RequestError naming `tools`."""

    def bad(i: int | None, why: str) -> RequestError:
        where = "tools" if i is None else f"tools[{i}]"
        return RequestError(f"{where}: {why}", "each tool is {\"type\": \"function\", \"function\": {\"name\", "
                            "\"description\", \"parameters\": <JSON schema>}}", param="tools")  # fmt: skip

    if not isinstance(tools, list) or not tools:
        raise bad(None, "must be a non-empty list of tools")
    if len(tools) > MAX_TOOLS:
        raise bad(None, f"{len(tools)} tools, more than the {MAX_TOOLS} this server takes")
    functions, names = [], set()
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(i, 'must be {"type": "function", "function": {...}}')
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise bad(i, f"function name {name!r} must be 1 to 64 letters, digits, '_' or '-'")
        if name in names:
            raise bad(i, f"function name {name!r} is given twice")
        names.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise bad(i, "function description must be a string")
        params = fn.get("parameters", {"type": "object"})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise bad(i, "function parameters must be a JSON schema of an object")
        if not isinstance(fn.get("strict", False), bool | None):
            raise bad(i, "function strict must be true or false")
        functions.append({**fn, "parameters": params})
    return functions


def check_tool_choice(tool_choice, functions: list[dict]) -> tuple[str, str | None]:
    """(mode, function name): mode "none", "auto", "required" or "named" (the name)."""
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (
            (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice.get("function"), dict) else None
        )
        if name in {f["name"] for f in functions}:
            return "named", name
        raise RequestError(
            f"tool_choice names the function {name!r}, which is not among the tools", param="tool_choice"
        )
    raise RequestError(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


# -- grammars of calls ----------------------------------------------------------------------------------------


def _call_schema(fmt: str, functions: list[dict]) -> dict:
    """One call's JSON object: the name one of the functions', its arguments that function's parameters."""
    key = "parameters" if fmt == "llama3_json" else "arguments"
    return {
        "x-guidance": {"whitespace_flexible": False},  # compact, as every JSON constraint (structured.py)
        "anyOf": [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, key: constrained_schema(f["parameters"])},
                "required": ["name", key],
                "additionalProperties": False,
            }
            for f in functions
        ],
    }


def call_grammar(fmt: str, functions: list[dict], *, parallel: bool = True, free_text: bool = False) -> str:
    """A Lark grammar (runtime/structured.py) of one or more calls (one if not `parallel`) of `functions` in
    `fmt`; with free_text, also any text that does not open with the format's call marker (tool_choice auto with
    strict functions)."""
    call = json.dumps(_call_schema(fmt, functions))
    if fmt == "mistral":
        one_or_more = {"minItems": 1, **({} if parallel else {"maxItems": 1})}
        array = json.dumps(
            {"type": "array", "items": json.loads(call), **one_or_more, "x-guidance": {"whitespace_flexible": False}}
        )
        rules = f'calls: "[TOOL_CALLS]" %json {array}\n'
        marker = r"\["
    else:
        separator = "; " if fmt == "llama3_json" else "\n"
        more = f" ({json.dumps(separator)} call)*" if parallel else ""
        if fmt == "llama3_json":
            rules = f"calls: call{more}\ncall: %json {call}\n"
            marker = "{"
        else:
            rules = f'calls: call{more}\ncall: "<tool_call>\\n" body "\\n</tool_call>"\nbody: %json {call}\n'
            marker = "<"
    if not free_text:
        return "start: calls\n" + rules
    return f"start: TEXT | calls\nTEXT: /[^{marker}](.|\\n)*/\n" + rules


# -- parsing a model's output ---------------------------------------------------------------------------------


@dataclasses.dataclass
class ParsedOutput:
    content: str | None  # the text that is not a call; None when there is none
    tool_calls: list[ToolCall]


def _as_call(obj, keys=("arguments", "parameters")) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as JSON text already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def _hermes_call(block: str) -> ToolCall | None:
    """The call of one `<tool_call>...</tool_call>` block; None if it does not parse (it stays text)."""
    try:
        return _as_call(json.loads(_HERMES.fullmatch(block).group(1)))
    except ValueError:
        return None


def _parse_hermes(text: str) -> ParsedOutput | None:
    """Each block that parses is a call, each that does not stays text; the content is the text between the
    calls, trimmed where it meets a call or the end, its pieces joined by newlines (as ToolCallStreamParser
    sends it)."""
    calls, pieces, at = [], [], 0
    for m in _HERMES.finditer(text):
        if (call := _hermes_call(m.group(0))) is None:
            continue
        calls.append(call)
        pieces.append(text[at : m.start()])
        at = m.end()
    if not calls:
        return None
    pieces.append(text[at:])
    content = [pieces[0].rstrip()] + [p.strip() for p in pieces[1:]]  # the first keeps its leading text as sent
    return ParsedOutput("\n".join(p for p in content if p) or None, calls)


def _parse_llama3(text: str) -> ParsedOutput | None:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return None
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except ValueError:
            return None
        if (call := _as_call(obj, ("parameters", "arguments"))) is None:
            return None
        calls.append(call)
        rest = body[at:].lstrip()
        if not rest:
            break
        if not rest.startswith(";"):
            return None
        at = len(body) - len(rest[1:].lstrip())
    return ParsedOutput(None, calls)


def _parse_mistral(text: str) -> ParsedOutput | None:
    head, marker, body = text.partition("[TOOL_CALLS]")
    if not marker:
        return None
    body = body.strip()
    calls = []
    if body.startswith("["):
        try:
            items = json.loads(body)
        except ValueError:
            return None
        calls = [_as_call(item) for item in items] if isinstance(items, list) else [None]
    else:  # v11+: name[ARGS]{...}, repeated after further [TOOL_CALLS] markers
        for part in body.split("[TOOL_CALLS]"):
            name, sep, args = part.strip().partition("[ARGS]")
            try:
                calls.append(_as_call({"name": name.strip(), "arguments": json.loads(args)}) if sep else None)
            except ValueError:
                calls.append(None)
    if not calls or any(c is None for c in calls):
        return None
    return ParsedOutput(head.rstrip() or None, calls)


_PARSERS = {"hermes": _parse_hermes, "llama3_json": _parse_llama3, "mistral": _parse_mistral}


def parse_tool_calls(fmt: str, text: str) -> ParsedOutput:
    """The calls in a finished output, and the text around them; no calls when they do not parse."""
    return _PARSERS[fmt](text) or ParsedOutput(text, [])


def format_tool_calls(fmt: str, calls: list[dict]) -> str:
    """Calls of an assistant message in the history (OpenAI's tool_calls), as the model writes them: for a
    template that does not render tool_calls itself."""
    objs = []
    for c in calls:
        fn = c.get("function") or {}
        args = fn.get("arguments", "{}")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        objs.append({"name": fn.get("name"), "parameters" if fmt == "llama3_json" else "arguments": args})
    if fmt == "mistral":
        return "[TOOL_CALLS]" + json.dumps(objs, ensure_ascii=False)
    if fmt == "llama3_json":
        return "; ".join(json.dumps(o, ensure_ascii=False) for o in objs)
    return "\n".join(f"<tool_call>\n{json.dumps(o, ensure_ascii=False)}\n</tool_call>" for o in objs)


def tools_system_prompt(fmt: str, functions: list[dict]) -> str:
    """The tools and the call format, told to a model whose chat template does not render `tools`."""
    example = format_tool_calls(
        fmt, [{"function": {"name": "<function name>", "arguments": {"<argument>": "<value>"}}}]
    )
    listing = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False) for f in functions)
    return (
        f"You may call these functions to answer:\n{listing}\nTo call a function, answer with the call alone, "
        f"written as:\n{example}"
    )


_OPEN, _CLOSE, _PYTHON_TAG, _MISTRAL = "<tool_call>", "</tool_call>", "<|python_tag|>", "[TOOL_CALLS]"


class ToolCallStreamParser:
    """A streamed output as OpenAI's `delta` fragments: `{"content": ...}` for free text, and for each call
    `{"tool_calls": [{"index", "id", "type", "function": {"name", "arguments": ""}}]}` then
    `{"tool_calls": [{"index", "function": {"arguments"}}]}` with its whole arguments. What it sends in all is
    what parse_tool_calls makes of the whole text.

    Free text goes out as soon as it cannot be a call's beginning; its trailing whitespace waits too, since
    whitespace that meets a call is not content. hermes sends each call once its block closes; llama3's and
    Mistral's calls are the rest of the output, which is calls only if all of it parses, so from their marker
    on the text waits for the end."""

    def __init__(self, fmt: str):
        self.fmt = fmt
        self.tool_calls: list[ToolCall] = []  # the calls sent so far
        self._text = ""  # the whole output so far
        self._unread = ""  # its end, not yet sent as content or a call
        self._in_block = False  # hermes: _unread opens a <tool_call> block whose close has not come
        self._held = False  # llama3, Mistral: the calls' marker came; the rest waits for the end
        self._free = False  # llama3: the output opened with text, so all of it is content
        self._blank = ""  # content's trailing whitespace, held back
        self._trim = False  # hermes: a call was sent, and the whitespace after it is not content
        self._sent_content = False

    def feed(self, delta: str) -> list[dict]:
        """The fragments the output so far lets out, given its next piece of text."""
        self._text += delta
        self._unread += delta
        if self.fmt == "hermes":
            return self._read_hermes()
        if self.fmt == "llama3_json":
            return self._read_llama3()
        return self._read_to_marker(_MISTRAL)

    def finish(self) -> list[dict]:
        """The fragments still to send once the output has ended."""
        out = []
        if self._held and (calls := parse_tool_calls(self.fmt, self._text).tool_calls):
            self._unread = ""
            for call in calls:
                out += self._call(call)
        elif self.fmt == "hermes":
            out += self._content(self._unread)  # an unclosed block, or a marker's beginning, is text
            self._unread = ""
        rest = self._unread if self.tool_calls else self._blank + self._unread
        self._blank = self._unread = ""
        return out + ([{"content": rest}] if rest else [])

    def _read_hermes(self) -> list[dict]:
        out = []
        while True:
            if not self._in_block:
                out += self._read_to_marker(_OPEN)
                if not self._in_block:
                    return out
            end = self._unread.find(_CLOSE)
            if end < 0:
                return out
            end += len(_CLOSE)
            block, self._unread, self._in_block = self._unread[:end], self._unread[end:], False
            call = _hermes_call(block)
            out += self._content(block) if call is None else self._call(call)

    def _read_llama3(self) -> list[dict]:
        if not (self._held or self._free):
            head = self._unread.lstrip()
            self._held = head.startswith(("{", _PYTHON_TAG))
            self._free = not self._held and not _PYTHON_TAG.startswith(head)  # else undecided: a tag's beginning
        if not self._free or not self._unread:
            return []
        text, self._unread = self._unread, ""
        return [{"content": text}]

    def _read_to_marker(self, marker: str) -> list[dict]:
        """Sends the text before `marker` (hermes' block or Mistral's calls), or all of it but the end that may
        begin one; where the marker came, _unread then opens with it."""
        if self._held:
            return []
        start = self._unread.find(marker)
        if start < 0:
            start = len(self._unread) - _partial_suffix(self._unread, marker)
        elif self.fmt == "hermes":
            self._in_block = True
        else:
            self._held = True
        text, self._unread = self._unread[:start], self._unread[start:]
        return self._content(text)

    def _content(self, text: str) -> list[dict]:
        if self._trim:
            text = text.lstrip()
            if not text:
                return []
            self._trim = False
            if self._sent_content:  # content between calls: its pieces on lines of their own
                text = "\n" + text
        text = self._blank + text
        body = text.rstrip()
        self._blank = text[len(body) :]
        if not body:
            return []
        self._sent_content = True
        return [{"content": body}]

    def _call(self, call: ToolCall) -> list[dict]:
        index = len(self.tool_calls)
        self.tool_calls.append(call)
        self._blank, self._trim = "", True
        opening = {"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
        return [
            {"tool_calls": [opening]},
            {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
        ]


def merge_deltas(fragments: list[dict]) -> dict:
    """Fragments as one OpenAI `delta`: the content joined, and a call's fragments in one entry of tool_calls."""
    merged: dict = {}
    for fragment in fragments:
        if "content" in fragment:
            merged["content"] = merged.get("content", "") + fragment["content"]
        for piece in fragment.get("tool_calls", []):
            calls = merged.setdefault("tool_calls", [])
            if calls and calls[-1]["index"] == piece["index"]:
                calls[-1]["function"]["arguments"] += piece["function"]["arguments"]
            else:
                calls.append({**piece, "function": dict(piece["function"])})
    return merged


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may become one)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
