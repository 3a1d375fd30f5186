"""The worker's folders run one way (workers/process/__init__.py, workers/shard/__init__.py, docs/workers.md): the
entry points (workers/worker_main.py, workers/celery_worker.py) over the shard work (workers/shard/), the shard work
over the process plumbing (workers/process/), the plumbing over the engine (workers/engine/), lazy imports
included; tests/test_layout.py checks the floors around them. The test doubles (workers/doubles/) stand beside the
folders, behind the fence tests/test_layout.py holds."""

from __future__ import annotations

from tests.test_layout import ROOT, imports, is_double, modules

RANK = {"entry": 3, "shard": 2, "process": 1, "engine": 0}


def _folder(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "workers" or len(parts) < 2:
        return None
    if parts[1] in ("worker_main", "celery_worker"):
        return "entry"
    return parts[1] if parts[1] in RANK else None


def test_every_worker_module_but_the_tiny_model_builders_has_a_folder():
    known = modules()
    loose = sorted(m for m in known if m.startswith("workers.") and _folder(m) is None and not is_double(m))
    assert loose == ["workers.tiny_chat_template", "workers.tiny_model", "workers.tiny_vocab"]


def test_the_worker_folders_import_only_downward():
    known = modules()
    upward = [f"{m} ({known[m].relative_to(ROOT)}:{line}) imports {target}"
              for m in sorted(known) if _folder(m) for target, line in imports(known[m], known)
              if _folder(target) and RANK[_folder(target)] > RANK[_folder(m)]]
    assert not upward, "\n".join(upward)
    assert any(_folder(t) == "engine" for m in known if _folder(m) == "shard" for t, _ in imports(known[m], known))
