"""`llmc compile`: a checkpoint into an artifact for a target, through the quality gate of llmc.tools.build."""

from __future__ import annotations

from pathlib import Path

import click

from .options import PathKind, finite_number, kv_cache_dtype_option, quant_options


@click.command("compile")
@click.argument("model", type=click.Path(path_type=Path))
@click.option(
    "--target",
    default="cpu",
    show_default=True,
    help="The machine to build for: cpu (this host) or an NVIDIA GPU generation such as sm90, as "
    "targets/<name>.toml, or a TOML in a directory of $LLMC_TARGET_PATH.",
)
@click.option(
    "-o",
    "--output",
    type=PathKind("output dir"),
    required=True,
    help="Artifact directory to write: new (in a directory that exists), empty, or an artifact, which is replaced "
    "whole; not a symlink.",
)
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
@kv_cache_dtype_option
@quant_options
@click.option(
    "--calibration",
    type=PathKind("input"),
    default=None,
    help="With --quant: the UTF-8 text file (its first 2048 tokens, at least 2000; a symlink to it is followed) on "
    "which the quantized build is compared with the unquantized one: text the model was not trained on "
    "[default: the bundled model's held-out text].",
)
@click.option(
    "--max-kl",
    type=click.FloatRange(min=0),
    callback=finite_number,
    default=None,
    help="With --quant: fail, writing nothing, when the mean KL divergence (nats) of the quantized model's "
    "next-token distributions from the unquantized model's exceeds this.",
)
@click.option(
    "--max-ppl-increase",
    type=float,
    callback=finite_number,
    default=None,
    metavar="PERCENT",
    help="With --quant: fail, writing nothing, when the quantized model's perplexity on the calibration text is "
    "more than PERCENT percent over the unquantized model's.",
)
@click.option(
    "--tuning-db",
    type=PathKind("input", keywords=("none",)),
    default=None,
    help="The tuning database whose entries set the kernels' tuned parameters: a file that exists (a symlink to "
    "it is followed), or 'none' for every template's defaults [default: the target's, "
    "targets/<target>.tuning.json, if there is one].",
)
def compile_cmd(
    model: Path,
    target: str,
    output: Path,
    weight_dtype: str,
    block_size: int | None,
    kv_cache_dtype: str,
    quant,
    calibration: Path | None,
    max_kl: float | None,
    max_ppl_increase: float | None,
    tuning_db: Path | str | None,
) -> None:
    """Compile MODEL (a Hugging Face checkpoint dir or a .gguf file) into an artifact for TARGET.

    A quantized build (--quant) is compared with the unquantized one on the CPU: the mean KL divergence, the
    top-1 agreement and both perplexities on a calibration text go into the manifest (llmc inspect shows them).
    """
    from llmc.tools.build import compile_checkpoint  # torch and TVM load only when it compiles

    out = compile_checkpoint(
        model,
        target=target,
        output=output,
        weight_dtype=weight_dtype,
        progress=True,
        block_size=block_size,
        quant=quant,
        kv_dtype=kv_cache_dtype,
        calibration=calibration,
        max_kl=max_kl,
        max_ppl_increase=max_ppl_increase,
        tuning_db=False if tuning_db == "none" else tuning_db,
    )
    click.echo(f"wrote {out}")
