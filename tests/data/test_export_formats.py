"""One list of export formats (app/data/export_formats.py): the CLI's choices, the exporter's writers, the docs'
tables and the README's are held to it, and a format's missing optional package stops an export before any work."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from app.cli.data import export_cmd
from app.data import export_formats
from app.data.export_formats import FORMATS, STATES, TEXT, TOKENS
from tests.support.synthetic_run import Spec, build_run

ROOT = Path(__file__).resolve().parents[2]
FORMATS_MD = (ROOT / "docs" / "formats.md").read_text()


def tables(markdown: str) -> list[list[list[str]]]:
    """Every table of a markdown text: rows of cells, the header first (the `|---|` line dropped)."""
    out, rows = [], []
    for line in [*markdown.splitlines(), ""]:
        if re.fullmatch(r"\|[-|: ]+", line.strip()):
            continue
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
        elif rows:
            out.append(rows)
            rows = []
    return out


def test_the_cli_offers_exactly_the_listed_formats_in_their_order():
    choice = next(p for p in export_cmd.params if p.name == "fmt").type
    assert list(choice.choices) == list(FORMATS) == export_formats.names()
    assert len(FORMATS) == 8 and {f.kind for f in FORMATS.values()} == {TEXT, STATES, TOKENS}


def test_the_docs_summary_table_is_the_one_the_list_prints():
    begin, end = "<!-- export formats: begin -->\n", "<!-- export formats: end -->"
    shown = FORMATS_MD[FORMATS_MD.index(begin) + len(begin):FORMATS_MD.index(end)]
    assert shown == export_formats.markdown_table(), "run `python -m app.data.export_formats` and paste its table"


def test_the_docs_detail_tables_describe_each_format_once():
    """The text, hidden-state and token-only tables of docs/formats.md, one row per format, none missing."""
    summary_end = FORMATS_MD.index("<!-- export formats: end -->")
    named = []
    for table in tables(FORMATS_MD[summary_end:]):
        if table[0][0] in ("format", "`--format`"):
            named += [re.fullmatch(r"`([a-z0-9-]+)`", row[0])[1] for row in table[1:]]
    assert sorted(named) == sorted(FORMATS)


def test_the_readme_formats_table_names_every_format_once():
    readme = (ROOT / "README.md").read_text()
    named = [name for table in tables(readme) for row in table[1:] if row[1] == "`regen export --format`"
             for name in re.findall(r"`([a-z0-9-]+)`", row[0].split(":")[0])]
    assert sorted(named) == sorted(FORMATS)


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_format_has_the_writer_its_kind_needs(name):
    fmt = FORMATS[name]
    if fmt.kind == TEXT:
        assert fmt.writer is None and not fmt.needs_states
        with pytest.raises(ValueError):
            fmt.writer_class()
        return
    cls = fmt.writer_class()
    assert cls.name == name and cls.needs_states is fmt.needs_states is (fmt.kind == STATES)
    assert ("model_path" in cls.__init__.__code__.co_varnames) is fmt.final_norm


def test_each_format_s_one_file_is_the_one_its_writer_writes():
    from app.data.export_online import PROMPTS_FILE
    from app.data.export_text import SPECFORGE_FILE

    assert {n: f.file for n, f in FORMATS.items() if f.file} == {"specforge-jsonl": SPECFORGE_FILE,
                                                                 "specforge-online": PROMPTS_FILE}


def test_an_unknown_format_is_one_line_naming_the_known_ones():
    with pytest.raises(export_formats.ConfigError, match="unknown export format 'csv' .one of sharegpt, parquet"):
        export_formats.get("csv")


@pytest.mark.parametrize(("fmt", "missing", "pip"), [("parquet", "pyarrow", "pip install 'pyarrow>=15'"),
                                                      ("speculators-online", "datasets", "pip install 'datasets>=3'")])
def test_a_missing_optional_package_stops_the_export_before_any_work(tmp_path, monkeypatch, fmt, missing, pip):
    build_run(tmp_path / "s", Spec())
    monkeypatch.setitem(sys.modules, missing, None)  # what Python does when the package is not installed
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["export", "synth", "--storage", str(tmp_path / "s"), "--format", fmt,
                                       "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [f"regen: error: regen export --format {fmt} needs {missing}: {pip}"]
    assert not out.exists()  # nothing written: not even the export's pin
