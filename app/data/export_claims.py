"""Claims in an export folder: which exporter process is writing a shard (or assembling the export) right now.

Why: several exporters may work on one folder at once; they would write the same bytes, but twice. A claim is
`claims/{key}.json`, created exclusively, with the claimer's identity and a heartbeat on the fleet's clock;
it is released once the shard's done marker is written (the marker says done), and taken over once its
process is gone. Details: docs/formats.md#export-claims.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import orjson

from app.base.clock import shared_now
from app.base.ledger import timestamp
from app.base.liveness import attempt_state, heartbeat_seconds, identity, lease_seconds
from app.base.storage import Storage


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
