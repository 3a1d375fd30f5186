"""The run's small documents on storage, each defined once as a type with its reading and writing.

Why: a document that is a dict built where written and read by key elsewhere lets a key's name or default
drift. Each type is the JSON object itself (a `dict`) with its keys named once: typed properties (with older
writers' defaults), `new` and `parse` (which refuses a malformed document in one line); unknown keys stay
untouched. Defined: `AttemptRecord`, `DoneMarker`, `CaptureMarker`, `DeadLetter`, `Pause`, `ProduceSummary`,
`Manifest`. Paths and rules: docs/formats.md#the-runs-documents-as-types.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from app.base.errors import ConfigError


class MalformedDocument(ConfigError):
    """A run document that is not what its type says; the message is one line naming the path."""


_ANY = object


class Document(dict):
    """A run document: its JSON object, with the keys its type requires (`REQUIRED`) and the types of the keys it
    knows (`TYPES`) checked when it is read."""

    REQUIRED: ClassVar[tuple[str, ...]] = ()
    TYPES: ClassVar[dict[str, type | tuple[type, ...]]] = {}

    @classmethod
    def parse(cls, raw: bytes, where: str):
        """The document from its bytes; `where` (its path) names it in the one-line refusal of a malformed one."""
        try:
            body = orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise MalformedDocument(f"{where}: not JSON ({exc})") from None
        return cls.from_dict(body, where)

    @classmethod
    def from_dict(cls, body: Any, where: str):
        if not isinstance(body, dict):
            raise MalformedDocument(f"{where}: a JSON object expected, found {type(body).__name__}")
        for key in cls.REQUIRED:
            if key not in body:
                raise MalformedDocument(f"{where}: no {key!r}")
        for key, kind in cls.TYPES.items():
            if key in body and not isinstance(body[key], kind):
                kinds = kind if isinstance(kind, tuple) else (kind,)
                names = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise MalformedDocument(f"{where}: {key!r} is {type(body[key]).__name__}, not {names}")
        cls.check(body, where)
        return cls(body)

    @classmethod
    def check(cls, body: dict, where: str) -> None:
        """Checks beyond a key's type (a subclass's)."""

    def to_json(self) -> bytes:
        return orjson.dumps(self)


_NUMBER = (int, float)


class _Counts(Document):
    """What a shard's markers count, read with the defaults older markers imply."""

    @property
    def samples(self) -> int:
        return int(self.get("samples", 0))

    @property
    def records(self) -> int:
        """Records written: a multi-turn conversation gives one per turn; markers before multi-turn count samples."""
        return int(self.get("records", self.get("samples", 0)))

    @property
    def ok(self) -> int:
        return int(self.get("ok", 0))

    @property
    def stubs(self) -> int:
        return int(self.get("stubs", 0))

    @property
    def rejected(self) -> dict[str, int]:
        return {k: int(n) for k, n in (self.get("rejected") or {}).items()}

    @property
    def flags(self) -> dict[str, int]:
        return {k: int(n) for k, n in (self.get("flags") or {}).items()}

    @property
    def prompt_tokens(self) -> int:
        return int(self.get("prompt_tokens", 0))

    @property
    def generated_tokens(self) -> int:
        return int(self.get("generated_tokens", 0))

    @property
    def generation_seconds(self) -> float:
        return float(self.get("generation_seconds", 0.0))


def _check_file_refs(files: dict, where: str) -> None:
    for name, ref in files.items():
        if not isinstance(ref, dict) or not isinstance(ref.get("path"), str):
            raise MalformedDocument(f"{where}: files.{name} names no path")


class AttemptRecord(Document):
    """One delivery of a stage key in one process (`{run}/attempts/{key}/{attempt}.json`): who (`worker`, and the
    process: `host`, `boot`, `pidns`, `pid`, `pid_start`), when it started and last renewed its lease
    (`started`, `heartbeat`, both on the fleet's shared clock; `lease_s`), and how it ended if it did not
    publish (`error`, `error_kind` "error" or "crash", `failed`; or `ended`, `ended_at`). Written by
    app.base.ledger.record_attempt and amended by its one read-modify-write."""

    REQUIRED = ("attempt",)
    TYPES: ClassVar = {"attempt": str, "worker": (str, type(None)), "started": str, "heartbeat": str,
                       "lease_s": _NUMBER, "pid": int, "error": str, "error_kind": str, "failed": str}

    @classmethod
    def new(cls, attempt: str, worker: str, identity: dict, started: str, lease_s: float,
            extra: dict | None = None) -> AttemptRecord:
        """`extra` (the engine, the stage) is written as it is, over the keys before it."""
        body = {"attempt": attempt, "worker": worker, **identity, "started": started, "lease_s": lease_s,
                **(extra or {})}
        body.setdefault("heartbeat", body["started"])
        return cls(body)

    @property
    def attempt(self) -> str:
        return self["attempt"]

    @property
    def worker(self) -> str | None:
        return self.get("worker")

    @property
    def host(self) -> str | None:
        """The host the attempt's process ran on (records before host identity have none)."""
        return self.get("host")

    @property
    def started(self) -> str | None:
        return self.get("started")

    @property
    def heartbeat(self) -> str | None:
        """The last lease renewal; records written before leases have only `started`."""
        return self.get("heartbeat") or self.get("started")

    @property
    def error(self) -> str | None:
        return self.get("error")

    @property
    def error_kind(self) -> str | None:
        return self.get("error_kind")


class DoneMarker(_Counts):
    """A shard's completion marker: the attempt whose files are the shard's (`files`: the records file and, with
    inline capture, the hidden file, each with its size and sha256), the shard's counts, who made it and when
    (`finished`, the fleet's shared clock). Written exclusively, once, last (workers.shard.shard_output)."""

    REQUIRED = ("shard_id", "attempt", "files")
    TYPES: ClassVar = {"shard_id": str, "attempt": str, "files": dict, "samples": int, "records": int, "ok": int,
                       "stubs": int, "rejected": dict, "flags": dict, "prompt_tokens": int, "generated_tokens": int,
                       "generation_seconds": _NUMBER, "worker": (str, type(None)), "finished": str}

    @classmethod
    def check(cls, body: dict, where: str) -> None:
        _check_file_refs(body["files"], where)
        if "records" not in body["files"]:
            raise MalformedDocument(f"{where}: files names no records file")

    @classmethod
    def new(cls, shard_id: str, attempt: str, files: dict, summary: dict) -> DoneMarker:
        """The marker a generation publishes (`finished` is stamped as it is created)."""
        return cls({"shard_id": shard_id, "attempt": attempt, "files": files, **summary})

    @property
    def shard_id(self) -> str:
        return self["shard_id"]

    @property
    def attempt(self) -> str:
        return self["attempt"]

    @property
    def records_file(self) -> dict:
        return self["files"]["records"]

    @property
    def hidden_file(self) -> dict | None:
        """The inline capture's hidden file (path, bytes, sha256); None without inline capture."""
        return (self.get("files") or {}).get("hidden")

    @property
    def worker(self) -> str | None:
        return self.get("worker")

    @property
    def finished(self) -> str | None:
        return self.get("finished")


class CaptureMarker(Document):
    """A staged shard's capture marker: the capture attempt's hidden file (path, bytes, sha256), each sample's
    place in it (`index`), what the quality gate flagged (`problems`), the capture check's outcome, who
    captured it and when (`finished`, the fleet's shared clock)."""

    REQUIRED = ("shard_id", "attempt", "hidden")
    TYPES: ClassVar = {"shard_id": str, "attempt": str, "hidden": dict, "index": dict, "problems": dict,
                       "worker": (str, type(None)), "capture_check": dict, "repaired": dict, "finished": str}

    @classmethod
    def check(cls, body: dict, where: str) -> None:
        _check_file_refs({"hidden": body["hidden"]}, where)

    @classmethod
    def new(cls, shard_id: str, attempt: str, hidden: dict, index: dict, problems: dict, worker: str,
            engine_mode: str, capture_check: dict, repaired: dict | None = None) -> CaptureMarker:
        body = {"shard_id": shard_id, "attempt": attempt, "hidden": hidden, "index": index, "problems": problems,
                "worker": worker, "engine_mode": engine_mode, "capture_check": capture_check}
        if repaired:  # samples whose first capture had zero or non-finite rows, captured again
            body["repaired"] = repaired
        return cls(body)

    @property
    def attempt(self) -> str:
        return self["attempt"]

    @property
    def hidden_file(self) -> dict:
        return self["hidden"]

    @property
    def finished(self) -> str | None:
        return self.get("finished")


class Manifest(Document):
    """The run's manifest (`{run}/run.json`): the settings that decide its data (app.base.manifest.RunSettings, the
    one definition of each setting and its default), when it was created and the software it was created with.
    Written once, when the run is created. Runs made before the counts had one home also carry a copy of the
    producer's counts here (`counts`), which `run_counts` reads where the producer's summary has none."""

    REQUIRED = ("run_id", "settings")
    TYPES: ClassVar = {"format": str, "run_id": str, "created": str, "settings": dict, "counts": (dict, type(None)),
                       "software": dict}

    @classmethod
    def new(cls, fmt: str, run_id: str, created: str, settings: dict, software: dict) -> Manifest:
        # `software`: what the manifest was written with (a worker records its own on each attempt); not
        # settings, so a run reopened after an upgrade is not refused for it
        return cls({"format": fmt, "run_id": run_id, "created": created, "settings": settings, "software": software})

    @property
    def run_id(self) -> str:
        return self["run_id"]

    @property
    def settings(self) -> dict:
        return self["settings"]

class ProduceSummary(Document):
    """What the producer enqueued (`{run}/produce.json`): whether it finished (`complete`), the queue, its own
    settings, and its counts (lines read, enqueued, duplicates, rejected by reason, shards, samples, modes).
    Rewritten as the producer goes and once at its end; the run's counts are read from here first
    (`run_counts`)."""

    REQUIRED = ("run_id",)
    TYPES: ClassVar = {"run_id": str, "complete": bool, "queue": (str, type(None)), "counts": (dict, type(None)),
                       "producer_settings": (dict, type(None))}

    @classmethod
    def new(cls, run_id: str, complete: bool, started: str, finished: str | None, queue: str,
            producer_settings: dict, counts: dict | None) -> ProduceSummary:
        return cls({"run_id": run_id, "complete": complete, "started": started, "finished": finished, "queue": queue,
                    "producer_settings": producer_settings, "counts": counts})

    @property
    def complete(self) -> bool:
        return bool(self.get("complete"))

    @property
    def queue(self) -> str | None:
        return self.get("queue")

    @property
    def counts(self) -> dict | None:
        return self.get("counts")


def run_counts(produce: dict | None, manifest: dict | None) -> dict:
    """The run's counts: the producer's summary's (their one home), else the copy an older run's manifest
    carries; one rule for every reader."""
    return (produce or {}).get("counts") or (manifest or {}).get("counts") or {}


class DeadLetter(Document):
    """A stage key that failed too often: why, every attempt's record as it stood, and when (the fleet's clock).
    `regen retry-dead` archives it and re-sends the key."""

    REQUIRED = ("shard_id", "reason")
    TYPES: ClassVar = {"shard_id": str, "attempts": list, "dead_lettered": (str, type(None))}

    @classmethod
    def new(cls, key: str, reason: str, attempts: list[dict], when: str) -> DeadLetter:
        return cls({"shard_id": key, "reason": reason, "attempts": attempts, "dead_lettered": when})

    @property
    def key(self) -> str:
        """The stage key (app.base.ledger.stage_key) it was written for."""
        return self["shard_id"]

    @property
    def reason(self) -> str:
        return str(self["reason"])

    @property
    def attempts(self) -> list[dict]:
        return self.get("attempts") or []

    @property
    def dead_lettered(self) -> str | None:
        return self.get("dead_lettered")


class Pause(Document):
    """Why a run is paused, and the figures behind it (the stub rate and its window, or the capture check that
    failed, and the worker that paused it). Workers drop the run's shards while it exists."""

    REQUIRED = ("reason",)

    @classmethod
    def new(cls, reason: str, **details) -> Pause:
        return cls({"reason": reason, **details})

    @property
    def reason(self) -> str:
        return str(self["reason"])

    @property
    def details(self) -> dict:
        return {k: v for k, v in self.items() if k != "reason"}
