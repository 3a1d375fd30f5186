"""`regen retry-dead` checks that it can re-send before it archives anything: a shard whose letter was archived
but never re-sent would be neither dead nor queued."""

from __future__ import annotations

import pytest

from app.base.errors import ConfigError
from producer.retry_dead import retry_dead
from producer.run_setup import ProduceOptions
from tests.support.status_run import DEAD, build_status_run


def test_a_retry_whose_broker_does_not_answer_archives_nothing_and_leaves_the_shard_dead(tmp_path):
    store = build_status_run(str(tmp_path))["store"]
    opts = ProduceOptions(inputs=[], run_id=store.run_id, storage=str(tmp_path), broker="redis://127.0.0.1:1/0")
    with pytest.raises(ConfigError, match="does not answer.*nothing was archived"):
        retry_dead(opts, [DEAD])
    assert store.dead_shards() == {DEAD}
    assert store.storage.listdir(store.attempts_dir(DEAD))  # its attempt records are still where they were
    assert not store.storage.listdir("r1/archive")
