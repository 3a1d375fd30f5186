"""Nothing in the repository reads a path outside it: a user's clone is all they have.

The development machines and CI keep a `shared/` folder of notes and data beside the checkout, so a test that
reads from that folder (one level up, then into it) passes in CI and fails on every user's machine (it happened: the producer's format
fixtures). This test is the only thing that can catch the next one, so it reads every text file under the
packages, `tests/`, `bench/`, `scripts/`, `deploy/`, `.ci/` and `docs/`, and the README, and fails on:

- a mention of that folder or its notes (`shared/data`, `NOTES.md`, ...), in code, comments or docs alike;
- a Python path built from `__file__` that climbs above the repository root (`Path(__file__).parents[k]`,
  `.parent`, `os.path.dirname`, `".."` joins, and names bound to such paths, e.g. `REPO.parent`);
- a shell script whose `$(dirname "$0")/..` climbs above the repository root.

Each rule is also run on snippets that break it, so the test cannot pass by never matching.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("app", "producer", "workers", "tests", "bench", "scripts", "deploy", ".ci", "docs")
TOP_FILES = ("README.md", "pyproject.toml", "compose.yaml")
SKIP_PARTS = {"__pycache__", "build", "dist"}
UP = ".."  # spelled apart so this file does not match its own rules

# The folder beside the checkout and what it holds; `NOTES.md` / `STYLE.md` are its notes files.
OUTSIDE_NAMES = re.compile(
    r"(?:\.\./|/work/)shared\b"
    r"|\bshared/(?:data|design|hooks|NOTES\.md|STYLE\.md)\b"
    r"|\b(?:NOTES|STYLE)\.md\b"
    r"""|(?:\bparent|["']\.\.["'])\s*/\s*["']shared["']"""
)
SHELL_CLIMB = re.compile(r"""\$\(dirname\s+"?\$(?:0|\{BASH_SOURCE\[0\]\}|BASH_SOURCE)"?\)((?:/\.\.)+)""")


def text_files() -> list[Path]:
    out = [ROOT / name for name in TOP_FILES if (ROOT / name).is_file()]
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*")):
            if path.is_file() and not SKIP_PARTS & set(path.parts) and ".egg-info" not in str(path):
                out.append(path)
    return out


def read_text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None  # binary fixtures (.rgh) name no paths


def outside_mentions(text: str) -> list[tuple[int, str]]:
    """(line, match) for each mention of the folder beside the checkout or its notes."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in OUTSIDE_NAMES.finditer(text)]


def shell_climbs(text: str, depth: int) -> list[tuple[int, str]]:
    """(line, match) for each `$(dirname "$0")/..` that climbs more than `depth` folders (the script's own depth)."""
    return [(text.count("\n", 0, m.start()) + 1, m.group(0)) for m in SHELL_CLIMB.finditer(text)
            if m.group(1).count("..") > depth]


class _Climb(ast.NodeVisitor):
    """Tracks paths derived from `__file__` as a depth below the repository root; records those that go above it.

    Depth counts path components from the root: `tests/support/paths.py` is 3, its folder 2, the root 0, the
    folder beside the checkout -1. Flow-insensitive: a name keeps the last depth bound to it, which is all the
    module-level `REPO = Path(__file__).resolve().parents[k]` idiom needs.
    """

    KEEP = {"resolve", "absolute", "expanduser", "abspath", "realpath", "normpath", "Path", "PurePath", "str",
            "fspath"}

    def __init__(self, file_depth: int):
        self.file_depth = file_depth
        self.names: dict[str, int] = {}
        self.escapes: list[tuple[int, str]] = []

    def depth(self, node: ast.AST) -> int | None:
        """The depth `node` evaluates to, when it is a path derived from `__file__`; else None."""
        if isinstance(node, ast.Name):
            if not isinstance(node.ctx, ast.Load):
                return None  # the name being bound: its value is judged
            return self.file_depth if node.id == "__file__" else self.names.get(node.id)
        if isinstance(node, ast.Attribute):
            base = self.depth(node.value)
            return None if base is None else base - 1 if node.attr == "parent" else None
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents":
            base = self.depth(node.value.value)
            index = node.slice
            if base is not None and isinstance(index, ast.Constant) and isinstance(index.value, int):
                return base - 1 - index.value
            return None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            base = self.depth(node.left)
            return None if base is None else base if base < 0 else self.joined(base, [node.right])
        if isinstance(node, ast.Call):
            return self.call_depth(node)
        return None

    def call_depth(self, node: ast.Call) -> int | None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if isinstance(func, ast.Attribute) and name in self.KEEP and not node.args:
            return self.depth(func.value)  # Path(...).resolve()
        if not node.args:
            return None
        first = self.depth(node.args[0])
        if first is None:
            return None
        if name in self.KEEP:
            return first
        if name == "dirname":
            return first - 1
        if name in ("join", "joinpath"):
            return self.joined(first, node.args[1:])
        return None

    @staticmethod
    def joined(base: int, parts: list[ast.AST]) -> int | None:
        depth = base
        for part in parts:
            if not (isinstance(part, ast.Constant) and isinstance(part.value, str)):
                return depth  # a computed name descends at least one level: no climb to judge
            for component in part.value.split("/"):
                if component == UP:
                    depth -= 1
                    if depth < 0:
                        return depth  # outside, whatever it descends into after
                elif component not in ("", "."):
                    depth += 1
        return depth

    def generic_visit(self, node: ast.AST) -> None:
        depth = self.depth(node) if isinstance(node, ast.expr) else None
        if depth is not None and depth < 0:
            self.escapes.append((getattr(node, "lineno", 0), ast.unparse(node)))
            return  # one report per expression, not one per sub-expression
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = self.depth(node.value)
            if value is not None:
                self.names[node.targets[0].id] = value
        super().generic_visit(node)


def python_escapes(source: str, file_depth: int) -> list[tuple[int, str]]:
    visitor = _Climb(file_depth)
    visitor.visit(ast.parse(source))
    return visitor.escapes


def findings(path: Path) -> list[str]:
    text = read_text(path)
    if text is None:
        return []
    rel = path.relative_to(ROOT)
    # This file spells the patterns it looks for; it is still held to the path rules below.
    mentions = [] if path == Path(__file__).resolve() else outside_mentions(text)
    found = [f"line {line}: names {match!r}" for line, match in mentions]
    if path.suffix == ".py":
        found += [f"line {line}: `{expr}` climbs above the repository root"
                  for line, expr in python_escapes(text, len(rel.parts))]
    if path.suffix == ".sh" or text.startswith("#!") and "sh" in text.split("\n", 1)[0]:
        found += [f"line {line}: `{match}` climbs above the repository root"
                  for line, match in shell_climbs(text, len(rel.parts) - 1)]
    return [f"{rel}: {f}" for f in found]


def test_no_file_reads_or_names_a_path_outside_the_repository():
    files = text_files()
    assert len(files) > 100, "the scan found too few files to mean anything"
    problems = [problem for path in files for problem in findings(path)]
    assert not problems, "\n".join(problems)


# -- the rules break on what they must catch -----------------------------------------------------------------
@pytest.mark.parametrize("text", [
    f'FORMATS = REPO / "{UP}" / "shared" / "data"',
    f"see {UP}/shared/NOTES.md for the figures",
    "open('/work/" + "shared/data/formats/x.jsonl')",
    "measured facts: " + "NOTES" + ".md, section 3",
    "rows from shared/" + "data/formats",
])
def test_mentions_of_the_folder_beside_the_checkout_are_found(text):
    assert outside_mentions(text)


@pytest.mark.parametrize("text", ["shared storage holds the run", "a shared/ folder of the run's own", "notes.md"])
def test_ordinary_words_are_not_mentions(text):
    assert not outside_mentions(text)


@pytest.mark.parametrize(("source", "depth"), [
    ("REPO = Path(__file__).resolve().parents[2]\nX = REPO.parent / 'shared'", 3),
    ("X = Path(__file__).resolve().parents[3]", 3),
    ("X = Path(__file__).parent.parent.parent.parent", 3),
    (f"X = Path(__file__).parent / '{UP}' / '{UP}' / 'shared'", 2),
    ("import os\nX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))", 1),
    (f"import os\nROOT = os.path.dirname(__file__)\nX = os.path.join(ROOT, '{UP}/{UP}', 'data')", 2),
])
def test_python_paths_climbing_above_the_root_are_found(source, depth):
    assert python_escapes(source, depth)


@pytest.mark.parametrize(("source", "depth"), [
    ("REPO = Path(__file__).resolve().parents[2]\nX = REPO / 'tests' / 'fixtures'", 3),
    ("X = Path(__file__).parent.parent", 2),
    ("import os\nX = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))", 2),
    (f"X = Path(__file__).parent / '{UP}' / 'app'", 2),
    ("X = out.parent / 'hf-cache'", 3),
])
def test_python_paths_inside_the_repository_pass(source, depth):
    assert not python_escapes(source, depth)


def test_shell_climbs_are_judged_by_the_scripts_depth():
    assert shell_climbs(f'cd "$(dirname "$0")/{UP}"', depth=1) == []
    assert shell_climbs(f'cd "$(dirname "$0")/{UP}/{UP}/shared"', depth=1)
    assert shell_climbs(f'cd "$(dirname "${{BASH_SOURCE[0]}}")/{UP}/{UP}"', depth=1)
