"""Shards held by dead processes come back within a few lease lengths, not after the broker's visibility timeout.

Why: a message fetched by a worker whose host then died stays in kombu's `unacked` hash until the visibility
timeout (hours), while storage already knows every attempt on the shard is dead. `resend_dead_holders` judges
each unacked shard message on storage, claims the re-send in Redis (`SET NX`, once per death) and moves the
message back to the head of its queue with kombu's own `restore_by_tag`. Exactly-once still rests on the
storage's completion marker. Steps and rules: docs/faults.md#re-sending-shards-held-by-dead-processes.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kombu import compression
from kombu.serialization import loads
from kombu.utils.json import loads as kombu_json

from app.base.celery_app import CAPTURE_TASK, GENERATE_TASK, create_app, redis_client
from app.base.clock import shared_now
from app.base.config import current, mask_text
from app.base.documents import AttemptRecord
from app.base.ledger import (
    CAPTURE,
    GENERATE,
    attempt_errors,
    is_dead,
    is_finished,
    stage_key,
    sweep_temporaries,
)
from app.base.liveness import attempt_state, lease_seconds
from app.base.storage import RunStore, Storage

log = logging.getLogger("regen.dead_holders")

UNACKED = "unacked"  # kombu's Redis transport default (regen does not change it)
UNSTARTED_LEASES = 2.0  # how long a fetched message may show no attempt before its holder counts as dead
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
CLAIM_PREFIX = "regen.resent"
CLAIM_TTL_S = 7 * 86400  # a claim outlives any shard; a run's shard dies with a new attempt id next time
TURN_KEY = "regen.dead-holders.turn"  # whose the current period's check is (workers.process.dead_holder_watch)
_STAGES = {GENERATE_TASK: GENERATE, CAPTURE_TASK: CAPTURE}


@dataclass(frozen=True)
class Held:
    """One unacked shard message: its delivery tag and what it asks for."""

    tag: str
    run_id: str
    storage: str
    key: str  # the shard's stage key (app.base.ledger.stage_key)
    eta: float | None = None  # a Celery retry's countdown end (POSIX seconds)


def decode_held(tag: str, raw: bytes) -> Held | None:
    """The shard task an unacked hash entry holds (`[message, exchange, routing key]`, as kombu writes it); None
    for anything else (another task, an unreadable body)."""
    try:
        message = kombu_json(raw.decode() if isinstance(raw, bytes) else raw)[0]  # bytes travel as typed JSON
        headers = message.get("headers") or {}
        stage = _STAGES.get(headers.get("task"))
        if stage is None:
            return None
        body = message["body"]
        if (message.get("properties") or {}).get("body_encoding") == "base64":
            body = base64.b64decode(body)
        if headers.get("compression"):
            body = compression.decompress(body if isinstance(body, bytes) else body.encode(), headers["compression"])
        _, kwargs, _ = loads(body, message.get("content-type"), message.get("content-encoding") or "utf-8",
                             accept={"application/json"})
        eta = headers.get("eta")
        return Held(tag, str(kwargs["run_id"]), str(kwargs["storage"]), stage_key(str(kwargs["shard_id"]), stage),
                    dt.datetime.fromisoformat(eta).timestamp() if eta else None)
    except Exception:  # not a shard message regen can read: the visibility timeout stays its only way back
        return None


def take_turn(broker_url: str, seconds: float, holder: str) -> bool:
    """Whether `holder` has the fleet's one dead-holder check for the next `seconds`: it takes the turn when
    nobody holds it (`SET NX PX` in Redis) and keeps it while it asks again in time (so one checker's cache of
    decoded messages stays warm instead of every checker fetching every held message once). True where the
    broker is not Redis (nothing to share a turn on) and when Redis cannot be asked (the check then fails and
    logs on its own)."""
    if not broker_url.startswith(REDIS_SCHEMES):
        return True
    ms = max(1, int(seconds * 1000))
    try:
        client = redis_client(broker_url)
        try:
            if client.set(TURN_KEY, holder, nx=True, px=ms):
                return True
            # the holder renews its own turn; a compare-and-set, so a lapsed turn someone else took stays theirs
            return bool(client.eval(_RENEW, 1, TURN_KEY, holder, ms))
        finally:
            client.close()
    except Exception as exc:
        log.warning("could not take the dead-holder check's turn: %s", mask_text(str(exc)))
        return True


_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) else return 0 end"


def died_holding(records: list[dict], now: float, stale_after: float | None) -> dict | None:
    """The newest of a key's attempt records when its process died holding the key and no attempt is alive; None
    otherwise (one runs, or the newest recorded an error or its end: Celery's retry, a new message, is then the
    key's way back, and may be held with its `eta` by a live worker)."""
    if not records:
        return None
    states = [attempt_state(r, now, stale_after) for r in records]
    newest = max(range(len(records)), key=lambda i: (records[i].get("started") or "", records[i].get("attempt") or ""))
    if "alive" in states or states[newest] != "dead":
        return None
    return records[newest]


def dead_holder(store: RunStore, key: str, now: float, stale_after: float | None) -> AttemptRecord | dict | None:
    """What holds `key` when its holder died: its newest attempt when that one's process died holding it and
    none is alive (`died_holding`), `{}` when it has no attempt at all (a fetch its holder never began, judged
    by how long it has been held), None when the key is finished, dead-lettered, running or being retried."""
    if is_finished(store, key) or is_dead(store, key):
        return None
    records = attempt_errors(store, key)
    if not records:
        return {}
    return died_holding(records, now, stale_after)


class DeadHolderCheck:
    """Finds and re-sends the shards held by dead processes on one broker (see the module docstring).

    Decoded messages are remembered by delivery tag (a message's tag never changes), so a periodic check reads
    only the messages fetched since the last one. `storage_for` maps a message's storage URL to this host's (a
    worker's `--storage`); `restore(tag)` moves one message back (default: kombu's `restore_by_tag` on a
    connection of the app `app` or one made for `broker_url`)."""

    def __init__(self, broker_url: str, stale_after: float | None, app=None,
                 storage_for: Callable[[str], str] | None = None):
        self.broker_url, self.stale_after, self.app = broker_url, stale_after, app
        self.storage_for = storage_for or (lambda url: url)
        self._decoded: dict[str, Held | None] = {}
        self._first_seen: dict[str, float] = {}  # tag -> when this checker first saw it held (monotonic)
        self._swept: set[str] = set()  # held copies of finished shards whose folders this checker swept
        self._connection = None  # kombu's, for the restores of one check

    def held(self, client) -> list[Held]:
        tags = [t.decode() if isinstance(t, bytes) else t for t in client.hkeys(UNACKED)]
        self._decoded = {t: self._decoded[t] for t in tags if t in self._decoded}
        self._first_seen = {t: self._first_seen.get(t, time.monotonic()) for t in tags}
        new = [t for t in tags if t not in self._decoded]
        if new:
            for tag, raw in zip(new, client.hmget(UNACKED, new), strict=True):
                self._decoded[tag] = decode_held(tag, raw) if raw is not None else None
        return [h for h in self._decoded.values() if h is not None]

    def run(self) -> list[dict]:
        """One check: re-send what dead processes hold; returns one dict per shard re-sent (shard, run, worker,
        host, last heartbeat). Broker or storage trouble is logged and ends the check, never raised."""
        if not self.broker_url.startswith(REDIS_SCHEMES):
            return []  # kombu's filesystem transport has no unacked hash: it delivers at most once
        try:
            client = redis_client(self.broker_url)
            try:
                return self._run(client)
            finally:
                client.close()
                self._close()
        except Exception as exc:
            log.warning("check for shards held by dead workers failed: %s", mask_text(str(exc)))
            return []

    def _run(self, client) -> list[dict]:
        now = shared_now(self.broker_url)
        by_key: dict[tuple, list[Held]] = {}
        for h in self.held(client):
            by_key.setdefault((self.storage_for(h.storage), h.run_id, h.key), []).append(h)
        resent = []
        for (storage, run_id, key), messages in sorted(by_key.items()):
            try:
                store = RunStore(Storage(storage), run_id)
                holder = dead_holder(store, key, now, self.stale_after)
                if holder is None:
                    self._sweep_finished(store, key, messages)
            except Exception as exc:  # one run's unreachable storage does not stop the others'
                log.warning("could not judge %s/%s: %s", run_id, key, exc)
                continue
            if holder is None:
                continue
            if holder:
                tag, claim = messages[0].tag, f"{CLAIM_PREFIX}:{run_id}:{key}:{holder.get('attempt')}"
            else:  # never started: only a message held long enough, past its eta, counts
                wait = UNSTARTED_LEASES * lease_seconds()
                old = [m for m in messages if time.monotonic() - self._first_seen[m.tag] >= wait
                       and (m.eta is None or now - m.eta >= wait)]
                if not old:
                    continue
                tag, claim = old[0].tag, f"{CLAIM_PREFIX}:{run_id}:{key}:unstarted:{old[0].tag}"
            if not client.set(claim, "1", nx=True, ex=CLAIM_TTL_S):
                continue  # another checker re-sent it for this death
            self.restore(tag)
            found = {"shard": key, "run": run_id, "worker": holder.worker if holder else None,
                     "host": holder.host if holder else None, "last_heartbeat": holder.heartbeat if holder else None}
            if holder:
                log.warning("re-sent %s of run %s: every attempt died (last held by %s on host %s, last heartbeat "
                            "%s)", key, run_id, found["worker"], found["host"], found["last_heartbeat"])
            else:
                log.warning("re-sent %s of run %s: fetched %.0f s ago and never started (its holder died)", key,
                            run_id, time.monotonic() - self._first_seen[tag])
            resent.append(found)
        return resent

    def _sweep_finished(self, store: RunStore, key: str, messages: list[Held]) -> None:
        """A held copy of a finished shard (a duplicate delivery whose holder may have died mid-write): remove
        what dead attempts left in the shard's folders, once per held message (the shard is done, nothing else
        returns to it; the copy itself is skipped whenever the broker hands it out again)."""
        fresh = [m.tag for m in messages if m.tag not in self._swept]
        if not fresh or not is_finished(store, key):
            return
        self._swept.update(fresh)
        removed = sweep_temporaries(store, key, self.stale_after)
        if removed:
            log.warning("removed %d temporaries dead attempts left on finished %s of run %s", removed, key,
                        store.run_id)

    def restore(self, tag: str) -> None:
        """Move the message back to the head of its queue: kombu's own restore transaction, on one connection
        for the whole check (a connection per message made a check that re-sends a dead host's 36 shards take
        ~25 s on a loaded 2-core box: docs/performance.md)."""
        if self.app is None:
            self.app = create_app(current().broker_for(self.broker_url))
        if self._connection is None:
            self._connection = self.app.connection_for_write()
        self._connection.default_channel.qos.restore_by_tag(tag, leftmost=False)

    def _close(self) -> None:
        if self._connection is not None:
            with contextlib.suppress(Exception):
                self._connection.close()
            self._connection = None
