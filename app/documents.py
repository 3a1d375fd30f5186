"""The run's small documents on storage, each defined once as a type with its reading and writing.

Why: the run's storage is the record of what is done, and each document used to be a dict built where it was
written and read by key wherever it was needed, so a key's name or default could drift between the writer and
its readers. A type here names every key, reads what older runs wrote (missing keys take the defaults older
writers implied), keeps keys it does not know (a newer writer's, read by an older reader and written back
unchanged), and refuses a malformed document in one line that names its path. The JSON it writes is the same,
key for key and in the same order, as the dicts it replaces, so runs written before read the same.

Defined here so far: the dead letter (`DeadLetter`, `{run}/dead/{key}.json`) and the pause (`Pause`,
`{run}/PAUSED.json`). The manifest is app.manifest's (`RunSettings`), the completion and capture markers
workers.shard.shard_output's, the attempt record app.ledger's.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import orjson

from app.errors import ConfigError


class MalformedDocument(ConfigError):
    """A run document that is not what its type says; the message is one line naming the path."""


def _load(raw: bytes, where: str) -> dict:
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedDocument(f"{where}: not JSON ({exc})") from None
    if not isinstance(body, dict):
        raise MalformedDocument(f"{where}: a JSON object expected, found {type(body).__name__}")
    return body


def _field(body: dict, name: str, kind: type | tuple[type, ...], where: str, default: Any = ...) -> Any:
    if name not in body:
        if default is ...:
            raise MalformedDocument(f"{where}: no {name!r}")
        return default
    value = body[name]
    if not isinstance(value, kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise MalformedDocument(f"{where}: {name!r} is {type(value).__name__}, not {names}")
    return value


class Document(Mapping):
    """A typed document that reads as the read-only mapping of its JSON (`doc["reason"]`, `dict(doc)`, `==` a
    dict): readers that print or serialise it need no second form. Subclasses define `to_dict` and `from_dict`."""

    def to_dict(self) -> dict:
        raise NotImplementedError

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict())


def _unknown(body: dict, cls) -> dict:
    known = {f.name for f in fields(cls)} - {"extra"}
    return {k: v for k, v in body.items() if k not in known}


@dataclass(eq=False)
class DeadLetter(Document):
    """A stage key that failed too often: why, every attempt's record as it stood, and when (the fleet's clock).
    `regen retry-dead` archives it and re-sends the key."""

    shard_id: str  # the stage key (app.ledger.stage_key)
    reason: str
    attempts: list[dict] = field(default_factory=list)
    dead_lettered: str | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        body = {"shard_id": self.shard_id, "reason": self.reason, "attempts": self.attempts}
        if self.dead_lettered is not None:
            body["dead_lettered"] = self.dead_lettered
        return {**body, **self.extra}

    @classmethod
    def from_dict(cls, body: dict, where: str) -> DeadLetter:
        return cls(shard_id=_field(body, "shard_id", str, where), reason=str(_field(body, "reason", object, where)),
                   attempts=_field(body, "attempts", list, where, []),
                   dead_lettered=_field(body, "dead_lettered", (str, type(None)), where, None),
                   extra=_unknown(body, cls))

    @classmethod
    def parse(cls, raw: bytes, where: str) -> DeadLetter:
        return cls.from_dict(_load(raw, where), where)


@dataclass(eq=False)
class Pause(Document):
    """Why a run is paused, and the figures behind it (`details`: the stub rate and its window, or the capture
    check that failed, and the worker that paused it). Workers drop the run's shards while it exists."""

    reason: str
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"reason": self.reason, **self.details}

    @classmethod
    def from_dict(cls, body: dict, where: str) -> Pause:
        return cls(reason=str(_field(body, "reason", object, where)),
                   details={k: v for k, v in body.items() if k != "reason"})

    @classmethod
    def parse(cls, raw: bytes, where: str) -> Pause:
        return cls.from_dict(_load(raw, where), where)
