"""Leases on one clock (app/base/clock.py): a host whose clock is minutes off judges other hosts' attempts right.

The judging code runs in a real process whose clock libfaketime (Debian's `faketime`; .ci/run installs it)
shifts by ten minutes, against the real Redis whose `TIME` is the shared clock. The same process on its own
clock (a broker URL with no Redis `TIME`, so the local clock stands in) shows what the shared clock prevents.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from app.base.ledger import record_attempt
from app.base.storage import RunStore, Storage
from tests.support.paths import REPO
from tests.support.redis_db import OPS_BROKER, redis_or_fail

SHIFT_S = 600  # ten minutes: five 120 s leases (the default heartbeat of 30 s)
SHARD = "shard-000000"

JUDGE = """
import json, sys
from app.base.ledger import record_attempt, sweep_temporaries
from app.base.liveness import clock_skew_warning
from app.base.storage import RunStore, Storage
store = RunStore(Storage(sys.argv[1]), "r1")
count = record_attempt(store, sys.argv[2], "b" * 12, "judge@hostC")
removed = sweep_temporaries(store, sys.argv[2], stale_after=None)
print(json.dumps({"crashes": count.crashes, "removed": removed, "warning": clock_skew_warning()}))
"""


def _judge(root: Path, shard: str, shift: str, broker: str) -> dict:
    if shutil.which("faketime") is None:
        if os.environ.get("CI"):
            pytest.fail("faketime is not installed; .ci/run installs Debian's faketime")
        pytest.skip("faketime (Debian's libfaketime) is not installed")
    env = {**os.environ, "REGEN_BROKER_URL": broker, "PYTHONPATH": str(REPO)}
    out = subprocess.run(["faketime", "-f", shift, sys.executable, "-c", JUDGE, str(root), shard],
                         capture_output=True, text=True, env=env, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _live_attempt_on_another_host(root: Path, shard: str, **fields) -> Path:
    """An attempt of hostB's, its lease renewed now (on the shared clock), and the temporary it is writing."""
    store = RunStore(Storage(str(root)), "r1")
    record_attempt(store, shard, "a" * 12, "gpu0@hostB", host="hostB", boot="hostB-boot", **fields)
    tmp = root / "r1" / "shards" / shard / f".{'a' * 12}.hidden.rgh.tmp-1"
    tmp.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_bytes(b"half-written hidden states")
    return tmp


@pytest.mark.parametrize("shift", [f"+{SHIFT_S}s", f"-{SHIFT_S}s"])
def test_a_host_with_its_clock_minutes_off_counts_no_crash_and_sweeps_no_live_temporary(tmp_path, monkeypatch,
                                                                                         shift):
    redis_or_fail(OPS_BROKER)
    monkeypatch.setenv("REGEN_BROKER_URL", OPS_BROKER)  # this process writes the lease on the shared clock too
    tmp = _live_attempt_on_another_host(tmp_path, SHARD)
    judged = _judge(tmp_path, SHARD, shift, OPS_BROKER)
    assert judged["crashes"] == 0 and judged["removed"] == 0 and tmp.exists(), judged
    assert judged["warning"] and ("ahead" if shift.startswith("+") else "behind") in judged["warning"]


def test_a_host_whose_clock_runs_behind_still_sees_a_dead_host_die(tmp_path, monkeypatch):
    redis_or_fail(OPS_BROKER)
    monkeypatch.setenv("REGEN_BROKER_URL", OPS_BROKER)
    import datetime as dt

    from app.base.clock import shared_now
    from app.base.ledger import timestamp

    last = dt.datetime.fromtimestamp(shared_now() - 300, dt.UTC).isoformat()  # its last renewal, 5 min ago
    tmp = _live_attempt_on_another_host(tmp_path, SHARD, started=last, heartbeat=last)
    assert timestamp()  # the shared clock answers
    judged = _judge(tmp_path, SHARD, f"-{SHIFT_S}s", OPS_BROKER)
    assert judged["crashes"] == 1 and judged["removed"] == 1 and not tmp.exists(), judged


def test_on_its_own_clock_the_same_host_would_kill_the_live_attempt(tmp_path, monkeypatch):
    """The failure the shared clock prevents, shown with the same judge on its own clock: the test above can fail."""
    redis_or_fail(OPS_BROKER)
    monkeypatch.setenv("REGEN_BROKER_URL", OPS_BROKER)
    tmp = _live_attempt_on_another_host(tmp_path, SHARD)
    judged = _judge(tmp_path, SHARD, f"+{SHIFT_S}s", "filesystem:///nonexistent-broker")
    assert judged["crashes"] == 1 and judged["removed"] == 1 and not tmp.exists(), judged
    assert judged["warning"] is None  # no shared clock to compare with
