"""One fsspec-backed storage type: local and NFS paths now, `s3://` through s3fs.

Storage is the record of what is done: a shard is done exactly when its completion marker exists, created last
and exclusively; no writer exposes a partial file (docs/faults.md#one-output-per-shard; object stores:
docs/operating.md#s3-and-other-object-stores). Under the root, names deterministic (`{shard}`: a stage key):

    {run}/run.json                               run manifest (settings, inputs; written once)
    {run}/produce.json                           what the producer enqueued (summary, per-reason rejects)
    {run}/rejects.jsonl                          one row per rejected input line: file, line, reason
    {run}/shards/{shard}/{attempt}.records.jsonl.zst   the shard's sample records
    {run}/shards/{shard}/{attempt}.hidden.rgh          the shard's hidden states (see app.base.hidden_file)
    {run}/done/{shard}.json                      completion marker: names the attempt whose files are valid
    {run}/captured/{shard}.json                  staged capture's marker: names the hidden file to read
    {run}/attempts/{shard}/{attempt}.json        one file per delivery that started the shard
    {run}/dead/{shard}.json                      dead letter: the shard failed too often, with its errors
    {run}/archive/{key}/{stamp}/                 a retried dead letter (`dead.json`) and its attempts, kept
                                                 by `regen retry-dead`
    {run}/PAUSED.json                            present while the run is paused (reason inside)
"""

from __future__ import annotations

import contextlib
import glob
import os
import uuid
from collections.abc import Iterator

import fsspec
import orjson

from app.base.config import current, mask_url
from app.base.documents import AttemptRecord, DoneMarker
from app.base.errors import ConfigError, InvalidId
from app.base.ids import validate_id
from app.base.packages import REQUIREMENTS
from app.base.storage_counts import count


class Storage:
    """A root folder (local path or URL) with atomic writes and exclusive marker creation."""

    def __init__(self, root: str, **storage_options):
        self.url = root
        if "://" in root and not root.startswith("file://"):
            storage_options = {**current().storage_options, **storage_options}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(root, **storage_options)
        except ImportError as exc:  # fsspec imports a protocol's package on first use: s3fs for s3://
            raise ConfigError(f"storage {mask_url(root)}: {exc}" + (f" (pip install '{REQUIREMENTS['s3fs']}')"
                              if root.startswith(("s3://", "s3a://")) else "")) from None
        self.is_local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if self.is_local:
            self.root = os.path.abspath(self.root)
            os.makedirs(self.root, exist_ok=True)

    def __repr__(self) -> str:
        return f"Storage({self.url!r})"

    # -- paths -------------------------------------------------------------------------------------------
    def path(self, rel: str) -> str:
        parts = [p for p in rel.split("/") if p]
        for p in parts:
            if p in (".", "..") or "\\" in p or "\x00" in p:
                raise InvalidId(f"refusing path component {p!r} in {rel!r}")
        return "/".join([self.root.rstrip("/"), *parts])

    # -- reads ------------------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        count("exists", rel)
        return self.fs.exists(self.path(rel))

    def read_bytes(self, rel: str) -> bytes:
        with self.fs.open(self.path(rel), "rb") as fh:
            data = fh.read()
        count("read", rel, len(data))
        return data

    def read_json(self, rel: str):
        return orjson.loads(self.read_bytes(rel))

    def read_many(self, rels: list[str]) -> dict[str, bytes]:
        """{rel: bytes} of the files among `rels` that exist, in one batched call (fsspec's `cat` of a list, which
        object stores fetch concurrently); a file missing or gone is left out."""
        if not rels:
            return {}
        fulls = [self.path(rel) for rel in rels]
        by_full = dict(zip(fulls, rels, strict=True))
        data = self.fs.cat(fulls, on_error="omit")
        out = {}
        for full, raw in data.items():
            # the backend names each result by its own form of the path (with or without the protocol)
            rel = by_full.get(full) or by_full.get(fsspec.core.strip_protocol(full))
            if rel is None:
                raise RuntimeError(f"storage {self.url}: {full!r} read back under a name that was not asked for")
            if isinstance(raw, bytes):
                count("read", rel, len(raw))
                out[rel] = raw
        return out

    def open(self, rel: str, mode: str = "rb"):
        count("open", rel)
        return self.fs.open(self.path(rel), mode)

    def size(self, rel: str) -> int:
        count("stat", rel)
        return self.fs.size(self.path(rel))

    def listdir(self, rel: str) -> list[str]:
        """Names (not paths) directly under `rel`; empty when the folder does not exist."""
        count("list", rel)
        if self.is_local:  # names straight from the directory: fsspec's local `ls` re-parses every entry's path
            with contextlib.suppress(NotADirectoryError):
                try:
                    return sorted(os.listdir(self.path(rel)))
                except FileNotFoundError:
                    return []
        try:
            entries = self.fs.ls(self.path(rel), detail=False)
        except FileNotFoundError:
            return []
        return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in entries)

    # -- writes -----------------------------------------------------------------------------------------
    def _tmp_name(self, full: str) -> str:
        head, _, tail = full.rpartition("/")
        return f"{head}/.{tail}.tmp-{uuid.uuid4().hex[:12]}"

    @contextlib.contextmanager
    def atomic_writer(self, rel: str) -> Iterator:
        """Yield a binary file; on clean exit it appears under `rel` at once, on error nothing appears."""
        full = self.path(rel)
        count("mkdir", rel)
        self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
        if not self.is_local:
            # Object stores: the object appears only when the upload is committed (one PUT, or the multipart
            # upload's completion). fsspec commits whenever a file is closed, an error included, so the file is
            # opened without autocommit: committed on a clean exit, discarded (multipart upload aborted) on an error.
            fh = self.fs.open(full, "wb", autocommit=False)
            try:
                yield fh
            except BaseException:
                with contextlib.suppress(Exception):
                    fh.discard()
                with contextlib.suppress(Exception):
                    fh.closed = True  # nothing left to flush; closing would try to upload the discarded buffer
                raise
            nbytes = fh.tell()
            fh.close()
            fh.commit()
            count("write", rel, nbytes)
            return
        tmp = self._tmp_name(full)
        try:
            with open(tmp, "wb") as fh:
                yield fh
                fh.flush()
                count("write", rel, fh.tell())
                os.fsync(fh.fileno())
                count("fsync", rel)
            os.replace(tmp, full)
            count("rename", rel)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
                count("delete", rel)
            raise

    def write_bytes(self, rel: str, data: bytes) -> None:
        """`data` under `rel`, atomically. On object stores one PUT (`pipe_file`): already atomic, where
        `atomic_writer`'s uncommitted upload is a multipart upload of three requests (initiate, part, complete)
        even for an attempt record's few hundred bytes, which tripled the requests of every marker, record and
        heartbeat (bench/bench_fleet_scale.py's S3 pass, docs/performance.md)."""
        if not self.is_local:
            full = self.path(rel)
            count("write", rel, len(data))
            self.fs.pipe_file(full, data)
            return
        with self.atomic_writer(rel) as fh:
            fh.write(data)

    def write_json(self, rel: str, obj) -> None:
        self.write_bytes(rel, orjson.dumps(obj, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY) + b"\n")

    def create_exclusive(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data` unless it exists; True when this call created it.

        Local and NFS (v3+ honours link()): written to a temporary file, then hard-linked into place, which
        fails if the name exists, so two concurrent callers cannot both win. Object stores: fsspec's
        `pipe_file(mode="create")`; s3fs sends it as a conditional PUT (`If-None-Match: *`), which the store
        refuses when the key exists, so the race is decided by the store (AWS S3, MinIO; moto in the tests).
        Filesystems without conditional writes fall back, inside fsspec, to exists-then-write.
        """
        full = self.path(rel)
        count("mkdir", rel)
        self.fs.makedirs(full.rpartition("/")[0], exist_ok=True)
        if not self.is_local:
            count("put_if_absent", rel, len(data))
            try:
                self.fs.pipe_file(full, data, mode="create")
            except FileExistsError:
                return False
            return True
        tmp = self._tmp_name(full)
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            count("write", rel, len(data))
            os.fsync(fh.fileno())
            count("fsync", rel)
        try:
            count("link", rel)
            os.link(tmp, full)
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(tmp)
            count("delete", rel)

    def delete(self, rel: str, recursive: bool = False) -> None:
        count("delete", rel)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(self.path(rel), recursive=recursive)

    def temporaries(self, rel: str) -> list[tuple[str, float]]:
        """(name, mtime) of the `atomic_writer` temporaries (`.name.tmp-*`) directly in folder `rel`; empty on
        object stores (an unfinished upload never becomes an object) and when the folder does not exist."""
        if not self.is_local:
            return []
        count("list", rel)
        out = []
        for path in glob.glob(os.path.join(glob.escape(self.path(rel)), ".*.tmp-*")):
            with contextlib.suppress(FileNotFoundError):
                out.append((os.path.basename(path), os.stat(path).st_mtime))
        return sorted(out)

    def remove_temporary(self, rel: str) -> int:
        """Remove one temporary named by `temporaries`; 1 when this call removed it."""
        name = rel.rsplit("/", 1)[-1]
        if not (name.startswith(".") and ".tmp-" in name):
            raise ValueError(f"{rel!r} is not a temporary file")
        count("delete", rel)
        try:
            os.unlink(self.path(rel))
        except FileNotFoundError:
            return 0
        return 1


class RunStore:
    """The paths and markers of one run inside a Storage; the only place that knows the run layout (what is
    written at those paths, and when, is app.base.ledger's)."""

    def __init__(self, storage: Storage, run_id: str):
        self.storage = storage
        self.run_id = validate_id(run_id, "run id")

    def rel(self, *parts: str) -> str:
        return "/".join((self.run_id, *parts))

    # manifest and producer outputs
    @property
    def manifest_path(self) -> str:
        return self.rel("run.json")

    @property
    def rejects_path(self) -> str:
        return self.rel("rejects.jsonl")

    @property
    def produce_path(self) -> str:
        return self.rel("produce.json")

    @property
    def pause_path(self) -> str:
        return self.rel("PAUSED.json")

    def exists(self) -> bool:
        return self.storage.exists(self.manifest_path)

    # shard outputs
    def records_path(self, shard: str, attempt: str) -> str:
        return self.rel("shards", validate_id(shard, "shard id"), f"{validate_id(attempt, 'attempt')}.records.jsonl.zst")

    def hidden_path(self, shard: str, attempt: str) -> str:
        return self.rel("shards", validate_id(shard, "shard id"), f"{validate_id(attempt, 'attempt')}.hidden.rgh")

    def done_path(self, shard: str) -> str:
        return self.rel("done", f"{validate_id(shard, 'shard id')}.json")

    def captured_path(self, shard: str) -> str:
        """Staged capture's own completion marker (its hidden file is published separately)."""
        return self.rel("captured", f"{validate_id(shard, 'shard id')}.json")

    def dead_path(self, shard: str) -> str:
        return self.rel("dead", f"{validate_id(shard, 'shard id')}.json")

    def attempts_dir(self, shard: str) -> str:
        return self.rel("attempts", validate_id(shard, "shard id"))

    def attempt_path(self, key: str, attempt: str) -> str:
        return f"{self.attempts_dir(key)}/{attempt}.json"

    def attempt_record(self, key: str, attempt: str) -> AttemptRecord:
        """One attempt's record, typed (FileNotFoundError when it has none)."""
        path = self.attempt_path(key, attempt)
        return AttemptRecord.parse(self.storage.read_bytes(path), path)

    def archive_dir(self, key: str, stamp: str) -> str:
        """Where `regen retry-dead` keeps a dead letter and its attempts once it re-sends the shard."""
        return self.rel("archive", validate_id(key, "shard id"), validate_id(stamp, "archive stamp"))

    # markers
    def is_done(self, shard: str) -> bool:
        """Whether the generation's marker exists: the primitive app.base.ledger.is_finished(store, key) calls, the one
        answer to "is this stage finished" (either stage) that the worker's guards ask."""
        return self.storage.exists(self.done_path(shard))

    def done_marker(self, shard: str) -> DoneMarker | None:
        path = self.done_path(shard)
        try:
            return DoneMarker.parse(self.storage.read_bytes(path), path)
        except FileNotFoundError:
            return None

    def _markers(self, folder: str) -> set[str]:
        """Names of the `*.json` markers in one folder of the run, from one listing (no per-shard round trips)."""
        return {n[: -len(".json")] for n in self.storage.listdir(self.rel(folder)) if n.endswith(".json")}

    def read_documents(self, rels: list[str]) -> dict[str, dict]:
        """{rel: parsed JSON} of the run's small documents among `rels`, in one batched read; a file missing, or
        caught half-written on a store without atomic rename, is left out (the next read sees it)."""
        out = {}
        for rel, raw in self.storage.read_many(rels).items():
            with contextlib.suppress(orjson.JSONDecodeError):
                out[rel] = orjson.loads(raw)
        return out

    def marker_paths(self, folder: str) -> dict[str, str]:
        """{name: path} of the `*.json` markers in one of the run's flat folders (`done`, `captured`, `dead`),
        from one listing."""
        return {name: self.rel(folder, f"{name}.json") for name in self._markers(folder)}

    def attempt_keys(self) -> list[str]:
        """The stage keys with an attempts folder, from one listing of `attempts/` (not of every folder in it)."""
        keys = []
        for name in self.storage.listdir(self.rel("attempts")):
            with contextlib.suppress(InvalidId):
                keys.append(validate_id(name, "shard id"))
        return keys

    def attempt_tree(self) -> dict[str, list[str]]:
        """{key: paths of its attempt records} for every key, from one recursive listing of `attempts/` (a walk
        of the folders locally, paginated listings of the prefix on an object store): what a first scan needs."""
        storage = self.storage
        root = self.rel("attempts")
        count("list", root)
        try:
            found = storage.fs.find(storage.path(root))
        except FileNotFoundError:
            return {}
        strip = fsspec.core.strip_protocol
        base = strip(storage.path(root)).rstrip("/") + "/"
        tree: dict[str, list[str]] = {}
        for full in sorted(found):
            rest = strip(full)
            if not rest.startswith(base):
                continue
            rest = rest[len(base):]
            key, _, name = rest.partition("/")
            if "/" in name or not name.endswith(".json") or name.startswith("."):
                continue
            try:
                validate_id(key, "shard id")
            except InvalidId:
                continue
            tree.setdefault(key, []).append(f"{root}/{key}/{name}")
        return tree

    def attempt_paths(self, key: str) -> list[str]:
        """Paths of one key's attempt records (temporaries `.name.tmp-*` left out), from one listing."""
        folder = self.attempts_dir(key)
        return [f"{folder}/{n}" for n in self.storage.listdir(folder) if n.endswith(".json") and not n.startswith(".")]

    def done_shards(self) -> set[str]:
        """All shards with a completion marker."""
        return self._markers("done")

    def captured_shards(self) -> set[str]:
        """Shards whose staged capture is published."""
        return self._markers("captured")

    def dead_shards(self) -> set[str]:
        """Dead-lettered stage keys (app.base.ledger reads them back into shard and stage)."""
        return self._markers("dead")
