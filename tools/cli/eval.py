"""`llmc eval`: evaluations of a compiled model (`llmc eval ppl`: perplexity over a text file)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from llmc.errors import LlmcError
from llmc.tools.engine_setup import load_model, resolve_artifact

from .options import PathKind


@click.group("eval")
def eval_group() -> None:
    """Evaluate a compiled model."""


@eval_group.command("ppl")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--text",
    "text_file",
    type=PathKind("input"),
    required=True,
    help="UTF-8 text file to score (a symlink to it is followed).",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="Score only the first N tokens.")
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_ppl(
    artifact: Path, text_file: Path, max_tokens: int | None, kv_cache_memory: str | None, as_json: bool
) -> None:
    """Perplexity of the compiled ARTIFACT over a text file.

    The text is split into windows of the model's context; each window runs as prefill steps that return the
    logits of every row, scoring every next token.
    """
    from llmc.runtime.scoring import perplexity

    # logits at every row of a step (max_num_logits is capped at the step's max_num_tokens)
    model, tokenizer = load_model(resolve_artifact(artifact), kv_cache_memory, max_num_seqs=1, max_num_logits=512)
    try:
        text = text_file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LlmcError(
            f"--text {text_file}: not UTF-8 text ({e.reason} at byte {e.start})", "pass a text file"
        ) from None
    ids = tokenizer.encode(text).ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    with model:
        result = perplexity(model, ids)
    if as_json:
        click.echo(
            json.dumps(
                {"perplexity": result.perplexity, "num_tokens": result.num_tokens, "tokens_per_s": result.tokens_per_s}
            )
        )
    else:
        click.echo(
            f"perplexity {result.perplexity:.4f} over {result.num_tokens} tokens ({result.tokens_per_s:.1f} tokens/s)"
        )
