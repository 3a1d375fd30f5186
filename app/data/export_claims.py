"""Claims in an export folder: which exporter process is writing a shard (or assembling the export) right now.

Why: several exporters may work on one folder at once (`--processes`, `--part` on several hosts, a rerun started
while an old one still runs). A shard's files have deterministic names and contents, so two writers would write
the same bytes, but twice the work and twice the disk traffic; a claim makes the second one skip the shard.

A claim is `claims/{key}.json`, created exclusively (app/storage.py: hard link on local and NFS, a conditional
PUT on object stores), holding the claimer's identity (app/liveness.py) and a heartbeat it renews while it
works. It is released (deleted) once the shard's done marker is written; the marker, not the claim, says a
shard is done. A claim whose process is gone is taken over: on the same machine at once (pid and start time),
from another machine once its lease (4 heartbeats) ran out without a renewal.
"""

from __future__ import annotations

import datetime as dt
import time

import orjson

from app.liveness import attempt_state, heartbeat_seconds, identity, lease_seconds
from app.storage import Storage


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).isoformat(timespec="milliseconds")


class Claim:
    """One held claim; `renew()` refreshes its heartbeat at most once per heartbeat interval."""

    def __init__(self, out: Storage, rel: str, body: dict):
        self.out, self.rel, self.body = out, rel, body
        self._renewed = time.monotonic()

    def renew(self) -> None:
        if time.monotonic() - self._renewed < heartbeat_seconds():
            return
        self.body["heartbeat"] = _now_iso()
        self.out.write_json(self.rel, self.body)
        self._renewed = time.monotonic()

    def release(self) -> None:
        self.out.delete(self.rel)


def take(out: Storage, key: str, lease: bool = True) -> Claim | None:
    """Claim `key`, taking over a claim whose process is gone; None when a live process holds it.
    `lease` False: a claim from another machine never expires (its holder does not renew it)."""
    rel = f"claims/{key}.json"
    body = {**identity(), "started": _now_iso(), "heartbeat": _now_iso(),
            "lease_s": lease_seconds() if lease else None}
    data = orjson.dumps(body)
    for _ in range(2):
        if out.create_exclusive(rel, data):
            return Claim(out, rel, body)
        try:
            held = out.read_json(rel)
        except (FileNotFoundError, orjson.JSONDecodeError):
            continue  # released (or being written) meanwhile: try again
        if attempt_state(held, time.time(), None) != "dead":
            return None
        out.delete(rel)  # its process is gone: take it over
    return None
