"""The shards this worker process is running now: one delivery of a shard at a time, leases kept, a journal.

Why: Redis delivers at least once, and copies of one shard run side by side only waste slots (and once
dead-lettered a healthy shard). The first delivery claims the shard; another message for it is acked and
dropped, the same message again is deferred. Each claimed attempt's lease is renewed (app.base.liveness), and a
journal on local disk lets the next worker on this host clean up after a dead process.
Why each rule: docs/faults.md#one-delivery-of-a-shard-per-process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass

import orjson

from app.base.config import current
from app.base.ledger import (
    MARKER_TEMPORARY_AGE,
    renew_lease,
    split_key,
    sweep_marker_temporaries,
    sweep_temporaries,
)
from app.base.liveness import heartbeat_seconds, identity, on_this_machine, process_alive
from app.base.storage import RunStore, Storage

log = logging.getLogger("regen.inflight")


def state_dir() -> str:
    """This host's local journal folder (`REGEN_STATE_DIR`, default /var/tmp/regen-UID; app.base.config)."""
    return current().state_dir


@dataclass(eq=False)
class Claim:
    key: tuple  # (storage url, run id, shard key)
    tag: str | None  # the delivery's tag
    store: object | None = None  # RunStore, once the attempt is recorded
    attempt: str | None = None
    journal: str | None = None


class InFlight:
    def __init__(self):
        self._lock = threading.Lock()
        self._claims: dict[tuple, Claim] = {}
        self._beat: threading.Thread | None = None

    def claim(self, key: tuple, tag: str | None) -> tuple[Claim | None, Claim | None]:
        """(this delivery's claim, None), or (None, the claim of the delivery that holds the shard)."""
        with self._lock:
            holder = self._claims.get(key)
            if holder is not None:
                return None, holder
            claim = self._claims[key] = Claim(key, tag)
            return claim, None

    def held(self) -> int:
        """How many shards this process holds now."""
        with self._lock:
            return len(self._claims)

    def started(self, claim: Claim, store, attempt: str) -> None:
        """The attempt's record exists: renew its lease from now on, and journal it on local disk."""
        claim.store, claim.attempt = store, attempt
        me = identity()
        entry = {"storage": store.storage.url, "run_id": store.run_id, "key": claim.key[2], "attempt": attempt,
                 **me}  # host, boot id, pid namespace, pid and its start: as the attempt record names the process
        folder = os.path.join(state_dir(), "attempts")
        try:
            os.makedirs(folder, exist_ok=True)
            path = os.path.join(folder, f"{me['pid']}-{attempt}.json")
            with open(path, "wb") as fh:
                fh.write(orjson.dumps(entry))
            claim.journal = path
        except OSError as exc:  # the journal only speeds tidying up; leases and publish-time sweeps remain
            log.warning("cannot journal attempt %s in %s: %s", attempt, folder, exc)
        self._ensure_beating()

    def release(self, claim: Claim) -> None:
        with self._lock:
            if self._claims.get(claim.key) is claim:
                del self._claims[claim.key]
        if claim.journal:
            with contextlib.suppress(OSError):
                os.unlink(claim.journal)

    def _ensure_beating(self) -> None:
        with self._lock:
            if self._beat is None:
                self._beat = threading.Thread(target=self._beat_loop, name="regen-lease", daemon=True)
                self._beat.start()

    def _beat_loop(self) -> None:
        """Renew every claimed attempt's lease; the ledger serialises a renewal with the attempt's own record
        writes (a renewal of an attempt that recorded its error meanwhile leaves the record as it is)."""
        interval = heartbeat_seconds()
        while True:
            threading.Event().wait(interval)
            with self._lock:
                claims = [c for c in self._claims.values() if c.attempt is not None]
            for c in claims:
                if self._claims.get(c.key) is not c:  # ended meanwhile
                    continue
                try:
                    renew_lease(c.store, c.key[2], c.attempt)
                except Exception as exc:  # storage trouble: the attempt itself will meet it too
                    log.warning("lease of %s/%s not renewed: %s", c.key[1], c.key[2], exc)


def sweep_dead_attempts(stale_after: float | None) -> int:
    """Remove the temporaries of this host's attempts whose process is gone; return how many files went.

    Only entries of this machine (host name, boot id and pid namespace all equal, app.base.liveness) are judged: a
    pid means nothing on another machine, so a journal folder shared by mistake (it is per host,
    docs/configuration.md) never costs another host its live temporaries. Entries without that identity
    (written before it was recorded) are left alone too; the publish-time sweeps still tidy their shards.
    Run at a worker's start (in a thread: storage may be slow). Each dead attempt's shard folders are swept, then
    each run's marker folders once for all its dead attempts' shards (the only marker-folder pass a worker makes);
    a marker temporary too young to tell from a live duplicate's is looked at again once it is old enough. A
    journal entry whose storage cannot be reached stays for the next start."""
    folder = os.path.join(state_dir(), "attempts")
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return 0
    runs: dict[tuple[str, str], list[tuple[str, dict]]] = {}
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                entry = orjson.loads(fh.read())
        except (OSError, orjson.JSONDecodeError):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        if not on_this_machine(entry):
            continue  # another host's (or an old entry's): its pid cannot be judged here
        if not process_alive(entry.get("pid"), entry.get("pid_start")):
            runs.setdefault((entry.get("storage"), entry.get("run_id")), []).append((path, entry))
    removed, waiting = 0, []
    for entries in runs.values():
        try:
            store = RunStore(Storage(entries[0][1]["storage"]), entries[0][1]["run_id"])
        except Exception as exc:
            log.warning("could not sweep the dead attempts of run %s: %s", entries[0][1].get("run_id"), exc)
            continue
        swept, young = _sweep_run(store, entries, stale_after)
        removed += swept
        if young:
            waiting.append((store, young))
    if waiting:  # what a process killed seconds ago left in the marker folders: old enough after the wait
        time.sleep(MARKER_TEMPORARY_AGE + 1)
        for store, shards in waiting:
            with contextlib.suppress(Exception):
                removed += sweep_marker_temporaries(store, shards)[0]
    if removed:
        log.info("removed %d temporaries of this host's dead attempts", removed)
    return removed


def _sweep_run(store: RunStore, entries: list[tuple[str, dict]], stale_after: float | None) -> tuple[int, set]:
    """Sweep one run's dead attempts (journal entries, removed once swept), then its marker folders once;
    return (files removed, the shards whose marker temporaries were too young to remove yet)."""
    removed, shards = 0, set()
    for path, entry in entries:
        try:
            removed += sweep_temporaries(store, entry["key"], stale_after)
        except Exception as exc:
            log.warning("could not sweep dead attempt %s of %s/%s: %s", entry.get("attempt"), entry.get("run_id"),
                        entry.get("key"), exc)
            continue
        shards.add(split_key(entry["key"])[0])
        with contextlib.suppress(OSError):
            os.unlink(path)
    try:
        swept, young = sweep_marker_temporaries(store, shards)
    except Exception as exc:  # tidying only: the shard folders are swept
        log.warning("could not sweep the marker folders of run %s: %s", store.run_id, exc)
        return removed, set()
    return removed + swept, shards if young else set()
