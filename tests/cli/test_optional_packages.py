"""A command that needs an optional package (pyproject.toml's extras) checks for it when it starts: a missing one
is one line with the pip command, before anything is read or written (app/base/packages.py). The package is made
missing the way Python sees an uninstalled one: `sys.modules[name] = None` makes its import fail."""

from __future__ import annotations

import subprocess
import sys

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.synthetic_run import Spec, build_run


def regen(*args) -> tuple[int, list[str]]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.output.strip().splitlines()


def test_stats_html_without_matplotlib_is_refused_before_reading_the_run(tmp_path, monkeypatch):
    build_run(tmp_path / "s", Spec())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    html = tmp_path / "report.html"
    code, lines = regen("stats", "synth", "--storage", str(tmp_path / "s"), "--html", str(html))
    assert (code, lines) == (2, ["regen: error: regen stats --html needs matplotlib: pip install 'matplotlib>=3.8'"])
    assert not html.exists()


def test_stats_without_html_does_not_need_matplotlib(tmp_path, monkeypatch):
    build_run(tmp_path / "s", Spec())
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    code, lines = regen("stats", "synth", "--storage", str(tmp_path / "s"), "--json")
    assert code == 0, lines


def test_verify_reference_without_torch_is_refused_at_the_start(tmp_path, monkeypatch):
    build_run(tmp_path / "s", Spec())
    monkeypatch.setitem(sys.modules, "torch", None)
    code, lines = regen("verify", "synth", "--storage", str(tmp_path / "s"), "--reference", "2")
    assert (code, lines) == (2, ["regen: error: regen verify --reference needs torch: pip install 'torch'"])


@pytest.mark.parametrize("fmt", ["specforge-dflash", "specforge-online"])
def test_a_torch_written_export_without_torch_is_refused_before_its_output_exists(tmp_path, monkeypatch, fmt):
    build_run(tmp_path / "s", Spec())
    monkeypatch.setitem(sys.modules, "torch", None)
    code, lines = regen("export", "synth", "--storage", str(tmp_path / "s"), "--format", fmt,
                        "--out", str(tmp_path / "out"))
    assert (code, lines) == (2, [f"regen: error: regen export --format {fmt} needs torch: pip install 'torch'"])
    assert not (tmp_path / "out").exists()


def test_s3_storage_without_s3fs_names_the_package(tmp_path):
    """In a fresh process: fsspec remembers a protocol's class once any test here has imported it."""
    code = ("import sys; sys.modules['s3fs'] = None\n"
            "from app.cli import main\n"
            "main(['stats', 'some-run', '--storage', 's3://bucket/regen'])")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "regen: error: storage s3://bucket/regen: Install s3fs to access S3 (pip install 's3fs>=2024.12')"]
