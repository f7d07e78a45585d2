"""The click options several commands share (compile's quantization and KV cache dtype, which run, serve and bench
apply when they compile a checkpoint; prefix caching; speculative decoding), their small formatters, and the
kinds of path an option takes (PathKind), each checked on the command line."""

from __future__ import annotations

import functools
import json
import math
import os
import stat
from pathlib import Path

import click

# numpy only: neither torch nor TVM
from llmc.compiler.quant import GROUP_SIZES, PER_CHANNEL, QUANT_MODES, TENSOR_TYPES, QuantConfig
from llmc.dtypes import KV_DTYPE_SPELLINGS, KV_DTYPES
from llmc.errors import LlmcError


class PathKind(click.ParamType):
    """The kind of path an option takes, checked while the command line is read, before any work; a path of
    the wrong kind is an LlmcError (one line) naming the option and the path, and nothing is touched.

    Symlinks: an input may be one (it is followed); an output may not, since llmc writes an output beside it
    and renames it into place, which would replace the link rather than write where it leads. The kinds:
    - "input": an existing file (a symlink to one is fine), not a directory, device, FIFO or socket;
    - "model": an llmc artifact or checkpoint directory, or a .gguf file (a symlink to one is fine);
    - "output file": a file to write or replace: its directory exists; the path is not a directory, a
      device, a FIFO, a socket or a symlink;
    - "output dir": an artifact directory to write or replace: its parent exists; the path is not a file or
      a symlink, and a directory already there is empty or an llmc artifact.
    """

    name = "path"

    def __init__(self, kind: str, keywords: tuple[str, ...] = ()):
        assert kind in ("input", "model", "output file", "output dir"), kind
        self.kind, self.keywords = kind, keywords  # keywords: words that pass as they are (--tuning-db none)

    def convert(self, value, param, ctx) -> Path | str:
        if value in self.keywords:
            return value
        path = Path(value)
        why = (_output_problem if self.kind.startswith("output") else _input_problem)(path, self.kind)
        if why is not None:
            flag = "/".join(param.opts) if param is not None else "path"
            raise LlmcError(f"{flag} {path}: {why[0]}", why[1])
        return path


_SPECIAL = "a device, FIFO or socket"


def _missing(path: Path) -> tuple[str, str]:
    """Why a path that does not exist cannot be read: a dangling link, a missing directory, or no such file."""
    if path.is_symlink():
        return f"is a symlink to {os.readlink(path)}, which does not exist", "point it at the file, or pass the file"
    parent = path.absolute().parent
    if not parent.is_dir():
        return f"no such directory {parent}", "check the path"
    return "no such file", "check the path"


def _input_problem(path: Path, kind: str) -> tuple[str, str] | None:
    try:
        mode = path.stat().st_mode  # follows a symlink
    except FileNotFoundError:
        return _missing(path)
    except OSError as e:  # a symlink loop, a file used as a directory, no permission
        return f"cannot be read ({e.strerror})", "check the path"
    if kind == "model":
        hint = "pass an artifact or checkpoint directory, or a .gguf file"
        if stat.S_ISDIR(mode):
            if (path / "manifest.json").is_file() or (path / "config.json").is_file():
                return None
            return (
                "is a directory that is neither an llmc artifact (manifest.json) nor a checkpoint (config.json)",
                hint,
            )
        if not stat.S_ISREG(mode):
            return f"is {_SPECIAL}, not a regular file or directory", hint
        return None if path.suffix.lower() == ".gguf" else ("is a file, but not a .gguf file", hint)
    if stat.S_ISDIR(mode):
        return "is a directory, not a file", "pass a file"
    if not stat.S_ISREG(mode):
        return f"is {_SPECIAL}, not a regular file", "pass a file"
    return None


def _output_problem(path: Path, kind: str) -> tuple[str, str] | None:
    want = "directory" if kind == "output dir" else "file"
    try:
        mode = path.lstat().st_mode  # the path itself, not what a link leads to
    except FileNotFoundError:
        parent = path.absolute().parent
        if not parent.is_dir():
            return f"no such directory {parent}", "create it first, or choose another output path"
        return None
    except OSError as e:  # a file used as a directory, no permission
        return f"cannot be written ({e.strerror})", "choose another output path"
    if stat.S_ISLNK(mode):
        return (
            f"is a symlink (to {os.readlink(path)}); llmc replaces its output {want} whole rather than "
            "writing through a link",
            f"pass the {want} the link leads to, or remove the link",
        )
    if kind == "output file":
        if stat.S_ISDIR(mode):
            return "is a directory, not a file", "choose a file path"
        return None if stat.S_ISREG(mode) else (f"is {_SPECIAL}, not a regular file", "choose a file path")
    if not stat.S_ISDIR(mode):
        what = "a file" if stat.S_ISREG(mode) else _SPECIAL
        return f"is {what}, not a directory", "choose a directory path for the artifact"
    if (path / "manifest.json").is_file() or not any(os.scandir(path)):
        return None  # an artifact, replaced whole, or an empty directory
    return "exists and is not an llmc artifact", "choose another output path, or remove it first"


def quant_options(command):
    """--quant, --group-size, --quant-lm-head, --tensor-quant, handed to `command` as one `quant` (a QuantConfig):
    compile's quantization, which run, serve and bench apply when they compile a checkpoint."""

    @functools.wraps(command)
    def with_quant(
        *args, quant: str, group_size: str | None, quant_lm_head: bool, tensor_quant: tuple[str, ...], **kwargs
    ):
        overrides = []
        for text in tensor_quant:
            pattern, eq, kind = text.rpartition("=")
            if not eq or not pattern:
                raise click.BadParameter(f"{text!r} is not PATTERN=TYPE", param_hint="--tensor-quant")
            overrides.append((pattern, kind))
        group = int(group_size) if group_size is not None and group_size.isdigit() else group_size
        config = QuantConfig(quant, group, quant_lm_head, tuple(overrides))
        return command(*args, quant=config, **kwargs)

    options = [
        click.option(
            "--quant",
            type=click.Choice(QUANT_MODES),
            default="none",
            show_default=True,
            help="Quantize the linears' weights: int8 or int4, symmetric, in groups of 32 by default; q4_k / "
            "q5_k as llama.cpp's Q4_K / Q5_K (asymmetric 4- / 5-bit groups of 32 with 6-bit scales and mins per "
            "256). Recipes, as llama.cpp's file types, choose per tensor, the lm_head and embedding included: q8_0 (int8 groups of 32 throughout), "
            "q4_k_m / q5_k_m (q4_k / q5_k; the lm_head, and ffn_down and attn_v on an "
            "eighth-and-a-third of the layers, as Q6_K). A linear whose input size is not a multiple of 32 stays "
            "float.",
        ),
        click.option(
            "--group-size",
            type=click.Choice([*map(str, GROUP_SIZES), PER_CHANNEL]),
            default=None,
            help=f"Weights per scale, along the input dim [default: 32]; {PER_CHANNEL}: int8 with one scale per "
            "output channel (fewer bytes, coarser).",
        ),
        click.option("--quant-lm-head", is_flag=True, help="Quantize the lm_head too (off: it stays float)."),
        click.option(
            "--tensor-quant",
            multiple=True,
            metavar="PATTERN=TYPE",
            help="Give the tensors whose checkpoint name matches the regular expression PATTERN their own TYPE "
            f"({', '.join(TENSOR_TYPES)}) in place of --quant's choice; repeatable, the first match wins. "
            "E.g. 'mlp\\.down_proj=q8_0', 'lm_head=q8_0', 'experts=int4'.",
        ),
    ]
    for option in reversed(options):
        with_quant = option(with_quant)
    return with_quant


kv_cache_dtype_option = click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", *KV_DTYPES, *KV_DTYPE_SPELLINGS]),
    default="auto",
    show_default=True,
    help="What the KV cache stores: bfloat16 halves its bytes (twice the tokens in the same memory, half the "
    "attention reads) for k/v rounded to bf16; int8 a quarter of float32's plus a scale per token and kv head; "
    "fp8 (float8_e4m3fn; CUDA sm89 and later) the same bytes as e4m3; auto is bfloat16 for a bf16 / fp16 build on "
    "a CUDA target, else float32. run, serve and bench: when they compile a checkpoint.",
)

no_prefix_caching = click.option(
    "--no-prefix-caching",
    is_flag=True,
    help="Compute every prompt in full, instead of reusing the KV blocks of a prompt prefix seen before.",
)


def speculative_options(command):
    """--speculative, --num-speculative-tokens, --draft: guess tokens cheaply and verify them in one model step."""
    command = click.option(
        "--draft",
        type=PathKind("model"),
        default=None,
        help="The draft model of --speculative draft: an artifact or checkpoint dir, or a .gguf file, with the same "
        "tokenizer (a symlink to one is followed).",
    )(command)
    command = click.option(
        "--num-speculative-tokens",
        type=click.IntRange(1, 64),
        default=4,
        show_default=True,
        help="Tokens guessed (and verified in one step) per sequence and step, with --speculative.",
    )(command)
    return click.option(
        "--speculative",
        type=click.Choice(["ngram", "draft"]),
        default=None,
        help="Speculative decoding: ngram guesses the next tokens from the longest earlier match of the last "
        "tokens in the prompt and output (prompt lookup); draft has a smaller model (--draft) guess them. "
        "Greedy outputs are unchanged, sampled ones keep their distribution.",
    )(command)


def finite_number(ctx, param, value):
    """A click callback: a float option's nan or inf is refused (FloatRange lets nan through every bound)."""
    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def structured_options(command):
    """--json-schema, --regex, --choice, --grammar: the output must match one of them (the engine masks every
    step's logits with the grammar); `structured_outputs` turns them into SamplingParams' StructuredOutputs."""
    for option in (
        click.option(
            "--grammar", type=PathKind("input"), default=None, help="Output matches this Lark or GBNF grammar."
        ),
        click.option("--choice", multiple=True, help="Output is one of these strings (repeat the option for each)."),
        click.option("--regex", default=None, help="Output matches this regular expression (Rust regex syntax)."),
        click.option(
            "--json-schema", type=PathKind("input"), default=None, help="Output is JSON valid against this schema file."
        ),
    ):
        command = option(command)
    return command


def structured_outputs(json_schema: Path | None, regex: str | None, choice: tuple[str, ...], grammar: Path | None):
    """The StructuredOutputs the options ask for (None: free text). A file that is not UTF-8 text or JSON, or more
    than one option, is an LlmcError."""
    from llmc.sampling_params import MAX_GRAMMAR_CHARS, StructuredOutputs

    def read(path: Path, flag: str) -> str:
        with open(path, "rb") as f:
            data = f.read(4 * MAX_GRAMMAR_CHARS + 1)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise LlmcError(f"{flag} {path}: not UTF-8 text", f"pass a text file for {flag}") from None
        if len(text) > MAX_GRAMMAR_CHARS:
            raise LlmcError(f"{flag} {path}: longer than {MAX_GRAMMAR_CHARS:,} characters")
        return text

    given = [json_schema, regex, choice or None, grammar]
    if sum(g is not None for g in given) == 0:
        return None
    if sum(g is not None for g in given) > 1:
        raise LlmcError("give one of --json-schema, --regex, --choice and --grammar")
    schema = None
    if json_schema is not None:
        try:
            schema = json.loads(read(json_schema, "--json-schema"))
        except ValueError as e:
            raise LlmcError(f"--json-schema {json_schema}: not JSON ({e})", "pass a JSON schema file") from None
    return StructuredOutputs(
        json=schema,
        regex=regex,
        choice=tuple(choice) or None,
        grammar=None if grammar is None else read(grammar, "--grammar"),
    )


def config_text(config: dict) -> str:
    """A kernel's tunable parameters as `k=v k=v` (tune's table, inspect's tuning lines)."""
    return " ".join(f"{k}={v}" for k, v in config.items())
