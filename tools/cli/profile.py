"""`llmc profile`: one decode or prefill step of an artifact, per kernel against its floor (llmc.tools.profile)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


@click.command()
@click.argument("artifact", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--simulate", is_flag=True, help="Run the step under the CUDA simulator's counters (no GPU needed).")
@click.option("--phase", type=click.Choice(["decode", "prefill"]), default="decode", show_default=True)
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True, help="Decode: sequences.")
@click.option(
    "--context",
    type=click.IntRange(min=0),
    default=1024,
    show_default=True,
    help="Decode: tokens already in each sequence's KV cache.",
)
@click.option("--prompt-len", type=click.IntRange(min=1), default=256, show_default=True, help="Prefill: tokens.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the step's random token ids.")
@click.option(
    "--repeats",
    type=click.IntRange(min=1),
    default=10,
    show_default=True,
    help="Without --simulate: timed steps (after two warm-up steps); each kernel's time is the median.",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object: step and kernels.")
def profile(
    artifact: Path,
    simulate: bool,
    phase: str,
    batch: int,
    context: int,
    prompt_len: int,
    seed: int,
    repeats: int,
    as_json: bool,
) -> None:
    """One decode or prefill step of ARTIFACT, per kernel against its floor (the bytes it must move and the
    FLOPs it must do). A CUDA artifact on its GPU: each kernel timed with CUDA events, floors at the target's
    ceilings. A CPU artifact: each kernel timed on the host, floors at this host's bandwidth and peak rates,
    measured first. --simulate (CUDA): bytes, DRAM sectors, sector efficiency, bank conflicts and tensor-core
    instructions counted, the time predicted from them."""
    from llmc.tools.profile import profile_simulated
    from llmc.tools.profile_measured import profile_measured
    from llmc.tools.profile_table import format_table

    stages = ("build", "load", "run") if simulate else ("ceilings", "load", "run")
    labels = {
        "build": "building the profiling library",
        "ceilings": "the ceilings (a CPU: measured)",
        "load": "loading",
        "run": f"running one {phase} step" if simulate else f"timing {repeats} {phase} steps",
    }
    with click.progressbar(length=len(stages), label="profile", file=sys.stderr, item_show_func=lambda s: s) as bar:
        done = []

        def progress(stage: str) -> None:
            if done:
                bar.update(1)
            done.append(stage)
            bar.label = f"profile: {labels[stage]}"
            bar.render_progress()

        if simulate:
            report = profile_simulated(
                artifact, phase=phase, batch=batch, context=context, prompt_len=prompt_len, seed=seed, progress=progress
            )
        else:
            report = profile_measured(
                artifact,
                phase=phase,
                batch=batch,
                context=context,
                prompt_len=prompt_len,
                seed=seed,
                repeats=repeats,
                progress=progress,
            )
        bar.update(1)
    click.echo(json.dumps(report) if as_json else format_table(report))
