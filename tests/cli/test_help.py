"""Every command's help groups its options by purpose (app.cli.help_panels, rendered by rich-click), and every
option has a help text and says its default. An option added to a command without a panel or a help text fails
here, naming it: a merge cannot leave one ungrouped."""

from __future__ import annotations

import re

import click
import pytest
from click.testing import CliRunner

from app.cli import main
from app.cli.help_panels import COMMANDS as COMMAND_PANELS
from app.cli.help_panels import PANELS, grouped

COMMANDS = sorted(main.commands)


def _options(command: click.Command) -> list[click.Option]:
    return [p for p in command.params if isinstance(p, click.Option) and not p.hidden]


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_is_in_a_panel_and_every_panel_names_real_options(name):
    command = main.commands[name]
    flags = {p.opts[0] for p in _options(command)}
    assert not flags - grouped(name), f"regen {name}: options in no panel of app/cli/help_panels.py"
    assert not grouped(name) - flags, f"regen {name}: panels name options the command does not have"
    listed = [flag for _, options in PANELS.get(name, []) for flag in options]
    assert len(listed) == len(set(listed)), f"regen {name}: an option in two panels"


@pytest.mark.parametrize("name", COMMANDS)
def test_every_option_has_a_help_text_and_its_default(name):
    for p in _options(main.commands[name]):
        assert p.help and p.help.strip(), f"regen {name} {p.opts[0]}: no help text"
        shown = p.show_default is not False and p.default not in (None, ()) and not p.is_flag
        says = re.search(r"default", p.help, re.I)
        assert p.is_flag or p.multiple or p.required or shown or says, \
            f"regen {name} {p.opts[0]}: the help says no default (show_default, or '[default: ...]' in words)"


@pytest.mark.parametrize("name", COMMANDS)
def test_the_help_shows_the_panels_and_no_ungrouped_options(name):
    result = CliRunner().invoke(main, [name, "--help"], terminal_width=120)
    assert result.exit_code == 0, result.output
    for title, _ in PANELS.get(name, []):
        assert f"─ {title} " in result.output, f"regen {name} --help has no panel {title!r}"
    assert "─ Options " not in result.output, f"regen {name} --help lists options outside the panels"
    for p in _options(main.commands[name]):
        assert p.opts[0] in result.output, p.opts[0]


def test_the_top_level_help_lists_every_command_in_a_panel():
    listed = [c for _, commands in COMMAND_PANELS for c in commands]
    assert sorted(listed) == COMMANDS and len(listed) == len(set(listed))
    result = CliRunner().invoke(main, ["--help"], terminal_width=120)
    assert result.exit_code == 0 and "─ Commands " not in result.output
    for title, _ in COMMAND_PANELS:
        assert f"─ {title} " in result.output


def test_one_name_per_concept_across_commands():
    """The flags that name one thing are spelled one way: a queue is --queue, a sample size --sample, a run RUN."""
    for name, command in main.commands.items():
        flags = {o for p in _options(command) for o in p.opts}
        assert "--queues" not in flags and "--samples" not in flags, name
        for p in command.params:
            if isinstance(p, click.Argument) and p.name == "run_id":
                assert p.metavar in ("RUN", "[RUN]"), f"regen {name}: its run argument is {p.metavar!r}"
    assert "--layers" not in {o for p in _options(main.commands["tiny-model"]) for o in p.opts}  # capture layers
