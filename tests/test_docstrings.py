"""Docstrings say why in a few lines, and the docs they link to still hold the heading they name.

A module's docstring says what the module holds and why; measurements, history and long reference move to
docs/ under a heading, and the docstring links it as `docs/<file>.md#<anchor>` (GitHub's anchor of the
heading). So every module of the product opens with at most `LIMIT` lines, and every such link in any
docstring of the project resolves: the file exists and one of its headings has that anchor.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("app", "producer", "workers", "deploy")
LIMIT = 12

# Modules whose docstrings may not yet be short (none: the list may only shrink).
NOT_YET: set[str] = set()

# A docstring that is itself the reference, with the most lines it may take and why it is kept in code.
REFERENCE = {
    "app/base/storage.py": (24, "the storage layout, described once where RunStore owns it (issue 46, item 1)"),
}

LINK = re.compile(r"docs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?")


def product_modules() -> list[Path]:
    return sorted(path for package in PRODUCT for path in (ROOT / package).rglob("*.py"))


def module_docstring_lines(path: Path) -> int:
    text = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")), clean=False)
    return len(text.splitlines()) if text else 0


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, each space a hyphen."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Every heading's anchor in a Markdown text (headings inside code fences are not headings)."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6} +(.+?) *#* *$", line)
        if fenced or not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def docstrings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the module's docstring and every class's and function's in it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                out.append((node.body[0].lineno, text))
    return out


def broken_links(text: str, docs: Path) -> list[str]:
    problems = []
    for name, anchor in LINK.findall(text):
        target = docs / name
        if not target.is_file():
            problems.append(f"docs/{name}: no such file")
        elif anchor and anchor not in anchors(target.read_text(encoding="utf-8")):
            problems.append(f"docs/{name}#{anchor}: no heading with that anchor")
    return problems


def test_module_docstrings_are_short():
    too_long = []
    for path in product_modules():
        rel = path.relative_to(ROOT).as_posix()
        if rel in NOT_YET:
            continue
        limit = REFERENCE.get(rel, (LIMIT, ""))[0]
        lines = module_docstring_lines(path)
        if lines > limit:
            too_long.append(f"{rel}: {lines} lines (at most {limit}; the rest belongs in docs/, linked)")
    assert not too_long, "\n".join(too_long)


def test_exempt_lists_name_real_modules_still_over_the_limit():
    """An entry that no longer needs its exemption is taken off the list, so the lists only shrink."""
    stale = []
    for rel in NOT_YET:
        if not (ROOT / rel).is_file() or module_docstring_lines(ROOT / rel) <= LIMIT:
            stale.append(f"{rel}: gone or already short; remove it from NOT_YET")
    for rel in REFERENCE:
        if not (ROOT / rel).is_file() or module_docstring_lines(ROOT / rel) <= LIMIT:
            stale.append(f"{rel}: gone or already short; remove it from REFERENCE")
    assert not stale, "\n".join(stale)


def test_docstring_links_to_docs_resolve():
    broken = []
    sources = [p for p in ROOT.rglob("*.py") if not ({".git", ".venv", "node_modules"} & set(p.parts))]
    for path in sorted(sources):
        for line, text in docstrings(path):
            broken += [f"{path.relative_to(ROOT)}:{line}: {p}" for p in broken_links(text, ROOT / "docs")]
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Fanning out an export (`--processes`, `--part`)", "fanning-out-an-export---processes---part"),
        ("Flower's own Celery app", "flowers-own-celery-app"),
        ("Side threads on the CPU: SCHED_BATCH at nice 19", "side-threads-on-the-cpu-sched_batch-at-nice-19"),
        ("How compose.yaml is generated", "how-composeyaml-is-generated"),
    ],
)
def test_slug_is_githubs(heading, anchor):
    assert slug(heading) == anchor


def test_a_missing_heading_or_file_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# A\n\n## Kept here\n\n```bash\n# not a heading\n```\n\n## Kept here\n")
    assert broken_links("see docs/a.md#kept-here and docs/a.md#kept-here-1", tmp_path) == []
    assert broken_links("see docs/a.md#not-a-heading", tmp_path) == [
        "docs/a.md#not-a-heading: no heading with that anchor"
    ]
    assert broken_links("see docs/b.md#kept-here", tmp_path) == ["docs/b.md: no such file"]
