"""The shards this worker process is running now: one delivery of a shard at a time, leases kept, a journal.

Why a registry: Redis delivers at least once, and one process can be handed several copies of one shard (an
engine-death re-publish and the restored original; `regen reconcile` beside the original; the visibility timeout
restoring a message that still runs). Run side by side they only waste slots, and when the process died each
copy counted as a failed attempt: six copies and one SIGKILL dead-lettered a healthy shard. So the first delivery
claims the shard; a second one in this process does not start an attempt:
- a different message (another delivery tag) is acked and dropped: the claimed delivery stays unacked until it
  ends, and whatever ends it (done, a retry, an engine-death re-publish, a kill and Redis' restore) covers the
  shard;
- the same message again (the visibility timeout restored it while it runs) is deferred with Celery's retry
  (a new message, some seconds later): acking it would ack the running delivery's message too.

Leases: every claimed attempt's record gets a fresh `heartbeat` every `heartbeat_seconds()` (app/liveness.py),
so other machines can tell a dead attempt from a slow one. Journal: each attempt is also a small file on local
disk (`REGEN_STATE_DIR`, default /var/tmp/regen-UID/attempts) until it ends, so a worker starting on this host
finds the attempts of its host's dead processes and removes their temporaries (`sweep_dead_attempts`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass, field

import orjson

from app.liveness import heartbeat_seconds, identity, process_alive
from app.settings import current

log = logging.getLogger("regen.inflight")


def state_dir() -> str:
    """This host's local journal folder (`REGEN_STATE_DIR`, default /var/tmp/regen-UID; app/settings.py)."""
    return current().state_dir


@dataclass(eq=False)
class Claim:
    key: tuple  # (storage url, run id, shard key)
    tag: str | None  # the delivery's tag
    store: object | None = None  # RunStore, once the attempt is recorded
    attempt: str | None = None
    journal: str | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)  # lease renewals vs the attempt's own writes


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

    def started(self, claim: Claim, store, attempt: str) -> None:
        """The attempt's record exists: renew its lease from now on, and journal it on local disk."""
        claim.store, claim.attempt = store, attempt
        me = identity()
        entry = {"storage": store.storage.url, "run_id": store.run_id, "key": claim.key[2], "attempt": attempt,
                 "pid": me["pid"], "pid_start": me["pid_start"]}
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
        from workers.shard_output import renew_lease

        interval = heartbeat_seconds()
        while True:
            threading.Event().wait(interval)
            with self._lock:
                claims = [c for c in self._claims.values() if c.attempt is not None]
            for c in claims:
                with c.lock:
                    if self._claims.get(c.key) is not c:  # ended meanwhile
                        continue
                    try:
                        renew_lease(c.store, c.key[2], c.attempt)
                    except Exception as exc:  # storage trouble: the attempt itself will meet it too
                        log.warning("lease of %s/%s not renewed: %s", c.key[1], c.key[2], exc)


def sweep_dead_attempts(stale_after: float | None) -> int:
    """Remove the temporaries of this host's attempts whose process is gone; return how many files went.

    Run at a worker's start (in a thread: storage may be slow). A journal entry whose storage cannot be reached
    stays for the next start."""
    from app.storage import RunStore, Storage
    from workers.shard_output import sweep_temporaries

    folder = os.path.join(state_dir(), "attempts")
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return 0
    removed = 0
    for name in names:
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as fh:
                entry = orjson.loads(fh.read())
        except (OSError, orjson.JSONDecodeError):
            with contextlib.suppress(OSError):
                os.unlink(path)
            continue
        if process_alive(entry.get("pid"), entry.get("pid_start")):
            continue
        try:
            store = RunStore(Storage(entry["storage"]), entry["run_id"])
            removed += sweep_temporaries(store, entry["key"], stale_after)
        except Exception as exc:
            log.warning("could not sweep dead attempt %s of %s/%s: %s", entry.get("attempt"), entry.get("run_id"),
                        entry.get("key"), exc)
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
    if removed:
        log.info("removed %d temporaries of this host's dead attempts", removed)
    return removed
