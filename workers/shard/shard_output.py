"""Publishing a shard's outputs so that a redelivered or doubly-delivered shard yields exactly one result.

Each delivery that starts a shard is an *attempt* with its own random id. The attempt writes its records and
hidden-state file under names that include the attempt id (each atomically: temporary name, then rename),
then tries to create the shard's completion marker exclusively. The marker names the attempt whose files are
the shard's output. If another attempt got there first, this attempt deletes its own files: readers only
ever follow the marker, so two workers running one shard at once cannot corrupt or duplicate it. Attempts,
dead letters and the sweep of what dead attempts left are the shard ledger's (app.base.ledger).
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import orjson

from app.base.documents import DoneMarker
from app.base.hidden_file import EncodedSample, HiddenFileWriter
from app.base.ledger import sweep_temporaries, timestamp
from app.base.manifest import COMPRESSION_LEVEL
from app.base.records import encode_records
from app.base.storage import RunStore


@dataclass(frozen=True)
class WrittenHidden:
    """An attempt's hidden-state file already in place (HiddenFileStream), for `publish_shard` to name."""

    path: str
    bytes: int
    sha256: str

    def info(self) -> dict:
        """How a marker names the file: path, size and sha256 (what `regen verify` checks it against)."""
        return {"path": self.path, "bytes": self.bytes, "sha256": self.sha256}


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
    level: int = COMPRESSION_LEVEL,
    stale_after: float | None = None,
) -> bool:
    """Write outputs, then the completion marker last. True if this attempt's outputs are the shard's.

    `hidden_samples`: encoded samples to write now, or the file a HiddenFileStream already wrote, or None.
    `stale_after`: once won, remove temporary files in the shard's folder untouched for this many seconds."""
    records_rel = store.records_path(shard, attempt)
    records_bytes = encode_records(records, level=level)
    files: dict[str, dict] = {}
    if isinstance(hidden_samples, WrittenHidden):  # already in place: deleted below if this attempt loses
        files["hidden"] = hidden_samples.info()
        hidden_samples = None
    try:
        store.storage.write_bytes(records_rel, records_bytes)
        files["records"] = {"path": records_rel, "bytes": len(records_bytes),
                            "sha256": hashlib.sha256(records_bytes).hexdigest()}
        if hidden_samples is not None:  # the same writer as a streamed file, fed all at once
            with hidden_file_stream(store, shard, attempt) as stream:
                for sample in hidden_samples:
                    stream.append(sample)
            files["hidden"] = stream.written.info()
    except BaseException:  # a write failed (disk full, NFS error): leave nothing behind
        for info in files.values():
            store.storage.delete(info["path"])
        raise
    marker = DoneMarker.new(shard, attempt, files, summary)
    return publish_marker(store, store.done_path(shard), marker, [i["path"] for i in files.values()], shard,
                          stale_after)


def publish_marker(store: RunStore, marker_rel: str, marker: dict, owned: list[str], shard: str,
                   stale_after: float | None = None) -> bool:
    """Publish a stage of a shard (generation's completion marker, staged capture's capture marker): the one way
    both stages end. The marker is created exclusively, stamped `finished` on the fleet's shared clock (the
    same clock attempts' `started` is on, so a stage's duration is one clock's difference); the files it names
    (`owned`, each with its sha256 in the marker) are deleted when another attempt's marker was there first or
    the write failed. Once won, what dead attempts of the shard left half-written is swept (`stale_after`)."""
    won = False
    try:
        body = {**marker, "finished": timestamp()}
        won = store.storage.create_exclusive(marker_rel, orjson.dumps(body, option=orjson.OPT_INDENT_2))
        if won:
            # What killed attempts of this shard left half-written is of no use now that it is done; a duplicate
            # still writing (its process alive, its lease fresh) keeps its file and removes it when it loses.
            # Only the shard's own folders: the run-wide marker folders are swept at a worker's start.
            with contextlib.suppress(OSError):  # tidying only: the stage is published either way
                sweep_temporaries(store, shard, stale_after)
    finally:
        if not won:
            for path in owned:
                store.storage.delete(path)
    return won


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

