"""One reading API over a run on storage, shared by verify, stats, export and the PyTorch Dataset.

Why one module: the rules for what a run's data *is* live in app.base.storage (a shard's output is exactly the
files its completion marker names; staged runs take hidden states from the `captured/` marker instead), and
every reader must apply them the same way. Nothing here lists `shards/` directly: files no marker names
are leftovers of losing attempts and are never data.

Reads stream: records one shard at a time (`iter_jsonl_zst`), hidden states one sample at a time through a
`HiddenFileReader` (two seeks per sample, no whole-file decompression). Open hidden-file readers are kept in a
small LRU, and re-opened after a fork (DataLoader workers must not share file offsets).
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from app.base import ledger
from app.base.documents import CaptureMarker, DeadLetter, DoneMarker, ProduceSummary, run_counts
from app.base.hidden_file import HiddenFileReader
from app.base.ids import shard_id
from app.base.manifest import RunSettings
from app.base.manifest import load as load_manifest
from app.base.records import Record, iter_records
from app.base.storage import RunStore, Storage

_LISTING_ONCE = threading.Lock()  # module-level: a reader stays picklable (DataLoader workers under spawn)


@dataclass
class ShardInfo:
    """A done shard: its id and completion marker (and, for staged runs, the capture marker if present)."""

    shard_id: str
    marker: DoneMarker
    captured: CaptureMarker | None = None

    @property
    def ok(self) -> int | None:
        return self.marker.get("ok")


class RunReader:
    """Read-only view of one run: manifest, producer counts, done shards, records and hidden states."""

    def __init__(self, storage: Storage | str, run_id: str, max_open: int = 8):
        self.storage = storage if isinstance(storage, Storage) else Storage(storage)
        self.store = RunStore(self.storage, run_id)
        self.run_id = run_id
        self.manifest = load_manifest(self.store)
        self.settings = self.manifest.get("settings", {})
        self.run_settings = RunSettings.view(self.settings)  # the settings, typed (app.base.manifest)
        self.capture_mode = self.run_settings.capture_mode
        self.layers = self.run_settings.vllm_layer_ids
        self.max_open = max_open
        self._readers: OrderedDict[str, tuple[object, HiddenFileReader]] = OrderedDict()
        self._pid = os.getpid()
        self._dead_capture: set[str] | None = None

    # -- run-level ---------------------------------------------------------------------------------------
    def produce_state(self) -> ProduceSummary | None:
        try:
            return ProduceSummary.parse(self.storage.read_bytes(self.store.produce_path), self.store.produce_path)
        except FileNotFoundError:
            return None

    def expected_shards(self) -> list[str]:
        """Every shard the producer made (app.base.documents.run_counts) plus any with markers."""
        counts = run_counts(self.produce_state(), self.manifest)
        names = {shard_id(k) for k in range(int(counts.get("shards") or 0))}
        return sorted(names | self.store.done_shards() | self.dead_generate_shards())

    def dead_generate_shards(self) -> set[str]:
        return ledger.dead(self.store, ledger.GENERATE)

    def dead_capture_shards(self) -> set[str]:
        """Shards whose staged capture was dead-lettered, listed once per reader: verify asks for every shard
        whose capture is missing, and a listing each was one per shard (14K on the job, a round trip each on
        NFS or S3). A reader serves one pass; a letter written during it shows on the next."""
        with _LISTING_ONCE:  # verify's shard threads ask at the same time
            if self._dead_capture is None:
                self._dead_capture = ledger.dead(self.store, ledger.CAPTURE)
        return self._dead_capture

    def dead_letter(self, shard: str) -> DeadLetter | None:
        """Why generation gave up on the shard (reason, every attempt); None when it was not dead-lettered."""
        return ledger.read_dead_letter(self.store, shard)

    def done_shards(self) -> list[str]:
        return sorted(self.store.done_shards())

    def shard(self, shard: str) -> ShardInfo | None:
        marker = self.store.done_marker(shard)
        if marker is None:
            return None
        return ShardInfo(shard, marker, self.captured_marker(shard) if self.capture_mode == "staged" else None)

    def captured_marker(self, shard: str) -> CaptureMarker | None:
        path = self.store.captured_path(shard)
        try:
            return CaptureMarker.parse(self.storage.read_bytes(path), path)
        except FileNotFoundError:
            return None

    def shards(self) -> Iterator[ShardInfo]:
        """Done shards in id order (a run in progress yields the ones finished so far)."""
        for name in self.done_shards():
            info = self.shard(name)
            if info is not None:
                yield info

    # -- records ------------------------------------------------------------------------------------------
    def records(self, info: ShardInfo) -> Iterator[Record]:
        """The shard's records in order, streamed (ok and worker-rejected alike)."""
        with self.storage.open(info.marker.records_file["path"]) as fh:
            yield from iter_records(fh, info.marker.records_file["path"])

    def iter_records(self, status: str | None = None) -> Iterator[tuple[ShardInfo, dict]]:
        for info in self.shards():
            for rec in self.records(info):
                if status is None or rec.get("status") == status:
                    yield info, rec

    # -- hidden states ------------------------------------------------------------------------------------
    def hidden_path(self, info: ShardInfo) -> str | None:
        """The file holding this shard's states: the done marker's (inline) or the capture marker's (staged)."""
        if self.capture_mode == "staged":
            return info.captured.hidden_file["path"] if info.captured is not None else None
        return (info.marker.hidden_file or {}).get("path")

    def hidden_reader(self, info: ShardInfo) -> HiddenFileReader | None:
        """A cached reader of the shard's hidden file; None when the shard has none (capture off / pending)."""
        if os.getpid() != self._pid:  # forked (DataLoader worker): the parent's handles share offsets
            self._readers.clear()
            self._pid = os.getpid()
        path = self.hidden_path(info)
        if path is None:
            return None
        if path in self._readers:
            self._readers.move_to_end(path)
            return self._readers[path][1]
        fh = self.storage.open(path)
        try:
            reader = HiddenFileReader(fh)
        except BaseException:
            fh.close()
            raise
        self._readers[path] = (fh, reader)
        while len(self._readers) > self.max_open:
            old_fh, _ = self._readers.popitem(last=False)[1]
            old_fh.close()
        return reader

    def hidden_position(self, info: ShardInfo, rec: dict, reader: HiddenFileReader) -> int | None:
        """Where the record's states are in the hidden file (by the file's own index of sample ids)."""
        return reader.by_id.get(rec["sample_id"])

    def states(self, info: ShardInfo, rec: dict, slots=None) -> tuple[np.ndarray, np.ndarray] | None:
        """(token_ids int32 [T-1], states uint16 bf16 [T-1, L, H]) for one record; CRCs checked. bf16 whatever
        the run stores: a lossy sample is decoded (`HiddenFileReader.read_stored` gives its stored form).
        `slots`: only those stored layers, in that order (`HiddenFileReader.read`)."""
        reader = self.hidden_reader(info)
        if reader is None:
            return None
        pos = self.hidden_position(info, rec, reader)
        return None if pos is None else reader.read(pos, slots)

    def close(self) -> None:
        for fh, _ in self._readers.values():
            fh.close()
        self._readers.clear()

    def __enter__(self) -> RunReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SampleIndex:
    """Global index over a run's ok samples, built from markers alone (no record is read to build it).

    Sample i is the k-th ok record of the shard whose cumulative `ok` count covers i. A shard's records are
    decoded once when first touched and kept (only the fields a trainer needs) in a small LRU, so random
    access costs one records decode per shard, not per sample.
    """

    KEEP = ("sample_id", "input_ids", "loss_mask", "num_prompt_tokens", "num_output_tokens", "hidden")

    def __init__(self, reader: RunReader, cache_shards: int = 4):
        self.reader = reader
        self.infos: list[ShardInfo] = []
        self.starts: list[int] = []
        total = 0
        for info in reader.shards():
            ok = info.ok
            if ok is None:  # a marker without counts: count the shard's ok records once
                ok = sum(1 for r in reader.records(info) if r.get("status") == "ok")
            if ok:
                self.infos.append(info)
                self.starts.append(total)
                total += int(ok)
        self.total = total
        self.cache_shards = cache_shards
        self._cache: OrderedDict[str, list[dict]] = OrderedDict()

    def __len__(self) -> int:
        return self.total

    def locate(self, i: int) -> tuple[ShardInfo, int]:
        if i < 0:
            i += self.total
        if not 0 <= i < self.total:
            raise IndexError(f"sample {i} out of range (run has {self.total} ok samples)")
        pos = int(np.searchsorted(self.starts, i, side="right")) - 1
        return self.infos[pos], i - self.starts[pos]

    def shard_records(self, info: ShardInfo) -> list[dict]:
        cached = self._cache.get(info.shard_id)
        if cached is not None:
            self._cache.move_to_end(info.shard_id)
            return cached
        rows = [{k: r.get(k) for k in self.KEEP} for r in self.reader.records(info) if r.get("status") == "ok"]
        self._cache[info.shard_id] = rows
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return rows

    def record(self, i: int) -> tuple[ShardInfo, dict]:
        info, k = self.locate(i)
        return info, self.shard_records(info)[k]
