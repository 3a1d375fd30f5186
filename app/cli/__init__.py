"""The `regen` console script: one click group, the only place where commands are assembled.

Each module here holds the commands of one floor below it: `produce` (producer/), `worker` and `run` (workers/;
`run` drives the producer too), `ops` (app/ops/), `data` (app/data/); `pilot` measures a host with `regen run`s.

Each command runs with its settings read from the environment once, on first use, so `--help` reads nothing
(app.settings); shared flags are defined once in app.cli.options. Errors regen raises on purpose
(`RegenError`) are printed as one line and exit with status 2; a traceback means a bug. The subcommands'
modules are imported at the top; vLLM, torch and the other heavy packages are imported only inside the functions
that use them (tests/test_layout.py lists those lazy imports), so `regen --help` never imports vLLM or torch.
"""

from __future__ import annotations

import sys

import click

from app.cli.data import commands as data_commands
from app.cli.ops import commands as ops_commands
from app.cli.pilot import pilot  # runs `regen run` per candidate and reads the runs back (app.pilot)
from app.cli.produce import commands as producer_commands
from app.cli.run import run  # drives both the producer and the workers, so it is assembled here
from app.cli.selfcheck import selfcheck  # engines (workers) judged by transformers (data)
from app.cli.worker import commands as worker_commands
from app.errors import RegenError
from app.settings import mask_text
from app.settings import scope as settings_scope


class RegenGroup(click.Group):
    def invoke(self, ctx):
        try:
            with settings_scope():  # the command's settings: the environment, read once on first use
                return super().invoke(ctx)
        except RegenError as exc:
            click.echo(f"regen: error: {mask_text(str(exc))}", err=True)
            sys.exit(2)


@click.group(cls=RegenGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="regen")
def main() -> None:
    """Regenerate drafter training data (thinking-mode generation + hidden states) with a Celery/Redis fleet."""


def _register() -> None:
    for command in (*producer_commands, *worker_commands, run, pilot, selfcheck, *ops_commands, *data_commands):
        main.add_command(command)


_register()

