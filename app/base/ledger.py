"""The shard ledger: what storage records about each shard's deliveries, so that at-least-once delivery is safe.

Redis delivers a shard at least once, so storage, not the broker, is the record (`app.base.storage` owns the paths,
this module the rules written at them): stage keys, attempt records and their leases, dead letters and their
archive, completion markers, the run's pause, and the sweep of what dead attempts left half-written. Each
rule: docs/faults.md#the-shard-ledger.
"""

from __future__ import annotations

import datetime as dt
import re
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import orjson

from app.base.clock import shared_now
from app.base.documents import AttemptRecord, DeadLetter, Pause
from app.base.liveness import attempt_state, identity, lease_seconds, process_key

if TYPE_CHECKING:
    from app.base.storage import RunStore

GENERATE, CAPTURE = "generate", "capture"
STAGES = (GENERATE, CAPTURE)
_SEPARATOR = "."


# -- stage keys ---------------------------------------------------------------------------------------------
def stage_key(shard: str, stage: str) -> str:
    """The key of `shard` at `stage`: the shard id for generation, `{shard}.capture` for the staged capture
    (a shard id holds no dot, app.base.ids.shard_id, so the key reads back unambiguously)."""
    if stage == GENERATE:
        return shard
    if stage == CAPTURE:
        return f"{shard}{_SEPARATOR}{CAPTURE}"
    raise ValueError(f"unknown stage {stage!r} (one of {', '.join(STAGES)})")


def split_key(key: str) -> tuple[str, str]:
    """(shard, stage) of a key `stage_key` made."""
    shard, dot, stage = key.rpartition(_SEPARATOR)
    if dot and stage == CAPTURE:
        return shard, CAPTURE
    return key, GENERATE


def stage_of(key: str) -> str:
    return split_key(key)[1]


# -- attempts -----------------------------------------------------------------------------------------------
def new_attempt_id() -> str:
    """12 hex digits: temporaries are named after their attempt (`.{attempt}.….tmp-*`), which the sweep reads."""
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class AttemptCount:
    """What a key's attempts count against it when a new one starts (see `record_attempt`)."""

    failures: int  # attempts that recorded an error of their own (the engine failed on it, storage, a bug)
    crashes: int  # distinct processes that died holding the shard (SIGKILL, OOM, an engine killed by a signal)
    records: int  # attempt records, this one included

    def __int__(self) -> int:
        return self.failures + self.crashes + 1


def record_attempt(store: RunStore, key: str, attempt: str, worker: str, stale_after: float | None = None,
                   **extra) -> AttemptCount:
    """Write this attempt's start file; return what the key's earlier attempts count against it.

    An attempt is one delivery of the shard in one process (workers.process.inflight keeps a process from running two
    copies at once). Earlier attempts count in two ways:
    - `failures`: each one that recorded an error of its own (`error_kind` "error"). These are the shard's own
      merits: a prompt the engine fails on fails every time.
    - `crashes`: each *process* that died holding the shard, counted once however many copies it held: attempts
      whose process is known dead (app.base.liveness: the pid gone on this machine, or a lease run out) and
      attempts that recorded `error_kind` "crash" (the engine's process vanished under a signal). A machine that
      is killed says nothing about the shard, so crashes have their own, larger limit. Before this rule one
      SIGKILL of a process holding six copies of a shard (a re-publish, the restored original, reconciles) counted
      six attempts and dead-lettered a healthy shard.
    An attempt that may still be running (alive, or its lease not yet run out) counts as neither. `stale_after`
    (the broker's visibility timeout) is the lease of records written without one. `extra` (the engine, the
    stage) is written into the record as it is.
    """
    body = AttemptRecord.new(attempt, worker, identity(), timestamp(), lease_seconds(), extra)
    store.storage.write_json(store.attempt_path(key, attempt), body)
    now = shared_now()  # leases are judged on the fleet's one clock (app.base.clock), as they are written
    failures, crashed, records = 0, set(), 1
    for other in attempt_errors(store, key):
        if other.get("attempt") == attempt:
            continue
        records += 1
        if other.get("error"):
            if other.get("error_kind") == "crash":
                crashed.add(process_key(other))
            else:
                failures += 1
        elif attempt_state(other, now, stale_after) == "dead":
            crashed.add(process_key(other))
    return AttemptCount(failures, len(crashed), records)


def renew_lease(store: RunStore, key: str, attempt: str) -> None:
    """Rewrite the attempt's `heartbeat`; an attempt that recorded an error (or whose record is gone) is left."""
    _amend(store, key, attempt, {"heartbeat": timestamp()}, running_only=True)


def record_attempt_error(store: RunStore, key: str, attempt: str, error: str, kind: str = "error") -> None:
    """Record why the attempt failed. `kind` "crash": the engine's process vanished (a signal, the OOM killer)
    without an error of its own; it counts as its process's crash, not as the shard's failure."""
    _amend(store, key, attempt, {"error": error, "error_kind": kind, "failed": timestamp()})


def record_attempt_end(store: RunStore, key: str, attempt: str, note: str) -> None:
    """Mark an attempt that ended without running the shard and without an error of the shard's (the delivery
    that found the attempts used up and wrote the dead letter): it counts as neither a failure nor a crash."""
    _amend(store, key, attempt, {"ended": note, "ended_at": timestamp()})


_RECORD_LOCKS = tuple(threading.Lock() for _ in range(64))


def _amend(store: RunStore, key: str, attempt: str, fields: dict, running_only: bool = False) -> None:
    """Add `fields` to the attempt's record: the one read-modify-write of attempt records.

    Serialised per record within the process (the lease thread renews while the attempt's own task records its
    end; unserialised, a renewal read before the error and written after it would erase the error). Only the
    process that started an attempt writes its record, so no lock across processes is needed. `running_only`:
    leave a record that is gone, unreadable or failed; otherwise a missing one is started afresh."""
    path = store.attempt_path(key, attempt)
    with _RECORD_LOCKS[hash(path) % len(_RECORD_LOCKS)]:
        try:
            body = store.storage.read_json(path)
        except FileNotFoundError:
            if running_only:
                return
            body = {"attempt": attempt}
        except orjson.JSONDecodeError:
            if running_only:
                return
            raise
        if running_only and body.get("error"):
            return
        body.update(fields)
        store.storage.write_json(path, body)


def attempt_names(store: RunStore, key: str) -> list[str]:
    """The key's attempt records; another attempt's record being written at this instant shows as
    `.name.tmp-*`, which is not an attempt of its own."""
    return [name for name in store.storage.listdir(store.attempts_dir(key)) if not name.startswith(".")]


def attempt_errors(store: RunStore, key: str) -> list[AttemptRecord]:
    """Every readable attempt record of `key` (errors or not), in name order; one gone or caught half-written
    is left out, one that is not an attempt record is refused (app.base.documents.MalformedDocument)."""
    out = []
    for name in attempt_names(store, key):
        path = f"{store.attempts_dir(key)}/{name}"
        try:
            body = orjson.loads(store.storage.read_bytes(path))
        except (FileNotFoundError, orjson.JSONDecodeError):
            continue
        out.append(AttemptRecord.from_dict(body, path))
    return out


# -- dead letters -------------------------------------------------------------------------------------------
def dead_letter(store: RunStore, key: str, reason: str) -> None:
    """Dead-letter `key`: the reason and every attempt's record, so the letter alone says why."""
    store.storage.write_json(store.dead_path(key), DeadLetter.new(key, reason, attempt_errors(store, key),
                                                                  timestamp()))


def read_dead_letter(store: RunStore, key: str) -> DeadLetter | None:
    path = store.dead_path(key)
    try:
        return DeadLetter.parse(store.storage.read_bytes(path), path)
    except FileNotFoundError:
        return None


def archive_dead(store: RunStore, key: str, stamp: str) -> str:
    """Move `key`'s dead letter and attempt records under `archive/{key}/{stamp}/`; return that folder.

    The letter is copied first and removed last, so an archive cut short leaves the key dead and running it
    again finishes it; the attempts go, or the first new delivery would count them and dead-letter it again."""
    storage = store.storage
    folder = store.archive_dir(key, stamp)
    storage.write_json(f"{folder}/dead.json", storage.read_json(store.dead_path(key)))
    shard = split_key(key)[0]
    sweep_temporaries(store, shard, stale_after=None)  # what its dead attempts left half-written
    sweep_marker_temporaries(store, {shard})
    names = [n for n in attempt_names(store, key) if n.endswith(".json")]
    for name in names:
        storage.write_bytes(f"{folder}/attempts/{name}", storage.read_bytes(f"{store.attempts_dir(key)}/{name}"))
    for name in names:
        storage.delete(f"{store.attempts_dir(key)}/{name}")
    storage.delete(store.dead_path(key))
    return folder


# -- completion markers -------------------------------------------------------------------------------------
def is_finished(store: RunStore, key: str) -> bool:
    """The key's completion marker exists: `done/` for generation, `captured/` for the staged capture."""
    shard, stage = split_key(key)
    return store.is_done(shard) if stage == GENERATE else store.storage.exists(store.captured_path(shard))


def is_dead(store: RunStore, key: str) -> bool:
    return store.storage.exists(store.dead_path(key))


def finished(store: RunStore, stage: str = GENERATE) -> set[str]:
    """Shards whose `stage` is finished, from one listing."""
    return store.done_shards() if stage == GENERATE else store.captured_shards()


def dead(store: RunStore, stage: str = GENERATE) -> set[str]:
    """Shards dead-lettered at `stage`, from one listing."""
    return {shard for shard, s in map(split_key, store.dead_shards()) if s == stage}


def missing_captures(store: RunStore) -> list[str]:
    """Staged runs: shards generated but neither captured nor dead at capture (their capture message was lost)."""
    captured, dead_at_capture = finished(store, CAPTURE), dead(store, CAPTURE)
    return sorted(s for s in finished(store, GENERATE) if s not in captured and s not in dead_at_capture)


# -- the pause ----------------------------------------------------------------------------------------------
def pause_state(store: RunStore) -> Pause | None:
    """Why the run is paused (`reason` and the figures behind it); None when it runs."""
    try:
        return Pause.parse(store.storage.read_bytes(store.pause_path), store.pause_path)
    except FileNotFoundError:
        return None


def pause_run(store: RunStore, reason: str, **details) -> None:
    """Pause the run: workers drop its shards (acked, not requeued) until `clear_pause`."""
    store.storage.write_json(store.pause_path, Pause.new(reason, **details))


def clear_pause(store: RunStore) -> Pause | None:
    """Lift the pause; return what it said (None when the run was not paused)."""
    pause = pause_state(store)
    if pause:
        store.storage.delete(store.pause_path)
    return pause


# -- the sweep of dead attempts' temporaries -----------------------------------------------------------------
MARKER_TEMPORARY_AGE = 60.0  # seconds: a marker's or letter's temporary is written in milliseconds
_OWNER = re.compile(r"^\.([0-9a-f]{12})")


def sweep_temporaries(store: RunStore, key: str, stale_after: float | None, now: float | None = None) -> int:
    """Remove the temporaries (`.name.tmp-*`) a shard's dead attempts left in its own folders; return how many.

    A temporary under `shards/{shard}/` or the attempt folders of the shard's keys names the attempt that wrote
    it; it goes once that attempt is known dead or ended (app.base.liveness), so a live duplicate's file stays. One
    naming no known attempt goes once untouched for `stale_after` seconds. Only the shard's own folders are
    listed (this runs at every publish); the run-wide marker folders are `sweep_marker_temporaries`'. Object
    stores have none (an unfinished upload never becomes an object). Attempts are judged on the fleet's shared
    clock (app.base.clock); `now` (default this host's clock) is what a temporary's modification time is compared
    with."""
    shard = split_key(key)[0]
    keys = [stage_key(shard, stage) for stage in STAGES]
    now = time.time() if now is None else now
    shared = shared_now()
    owners = {r.get("attempt"): r for k in keys for r in attempt_errors(store, k)}
    removed = 0
    for folder in (store.rel("shards", shard), *(store.attempts_dir(k) for k in keys)):
        for name, mtime in store.storage.temporaries(folder):
            match = _OWNER.match(name)
            record = owners.get(match.group(1)) if match else None
            if record is not None:
                gone = attempt_state(record, shared, stale_after) != "alive"
            else:
                gone = stale_after is not None and now - mtime > stale_after
            if gone:
                removed += store.storage.remove_temporary(f"{folder}/{name}")
    return removed


def sweep_marker_temporaries(store: RunStore, shards: Iterable[str], now: float | None = None) -> tuple[int, int]:
    """Remove the temporaries of `shards`' markers and letters (`done/`, `dead/`, `captured/`) older than
    MARKER_TEMPORARY_AGE; return (removed, younger ones left).

    Their names do not say which attempt wrote them, so only age tells a dead writer's from a live duplicate's.
    Each folder is listed once for all `shards`: this runs at a worker's start and in `regen retry-dead`, never
    per publish (listing the run-wide folders at every publish cost O(shards^2) listings on NFS)."""
    now = time.time() if now is None else now
    prefixes = tuple(f".{stage_key(s, stage)}.json.tmp-" for s in shards for stage in STAGES)
    removed = young = 0
    if not prefixes:
        return 0, 0
    for folder in ("done", "dead", "captured"):
        for name, mtime in store.storage.temporaries(store.rel(folder)):
            if not name.startswith(prefixes):
                continue
            if now - mtime > MARKER_TEMPORARY_AGE:
                removed += store.storage.remove_temporary(store.rel(folder, name))
            else:
                young += 1
    return removed, young


def timestamp() -> str:
    """Now on the fleet's shared clock (app.base.clock), as attempt records, leases and markers write it (ISO 8601,
    UTC, milliseconds): a lease written on one host is judged on another."""
    return dt.datetime.fromtimestamp(shared_now(), dt.UTC).isoformat(timespec="milliseconds")
