"""The ``sao`` command.

Sub-commands: ``demo``, ``bench``, ``sql``, ``lake``; training and replay join as their parts land.
Bad arguments exit with code 2 and a one-line reason, never a traceback.
"""

from __future__ import annotations

import importlib
import sys

import typer

from sao.cli_common import HELP_MARKUP, fail
from sao.lake.cli import lake_app, sql
from sao.runs_cli import config_app, demo, train
from sao.train.cli import replay
from sao.ui_cli import ui

app = typer.Typer(
    name="sao",
    help="Single-rollout asynchronous RL with every trajectory in Delta Lake.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode=HELP_MARKUP,
)

# `sao bench NAME [ARGS...]` runs `benchmarks/<module>.py`'s `main(argv)`. One line per benchmark.
BENCHMARKS: dict[str, str] = {
    "lake": "lake_ingest",
    "longrun": "long_run",
    "learning": "learning",
    "online": "online",
    "quality": "quality",
    "routing": "routing",
    "scale": "scale_model",
    "rollout": "rollout",
    "endpoint": "endpoint",
    "sft": "sft_warmstart",
    "peer": "peer",
    "update": "update_floor",
    "speed": "speed",
    "bias": "bias",
    "demo": "demo",
    "fresh": "fresh_clone",
    "gpu-check": "gpu_check",
}


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def bench(ctx: typer.Context, name: str = typer.Argument("--help", help="Benchmark to run.")) -> None:
    """Run a benchmark from benchmarks/: `sao bench NAME [ARGS]`; `sao bench NAME --help` lists its options."""
    if name in ("--help", "-h"):
        typer.echo("Usage: sao bench NAME [ARGS]...\n\nRun a benchmark; results go to docs/RESULTS.md.\n")
        typer.echo("Benchmarks: " + ", ".join(sorted(BENCHMARKS)))
        typer.echo("`sao bench NAME --help` lists a benchmark's options.")
        raise typer.Exit(0)
    if name not in BENCHMARKS:
        known = ", ".join(sorted(BENCHMARKS)) or "none yet"
        raise fail(f"unknown benchmark {name!r}; known: {known}")
    module = importlib.import_module(f"benchmarks.{BENCHMARKS[name]}")
    code = module.main(list(ctx.args))
    raise typer.Exit(code or 0)


# Training runs: `sao train` and `sao demo` (sao/runs_cli.py), both through the Prefect flow `train`.
app.command()(train)
app.command()(demo)
app.add_typer(config_app, name="config")

# The lake: `sao sql "<query>"` and `sao lake tables|versions|counts|examples|compact|vacuum`
# (sao/lake/cli.py).
app.command()(sql)
app.add_typer(lake_app, name="lake")

# `sao replay --run R --step N | --steps N:M` and `sao replay --trajectory ID` (sao/train/cli.py).
app.command()(replay)
# `sao ui`: a local Prefect server and the flows served (sao/ui_cli.py).
app.command()(ui)


def main() -> None:  # pragma: no cover - console entry point
    app(prog_name="sao")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
