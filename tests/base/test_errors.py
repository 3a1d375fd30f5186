"""The exception tree (app/base/errors.py): every error regen raises on purpose is a RegenError, and its class alone
decides what a worker does with it (`classify`), a storage hiccup and a bug included."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from app.base.errors import (
    ConfigError,
    EngineDead,
    EngineLost,
    Failure,
    InvalidId,
    InvalidTask,
    ManifestMismatch,
    PermanentError,
    RegenError,
    RetryableError,
    classify,
)
from app.base.hidden_file import CorruptHiddenFile
from app.base.states_codec import NonFiniteStates
from app.base.storage import Storage
from producer.normalise import Rejected

ROOT = Path(__file__).resolve().parents[2]
# Exception classes that are not errors for a user: control flow inside one module, and a bug's alarm (a
# traceback, not one line, is what a bug should print).
NOT_REGEN_ERRORS = {"app.data.reference._StopForward": "ends a forward pass early, caught in its own module"}


def _exception_classes() -> dict[str, type]:
    """Every class the project's code defines whose base is an exception, by `module.Name`."""
    found = {}
    for package in ("app", "producer", "workers"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.parse(path.read_text()).body:
                if isinstance(node, ast.ClassDef) and node.bases:
                    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
                    candidate = getattr(importlib.import_module(module), node.name)
                    if isinstance(candidate, type) and issubclass(candidate, BaseException):
                        found[f"{module}.{node.name}"] = candidate
    return found


def test_every_error_regen_defines_is_a_regen_error():
    classes = _exception_classes()
    assert {"app.base.hidden_file.CorruptHiddenFile", "producer.normalise.Rejected"} <= set(classes)  # the walk works
    outside = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, RegenError) and name not in NOT_REGEN_ERRORS)
    assert outside == []
    assert set(NOT_REGEN_ERRORS) <= set(classes)  # the exceptions named above still exist


def test_the_errors_that_joined_the_tree_are_still_caught_as_before():
    assert issubclass(CorruptHiddenFile, ValueError) and issubclass(NonFiniteStates, ValueError)
    for cls in (CorruptHiddenFile, NonFiniteStates, Rejected, InvalidId):
        assert issubclass(cls, PermanentError)
    rejected = Rejected("malformed_json", "line 3")
    assert (rejected.reason, rejected.detail) == ("malformed_json", "line 3")


@pytest.mark.parametrize("exc,failure", [
    (EngineLost("engine process exited (killed by SIGKILL)"), Failure.RESTART),
    (EngineDead("vLLM engine failed"), Failure.RESTART),
    (InvalidId("invalid shard id '../x'"), Failure.SET_ASIDE),
    (PermanentError("prompt too long"), Failure.DEAD_LETTER),
    (CorruptHiddenFile("bad magic"), Failure.DEAD_LETTER),
    (Rejected("not_utf8"), Failure.DEAD_LETTER),
    (InvalidTask("run r is not on storage"), Failure.RETRY_A_FEW),
    (RetryableError("broker gone"), Failure.RETRY),
    (OSError("stale NFS handle"), Failure.RETRY),
    (FileNotFoundError("records.jsonl.zst"), Failure.RETRY),
    (TimeoutError("read timed out"), Failure.RETRY),
    (ConfigError("capture requested but this engine was built without capture layers"), Failure.UNEXPECTED),
    (ManifestMismatch("another model"), Failure.UNEXPECTED),
    (KeyError("settings"), Failure.UNEXPECTED),
])
def test_a_failures_class_alone_decides_what_the_worker_does(exc, failure):
    assert classify(exc) is failure


def test_an_engine_death_is_retryable_and_restarts_before_anything_else():
    assert issubclass(EngineDead, RetryableError) and issubclass(InvalidTask, RetryableError)
    assert classify(EngineLost("gone")) is Failure.RESTART  # not the plain RETRY of its base


def test_a_path_that_climbs_out_of_storage_is_an_invalid_id_that_is_set_aside(tmp_path):
    storage = Storage(str(tmp_path))
    for bad in ("r1/../../etc/passwd", "runs/./x", "a\\b"):
        with pytest.raises(InvalidId) as refused:
            storage.path(bad)
        assert classify(refused.value) is Failure.SET_ASIDE  # never retried: it fails the same way every time
