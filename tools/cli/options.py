"""The click options several commands share (compile's quantization and KV cache dtype, which run, serve and bench
apply when they compile a checkpoint; prefix caching; speculative decoding), and their small formatters."""

from __future__ import annotations

import functools
from pathlib import Path

import click


def quant_options(command):
    """--quant, --group-size, --quant-lm-head, handed to `command` as one `quant` (a QuantConfig): compile's
    quantization, which run, serve and bench apply when they compile a checkpoint."""

    @functools.wraps(command)
    def with_quant(*args, quant: str, group_size: str | None, quant_lm_head: bool, **kwargs):
        from llmc.compiler.quant import QuantConfig  # numpy only: neither torch nor TVM

        config = QuantConfig(quant, None if group_size is None else int(group_size), quant_lm_head)
        return command(*args, quant=config, **kwargs)

    options = [
        click.option(
            "--quant",
            type=click.Choice(["none", "int8", "int4"]),
            default="none",
            show_default=True,
            help="Quantize the linears' weights: int8 (one scale per output channel, or per group with "
            "--group-size) or int4 (groups of 32 by default), symmetric. A linear whose input size "
            "is not a multiple of 32 stays float.",
        ),
        click.option(
            "--group-size",
            type=click.Choice(["32", "64", "128"]),
            default=None,
            help="Weights per scale, along the input dim [default: int8 per channel, int4 32].",
        ),
        click.option("--quant-lm-head", is_flag=True, help="Quantize the lm_head too (off: it stays float)."),
    ]
    for option in reversed(options):
        with_quant = option(with_quant)
    return with_quant


kv_cache_dtype_option = click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="What the KV cache stores: bfloat16 halves its bytes (twice the tokens in the same memory, half the "
    "attention reads) for k/v rounded to bf16; auto is bfloat16 for a bf16 / fp16 build on a CUDA target, else "
    "float32. run, serve and bench: when they compile a checkpoint.",
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
        type=click.Path(path_type=Path),
        default=None,
        help="The draft model of --speculative draft: an artifact or checkpoint dir with the same tokenizer.",
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


def config_text(config: dict) -> str:
    """A kernel's tunable parameters as `k=v k=v` (tune's table, inspect's tuning lines)."""
    return " ".join(f"{k}={v}" for k, v in config.items())
