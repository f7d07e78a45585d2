"""The `llmc` command line. Each command is a thin shell over the library; user errors print one line."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import sys
import time
from pathlib import Path

import click

from llmc import __version__, examples
from llmc.errors import LlmcError


class _Group(click.Group):
    """Turns LlmcError into one line and exit code 1; `--debug` shows the traceback instead."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LlmcError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(1)


@click.group(cls=_Group)
@click.version_option(__version__, prog_name="llmc")
@click.option("--debug", is_flag=True, help="Show full tracebacks for errors.")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """llmc: compile Llama-family checkpoints into self-contained inference modules."""
    ctx.ensure_object(dict)["debug"] = debug


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["onnx", "relax"]), default="onnx", show_default=True)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output file.")
def export(model: Path, fmt: str, output: Path) -> None:
    """Export the traced graph of MODEL (a Hugging Face checkpoint dir or a .gguf file) as ONNX or Relax TVMScript."""
    from llmc.compiler.export import export_onnx, relax_for_checkpoint
    from llmc.compiler.frontend.load import load_checkpoint

    ckpt = load_checkpoint(model)
    if fmt == "onnx":
        export_onnx(ckpt, output)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(relax_for_checkpoint(ckpt).script())
    click.echo(f"wrote {output}")


def _quant_options(command):
    """--quant, --group-size, --quant-lm-head, handed to `command` as one `quant` (a QuantConfig): compile's
    quantization, which run, serve and bench apply when they compile a checkpoint."""

    @functools.wraps(command)
    def with_quant(*args, quant: str, group_size: str | None, quant_lm_head: bool, **kwargs):
        from llmc.compiler.quant import QuantConfig  # numpy only: neither torch nor TVM

        config = QuantConfig(quant, None if group_size is None else int(group_size), quant_lm_head)
        return command(*args, quant=config, **kwargs)

    options = [
        click.option("--quant", type=click.Choice(["none", "int8", "int4"]), default="none", show_default=True,
                     help="Quantize the linears' weights: int8 (one scale per output channel, or per group with "
                          "--group-size) or int4 (groups of 32 by default), symmetric. A linear whose input size "
                          "is not a multiple of 32 stays float."),
        click.option("--group-size", type=click.Choice(["32", "64", "128"]), default=None,
                     help="Weights per scale, along the input dim [default: int8 per channel, int4 32]."),
        click.option("--quant-lm-head", is_flag=True, help="Quantize the lm_head too (off: it stays float)."),
    ]  # fmt: skip
    for option in reversed(options):
        with_quant = option(with_quant)
    return with_quant


_kv_cache_dtype_option = click.option(
    "--kv-cache-dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="What the KV cache stores: bfloat16 halves its bytes (twice the tokens in the same memory, half the "
    "attention reads) for k/v rounded to bf16; auto is bfloat16 for a bf16 / fp16 build on a CUDA target, else "
    "float32. run, serve and bench: when they compile a checkpoint.",
)


@main.command("compile")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--target",
    default="cpu",
    show_default=True,
    help="The machine to build for: cpu (this host) or an NVIDIA GPU generation such as sm90, as "
    "targets/<name>.toml, or a TOML in a directory of $LLMC_TARGET_PATH.",
)
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Artifact directory to write.")
@click.option(
    "--dtype",
    "weight_dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="Weight dtype in the artifact (auto: the checkpoint's); on a CUDA target the activations' too "
    "(float32 keeps the fp32 path).",
)
@click.option(
    "--block-size",
    type=click.IntRange(min=1),
    default=None,
    help="KV cache block size (tokens) the module is built for [default: the target's].",
)
@_kv_cache_dtype_option
@_quant_options
@click.option(
    "--calibration",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="With --quant: the UTF-8 text (its first 256 tokens) on which the quantized build is compared with the "
    "unquantized one [default: the bundled model's held-out text].",
)
@click.option(
    "--max-kl",
    type=click.FloatRange(min=0),
    default=None,
    help="With --quant: fail, writing nothing, when the mean KL divergence (nats) of the quantized model's "
    "next-token distributions from the unquantized model's exceeds this.",
)
@click.option(
    "--tuning-db",
    default=None,
    help="The tuning database whose entries set the kernels' tuned parameters, or 'none' for every template's "
    "defaults [default: the target's, targets/<target>.tuning.json].",
)
def compile_cmd(model: Path, target: str, output: Path, weight_dtype: str, block_size: int | None,
                kv_cache_dtype: str, quant, calibration: Path | None, max_kl: float | None,
                tuning_db: str | None) -> None:  # fmt: skip
    """Compile MODEL (a Hugging Face checkpoint dir or a .gguf file) into an artifact for TARGET.

    A quantized build (--quant) is compared with the unquantized one on the CPU: the mean KL divergence, the
    top-1 agreement and both perplexities on a calibration text go into the manifest (llmc inspect shows them).
    """
    from llmc.tools.build import compile_checkpoint  # torch and TVM load only when it compiles

    out = compile_checkpoint(
        model, target=target, output=output, weight_dtype=weight_dtype, progress=True, block_size=block_size,
        quant=quant, kv_dtype=kv_cache_dtype, calibration=calibration, max_kl=max_kl,
        tuning_db=False if tuning_db == "none" else tuning_db,
    )  # fmt: skip
    click.echo(f"wrote {out}")


@main.command()
@click.option("--target", default="cpu", show_default=True, help="The target whose kernels to tune.")
@click.option("--model", "model", type=click.Path(path_type=Path), default=None,
              help="Tune the kernels compile renders for this checkpoint (with --dtype and --quant) "
                   "[default: a standard set of Llama-family GEMM shapes].")  # fmt: skip
@click.option("--shape", "shape_texts", multiple=True,
              help="Tune this kernel shape only, e.g. gemm:n=576,k=576,wdtype=bf16 (repeatable).")  # fmt: skip
@click.option("--dtype", "weight_dtype", type=click.Choice(["auto", "float32", "bfloat16"]), default="auto",
              show_default=True, help="With --model: the weight dtype compile would use.")  # fmt: skip
@_quant_options
@click.option("--simulate", is_flag=True,
              help="GPU target, no GPU: rank candidates by the time llmc profile --simulate predicts "
                   "(entries marked simulated; measured ones replace them).")  # fmt: skip
@click.option("--budget", type=click.FloatRange(min=0), default=600, show_default=True,
              help="Seconds to spend; shapes left when it runs out stay untuned (run again to resume).")  # fmt: skip
@click.option("--rounds", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed rounds per candidate (interleaved); each figure is their median.")  # fmt: skip
@click.option("--db", type=click.Path(path_type=Path), default=None,
              help="The tuning database to write [default: targets/<target>.tuning.json].")  # fmt: skip
@click.option("--retune", is_flag=True, help="Run shapes again that already have entries for this machine.")
def tune(target: str, model: Path | None, shape_texts: tuple[str, ...], weight_dtype: str, quant, simulate: bool,
         budget: float, rounds: int, db: Path | None, retune: bool) -> None:  # fmt: skip
    """Find the fastest configuration of each kernel's tunable parameters on this machine.

    Every candidate is checked against a numpy reference before it is timed; a wrong one is rejected and
    logged. Winners go into the tuning database, which compile reads.
    """
    from llmc.compiler.tuning.database import TuningDB
    from llmc.targets import load_target, tuning_db_path
    from llmc.tools.tuning import tuner

    tgt = load_target(target)
    if shape_texts:
        shapes = [tuner.parse_shape(t, target) for t in shape_texts]
    elif model:
        shapes = tuner.model_shapes(model, target, weight_dtype, quant)
    else:
        shapes = tuner.standard_shapes(tgt.template_dir)
    database = TuningDB.load(db or tuning_db_path(target), target)
    results = tuner.tune(target, shapes, database, simulate=simulate, budget_s=budget, rounds=rounds, retune=retune)
    unit = "predicted us" if simulate else "us"
    rows = [["kernel", "tuned", f"default {unit}", f"tuned {unit}", "speed-up", "rejected"]]
    for r in results:
        if r.skipped:
            rows.append([str(r.shape), _config(r.config), "", "", "(already tuned)", ""])
            continue
        rejected = sum(c.rejected is not None for c in r.candidates)
        rows.append([str(r.shape), _config(r.config), f"{r.default_time_s * 1e6:.2f}", f"{r.time_s * 1e6:.2f}",
                     f"{r.default_time_s / r.time_s:.2f}x", f"{rejected}/{len(r.candidates)}"])  # fmt: skip
    from llmc.runtime.bench import align_columns

    click.echo("\n".join(align_columns(rows)))
    left = len(shapes) - len(results)
    click.echo(
        f"wrote {database.path}" + (f"; {left} shapes left untuned (budget): run again to resume" if left else "")
    )


def _config(config: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in config.items())


# ----------------------------------------------------------------------------------------------------------
# Artifacts from checkpoints, cached: `llmc run` with no argument or with a checkpoint dir

DEFAULT_PROMPT = "The list type"
DEFAULT_MAX_TOKENS = 64


def _resolve_artifact(path: Path | None, quant=None, kv_cache_dtype: str = "auto") -> Path:
    """quant: the QuantConfig a checkpoint is compiled with (--quant), kv_cache_dtype its KV cache's
    (--kv-cache-dtype); an artifact is compiled already."""
    from llmc.tools.build import cached_artifact

    if path is None:
        return cached_artifact(examples.bundled_checkpoint(), quant=quant, kv_dtype=kv_cache_dtype)
    if path.is_dir() and not (path / "manifest.json").exists() and (path / "config.json").is_file():
        return cached_artifact(path, quant=quant, kv_dtype=kv_cache_dtype)
    if path.is_file() and path.suffix.lower() == ".gguf":
        return cached_artifact(path, quant=quant, kv_dtype=kv_cache_dtype)
    if quant is not None and quant.enabled:
        raise LlmcError(f"--quant applies when a checkpoint is compiled, and {path} is not a checkpoint dir",
                        "pass the checkpoint, or compile it with llmc compile --quant")  # fmt: skip
    if kv_cache_dtype != "auto":
        raise LlmcError(f"--kv-cache-dtype applies when a checkpoint is compiled, and {path} is not a checkpoint",
                        "pass the checkpoint, or compile it with llmc compile --kv-cache-dtype")  # fmt: skip
    return path  # an artifact, or load_artifact says what is wrong with it


def _load_model(path: Path, kv_cache_memory: str | None, simulate: bool = False, **kw):
    from llmc.runtime.module import CompiledModel, load_tokenizer

    if simulate:  # the compiler builds the simulated module; the runtime only loads a library
        from llmc.compiler.codegen.simulator import build_simulated_library

        kw["library"] = build_simulated_library(path)
    model = CompiledModel.load(path, kv_cache_memory=kv_cache_memory, **kw)
    return model, load_tokenizer(model.tokenizer_path)


_no_prefix_caching = click.option(
    "--no-prefix-caching", is_flag=True,
    help="Compute every prompt in full, instead of reusing the KV blocks of a prompt prefix seen before.")  # fmt: skip


def _speculative_options(command):
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
        "--speculative", type=click.Choice(["ngram", "draft"]), default=None,
        help="Speculative decoding: ngram guesses the next tokens from the longest earlier match of the last "
             "tokens in the prompt and output (prompt lookup); draft has a smaller model (--draft) guess them. "
             "Greedy outputs are unchanged, sampled ones keep their distribution.")(command)  # fmt: skip


def _speculative_config(method: str | None, num_tokens: int, draft: Path | None, tokenizer, kv_cache_memory: str | None,
                        max_num_seqs: int, stack: contextlib.ExitStack):  # fmt: skip
    """The engine's SpeculativeConfig for the flags (None: off). A draft model is loaded, and closed by `stack`."""
    from llmc.runtime.spec_decode import SpeculativeConfig

    if (method == "draft") != (draft is not None):
        raise LlmcError("--draft goes with --speculative draft, and --speculative draft needs it",
                        "pass both: --speculative draft --draft ARTIFACT")  # fmt: skip
    if method is None:
        return None
    draft_model = None
    if draft is not None:
        draft_model, draft_tokenizer = _load_model(_resolve_artifact(draft), kv_cache_memory, max_num_seqs=max_num_seqs)
        stack.callback(draft_model.close)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise LlmcError(
                f"the draft model {draft} has another tokenizer than the target",
                "use a draft trained with the target's tokenizer (examples/train_tiny.py makes one)",
            )
    return SpeculativeConfig(method, num_tokens, draft_model)


def _logits_rows(method: str | None, num_tokens: int, max_num_seqs: int) -> int | None:
    """max_num_logits for CompiledModel.load: room for every sequence's guesses (None: the default, one each)."""
    return None if method is None else max_num_seqs * (num_tokens + 1)


def _engine_parts(stack: contextlib.ExitStack, path: Path, kv_cache_memory: str | None, max_num_seqs: int,
                  no_prefix_caching: bool, speculative: str | None, num_speculative_tokens: int, draft: Path | None,
                  **load_kw):  # fmt: skip
    """What run, serve and bench share: the model (and a draft) loaded for their flags and closed by `stack`,
    the tokenizer, and a factory of engines over them (detokenize=False: an engine that returns ids only)."""
    from llmc.runtime.engine import LLMEngine

    rows = _logits_rows(speculative, num_speculative_tokens, max_num_seqs)
    model, tokenizer = _load_model(path, kv_cache_memory, max_num_seqs=max_num_seqs, max_num_logits=rows, **load_kw)
    stack.callback(model.close)
    spec = _speculative_config(speculative, num_speculative_tokens, draft, tokenizer, kv_cache_memory, max_num_seqs,
                               stack)  # fmt: skip

    def make_engine(detokenize: bool = True) -> LLMEngine:
        return LLMEngine(model, tokenizer if detokenize else None, enable_prefix_caching=not no_prefix_caching,
                         speculative=spec)  # fmt: skip

    return model, tokenizer, make_engine


# ----------------------------------------------------------------------------------------------------------
# run


@main.command()
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
@_no_prefix_caching
@_speculative_options
@_quant_options
@_kv_cache_dtype_option
def run(artifact: Path | None, prompt: str | None, max_tokens: int, temperature: float, top_p: float, top_k: int,
        seed: int | None, as_json: bool, simulate: bool, kv_cache_memory: str | None,
        no_prefix_caching: bool, speculative: str | None, num_speculative_tokens: int,
        draft: Path | None, quant, kv_cache_dtype: str) -> None:  # fmt: skip
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
    if simulate and (artifact is None or not (artifact / "manifest.json").is_file()):
        raise LlmcError("--simulate needs a CUDA-target artifact",
                        "compile one: llmc compile CHECKPOINT --target sm90 -o OUT")  # fmt: skip
    path = _resolve_artifact(artifact, quant, kv_cache_dtype)
    if chat:
        from llmc.runtime.chat import run_chat

        with contextlib.ExitStack() as stack:
            model, tokenizer, make_engine = _engine_parts(stack, path, kv_cache_memory, 1, no_prefix_caching,
                                                          speculative, num_speculative_tokens, draft)  # fmt: skip
            params = SamplingParams(**{**model.generation_defaults, **given}, seed=seed, max_tokens=max_tokens)
            engine = make_engine()
            run_chat(engine, tokenizer, model.chat_template, params, bos_token=model.bos_token,
                     eos_token=model.eos_token)  # fmt: skip
        return
    if prompt is None:
        prompt = DEFAULT_PROMPT if artifact is None else sys.stdin.read()
        if not prompt:
            raise LlmcError("no prompt given", "pass --prompt TEXT, or pipe the prompt on stdin")
        if artifact is None and not as_json:
            click.echo(f"prompt: {prompt!r}", err=True)
    with contextlib.ExitStack() as stack:
        model, tokenizer, make_engine = _engine_parts(stack, path, kv_cache_memory, 1, no_prefix_caching, speculative,
                                                      num_speculative_tokens, draft, simulate=simulate)  # fmt: skip
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
        "decode_tokens_per_s": round((len(token_ids) - 1) / (end - first), 2) if len(token_ids) > 1 and end > first
        else 0.0,
        "total_ms": round((end - start) * 1e3, 3),
    }  # fmt: skip
    stats = engine.stats()
    spec = {"proposed": stats.spec_num_draft_tokens, "accepted": stats.spec_num_accepted_tokens}
    if as_json:
        result = {"prompt_token_ids": prompt_ids, "token_ids": token_ids, "text": "".join(text),
                  "finish_reason": finish, "timings": timings}  # fmt: skip
        if speculative is not None:
            result["speculative"] = spec
        click.echo(json.dumps(result))
    else:
        click.echo()
        accepted = f"; {spec['accepted']}/{spec['proposed']} guesses accepted" if speculative is not None else ""
        click.echo(f"[{len(prompt_ids)} prompt tokens, {len(token_ids)} generated ({finish}); prefill "
                   f"{timings['prefill_ms']:.1f} ms, decode {timings['decode_tokens_per_s']:.1f} tokens/s{accepted}]",
                   err=True)  # fmt: skip


def _stdin_is_tty() -> bool:
    return sys.stdin.isatty()


# ----------------------------------------------------------------------------------------------------------
# serve


@main.command()
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--model-name", default=None, help="The model id clients send and see [default: the artifact's name].")
@click.option(
    "--max-num-seqs", type=click.IntRange(min=1), default=64, show_default=True, help="Most sequences in one step."
)
@click.option(
    "--max-num-batched-tokens",
    type=click.IntRange(min=1),
    default=512,
    show_default=True,
    help="Most tokens in one step (prefill chunks and decodes together).",
)
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 4GiB (default: 20% of free memory).")
@click.option(
    "--max-body-size",
    default=None,
    callback=lambda ctx, param, v: None if v is None else _byte_size(v),
    help="Largest request body, e.g. 16MiB; larger ones get 413 [default: 4MiB].",
)
@click.option("--max-n", type=click.IntRange(min=1), default=None, help="Most choices (n) per request [default: 16].")
@click.option(
    "--max-waiting-requests",
    type=click.IntRange(min=0),
    default=None,
    help="Requests that may wait beyond --max-num-seqs; more get 429 with Retry-After [default: 256].",
)
@click.option(
    "--shutdown-timeout",
    type=click.FloatRange(min=0),
    default=None,
    help="Seconds requests in flight get to finish after SIGTERM or Ctrl-C; then they are cut [default: 30].",
)
@click.option(
    "--api-key",
    envvar="LLMC_API_KEY",
    default=None,
    show_envvar=True,
    help="Require `Authorization: Bearer <key>` on /v1 (401 otherwise); /health and /metrics stay open.",
)
@_no_prefix_caching
@_speculative_options
@_quant_options
@_kv_cache_dtype_option
@click.option(
    "--ray",
    "use_ray",
    is_flag=True,
    help="Serve on Ray Serve: --replicas copies of this server behind Ray's HTTP proxy, with "
    "prefix-affinity routing (needs pip install 'llmc[ray]').",
)
@click.option(
    "--address",
    default=None,
    help="With --ray: the Ray cluster to join (e.g. 10.0.0.1:6379 or auto) [default: start a local one].",
)
@click.option(
    "--replicas",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="With --ray: replicas, each loading the artifact once.",
)
@click.option(
    "--threads-per-replica",
    type=click.IntRange(min=1),
    default=None,
    help="With --ray and a CPU artifact: each replica's threads and Ray CPUs [default: this machine's "
    "cores / --replicas].",
)
@click.option(
    "--autoscale",
    default=None,
    help="With --ray: MIN:MAX replicas, scaled on requests in flight, or a JSON file of Ray Serve's "
    "autoscaling_config; replaces --replicas.",
)
def serve(artifact: Path, host: str, port: int, model_name: str | None, max_num_seqs: int,
          max_num_batched_tokens: int, kv_cache_memory: str | None, max_body_size: int | None, max_n: int | None,
          max_waiting_requests: int | None, shutdown_timeout: float | None, api_key: str | None,
          no_prefix_caching: bool, speculative: str | None, num_speculative_tokens: int,
          draft: Path | None, quant, kv_cache_dtype: str, use_ray: bool, address: str | None, replicas: int,
          threads_per_replica: int | None, autoscale: str | None) -> None:  # fmt: skip
    """Serve ARTIFACT over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models),
    with /health and Prometheus metrics at /metrics."""
    from llmc.runtime import server

    ray_serve = _ray_serve_module() if use_ray else None  # before any compile: a missing extra fails at once
    given = {"max_body_bytes": max_body_size, "max_n": max_n, "max_waiting_requests": max_waiting_requests,
             "shutdown_timeout_s": shutdown_timeout}  # fmt: skip
    limits = server.ServerLimits(**{k: v for k, v in given.items() if v is not None})  # unset: the library's default
    path = _resolve_artifact(artifact, quant, kv_cache_dtype)
    app_kw = dict(path=path.resolve(), name=model_name or artifact.resolve().name, limits=limits,
                  api_key=api_key or None, kv_cache_memory=kv_cache_memory, max_num_seqs=max_num_seqs,
                  max_num_batched_tokens=max_num_batched_tokens, no_prefix_caching=no_prefix_caching,
                  speculative=speculative, num_speculative_tokens=num_speculative_tokens,
                  draft=None if draft is None else _resolve_artifact(draft).resolve())  # fmt: skip
    if ray_serve is not None:
        return _serve_on_ray(ray_serve, app_kw, host, port, address, replicas, threads_per_replica, autoscale)
    with contextlib.ExitStack() as stack:
        app, model = _server_app(stack, **app_kw)
        click.echo(f"serving {app_kw['name']} ({model.num_blocks} KV blocks of {model.block_size} tokens) on "
                   f"http://{host}:{port}/v1", err=True)  # fmt: skip
        server.serve(app, host, port)


def _server_app(stack: contextlib.ExitStack, *, path: Path, name: str, limits, api_key: str | None,
                kv_cache_memory: str | None, max_num_seqs: int, max_num_batched_tokens: int, no_prefix_caching: bool,
                speculative: str | None, num_speculative_tokens: int, draft: Path | None):  # fmt: skip
    """The app `llmc serve` runs, over a model that `stack` closes; and the model."""
    from llmc.runtime import server
    from llmc.runtime.engine import AsyncLLMEngine

    model, tokenizer, make_engine = _engine_parts(stack, path, kv_cache_memory, max_num_seqs, no_prefix_caching,
                                                  speculative, num_speculative_tokens, draft,
                                                  max_num_tokens=max_num_batched_tokens)  # fmt: skip
    app = server.create_app(AsyncLLMEngine(make_engine()), tokenizer, name, model.chat_template,
                            bos_token=model.bos_token, eos_token=model.eos_token, limits=limits,
                            api_key=api_key)  # fmt: skip
    return app, model


def ray_replica_app(**app_kw):
    """One Ray Serve replica's app (runtime/ray_serve.py calls it in the replica's process) and its close."""
    stack = contextlib.ExitStack()
    app, _ = _server_app(stack, **app_kw)
    return app, stack.close


def ray_serve_options(path: Path, limits, max_num_seqs: int, replicas: int, threads_per_replica: int | None,
                      autoscale: str | None):  # fmt: skip
    """RayServeOptions for an artifact: a CUDA one takes a GPU per replica, a CPU one its threads in CPUs."""
    from llmc.artifact import load_artifact
    from llmc.runtime.ray_serve import RayServeOptions

    target = load_artifact(path, verify=False, check_target=False).target
    common = dict(replicas=replicas, limits=limits, autoscaling=_autoscaling_config(autoscale),
                  max_ongoing_requests=max_num_seqs + limits.max_waiting_requests)  # fmt: skip
    if target.get("name") != "cpu":
        return RayServeOptions(num_cpus=1, num_gpus=1, **common)
    threads = threads_per_replica or max(1, (os.cpu_count() or 1) // replicas)
    return RayServeOptions(num_cpus=threads, env={"OMP_NUM_THREADS": str(threads)}, **common)


def _autoscaling_config(text: str | None) -> dict | None:
    if text is None:
        return None
    low, sep, high = text.partition(":")
    if sep and low.isdigit() and high.isdigit():
        if not 0 <= int(low) <= int(high) or int(high) < 1:
            raise LlmcError(f"--autoscale {text}: MIN:MAX needs 0 <= MIN <= MAX and MAX >= 1", "e.g. --autoscale 1:4")
        return {"min_replicas": int(low), "max_replicas": int(high)}
    try:
        config = json.loads(Path(text).read_text())
    except (OSError, ValueError) as e:
        raise LlmcError(f"--autoscale {text}: neither MIN:MAX nor a readable JSON file ({e})",
                        "pass e.g. 1:4, or a JSON file of Ray Serve's autoscaling_config") from None  # fmt: skip
    if not isinstance(config, dict):
        raise LlmcError(f"--autoscale {text}: the JSON file must hold one object", 'e.g. {"max_replicas": 4}')
    return config


def _ray_serve_module():
    try:
        from llmc.runtime import ray_serve
    except ImportError as e:
        raise LlmcError(f"--ray needs Ray Serve, which is not installed ({e})",
                        "pip install 'llmc[ray]'  (or: pip install 'ray[serve]==2.60.0')") from None  # fmt: skip
    return ray_serve


def _serve_on_ray(ray_serve, app_kw: dict, host: str, port: int, address: str | None, replicas: int,
                  threads_per_replica: int | None, autoscale: str | None) -> None:  # fmt: skip
    options = ray_serve_options(app_kw["path"], app_kw["limits"], app_kw["max_num_seqs"], replicas,
                                threads_per_replica, autoscale)  # fmt: skip
    ray_serve.start_ray(address, None if address else max(os.cpu_count() or 1, replicas * options.num_cpus))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # as Ctrl-C: through `finally`, which stops Serve and Ray
    try:
        ray_serve.deploy(functools.partial(ray_replica_app, **app_kw), options, host=host, port=port)
        count = f"autoscaled {autoscale}" if autoscale else f"{replicas} replica(s)"
        click.echo(f"serving {app_kw['name']} on Ray Serve ({count}) at http://{host}:{port}/v1", err=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        ray_serve.shutdown()


def _byte_size(text: str) -> int:
    from llmc.runtime.kv_cache import parse_memory_size

    try:
        return parse_memory_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


# ----------------------------------------------------------------------------------------------------------
# bench


def _int_list(ctx, param, value: str) -> list[int]:
    try:
        levels = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise click.BadParameter(f"{value!r}: write comma-separated integers, e.g. 1,4,16") from None
    if not levels or min(levels) < 1:
        raise click.BadParameter(f"{value!r}: every level must be >= 1")
    return levels


@main.command()
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
@_no_prefix_caching
@_speculative_options
@_quant_options
@_kv_cache_dtype_option
def bench(artifact: Path, concurrency: list[int], num_requests: int | None, prompt_len: int, output_len: int,
          seed: int, shared_prefix: int, memory_bandwidth: float | None, kv_cache_memory: str | None, as_json: bool,
          no_prefix_caching: bool, speculative: str | None, num_speculative_tokens: int,
          draft: Path | None, quant, kv_cache_dtype: str) -> None:  # fmt: skip
    """TTFT, TPOT and tokens/s of ARTIFACT on a fixed synthetic workload, against the memory roofline."""
    from llmc.runtime.bench import format_bench_table, run_bench

    with contextlib.ExitStack() as stack:
        path = _resolve_artifact(artifact, quant, kv_cache_dtype)
        _, _, make_engine = _engine_parts(stack, path, kv_cache_memory, max(concurrency), no_prefix_caching,
                                          speculative, num_speculative_tokens, draft)  # fmt: skip
        result = run_bench(lambda: make_engine(detokenize=False),
                           concurrency=concurrency, num_requests=num_requests, prompt_len=prompt_len,
                           output_len=output_len, seed=seed, shared_prefix=shared_prefix,
                           memory_bandwidth=memory_bandwidth, progress=not as_json)  # fmt: skip
    click.echo(json.dumps(result, indent=2) if as_json else format_bench_table(result))


# ----------------------------------------------------------------------------------------------------------
# eval


@main.group("eval")
def eval_group() -> None:
    """Evaluate a compiled model."""


@eval_group.command("ppl")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option(
    "--text",
    "text_file",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    required=True,
    help="UTF-8 text file to score.",
)
@click.option("--max-tokens", type=click.IntRange(min=2), default=None, help="Score only the first N tokens.")
@click.option("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def eval_ppl(artifact: Path, text_file: Path, max_tokens: int | None, kv_cache_memory: str | None,
             as_json: bool) -> None:  # fmt: skip
    """Perplexity of the compiled ARTIFACT over a text file.

    The text is split into windows of the model's context; each window runs as prefill steps that return the
    logits of every row, scoring every next token.
    """
    from llmc.runtime.scoring import perplexity

    # logits at every row of a step (max_num_logits is capped at the step's max_num_tokens)
    model, tokenizer = _load_model(_resolve_artifact(artifact), kv_cache_memory, max_num_seqs=1, max_num_logits=512)
    ids = tokenizer.encode(text_file.read_text(encoding="utf-8")).ids
    if max_tokens is not None:
        ids = ids[:max_tokens]
    with model:
        result = perplexity(model, ids)
    if as_json:
        click.echo(json.dumps({"perplexity": result.perplexity, "num_tokens": result.num_tokens,
                               "tokens_per_s": result.tokens_per_s}))  # fmt: skip
    else:
        click.echo(f"perplexity {result.perplexity:.4f} over {result.num_tokens} tokens "
                   f"({result.tokens_per_s:.1f} tokens/s)")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------
# inspect


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("-v", "--verbose", is_flag=True, help="Artifacts: list every kernel, print the kernel program.")
@click.option(
    "--passes",
    "show_passes",
    is_flag=True,
    help="Checkpoints: trace, run each pass (what it rewrote), and print the kernel program (with --quant: "
    "the quantized one).",
)
@_quant_options
def inspect(model: Path, verbose: bool, show_passes: bool, quant) -> None:
    """Describe MODEL: a checkpoint dir or .gguf file (architecture, size, memory) or a compiled artifact."""
    if (model / "manifest.json").is_file():
        return _inspect_artifact(model, verbose)
    from llmc.compiler.frontend.load import load_checkpoint

    ckpt = load_checkpoint(model)
    c = ckpt.config
    n = c.num_parameters()
    dtypes = sorted(set(ckpt.dtypes.values()))
    click.echo(f"{model}: {c.architecture}")
    click.echo(f"  parameters     {n:,} ({n / 1e6:.1f}M)")
    click.echo(f"  layers         {c.num_layers}, hidden {c.hidden_size}, intermediate {c.intermediate_size}")
    window = (f"; sliding window {c.sliding_window} in {len(c.sliding_layers)} of {c.num_layers} layers"
              if c.sliding_window else "")  # fmt: skip
    click.echo(f"  heads          {c.num_heads} query, {c.num_kv_heads} kv, head_dim {c.head_dim}{window}")
    click.echo(f"  vocab          {c.vocab_size}{', tied embeddings' if c.tie_word_embeddings else ''}")
    rope = c.rope_scaling["rope_type"] if c.rope_scaling else "default"
    click.echo(f"  rope           theta {c.rope_theta:g}, {rope}; context {c.max_context}")
    click.echo(f"  weight dtypes  {', '.join(dtypes)} in {len(ckpt.files())} file(s)")
    click.echo(
        "  weight memory  "
        + ", ".join(
            f"{name} {_human_bytes(n * width)}"
            for name, width in (("fp32", 4), ("bf16/fp16", 2), ("int8", 1), ("int4", 0.5))
        )
    )
    kv_per_token = 2 * c.num_layers * c.kv_size
    click.echo(
        f"  kv cache       {_human_bytes(kv_per_token * 4)}/token at fp32, {_human_bytes(kv_per_token * 2)}/token at bf16"
    )
    if show_passes:
        _inspect_passes(ckpt, quant)


def _inspect_passes(ckpt, quant) -> None:
    from llmc.compiler.compile import build_program, quant_schemes, resolve_weight_dtype
    from llmc.compiler.passes.common import rewrite_counts
    from llmc.targets import load_target

    def report(name, mod):
        count = rewrite_counts(mod)[name]
        click.echo(f"    {name:<22} {f'{count} rewrites' if count else 'no pattern found: module unchanged'}")

    click.echo("  passes")
    # The kernel program is the same for every target but for the KV block size: show the CPU target's.
    program = build_program(
        ckpt, resolve_weight_dtype(ckpt, "auto"), load_target("cpu").block_size, after_each_pass=report,
        schemes=quant_schemes(ckpt, quant),
    )  # fmt: skip
    click.echo("\n".join("  " + line for line in str(program).splitlines()))


def _inspect_artifact(path: Path, verbose: bool) -> None:
    from llmc.artifact import load_artifact, safetensors_data_bytes

    a = load_artifact(path, verify=False, check_target=False)
    m, c = a.manifest, a.config
    target = dict(a.target)
    name = target.pop("name")
    isa = target.pop("isa", None)
    click.echo(f"{path}: llmc artifact for {name}, compiled by llmc {m.get('compiler_version')} "
               f"(format {m.get('format_version')}, ABI {m.get('abi_version')})")  # fmt: skip
    click.echo(f"  model          {c.architecture}, {c.num_parameters() / 1e6:.1f}M parameters, {c.num_layers} layers, "
               f"context {c.max_context}")  # fmt: skip
    for key in ("gencode", "flags", "machine"):  # what the module was built with; the rest is in the manifest
        if key in target:
            value = target[key]
            click.echo(f"  target {key:<8}{' '.join(map(str, value)) if isinstance(value, list) else value}")
    if isa:
        simd = [f for f in isa if f.startswith(("avx", "amx", "sve", "asimd", "fma", "f16c"))]
        click.echo(f"  target isa     {' '.join(simd or isa)}")
    weights = path / "weights.safetensors"
    size = _human_bytes(safetensors_data_bytes(weights)) if weights.is_file() else "missing"
    click.echo(f"  weights        {m.get('weight_dtype')}, {size}; quantization {m.get('quantization', 'none')}")
    click.echo(f"  KV cache       {a.kv_dtype}, blocks of {a.block_size} tokens")
    click.echo(f"  activations    {m.get('activation_dtype', 'float32')}")  # absent: an artifact from before the field
    quant = m.get("quant")
    if isinstance(quant, dict):
        _inspect_quant(quant, verbose)
    quality = m.get("quality")
    if isinstance(quality, dict):
        from llmc.tools.quality import describe  # numpy only

        click.echo(f"  quality        {describe(quality)}")
    plan = m.get("buffer_plan") or {}
    parts = []
    for key, value in plan.items():
        if isinstance(value, (list, tuple, dict)):
            value = len(value)
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            continue
        shown = _human_bytes(value) if key.endswith("bytes") and isinstance(value, int) else value
        parts.append(f"{key.removesuffix('_bytes')} {shown}")
    click.echo(f"  buffer plan    {', '.join(parts) if parts else '(none recorded)'}")
    passes = m.get("passes") or {}
    click.echo("  passes" + ("         (none recorded)" if not passes else ""))
    for pname, n in passes.items():
        click.echo(f"    {pname:<22} {'no pattern found' if not n else f'{n} rewrite' + ('s' if n != 1 else '')}")
    kernels = m.get("kernels") or []
    click.echo(f"  kernels        {len(kernels)}")
    _inspect_tuning(m.get("tuning"), verbose)
    fallback = sorted(
        {op for k in kernels if str(k.get("template")).endswith("/tvm_call") for op in k.get("fuses", [])}
    )
    click.echo(f"  TVM fallback   {', '.join(fallback) if fallback else 'none (every op has a kernel template)'}")
    if verbose:
        for k in kernels:
            fused = _fused(k)
            click.echo(f"    {k.get('id')}: {k.get('template')} x{k.get('launches', 1)} [{k.get('tuning_source', '')}] "
                       f"{_params(k)}{'; fuses ' + fused if fused else ''}")  # fmt: skip
        if m.get("kernel_program") is not None:  # load_artifact checked its schema
            from llmc.kernel_program import format_program

            click.echo("\n".join("  " + line for line in format_program(m["kernel_program"]).splitlines()))
    else:
        groups: dict[tuple[str, str], list[dict]] = {}
        for k in kernels:
            groups.setdefault((str(k.get("template")), _fused(k)), []).append(k)
        for (template, fused), ks in groups.items():
            launches = sum(int(k.get("launches", 1)) for k in ks)
            sources = sorted({str(k.get("tuning_source")) for k in ks if k.get("tuning_source")})
            click.echo(f"    {template:<22} {len(ks)} kernel{'s' if len(ks) != 1 else ' '} {launches:>3} launch"
                       f"{'es' if launches != 1 else '  '}  {'fuses ' + fused if fused else '':<28}"
                       f"{' tuning: ' + ', '.join(sources) if sources else ''}".rstrip())  # fmt: skip
        if kernels:
            click.echo("    (-v lists every kernel with its parameters)")


def _inspect_quant(quant: dict, verbose: bool) -> None:
    """The manifest's `quant` entry: the build's scheme, the activations, packed bytes and each GEMM's scheme."""
    weights = quant.get("weights") if isinstance(quant.get("weights"), dict) else {}
    packed = quant.get("packed_bytes") if isinstance(quant.get("packed_bytes"), dict) else {}
    sizes = ", ".join(f"{k} {_human_bytes(v)}" for k, v in packed.items() if isinstance(v, int))
    click.echo(f"  quant          {quant.get('default')}; activations {quant.get('activations')}"
               f"{'; ' + sizes if sizes else ''}")  # fmt: skip
    counts: dict[str, int] = {}
    for scheme in weights.values():
        counts[str(scheme)] = counts.get(str(scheme), 0) + 1
    click.echo(f"  quantized      {', '.join(f'{n} GEMM weights {s}' for s, n in counts.items()) or 'none'}")
    if verbose:
        for name, scheme in weights.items():
            click.echo(f"    {name}: {scheme}")


def _inspect_tuning(tuning: dict | None, verbose: bool) -> None:
    """Which tunable kernels took their parameters from the tuning database, which the template's defaults."""
    kernels = (tuning or {}).get("kernels") or {}
    if not kernels:
        click.echo("  tuning         none (no kernel has tunable parameters)")
        return
    by_source: dict[str, int] = {}
    for k in kernels.values():
        by_source[str(k.get("source"))] = by_source.get(str(k.get("source")), 0) + 1
    counts = ", ".join(f"{n} {src}" for src, n in sorted(by_source.items()))
    click.echo(f"  tuning         {counts} (of {len(kernels)} tunable kernels; default: no entry for this shape"
               f"{' and ISA' if any('ignored' in k for k in kernels.values()) else ''}); db {tuning.get('database')}")  # fmt: skip
    if verbose:
        for kid, k in kernels.items():
            ignored = "; ignored: " + ", ".join(k["ignored"]) if k.get("ignored") else ""
            click.echo(f"    {kid}: {k.get('source')} {_config(k.get('params') or {})}{ignored}")


def _fused(kernel: dict) -> str:
    return " + ".join(map(str, kernel.get("fuses") or []))


def _params(kernel: dict) -> str:
    params = kernel.get("params") or {}
    return ", ".join(f"{k}={v}" for k, v in params.items() if not (isinstance(v, list) and len(v) > 8))


@main.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--simulate", is_flag=True, help="Run the step under the CUDA simulator's counters (no GPU needed).")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Decode: sequences.")
@click.option("--context", type=click.IntRange(min=0), default=1024, show_default=True,
              help="Decode: tokens already in each sequence's KV cache.")  # fmt: skip
@click.option("--prompt-len", type=click.IntRange(min=1), default=256, show_default=True, help="Prefill: tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the step's random token ids.")
@click.option("--repeats", type=click.IntRange(min=1), default=10, show_default=True,
              help="Without --simulate: timed steps (after two warm-up steps); each kernel's time is the median.")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: step and kernels.")
def profile(artifact: Path, simulate: bool, phase: str, batch: int, context: int, prompt_len: int, seed: int,
            repeats: int, as_json: bool) -> None:  # fmt: skip
    """One decode or prefill step of ARTIFACT, per kernel against its floor (the bytes it must move and the
    FLOPs it must do). A CUDA artifact on its GPU: each kernel timed with CUDA events, floors at the target's
    ceilings. A CPU artifact: each kernel timed on the host, floors at this host's bandwidth and peak rates,
    measured first. --simulate (CUDA): bytes, DRAM sectors, sector efficiency, bank conflicts and tensor-core
    instructions counted, the time predicted from them."""
    from llmc.tools.profile import format_table, profile_measured, profile_simulated

    stages = ("build", "load", "run") if simulate else ("ceilings", "load", "run")
    labels = {"build": "building the profiling library", "ceilings": "the ceilings (a CPU: measured)",
              "load": "loading",
              "run": f"running one {phase} step" if simulate else f"timing {repeats} {phase} steps"}  # fmt: skip
    with click.progressbar(length=len(stages), label="profile", file=sys.stderr,
                           item_show_func=lambda s: s) as bar:  # fmt: skip
        done = []

        def progress(stage: str) -> None:
            if done:
                bar.update(1)
            done.append(stage)
            bar.label = f"profile: {labels[stage]}"
            bar.render_progress()

        if simulate:
            report = profile_simulated(artifact, phase=phase, batch=batch, context=context, prompt_len=prompt_len,
                                       seed=seed, progress=progress)  # fmt: skip
        else:
            report = profile_measured(artifact, phase=phase, batch=batch, context=context, prompt_len=prompt_len,
                                      seed=seed, repeats=repeats, progress=progress)  # fmt: skip
        bar.update(1)
    click.echo(json.dumps(report) if as_json else format_table(report))


if __name__ == "__main__":
    main()
