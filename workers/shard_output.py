"""Publishing a shard's outputs so that a redelivered or doubly-delivered shard yields exactly one result.

Each delivery that starts a shard is an *attempt* with its own random id. The attempt writes its records and
hidden-state file under names that include the attempt id (each atomically: temporary name, then rename),
then tries to create the shard's completion marker exclusively. The marker names the attempt whose files are
the shard's output. If another attempt got there first, this attempt deletes its own files: readers only
ever follow the marker, so two workers running one shard at once cannot corrupt or duplicate it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from app.hidden_file import EncodedSample, HiddenFileWriter
from app.jsonl_zst import dumps_jsonl_zst
from app.storage import RunStore


def new_attempt_id() -> str:
    return uuid.uuid4().hex[:12]


@dataclass(frozen=True)
class AttemptCount:
    """What a shard's attempts count against it when a new one starts (see `record_attempt`)."""

    failures: int  # attempts that recorded an error of their own (the engine failed on it, storage, a bug)
    crashes: int  # distinct processes that died holding the shard (SIGKILL, OOM, an engine killed by a signal)
    records: int  # attempt records, this one included

    def __int__(self) -> int:
        return self.failures + self.crashes + 1


def record_attempt(store: RunStore, shard: str, attempt: str, worker: str, stale_after: float | None = None,
                   **extra) -> AttemptCount:
    """Write this attempt's start file; return what the shard's earlier attempts count against it.

    An attempt is one delivery of the shard in one process (workers/inflight.py keeps a process from running two
    copies at once). Earlier attempts count in two ways:
    - `failures`: each one that recorded an error of its own (`error_kind` "error"). These are the shard's own
      merits: a prompt the engine fails on fails every time.
    - `crashes`: each *process* that died holding the shard, counted once however many copies it held: attempts
      whose process is known dead (app/liveness.py: the pid gone on this machine, or a lease run out) and
      attempts that recorded `error_kind` "crash" (the engine's process vanished under a signal). A machine that
      is killed says nothing about the shard, so crashes have their own, larger limit. Before this rule one
      SIGKILL of a process holding six copies of a shard (a re-publish, the restored original, reconciles) counted
      six attempts and dead-lettered a healthy shard.
    An attempt that may still be running (alive, or its lease not yet run out) counts as neither. `stale_after`
    (the broker's visibility timeout) is the lease of records written without one.
    """
    from app.liveness import attempt_state, identity, lease_seconds, process_key

    started = _now()
    body = {"attempt": attempt, "worker": worker, **identity(), "started": started, "lease_s": lease_seconds(),
            **_engine_fields(), **extra}
    body.setdefault("heartbeat", body["started"])
    store.storage.write_json(f"{store.attempts_dir(shard)}/{attempt}.json", body)
    now = dt.datetime.now(dt.UTC).timestamp()
    failures, crashed, records = 0, set(), 1
    for other in attempt_errors(store, shard):
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


def renew_lease(store: RunStore, shard: str, attempt: str) -> None:
    """Rewrite the attempt's `heartbeat` (the caller serialises this with `record_attempt_error`)."""
    path = f"{store.attempts_dir(shard)}/{attempt}.json"
    try:
        body = store.storage.read_json(path)
    except (FileNotFoundError, orjson.JSONDecodeError):
        return
    if body.get("error"):
        return
    body["heartbeat"] = _now()
    store.storage.write_json(path, body)


def _engine_fields() -> dict:
    """The engine this attempt runs on (vLLM's version, the operator's `--vllm-arg`s), in a worker process."""
    from workers.context import WorkerContext

    ctx = WorkerContext.current
    return {"engine": ctx.engine_record} if ctx is not None else {}


def _attempt_names(store: RunStore, shard: str) -> list[str]:
    """The shard's attempt records; another attempt's record being written at this instant shows as
    `.name.tmp-*`, which is not an attempt of its own."""
    return [name for name in store.storage.listdir(store.attempts_dir(shard)) if not name.startswith(".")]


def record_attempt_error(store: RunStore, shard: str, attempt: str, error: str, kind: str = "error") -> None:
    """Record why the attempt failed. `kind` "crash": the engine's process vanished (a signal, the OOM killer)
    without an error of its own; it counts as its process's crash, not as the shard's failure."""
    _update_attempt(store, shard, attempt, error=error, error_kind=kind, failed=_now())


def record_attempt_end(store: RunStore, shard: str, attempt: str, note: str) -> None:
    """Mark an attempt that ended without running the shard and without an error of the shard's (the delivery
    that found the attempts used up and wrote the dead letter): it counts as neither a failure nor a crash."""
    _update_attempt(store, shard, attempt, ended=note, ended_at=_now())


def _update_attempt(store: RunStore, shard: str, attempt: str, **fields) -> None:
    """Add `fields` to the attempt's record (a fresh one if its start file never landed)."""
    path = f"{store.attempts_dir(shard)}/{attempt}.json"
    try:
        body = store.storage.read_json(path)
    except FileNotFoundError:
        body = {"attempt": attempt}
    body.update(fields)
    store.storage.write_json(path, body)


def attempt_errors(store: RunStore, shard: str) -> list[dict]:
    out = []
    for name in _attempt_names(store, shard):
        try:
            out.append(store.storage.read_json(f"{store.attempts_dir(shard)}/{name}"))
        except (FileNotFoundError, orjson.JSONDecodeError):
            continue
    return out


def dead_letter(store: RunStore, shard: str, reason: str) -> None:
    attempts = attempt_errors(store, shard)
    store.storage.write_json(store.dead_path(shard), {"shard_id": shard, "reason": reason, "attempts": attempts,
                                                     "dead_lettered": _now()})


@dataclass(frozen=True)
class WrittenHidden:
    """An attempt's hidden-state file already in place (HiddenFileStream), for `publish_shard` to name."""

    path: str
    bytes: int
    sha256: str


class HiddenFileStream:
    """An attempt's hidden-state file, written while its shard generates: each sample goes in as soon as it is
    encoded, so a shard's states do not wait in RAM for the shard's end.

    A real model's sample is ~140 MB compressed ([4000, 5, 5120] bf16); held until the shard's end, a B200
    preset's 10 task slots of 64-sample shards kept tens of GB of them per GPU. Samples go in finishing order:
    readers find them through the file's own index of sample ids, and the record's `hidden.index` is the position
    `append` returns. Encoder threads append concurrently; one lock orders them.
    """

    def __init__(self, fh):
        self._hashing = _HashingWriter(fh)
        self._writer = HiddenFileWriter(self._hashing)
        self._lock = threading.Lock()
        self._open = True
        self.written: WrittenHidden | None = None  # set when the file is in place

    def append(self, sample: EncodedSample) -> int:
        with self._lock:
            if not self._open:  # an encoder finishing after its shard failed: the file is gone
                raise RuntimeError("the shard's hidden-state file is closed")
            self._writer.append(sample)
            return len(self._writer.entries) - 1

    def _close(self) -> None:
        with self._lock:  # waits for an append in progress
            self._open = False

    def _finish(self) -> tuple[int, str]:
        with self._lock:
            self._open = False
            return self._writer.close(), self._hashing.hexdigest()


@contextlib.contextmanager
def hidden_file_stream(store: RunStore, shard: str, attempt: str) -> Iterator[HiddenFileStream]:
    """Open the attempt's hidden-state file for streaming; on a clean exit it gets its index and is renamed into
    place (`stream.written`), on an error it is removed. Nothing refers to it until the completion marker does,
    and `publish_shard` deletes it if this attempt loses the marker."""
    path = store.hidden_path(shard, attempt)
    with store.storage.atomic_writer(path) as fh:
        stream = HiddenFileStream(fh)
        try:
            yield stream
        except BaseException:
            stream._close()  # late appends fail instead of writing into a file being removed
            raise
        size, sha256 = stream._finish()
    stream.written = WrittenHidden(path, size, sha256)


def publish_shard(
    store: RunStore,
    shard: str,
    attempt: str,
    records: list[dict],
    hidden_samples: list[EncodedSample] | WrittenHidden | None,
    summary: dict,
    level: int = 3,
    stale_after: float | None = None,
) -> bool:
    """Write outputs, then the completion marker last. True if this attempt's outputs are the shard's.

    `hidden_samples`: encoded samples to write now, or the file a HiddenFileStream already wrote, or None.
    `stale_after`: once won, remove temporary files in the shard's folder untouched for this many seconds."""
    records_rel = store.records_path(shard, attempt)
    records_bytes = dumps_jsonl_zst(records, level=level)
    files: dict[str, dict] = {}
    won = False
    if isinstance(hidden_samples, WrittenHidden):  # already in place: deleted below if this attempt loses
        files["hidden"] = {"path": hidden_samples.path, "bytes": hidden_samples.bytes, "sha256": hidden_samples.sha256}
        hidden_samples = None
    try:
        store.storage.write_bytes(records_rel, records_bytes)
        files["records"] = {"path": records_rel, "bytes": len(records_bytes),
                            "sha256": hashlib.sha256(records_bytes).hexdigest()}
        if hidden_samples is not None:  # the same writer as a streamed file, fed all at once
            with hidden_file_stream(store, shard, attempt) as stream:
                for sample in hidden_samples:
                    stream.append(sample)
            written = stream.written
            files["hidden"] = {"path": written.path, "bytes": written.bytes, "sha256": written.sha256}
        marker = {"shard_id": shard, "attempt": attempt, "files": files, "finished": _now(), **summary}
        won = store.storage.create_exclusive(store.done_path(shard),
                                             orjson.dumps(marker, option=orjson.OPT_INDENT_2))
        if won and stale_after is not None:
            # What killed attempts of this shard left half-written is of no use now that it is done; a duplicate
            # still writing (its process alive, its lease fresh) keeps its file and removes it when it loses.
            with contextlib.suppress(OSError):  # tidying only: the shard is published either way
                sweep_temporaries(store, shard, stale_after)
    finally:
        if not won:  # lost the race, or a write failed (disk full, NFS error): leave nothing behind
            for info in files.values():
                store.storage.delete(info["path"])
    return won


MARKER_TEMPORARY_AGE = 60.0  # seconds: a marker's or letter's temporary is written in milliseconds
_OWNER = re.compile(r"^\.([0-9a-f]{12})")


def sweep_temporaries(store: RunStore, key: str, stale_after: float | None, now: float | None = None) -> int:
    """Remove the temporaries (`.name.tmp-*`) a shard's dead attempts left; return how many.

    A temporary under `shards/{shard}/` or `attempts/{key}/` names the attempt that wrote it; it goes once that
    attempt is known dead or ended (app/liveness.py), so a live duplicate's file stays. One naming no known
    attempt goes once untouched for `stale_after` seconds. A marker's or dead letter's temporary goes after
    MARKER_TEMPORARY_AGE. Object stores have none (an unfinished upload never becomes an object)."""
    from app.liveness import attempt_state

    shard = key.removesuffix(".capture")
    now = time.time() if now is None else now
    owners = {r.get("attempt"): r for k in (shard, f"{shard}.capture") for r in attempt_errors(store, k)}
    removed = 0
    for folder in (store.rel("shards", shard), store.attempts_dir(shard), store.attempts_dir(f"{shard}.capture")):
        for name, mtime in store.storage.temporaries(folder):
            match = _OWNER.match(name)
            record = owners.get(match.group(1)) if match else None
            if record is not None:
                gone = attempt_state(record, now, stale_after) != "alive"
            else:
                gone = stale_after is not None and now - mtime > stale_after
            if gone:
                removed += store.storage.remove_temporary(f"{folder}/{name}")
    for folder in ("done", "dead", "captured"):
        for name, mtime in store.storage.temporaries(store.rel(folder)):
            if name.startswith((f".{shard}.json.tmp-", f".{shard}.capture.json.tmp-")) \
                    and now - mtime > MARKER_TEMPORARY_AGE:
                removed += store.storage.remove_temporary(store.rel(folder, name))
    return removed


class _HashingWriter:
    """File wrapper that hashes what passes through, so the marker can carry the file's sha256."""

    def __init__(self, fh):
        self.fh = fh
        self.h = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.h.update(data)
        return self.fh.write(data)

    def hexdigest(self) -> str:
        return self.h.hexdigest()


def _now() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")
