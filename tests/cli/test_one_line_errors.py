"""Every command answers bad input in one line and exit status 2, before it writes anything: each of its required
parts left out in turn, and every option given a malformed value (a number out of its bounds or not a number, a
broker or storage URL without scheme, host or a valid port, an unknown choice). The cases are derived from the
commands' own parameters, so an option added later is walked too; REQUIRED lists each command's required parts
(click's `required=True` ones are checked to be in it, so the table cannot fall behind)."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from app.cli import main
from app.cli.options import BrokerURL, StorageRoot

RUN = "r1"
MODEL = "/nonexistent/model"  # never read: each case fails on the command line before the command runs

# Each command's required parts (argument or option with its value), as a minimal command line; a part that
# click does not require but the command does (produce's INPUTS, worker's --model or --run) is listed too.
REQUIRED: dict[str, list[list[str]]] = {
    "produce": [["in.jsonl"]],
    "run": [["in.jsonl"], ["--model", MODEL]],
    "pilot": [["in.jsonl"], ["--model", MODEL]],
    "worker": [["--model", MODEL]],
    "reconcile": [[RUN], ["--storage", "STORAGE"]],
    "retry-dead": [[RUN], ["--storage", "STORAGE"]],
    "resume-run": [[RUN], ["--storage", "STORAGE"]],
    "status": [["--storage", "STORAGE"]],
    "metrics": [["--storage", "STORAGE"]],
    "verify": [[RUN], ["--storage", "STORAGE"]],
    "stats": [[RUN], ["--storage", "STORAGE"]],
    "export": [[RUN], ["--storage", "STORAGE"], ["--format", "sharegpt"], ["--out", "OUT"]],
    "tiny-model": [["OUT"]],
    "selfcheck": [],
}


def _argv(command: str, tmp_path, without: int | None = None) -> list[str]:
    parts = [p for k, p in enumerate(REQUIRED[command]) if k != without]
    return [command, *(str(tmp_path / t) if t in ("STORAGE", "OUT") else t for part in parts for t in part)]


def _one_line(result, tmp_path) -> str:
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("regen: error: "), result.stderr
    assert not any(tmp_path.iterdir()), f"{list(tmp_path.iterdir())} written before the error"
    return lines[0]


def test_every_command_is_in_the_table_with_every_part_click_requires():
    assert set(REQUIRED) == set(main.commands)
    for name, command in main.commands.items():
        given = {t for part in REQUIRED[name] for t in part}
        for p in command.params:
            if p.required and isinstance(p, click.Option):
                assert p.opts[0] in given, f"regen {name}: {p.opts[0]} is required but not in REQUIRED"
        arguments = [p for p in command.params if isinstance(p, click.Argument) and p.required]
        assert len(arguments) <= len([part for part in REQUIRED[name] if not part[0].startswith("-")]), name


CASES = [(name, k) for name in sorted(REQUIRED) for k in range(len(REQUIRED[name]))]


@pytest.mark.parametrize(("command", "part"), CASES, ids=[f"{c}-without-{REQUIRED[c][k][0]}" for c, k in CASES])
def test_a_missing_required_part_is_one_line(command, part, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in ("REGEN_STORAGE", "REGEN_MODEL", "REGEN_BROKER_URL"):
        monkeypatch.delenv(name, raising=False)
    result = CliRunner().invoke(main, _argv(command, tmp_path, without=part))
    line = _one_line(result, tmp_path)
    missing = REQUIRED[command][part][0]
    named = missing if missing.startswith("--") else None
    assert named is None or named in line or "--run" in line, line  # worker: "give --model PATH or --run RUN"


def _malformed(param: click.Parameter) -> list[str]:
    """Values the parameter's type must refuse."""
    t = param.type
    if isinstance(t, BrokerURL):
        return ["127.0.0.1:6379", "redis://", "redis://host:99999/0", "redis://host:port/0", "ftp://host/0"]
    if isinstance(t, StorageRoot):
        return ["", "s3://", "nosuch://bucket/runs"]
    if isinstance(t, click.IntRange | click.FloatRange):
        bad = ["not-a-number"]
        if t.min is not None:
            bad.append(str(t.min - 1 if isinstance(t, click.IntRange) else t.min - 0.5))
        if t.max is not None:
            bad.append(str(t.max + 1 if isinstance(t, click.IntRange) else t.max + 0.5))
        return bad
    if t in (click.INT, click.FLOAT):
        return ["not-a-number"]
    if isinstance(t, click.Choice):
        return ["no-such-choice"]
    return []


MALFORMED = [(name, p.opts[0], value) for name, command in sorted(main.commands.items()) for p in command.params
             if isinstance(p, click.Option) and not p.hidden for value in _malformed(p)]


def test_every_number_url_and_choice_option_is_walked():
    """The walk covers what it should: each command's bounded numbers, URLs and choices, none unbounded."""
    walked = {(c, o) for c, o, _ in MALFORMED}
    assert ("produce", "--broker") in walked and ("worker", "--broker") in walked and ("status", "--broker") in walked
    assert ("produce", "--max-tokens") in walked and ("run", "--max-tokens") in walked
    assert ("verify", "--storage") in walked and ("export", "--out") in walked
    for name, command in main.commands.items():
        for p in command.params:
            if isinstance(p, click.Option) and p.type in (click.INT, click.FLOAT) and not p.hidden:
                pytest.fail(f"regen {name} {p.opts[0]}: a number without bounds (click.IntRange / FloatRange)")


@pytest.mark.parametrize(("command", "option", "value"), MALFORMED,
                         ids=[f"{c}{o}={v or 'empty'}" for c, o, v in MALFORMED])
def test_a_malformed_value_is_one_line_naming_the_option(command, option, value, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, [*_argv(command, tmp_path), option, value])
    line = _one_line(result, tmp_path)
    assert option in line, line


def test_a_broker_url_in_the_environment_is_held_to_the_same_rules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("REGEN_BROKER_URL", "redis://:secret@host:99999/0")
    line = _one_line(CliRunner().invoke(main, ["status", "--storage", str(tmp_path / "s")]), tmp_path)
    assert "port" in line and "secret" not in line, line


def test_the_response_cap_and_the_context_are_bounded_by_the_model(tiny_qwen3, tmp_path, monkeypatch):
    """`--max-tokens` and `--max-model-len` beyond the model's max_position_embeddings: one line, nothing written."""
    monkeypatch.chdir(tmp_path)
    inputs = tmp_path.parent / f"{tmp_path.name}-in.jsonl"
    inputs.write_text('{"prompt": "hi"}\n')
    storage = str(tmp_path / "s")
    for argv in (["produce", str(inputs), "--model", str(tiny_qwen3), "--storage", storage, "--max-tokens", "99999999"],
                 ["run", str(inputs), "--model", str(tiny_qwen3), "--storage", storage, "--cpu", "--max-tokens",
                  "99999999"],
                 ["run", str(inputs), "--model", str(tiny_qwen3), "--storage", storage, "--cpu", "--max-model-len",
                  "99999999"],
                 ["worker", "--cpu", "--model", str(tiny_qwen3), "--max-model-len", "99999999"],
                 ["pilot", str(inputs), "--model", str(tiny_qwen3), "--storage", storage, "--cpu", "--max-tokens",
                  "99999999"]):
        line = _one_line(CliRunner().invoke(main, argv), tmp_path)
        assert "99,999,999" in line and "max_position_embeddings" in line, (argv, line)


def test_a_renamed_option_still_works_and_says_its_new_name(tmp_path):
    result = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "m"), "--layers", "2"])
    assert result.exit_code == 0, result.output
    assert "regen: --layers is deprecated: use --num-layers" in result.stderr
    assert '"num_hidden_layers": 2' in (tmp_path / "m" / "config.json").read_text()
    both = CliRunner().invoke(main, ["tiny-model", str(tmp_path / "n"), "--layers", "2", "--num-layers", "3"])
    assert both.exit_code == 2 and "give --num-layers only" in both.stderr


def test_a_file_option_naming_a_missing_file_is_one_line(tmp_path):
    result = CliRunner().invoke(main, ["pilot", "--forecast-only", str(tmp_path / "missing.json")])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
