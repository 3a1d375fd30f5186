"""The project's layout rules, read from every import statement of its modules (lazy ones inside functions too):

- the shared base (`app/*.py`) imports only the base;
- `producer/`, `workers/`, `app/data/` and `app/ops/` import the base and themselves, never each other;
- `app/pilot/` assembles the producer's reader, the workers' device facts and the run readers into the pilot;
- `app/cli/` is the only place that imports them all;
- no two modules import each other, directly or through others: every import statement counts, those inside
  functions (lazy imports) and under `if TYPE_CHECKING:` included, because a loop a lazy import hides is still
  two modules that cannot be read, moved or tested apart;
- no module imports another's private (`_name`) names: what two modules share is public where it is defined.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "producer", "workers")
MAY_IMPORT = {
    "base": {"base"},
    "producer": {"base", "producer"},
    "workers": {"base", "workers"},
    "data": {"base", "data"},
    "ops": {"base", "ops"},
    "pilot": {"base", "producer", "workers", "data", "pilot"},
    "cli": {"base", "producer", "workers", "data", "ops", "pilot", "cli"},
}


def modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            out[name] = path
    return out


def floor(module: str) -> str:
    for prefix, name in (("app.cli", "cli"), ("app.data", "data"), ("app.ops", "ops"), ("app.pilot", "pilot")):
        if module == prefix or module.startswith(prefix + "."):
            return name
    return "base" if module.split(".")[0] == "app" else module.split(".")[0]


def imports(path: Path, known: dict[str, Path]) -> list[tuple[str, int]]:
    """(module imported, line) for each of the project's modules `path` imports, anywhere in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in known else node.module
                     for a in node.names]
        else:
            continue
        out += [(n, node.lineno) for n in names if n in known and n not in PACKAGES]
    return out


def test_the_layout_has_the_floors_it_names():
    known = modules()
    floors = {floor(m) for m in known}
    assert floors == set(MAY_IMPORT), floors
    assert len(known) > 60  # the walk found the project, not an empty folder


def test_every_import_runs_downward_or_within_its_floor():
    known = modules()
    upward = [f"{m} ({known[m].relative_to(ROOT)}:{line}) imports {target}"
              for m in sorted(known) for target, line in imports(known[m], known)
              if floor(target) not in MAY_IMPORT[floor(m)]]
    assert not upward, "\n".join(upward)


# How high each floor stands: an import between floors goes to a lower one.
RANK = {"base": 0, "producer": 1, "workers": 1, "data": 1, "ops": 1, "pilot": 2, "cli": 3}


def floor_graph() -> dict[str, Counter]:
    """floor -> {floor it imports: import statements}, between floors only."""
    known = modules()
    graph: dict[str, Counter] = {f: Counter() for f in RANK}
    for m, path in known.items():
        for target, _ in imports(path, known):
            if floor(target) != floor(m):
                graph[floor(m)][floor(target)] += 1
    return graph


def test_the_import_graph_between_floors_runs_downward(capsys):
    graph = floor_graph()
    lines = [f"{f:>8} -> " + (", ".join(f"{t} ({n})" for t, n in sorted(graph[f].items(), key=lambda x: RANK[x[0]]))
                              or "-") for f in sorted(RANK, key=RANK.get)]
    with capsys.disabled():
        print("\nimports between the floors (import statements):\n" + "\n".join(lines))
    assert set(RANK) == set(MAY_IMPORT)
    assert not graph["base"], graph["base"]  # the ground floor imports nothing above it
    upward = [f"{f} -> {t}" for f, targets in graph.items() for t in targets if RANK[t] >= RANK[f]]
    assert not upward, upward
    assert graph["cli"]["pilot"] and graph["pilot"]["producer"] and graph["pilot"]["data"]  # the graph was read


# Imports that close a loop, each with why it is still here. Empty is the goal: an entry is a known defect.
def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports, from every import statement (lazy ones too)."""
    known = modules()
    return {m: {t for t, _ in imports(known[m], known)} - {m} for m in known}


def loops(graph: dict[str, set[str]]) -> list[str]:
    """Each cycle found by a depth-first walk from every module back to itself, as `a -> b -> a`."""
    found = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start and start == min(path):  # each loop once, from its first module
                    found.append(" -> ".join([*path, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return sorted(set(found))


def test_no_module_imports_itself_back_through_any_import():
    found = loops(import_graph())
    assert not found, "\n".join(found)


def test_the_loop_check_sees_a_lazy_import():
    graph = {"a": {"b"}, "b": set(), "c": set()}
    assert loops(graph) == []
    graph["b"].add("a")  # what a function-level `from a import x` inside b adds
    assert loops(graph) == ["a -> b -> a"]


def test_no_module_imports_another_modules_private_names():
    known = modules()
    private = []
    for m in sorted(known):
        for node in ast.walk(ast.parse(known[m].read_text())):
            if isinstance(node, ast.ImportFrom) and node.module in known and node.module != m:
                private += [f"{m} imports {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private, "\n".join(private)


@pytest.mark.parametrize("module,allowed", [("app.storage", False), ("producer.produce", False),
                                            ("app.cli.run", True)])
def test_the_rules_tell_a_module_that_may_import_everything_from_one_that_may_not(module, allowed):
    assert ("workers" in MAY_IMPORT[floor(module)]) is allowed


# -- prose that names code -----------------------------------------------------------------------------------
DOTTED = re.compile(r"(?<![\w./-])((?:app|workers|producer)(?:\.[a-z_][a-z_0-9]*)+)(?:\.([A-Za-z_]\w*))?")
FILE_PATH = re.compile(r"(?<![\w./-])(?:app|workers|producer)/[a-z_/]+\.py\b")


def top_level_names(path: Path) -> set[str]:
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Try):
            names |= {(a.asname or a.name) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))
                      for a in n.names}
    return names


def prose(path: Path) -> str:
    """A module's docstrings (module, classes, functions) and comments: where it names other code in words."""
    text = path.read_text()
    parts = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                parts.append(doc)
    tokens = tokenize.generate_tokens(io.StringIO(text).readline)
    parts += [t.string for t in tokens if t.type == tokenize.COMMENT]
    return "\n".join(parts)


def test_prose_names_modules_and_symbols_that_exist_not_file_paths():
    """Docstrings and comments name code by its dotted name (`app.ledger.stage_key`), never by file path, and
    every dotted name resolves: a move that leaves prose behind fails here instead of misleading a reader."""
    known = modules()
    wrong = []
    for name, path in sorted(known.items()):
        text = prose(path)
        wrong += [f"{name}: file path {m.group(0)}" for m in FILE_PATH.finditer(text)]
        for m in DOTTED.finditer(text):
            parts = m.group(0).split(".")
            k = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in known), default=0)
            if k == 0:
                wrong.append(f"{name}: {m.group(0)} names no module")
                continue
            rest = parts[k:]
            if rest and rest[0] not in top_level_names(known[".".join(parts[:k])]):
                wrong.append(f"{name}: {m.group(0)}: {'.'.join(parts[:k])} defines no {rest[0]}")
    assert not wrong, "\n".join(wrong)
