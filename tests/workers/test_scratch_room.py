"""Where capture files go when the default place is too small (workers/process/context.py `scratch_root`).

Containers get a 64 MB /dev/shm by default (Docker, Kubernetes), while one real sample's states take hundreds of
MB; the worker must notice at start-up, not when vLLM's write fails mid-shard. Free space is given per folder
here (the folders are real; only their free-space figures are chosen by the test).
"""

from __future__ import annotations

import logging
import tempfile

import pytest

from app.base.errors import ConfigError
from workers.process import context
from workers.process.context import capture_room, scratch_root

MB = 10**6


@pytest.fixture
def places(tmp_path, monkeypatch):
    """A /dev/shm and a temp dir of the test's own, with the free space the test sets."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    free = {str(shm): 64 * MB, str(tmp): 50_000 * MB}
    monkeypatch.setattr(context, "SHM", str(shm))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    monkeypatch.setattr(context, "free_bytes", lambda path: free[str(path)])
    monkeypatch.delenv("REGEN_SCRATCH", raising=False)
    return shm, tmp, free


def test_a_real_models_capture_room_is_hundreds_of_mb():
    # 4 samples of 4096 tokens x 5 layers x 5120 (a 32B model's width) in bf16; fp32 models write twice that.
    assert capture_room(4096, 5, 5120, "bfloat16") == 4 * 4096 * 5 * 5120 * 2
    assert capture_room(4096, 5, 5120, "float32") == 2 * capture_room(4096, 5, 5120, "bfloat16")


def test_shared_memory_is_used_while_it_has_room(places):
    shm, _, _ = places
    assert scratch_root(capture_room(2112, 3, 64, "bfloat16")) == str(shm)  # the tiny test model: ~3 MB


def test_a_small_shared_memory_falls_back_to_the_temp_dir_with_a_warning(places, caplog):
    _, tmp, _ = places
    with caplog.at_level(logging.WARNING, logger="regen.worker"):
        assert scratch_root(capture_room(4096, 5, 5120, "bfloat16")) == str(tmp)
    assert "64 MB free, less than the 839 MB" in caplog.text


def test_no_place_with_room_is_refused_at_start_up(places):
    _, _, free = places
    for path in free:
        free[path] = 10 * MB
    with pytest.raises(ConfigError, match=r"has 10 MB free; this worker needs 839 MB"):
        scratch_root(capture_room(4096, 5, 5120, "bfloat16"))


def test_an_explicit_scratch_place_is_used_or_refused_never_replaced(places, tmp_path, monkeypatch):
    _, _, free = places
    mine = tmp_path / "fast-nvme" / "scratch"  # created when missing
    monkeypatch.setenv("REGEN_SCRATCH", str(mine))
    free[str(mine)] = 2_000 * MB
    assert scratch_root(capture_room(4096, 5, 5120, "bfloat16")) == str(mine)
    assert mine.is_dir()
    free[str(mine)] = 100 * MB  # the temp dir still has room, but the operator chose this place
    with pytest.raises(ConfigError, match=r"REGEN_SCRATCH=.*fast-nvme/scratch has 100 MB free"):
        scratch_root(capture_room(4096, 5, 5120, "bfloat16"))
