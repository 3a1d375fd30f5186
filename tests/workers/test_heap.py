"""workers/process/heap.py: the start-up heap leaves the collector's generations, later garbage is still collected.

Run in a child process: freezing pytest's own heap would change every test after this one."""

from __future__ import annotations

import json
import subprocess
import sys

CHILD = r"""
import gc, json
startup = [[i] for i in range(50_000)]  # long-lived start-up state (lists are tracked by the collector)
before = len(gc.get_objects())
from workers.process.heap import freeze_startup_heap
frozen = freeze_startup_heap()
after = len(gc.get_objects())
cycle = []
cycle.append(cycle)  # garbage made later, reachable only from itself: only a collection frees it
del cycle
freed = gc.collect()
print(json.dumps({"before": before, "frozen": frozen, "after": after, "freed": freed, "alive": len(startup)}))
"""


def test_freezing_takes_the_start_up_heap_out_of_collections_but_not_later_garbage():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)
    assert got["before"] > 50_000 and got["frozen"] >= 50_000, got
    assert got["after"] < 1_000, got  # what a full collection still walks: next to nothing
    assert got["freed"] >= 1, got  # the later cycle was found and freed
    assert got["alive"] == 50_000  # frozen objects are kept, not freed
