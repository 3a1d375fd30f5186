"""The `regen` console script: one click group, the only place where commands are assembled.

Each module here holds the commands of one floor below it: `produce` (producer/), `worker` and `run` (workers/;
`run` drives the producer too), `ops` (app/ops/), `data` (app/data/); `pilot` measures a host with `regen run`s.

Each command runs with its settings read from the environment once, on first use, so `--help` reads nothing
(app.base.config); shared flags are defined once in app.cli.options, and each command's help groups its options
in the panels app.cli.help_panels declares (rich-click renders them). Bad input gets one line and exit status 2,
whether click finds it (a missing option, a malformed value) or regen does (`RegenError`); a failure that is not
bad input (a run that timed out or paused) one line and exit status 1; a traceback means a bug. The subcommands'
modules are imported at the top; vLLM, torch and the other heavy packages are imported only inside the functions
that use them (tests/test_layout.py lists those lazy imports), so `regen --help` never imports vLLM or torch.
"""

from __future__ import annotations

import sys

import click as plain_click
import rich_click as click

from app.base.config import mask_text
from app.base.config import scope as settings_scope
from app.base.errors import RegenError
from app.cli.data import commands as data_commands
from app.cli.help_panels import command_groups, option_groups
from app.cli.ops import commands as ops_commands
from app.cli.pilot import pilot  # runs `regen run` per candidate and reads the runs back (app.pilot)
from app.cli.produce import commands as producer_commands
from app.cli.run import run  # drives both the producer and the workers, so it is assembled here
from app.cli.selfcheck import selfcheck  # engines (workers) judged by transformers (data)
from app.cli.worker import commands as worker_commands

NAME = "regen"


def _one_line(text: str) -> str:
    return " ".join(mask_text(str(text)).split())


def error_line(exc: plain_click.ClickException, ctx: plain_click.Context | None) -> str:
    """A click error as one line: its message, and for bad usage where to read the command's options."""
    line = f"{NAME}: error: {_one_line(exc.format_message())}"
    where = exc.ctx if isinstance(exc, plain_click.UsageError) and exc.ctx is not None else None
    if where is not None:
        line += f" (see {where.command_path} --help)"
    return line


class RegenGroup(click.RichGroup):
    def invoke(self, ctx):
        try:
            with settings_scope():  # the command's settings: the environment, read once on first use
                return super().invoke(ctx)
        except RegenError as exc:
            click.echo(f"{NAME}: error: {_one_line(exc)}", err=True)
            sys.exit(2)

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        """click's standalone mode, with every error on one line (click's own print a usage block and a hint)."""
        if not standalone_mode:
            return super().main(args, prog_name or NAME, complete_var, standalone_mode=False, **extra)
        try:
            rv = super().main(args, prog_name or NAME, complete_var, standalone_mode=False, **extra)
        except plain_click.exceptions.NoArgsIsHelpError as exc:  # `regen` alone: the help, as click prints it
            click.echo(exc.message)
            sys.exit(exc.exit_code)
        except plain_click.ClickException as exc:
            click.echo(error_line(exc, None), err=True)
            sys.exit(exc.exit_code)
        except plain_click.Abort:
            click.echo(f"{NAME}: aborted", err=True)
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


HELP = click.RichHelpConfiguration(
    option_groups=option_groups(NAME), command_groups=command_groups(NAME), text_markup="plain", max_width=120,
    # the metavar after the help text, not in a column of its own: the help keeps the width
    options_table_column_types=["required", "opt_short", "opt_long", "help"],
    options_table_help_sections=["help", "deprecated", "envvar", "default", "required", "metavar"])


@click.group(NAME, cls=RegenGroup, context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.rich_config(help_config=HELP)
@click.version_option(package_name="regen")
def main() -> None:
    """Regenerate drafter training data (thinking-mode generation + hidden states) with a Celery/Redis fleet."""


def _register() -> None:
    for command in (*producer_commands, *worker_commands, run, pilot, selfcheck, *ops_commands, *data_commands):
        main.add_command(command)


_register()
