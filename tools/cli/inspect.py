"""`llmc inspect`: describe a checkpoint or a compiled artifact (describe.py formats both)."""

from __future__ import annotations

from pathlib import Path

import click

from .describe import inspect_artifact, inspect_checkpoint, inspect_passes
from .options import quant_options


@click.command()
@click.argument("model", type=click.Path(path_type=Path), required=False)
@click.option("--architectures", "list_architectures", is_flag=True, help="List the architectures llmc compiles.")
@click.option("-v", "--verbose", is_flag=True, help="Artifacts: list every kernel, print the kernel program.")
@click.option(
    "--passes",
    "show_passes",
    is_flag=True,
    help="Checkpoints: trace, run each pass (what it rewrote), and print the kernel program (with --quant: "
    "the quantized one).",
)
@quant_options
def inspect(model: Path | None, list_architectures: bool, verbose: bool, show_passes: bool, quant) -> None:
    """Describe MODEL: a checkpoint dir or .gguf file (architecture, size, memory) or a compiled artifact."""
    if list_architectures:
        from llmc.compiler.frontend.config import ARCHITECTURES
        from llmc.compiler.frontend.gguf_names import GGUF_ARCH

        for arch, covered in ARCHITECTURES.items():
            gguf = GGUF_ARCH.get(arch)
            click.echo(f"{arch:<22} {covered}" + (f" (GGUF: {gguf})" if gguf else ""))
        return
    if model is None:
        raise click.UsageError("give MODEL, or --architectures")
    if (model / "manifest.json").is_file():
        return inspect_artifact(model, verbose)
    from llmc.compiler.frontend.load import load_checkpoint

    ckpt = load_checkpoint(model)
    inspect_checkpoint(model, ckpt)
    if show_passes:
        inspect_passes(ckpt, quant)
