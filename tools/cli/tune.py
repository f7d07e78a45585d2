"""`llmc tune`: time each kernel's tunable configurations on this machine and write the winners to the tuning
database (llmc.tools.tuning.tuner does the work)."""

from __future__ import annotations

from pathlib import Path

import click

from .options import PathKind, config_text, quant_options


@click.command()
@click.option("--target", default="cpu", show_default=True, help="The target whose kernels to tune.")
@click.option(
    "--model",
    "model",
    type=click.Path(path_type=Path),
    default=None,
    help="Tune the kernels compile renders for this checkpoint (with --dtype and --quant) "
    "[default: a standard set of Llama-family GEMM shapes].",
)
@click.option(
    "--shape",
    "shape_texts",
    multiple=True,
    help="Tune this kernel shape only, e.g. gemm:n=576,k=576,wdtype=bf16 (repeatable).",
)
@click.option(
    "--dtype",
    "weight_dtype",
    type=click.Choice(["auto", "float32", "bfloat16"]),
    default="auto",
    show_default=True,
    help="With --model: the weight dtype compile would use.",
)
@quant_options
@click.option(
    "--simulate",
    is_flag=True,
    help="GPU target, no GPU: rank candidates by the time llmc profile --simulate predicts "
    "(entries marked simulated; measured ones replace them).",
)
@click.option(
    "--budget",
    type=click.FloatRange(min=0),
    default=600,
    show_default=True,
    help="Seconds to spend (a number, inf for no limit); shapes left when it runs out stay untuned (run "
    "again to resume).",
)
@click.option(
    "--rounds",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Timed rounds per candidate (interleaved); each figure is their median.",
)
@click.option(
    "--db",
    type=PathKind("output file"),
    default=None,
    help="The tuning database to update, or to create in a directory that exists; not a symlink "
    "[default: targets/<target>.tuning.json].",
)
@click.option("--retune", is_flag=True, help="Run shapes again that already have entries for this machine.")
def tune(
    target: str,
    model: Path | None,
    shape_texts: tuple[str, ...],
    weight_dtype: str,
    quant,
    simulate: bool,
    budget: float,
    rounds: int,
    db: Path | None,
    retune: bool,
) -> None:
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
            rows.append([str(r.shape), config_text(r.config), "", "", "(already tuned)", ""])
            continue
        rejected = sum(c.rejected is not None for c in r.candidates)
        rows.append(
            [
                str(r.shape),
                config_text(r.config),
                f"{r.default_time_s * 1e6:.2f}",
                f"{r.time_s * 1e6:.2f}",
                f"{r.default_time_s / r.time_s:.2f}x",
                f"{rejected}/{len(r.candidates)}",
            ]
        )
    from llmc.runtime.bench import align_columns

    click.echo("\n".join(align_columns(rows)))
    left = len(shapes) - len(results)
    written = any(not r.skipped for r in results)  # the database is saved after each shape tuned
    click.echo(
        (f"wrote {database.path}" if written else f"nothing tuned: {database.path} not written")
        + (f"; {left} shapes left untuned (budget): run again to resume" if left else "")
    )
