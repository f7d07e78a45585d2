"""The `llmc` command line. Each command is a thin shell over the library; user errors print one line."""

from __future__ import annotations

import sys
from pathlib import Path

import click

from . import __version__
from .errors import LlmcError


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
    """Export the traced graph of MODEL (a Hugging Face checkpoint dir) as ONNX or Relax TVMScript."""
    from .compiler.export import export_onnx, relax_for_checkpoint
    from .compiler.frontend.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model)
    if fmt == "onnx":
        export_onnx(ckpt, output)
    else:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(relax_for_checkpoint(ckpt).script())
    click.echo(f"wrote {output}")


@main.command()
@click.argument("model", type=click.Path(path_type=Path))
def inspect(model: Path) -> None:
    """Describe MODEL: a checkpoint dir (architecture, size, memory) or a compiled artifact."""
    from .compiler.frontend.checkpoint import load_checkpoint

    ckpt = load_checkpoint(model)
    c = ckpt.config
    n = c.num_parameters()
    dtypes = sorted(set(ckpt.dtypes.values()))
    click.echo(f"{model}: {c.architecture}")
    click.echo(f"  parameters     {n:,} ({n / 1e6:.1f}M)")
    click.echo(f"  layers         {c.num_layers}, hidden {c.hidden_size}, intermediate {c.intermediate_size}")
    click.echo(f"  heads          {c.num_heads} query, {c.num_kv_heads} kv, head_dim {c.head_dim}")
    click.echo(f"  vocab          {c.vocab_size}{', tied embeddings' if c.tie_word_embeddings else ''}")
    rope = c.rope_scaling["rope_type"] if c.rope_scaling else "default"
    click.echo(f"  rope           theta {c.rope_theta:g}, {rope}; context {c.max_context}")
    click.echo(f"  weight dtypes  {', '.join(dtypes)} in {len(ckpt.files())} file(s)")
    click.echo("  weight memory  " + ", ".join(
        f"{name} {_human_bytes(n * width)}" for name, width in (("fp32", 4), ("bf16/fp16", 2), ("int8", 1), ("int4", 0.5))
    ))
    kv_per_token = 2 * c.num_layers * c.kv_size
    click.echo(f"  kv cache       {_human_bytes(kv_per_token * 4)}/token at fp32, {_human_bytes(kv_per_token * 2)}/token at bf16")


if __name__ == "__main__":
    main()
