"""The `llmc` command line: the group and its error handling. Each command lives in its own module and is a thin
shell over the library; user errors print one line."""

from __future__ import annotations

import sys

import click

from llmc import __version__
from llmc.errors import LlmcError

from . import bench, compile, eval, export, inspect, profile, run, serve, tune


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


for _command in (
    export.export,
    compile.compile_cmd,
    tune.tune,
    run.run,
    serve.serve,
    bench.bench,
    eval.eval_group,
    inspect.inspect,
    profile.profile,
):
    main.add_command(_command)

if __name__ == "__main__":
    main()
