"""`llmc bench`: TTFT, TPOT and tokens/s of an artifact on a synthetic workload (llmc.runtime.bench)."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import click

from llmc.tools.engine_setup import engine_parts, resolve_artifact

from .options import kv_cache_dtype_option, no_prefix_caching, quant_options, speculative_options


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: write comma-separated integers, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{value!r}: every level must be >= 1")
    return levels


@click.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--concurrency",
    default="1,4,16",
    show_default=True,
    callback=_int_list,
    help="Concurrency levels, comma-separated.",
)
@click.option(
    "--num-requests",
    type=click.IntRange(min=1),
    default=None,
    help="Requests per level [default: max(4, 2 x concurrency)].",
)
@click.option("--prompt-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--output-len", type=click.IntRange(min=1), default=128, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option(
    "--shared-prefix",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Tokens at the start of every prompt that all prompts share (at most --prompt-len).",
)
@click.option("--memory-bandwidth", type=float, default=None, help="Bytes/s for the roofline [default: measured].")
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (default: 20% of free memory).")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
@click.option(
    "--structured",
    type=click.Choice(["json"]),
    default=None,
    help="Also run the workload with every output constrained to a JSON schema (records that run past "
    "--output-len), and compare its tokens/s and mask time per step with the unconstrained run.",
)
@no_prefix_caching
@speculative_options
@quant_options
@kv_cache_dtype_option
def bench(
    artifact: Path,
    concurrency: list[int],
    num_requests: int | None,
    prompt_len: int,
    output_len: int,
    seed: int,
    shared_prefix: int,
    memory_bandwidth: float | None,
    kv_cache_memory: str | None,
    as_json: bool,
    structured: str | None,
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
    quant,
    kv_cache_dtype: str,
) -> None:
    """TTFT, TPOT and tokens/s of ARTIFACT on a fixed synthetic workload, against the memory roofline."""
    from llmc.runtime.bench import (
        STRUCTURED_WORKLOADS,
        compare_structured,
        format_bench_table,
        format_structured_comparison,
        run_bench,
    )

    with contextlib.ExitStack() as stack:
        path = resolve_artifact(artifact, quant, kv_cache_dtype)
        _, _, make_engine = engine_parts(
            stack,
            path,
            kv_cache_memory,
            max(concurrency),
            no_prefix_caching,
            speculative,
            num_speculative_tokens,
            draft,
        )
        # a structured run needs the tokenizer (its grammar's token trie): its unconstrained twin detokenizes too
        detokenize = structured is not None
        workload = dict(
            concurrency=concurrency,
            num_requests=num_requests,
            prompt_len=prompt_len,
            output_len=output_len,
            seed=seed,
            shared_prefix=shared_prefix,
            memory_bandwidth=memory_bandwidth,
            progress=not as_json,
        )
        result = run_bench(lambda: make_engine(detokenize=detokenize), **workload)
        if structured is not None:
            constrained = run_bench(
                lambda: make_engine(detokenize=True), structured=STRUCTURED_WORKLOADS[structured], **workload
            )
            comparison = compare_structured(result, constrained)
    if as_json:
        if structured is not None:
            result = {"plain": result, "structured": constrained, "comparison": comparison}
        click.echo(json.dumps(result, indent=2))
        return
    click.echo(format_bench_table(result))
    if structured is not None:
        click.echo("\n" + format_bench_table(constrained))
        click.echo("\n" + format_structured_comparison(comparison, structured))
