"""Claims in an export folder: which exporter process is writing a shard (or assembling the export) right now.

Why: several exporters may work on one folder at once (`--processes`, `--part` on several hosts, a rerun started
while an old one still runs). A shard's files have deterministic names and contents, so two writers would write
the same bytes, but twice the work and twice the disk traffic; a claim makes the second one skip the shard.

A claim is `claims/{key}.json`, created exclusively (app.storage: hard link on local and NFS, a conditional
PUT on object stores), holding the claimer's identity (app.liveness) and a heartbeat that a thread of the
claimer renews every heartbeat interval while it works (`REGEN_HEARTBEAT_S`, as workers renew their attempts).
It is released (deleted) once the shard's done marker is written; the marker, not the claim, says a shard is
done. A claim whose process is gone is taken over: on the same machine at once (pid and start time),
from another machine once its lease (4 heartbeats) ran out without a renewal. Heartbeats are written and judged
on the fleet's shared clock (app.clock: the broker's Redis `TIME`, `REGEN_BROKER_URL`), as workers' leases
are, so exporters on hosts whose clocks disagree neither steal live claims nor wait on dead ones.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import orjson

from app.clock import shared_now
from app.ledger import timestamp
from app.liveness import attempt_state, heartbeat_seconds, identity, lease_seconds
from app.storage import Storage


class Claim:
    """One held claim: `with claim.held():` renews its heartbeat in a thread and releases it at the end."""

    def __init__(self, out: Storage, rel: str, body: dict):
        self.out, self.rel, self.body = out, rel, body

    @contextlib.contextmanager
    def held(self) -> Iterator[Claim]:
        stop = threading.Event()

        def beat() -> None:
            while not stop.wait(heartbeat_seconds()):
                self.body["heartbeat"] = timestamp()
                with contextlib.suppress(OSError):  # a missed beat is retried at the next one
                    self.out.write_json(self.rel, self.body)

        thread = threading.Thread(target=beat, name=f"claim {self.rel}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
            self.out.delete(self.rel)


def take(out: Storage, key: str) -> Claim | None:
    """Claim `key`, taking over a claim whose process is gone; None when a live process holds it."""
    rel = f"claims/{key}.json"
    body = {**identity(), "started": timestamp(), "heartbeat": timestamp(), "lease_s": lease_seconds()}
    data = orjson.dumps(body)
    for _ in range(2):
        if out.create_exclusive(rel, data):
            return Claim(out, rel, body)
        try:
            held = out.read_json(rel)
        except (FileNotFoundError, orjson.JSONDecodeError):
            continue  # released (or being written) meanwhile: try again
        if attempt_state(held, shared_now(), None) != "dead":
            return None
        out.delete(rel)  # its process is gone: take it over
    return None
