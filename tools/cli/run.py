"""`llmc run`: generate from an artifact, a checkpoint (compiled on demand) or the bundled model, once or as an
interactive chat."""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import click

from llmc.errors import LlmcError
from llmc.tools.engine_setup import engine_parts, resolve_artifact

from .options import (
    kv_cache_dtype_option,
    no_prefix_caching,
    quant_options,
    speculative_options,
    structured_options,
    structured_outputs,
)

DEFAULT_PROMPT = "The list type"
DEFAULT_MAX_TOKENS = 64


@click.command()
@click.argument("artifact", required=False, type=click.Path(path_type=Path))
@click.option("--prompt", help="Text to continue. Default: stdin when piped; the bundled model's demo prompt.")
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=None,
    help=f"Tokens to generate [default: {DEFAULT_MAX_TOKENS}; chat: until EOS].",
)
@click.option(
    "--temperature",
    type=float,
    default=None,
    help="0 is greedy [default: the checkpoint's generation_config.json, else 0].",
)
@click.option("--top-p", type=float, default=None, help="[default: the checkpoint's, else 1.0]")
@click.option("--top-k", type=int, default=None, help="0 is off [default: the checkpoint's, else 0].")
@click.option("--seed", type=int, default=None)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object (token ids, text, timings).")
@click.option("--simulate", is_flag=True, help="Run a CUDA-target artifact under the CUDA simulator.")
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB (default: 20% of free memory).")
@no_prefix_caching
@speculative_options
@quant_options
@kv_cache_dtype_option
@structured_options
def run(
    artifact: Path | None,
    prompt: str | None,
    max_tokens: int,
    temperature: float,
    top_p: float,
    top_k: int,
    seed: int | None,
    as_json: bool,
    simulate: bool,
    kv_cache_memory: str | None,
    no_prefix_caching: bool,
    speculative: str | None,
    num_speculative_tokens: int,
    draft: Path | None,
    quant,
    kv_cache_dtype: str,
    json_schema: Path | None,
    regex: str | None,
    choice: tuple[str, ...],
    grammar: Path | None,
) -> None:
    """Generate from ARTIFACT (a compiled artifact, a checkpoint dir or a .gguf file; default: the bundled model).

    A checkpoint is compiled for this CPU once and cached ($LLMC_CACHE_DIR, else ~/.cache/llmc). With an
    ARTIFACT, no --prompt and a terminal on stdin, it starts an interactive chat.
    """
    from llmc.sampling_params import SamplingParams

    chat = prompt is None and artifact is not None and not as_json and _stdin_is_tty()
    if max_tokens is None and not chat:
        max_tokens = DEFAULT_MAX_TOKENS
    given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    given = {k: v for k, v in given.items() if v is not None}
    given["structured"] = structured_outputs(json_schema, regex, choice, grammar)
    if simulate and (artifact is None or not (artifact / "manifest.json").is_file()):
        raise LlmcError(
            "--simulate needs a CUDA-target artifact", "compile one: llmc compile CHECKPOINT --target sm90 -o OUT"
        )
    path = resolve_artifact(artifact, quant, kv_cache_dtype)
    if chat:
        from llmc.runtime.chat import run_chat

        with contextlib.ExitStack() as stack:
            model, tokenizer, make_engine = engine_parts(
                stack, path, kv_cache_memory, 1, no_prefix_caching, speculative, num_speculative_tokens, draft
            )
            params = SamplingParams(**{**model.generation_defaults, **given}, seed=seed, max_tokens=max_tokens)
            engine = make_engine()
            run_chat(
                engine, tokenizer, model.chat_template, params, bos_token=model.bos_token, eos_token=model.eos_token
            )
        return
    if prompt is None:
        prompt = DEFAULT_PROMPT if artifact is None else sys.stdin.read()
        if not prompt:
            raise LlmcError("no prompt given", "pass --prompt TEXT, or pipe the prompt on stdin")
        if artifact is None and not as_json:
            click.echo(f"prompt: {prompt!r}", err=True)
    with contextlib.ExitStack() as stack:
        model, tokenizer, make_engine = engine_parts(
            stack,
            path,
            kv_cache_memory,
            1,
            no_prefix_caching,
            speculative,
            num_speculative_tokens,
            draft,
            simulate=simulate,
        )
        params = SamplingParams(**{**model.generation_defaults, **given}, seed=seed, max_tokens=max_tokens)
        engine = make_engine()
        prompt_ids = tokenizer.encode(prompt).ids
        engine.add_request(prompt_ids, params)
        token_ids: list[int] = []
        text, first, finish = [], None, None
        start = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.error is not None:
                    raise out.error
                if first is None:
                    first = time.perf_counter()
                token_ids += out.new_token_ids
                text.append(out.new_text)
                finish = out.finish_reason or finish
                if not as_json and out.new_text:
                    click.echo(out.new_text, nl=False)
                    sys.stdout.flush()
        end = time.perf_counter()
    first = first or end
    timings = {
        "prefill_ms": round((first - start) * 1e3, 3),
        "decode_tokens_per_s": round((len(token_ids) - 1) / (end - first), 2)
        if len(token_ids) > 1 and end > first
        else 0.0,
        "total_ms": round((end - start) * 1e3, 3),
    }
    stats = engine.stats()
    spec = {"proposed": stats.spec_num_draft_tokens, "accepted": stats.spec_num_accepted_tokens}
    if as_json:
        result = {
            "prompt_token_ids": prompt_ids,
            "token_ids": token_ids,
            "text": "".join(text),
            "finish_reason": finish,
            "timings": timings,
        }
        if speculative is not None:
            result["speculative"] = spec
        click.echo(json.dumps(result))
    else:
        click.echo()
        accepted = f"; {spec['accepted']}/{spec['proposed']} guesses accepted" if speculative is not None else ""
        click.echo(
            f"[{len(prompt_ids)} prompt tokens, {len(token_ids)} generated ({finish}); prefill "
            f"{timings['prefill_ms']:.1f} ms, decode {timings['decode_tokens_per_s']:.1f} tokens/s{accepted}]",
            err=True,
        )


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()
