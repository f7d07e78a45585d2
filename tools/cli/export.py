"""`llmc export`: the traced graph of a checkpoint as ONNX or Relax TVMScript."""

from __future__ import annotations

from pathlib import Path

import click

from .options import PathKind


@click.command()
@click.argument("model", type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["onnx", "relax"]), default="onnx", show_default=True)
@click.option(
    "-o",
    "--output",
    type=PathKind("output file"),
    required=True,
    help="Output file, in a directory that exists; replaced if it is there; not a symlink.",
)
def export(model: Path, fmt: str, output: Path) -> None:
    """Export the traced graph of MODEL (a Hugging Face checkpoint dir or a .gguf file) as ONNX or Relax TVMScript."""
    from llmc.compiler.export import export_onnx, relax_for_checkpoint
    from llmc.compiler.frontend.load import load_checkpoint

    ckpt = load_checkpoint(model)
    if fmt == "onnx":
        export_onnx(ckpt, output)
    else:
        output.write_text(relax_for_checkpoint(ckpt).script())
    click.echo(f"wrote {output}")
