"""The patches of other libraries (app.base.library_patches) against the libraries installed: each library is at a
version its patch was written for, each patched name is where the patch expects it, and each patch does what it
says. A kombu or Flower upgrade fails here first, naming the patch to re-read."""

from __future__ import annotations

import importlib.metadata

import pytest
from kombu.transport import redis as kombu_redis

from app.base import library_patches
from app.base.library_patches import PATCHES, Patch, check_versions


def test_every_patched_library_is_installed_at_a_version_its_patch_was_written_for():
    installed = {p.package for p in PATCHES if _installed(p.package)}
    assert "kombu" in installed  # a hard dependency: its patches are always checked
    assert check_versions() == []


def test_a_library_outside_its_patchs_range_is_named():
    version = importlib.metadata.version("kombu")
    found = check_versions([Patch("kombu", f"<{version}", "kombu.transport.redis.dumps")])
    assert len(found) == 1 and f"kombu {version} is outside <{version}" in found[0]
    assert "kombu.transport.redis.dumps" in found[0]
    assert check_versions([Patch("not-a-package-regen-uses", ">=1", "x")]) == []  # absent optional: no finding


def test_kombus_patched_names_are_where_the_patches_expect_them():
    from kombu.serialization import registry

    assert callable(kombu_redis.dumps) and callable(kombu_redis.loads)
    for method in ("_brpop_read", "_get"):
        assert callable(getattr(kombu_redis.Channel, method))
    assert callable(kombu_redis.Transport._deliver)
    assert isinstance(registry.name_to_type, dict) and isinstance(registry.type_to_name, dict)


def test_the_orjson_envelope_writes_what_kombus_own_reads():
    import datetime as dt

    from kombu.utils import json as kombu_json

    before = kombu_redis.dumps  # a producer test earlier in this process may have patched it already
    original = kombu_json.dumps  # what the transport module imports as its `dumps`
    try:
        kombu_redis.dumps = original
        library_patches.use_orjson_envelope()
        assert kombu_redis.dumps is not original and kombu_redis.dumps.regen_orjson
        message = {"body": "x", "headers": {"eta": dt.datetime(2026, 1, 1, tzinfo=dt.UTC)},
                   "properties": {"delivery_tag": "t"}}
        assert kombu_redis.loads(kombu_redis.dumps(message)) == kombu_redis.loads(original(message))
    finally:
        kombu_redis.dumps = before


def test_the_tolerant_loads_is_tolerant_only_inside_its_context():
    original = kombu_redis.loads
    try:
        library_patches.install_tolerant_envelope_loads()
        library_patches.install_tolerant_envelope_loads()  # idempotent: one wrapper
        assert kombu_redis.loads.regen_tolerant
        with pytest.raises(ValueError):
            kombu_redis.loads("\x00not json")
        with library_patches.tolerant_envelope_loads():
            got = kombu_redis.loads("\x00not json")
            assert isinstance(got, library_patches.Undecodable) and got.raw == "\x00not json"
            with library_patches.tolerant_envelope_loads(False), pytest.raises(ValueError):
                kombu_redis.loads("\x00not json")
        assert kombu_redis.loads('{"a": 1}') == {"a": 1}
    finally:
        kombu_redis.loads = original


def test_flowers_queue_listing_is_extended_where_the_patch_expects_it():
    pytest.importorskip("flower")
    from types import SimpleNamespace

    from flower.views import BaseHandler

    original = BaseHandler.get_active_queue_names
    try:
        library_patches.extend_flower_queue_listing(lambda handler: ["regen", "team-b"])
        patched = BaseHandler.get_active_queue_names
        assert patched.regen
        library_patches.extend_flower_queue_listing(lambda handler: ["never"])  # idempotent: the first stays
        assert BaseHandler.get_active_queue_names is patched
        # Flower's own method on what it reads: no known worker, the app's default queue `celery`
        handler = SimpleNamespace(application=SimpleNamespace(workers={}),
                                  capp=SimpleNamespace(conf=SimpleNamespace(task_default_queue="celery",
                                                                            task_queues=None)))
        assert original(handler) == ["celery"]
        assert patched(handler) == ["celery", "regen", "team-b"]
    finally:
        BaseHandler.get_active_queue_names = original


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
