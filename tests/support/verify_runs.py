"""`regen verify` as the tests call it: its exit code and JSON report, and the report's errors as a set."""

from __future__ import annotations

import json

from click.testing import CliRunner

from app.cli import main


def run_verify(root, run_id="synth", *extra):
    result = CliRunner().invoke(main, ["verify", run_id, "--storage", str(root), "--json", *extra])
    try:
        return result.exit_code, json.loads(result.stdout)
    except ValueError:
        raise AssertionError(f"exit {result.exit_code}, not JSON:\n{result.output[-3000:]}") from result.exception


def kinds(report: dict) -> set[tuple[str, str | None, str | None]]:
    return {(p["kind"], p["shard"], p["sample"]) for p in report["problems"] if p["severity"] == "error"}
