"""What a run has done, read from its storage markers alone; `regen status` and `regen metrics` share it.

Why storage and not Redis: Redis forgets a message once it is acked, so only the markers know what is done.
Each shard's stage key (app.base.ledger) is in exactly one state: done, dead, running, failed, stale or waiting,
decided in that order. `RunScanner` caches what never changes (done markers, dead letters) between scans.
Each state's rule: docs/operating.md#a-shards-state-from-storage.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field

import orjson

from app.base.config import DEFAULT_VISIBILITY_TIMEOUT, mask_text
from app.base.dead_holders import died_holding
from app.base.documents import (
    AttemptRecord,
    DeadLetter,
    Document,
    DoneMarker,
    Pause,
    ProduceSummary,
    run_counts,
)
from app.base.errors import InvalidId
from app.base.ids import validate_id
from app.base.ledger import CAPTURE, GENERATE, pause_state, split_key, stage_key, stage_of
from app.base.liveness import attempt_state
from app.base.manifest import RunSettings
from app.base.run_totals import RunTotals, parse_time
from app.base.storage import RunStore, Storage


def iso(ts: float | None) -> str | None:
    return None if ts is None else dt.datetime.fromtimestamp(ts, dt.UTC).isoformat(timespec="seconds")


def list_runs(storage: Storage) -> list[str]:
    """Run ids under the root: folders holding a run.json."""
    runs = []
    for name in storage.listdir(""):
        try:
            validate_id(name)
        except InvalidId:
            continue
        if storage.exists(f"{name}/run.json"):
            runs.append(name)
    return runs


@dataclass
class RunScan:
    """Everything on storage about one run at one moment."""

    run_id: str
    manifest: dict | None
    produce: ProduceSummary | None
    pause: Pause | None
    done: dict[str, DoneMarker] = field(default_factory=dict)  # shard -> completion marker
    captured: set[str] = field(default_factory=set)
    dead: dict[str, DeadLetter] = field(default_factory=dict)  # key -> dead letter
    attempts: dict[str, list[AttemptRecord]] = field(default_factory=dict)  # key -> attempt records


class RunScanner:
    """Scans one run, re-reading only what can still change between scans.

    Done markers and dead letters never change once written, and the attempts of a key that has its marker or its
    letter no longer matter to its state: those are read once and kept. Each scan then costs one listing of each
    of the run's folders (`done/`, `captured/`, `dead/`, `attempts/`) plus a listing and a read of the attempts of
    the keys still open, so a `--watch` or a Prometheus scrape lists O(shards in flight) folders, not every
    attempt folder of the run (which at a thousand GPUs' run is ~1.4M listings a scrape). The first scan walks
    `attempts/` once instead (one recursive listing: paginated on an object store)."""

    def __init__(self, store: RunStore):
        self.store = store
        self._documents: dict[str, Document] = {}  # path -> a marker or dead letter (immutable once written)
        self._settled_attempts: dict[str, list[AttemptRecord]] = {}  # key -> its attempts, read once it was settled

    def _read_json(self, rel: str) -> dict | None:
        try:
            return self.store.storage.read_json(rel)
        except (FileNotFoundError, orjson.JSONDecodeError):
            return None

    def _markers(self, folder: str, kind: type[Document]) -> dict:
        """{name: typed document} of one marker folder; only names not seen before are read (and checked)."""
        paths = self.store.marker_paths(folder)
        fresh = self.store.read_documents([p for p in paths.values() if p not in self._documents])
        self._documents.update({p: kind.from_dict(body, p) for p, body in fresh.items()})
        return {name: self._documents[p] for name, p in paths.items() if p in self._documents}

    def scan(self) -> RunScan:
        storage, store = self.store.storage, self.store
        storage.fs.invalidate_cache()  # object-store listings are cached per process; others write them
        produce = self._read_json(store.produce_path)
        scan = RunScan(store.run_id, self._read_json(store.manifest_path),
                       None if produce is None else ProduceSummary.from_dict(produce, store.produce_path),
                       pause_state(store))
        scan.done = self._markers("done", DoneMarker)
        scan.dead = self._markers("dead", DeadLetter)
        scan.captured = store.captured_shards()
        open_paths: dict[str, list[str]] = {}
        if not self._settled_attempts:  # a first scan: one walk of attempts/ beats a listing per folder
            open_paths = store.attempt_tree()
        else:
            for key in store.attempt_keys():
                if _settled(scan, key) and key in self._settled_attempts:
                    if self._settled_attempts[key]:
                        scan.attempts[key] = self._settled_attempts[key]
                else:
                    open_paths[key] = store.attempt_paths(key)
        bodies = store.read_documents([p for paths in open_paths.values() for p in paths])
        for key, paths in open_paths.items():
            found = [AttemptRecord.from_dict(bodies[p], p) for p in sorted(paths) if p in bodies]
            if found:
                scan.attempts[key] = found
            if _settled(scan, key):
                self._settled_attempts[key] = found
        return scan


def shard_states(scan: RunScan, now: float, stale_after: float, capture: bool = False) -> dict[str, str]:
    """State of every shard (or capture key) that has left a trace on storage; see the module docstring."""
    stage = CAPTURE if capture else GENERATE
    done = {stage_key(s, CAPTURE) for s in scan.captured} if capture else set(scan.done)
    keys = {k for k in (*scan.attempts, *scan.dead, *done) if stage_of(k) == stage}
    states = {}
    for key in keys:
        attempts = scan.attempts.get(key, [])
        if key in done:
            states[key] = "done"
        elif key in scan.dead:
            states[key] = "dead"
        elif not attempts:
            states[key] = "waiting"
        elif any(attempt_state(a, now, stale_after) == "alive" for a in attempts):
            # an attempt renewed its lease within it (app.base.liveness; on the fleet's shared clock, `now`)
            states[key] = "running"
        elif any("error" in a for a in attempts):
            states[key] = "failed"
        else:
            states[key] = "stale"
    return states


def _count(states: dict[str, str]) -> dict[str, int]:
    out = dict.fromkeys(("done", "running", "failed", "stale", "dead"), 0)
    for state in states.values():
        out[state] = out.get(state, 0) + 1
    return out


def _finished_by(scan: RunScan, key: str, attempt: dict) -> bool:
    """The attempt's own output is the key's: the done marker names it (a captured key: it was captured)."""
    shard, stage = split_key(key)
    if stage == CAPTURE:
        return shard in scan.captured
    return (scan.done.get(shard) or {}).get("attempt") == attempt.get("attempt")


def _settled(scan: RunScan, key: str) -> bool:
    """The key has its completion marker (`done/`, or `captured/` for a capture key) or its dead letter."""
    shard, stage = split_key(key)
    return key in scan.dead or (shard in scan.captured if stage == CAPTURE else shard in scan.done)


def blank_worker(name: str, source: str) -> dict:
    """One worker's row of a status before anything is known of it; `source` says who reported it (`storage`: its
    markers and attempts; `broker`: it answered the broker's inspect without leaving anything on storage yet)."""
    return {"name": name, "device": None, "shards_done": 0, "generated_tokens": 0, "generation_seconds": 0.0,
            "tokens_per_s": None, "busy_fraction": None, "first_attempt": None, "last_seen": None,
            "current_shard": None, "current_since": None, "state": "idle", "last_heartbeat": None,
            "heartbeat_age_s": None, "source": source}


def _workers(scan: RunScan, now: float, stale_after: float) -> dict[str, dict]:
    """Per worker, from markers and attempt files (the broker's view is laid over this by app.ops.fleet).

    Each attempt is judged by its own liveness (app.base.liveness), never by its shard's state: a worker's current
    shard is its newest attempt that is alive on a key without marker or dead letter, so a dead host holds none
    although a live one may run the same shard. `state`: `running` (an attempt of it is alive), `dead` (its newest attempt's process died holding the
    shard: neither its output nor an error of its own), else `idle` (finished or failed its last shard: alive
    or gone, storage cannot tell; the broker's `online` can). `last_heartbeat` is its newest lease renewal and
    `heartbeat_age_s` that renewal's age on the shared clock."""
    workers: dict[str, dict] = {}

    def entry(name: str) -> dict:
        return workers.setdefault(name, blank_worker(name, "storage"))

    for marker in scan.done.values():
        w = entry(marker.get("worker") or "unknown")
        w["device"] = marker.get("device") or w["device"]
        w["shards_done"] += 1
        w["generated_tokens"] += int(marker.get("generated_tokens", 0))
        w["generation_seconds"] += float(marker.get("generation_seconds", 0.0))
        w["last_seen"] = max(filter(None, (w["last_seen"], parse_time(marker.get("finished")))), default=None)
    newest: dict[str, tuple[float, str, dict]] = {}
    for key, attempts in scan.attempts.items():
        for a in attempts:
            w = entry(a.get("worker") or "unknown")
            started = parse_time(a.get("started"))
            beat = parse_time(a.get("heartbeat")) or started
            seen = max(filter(None, (started, beat, parse_time(a.get("failed")), w["last_seen"])), default=None)
            w["last_seen"] = seen
            if beat is not None and (w["last_heartbeat"] is None or beat > w["last_heartbeat"]):
                w["last_heartbeat"] = beat
            if started is not None:
                w["first_attempt"] = min(filter(None, (w["first_attempt"], started)))
                if w["name"] not in newest or started > newest[w["name"]][0]:
                    newest[w["name"]] = (started, key, a)
            if not _settled(scan, key) and attempt_state(a, now, stale_after) == "alive" \
                    and started is not None and (w["current_since"] is None or started > w["current_since"]):
                w["current_shard"], w["current_since"], w["state"] = key, started, "running"
    for name, (_, key, a) in newest.items():
        w = workers[name]
        if w["state"] != "running" and attempt_state(a, now, stale_after) == "dead" and not _finished_by(scan, key, a):
            w["state"] = "dead"
    for w in workers.values():
        w["heartbeat_age_s"] = round(now - w["last_heartbeat"], 1) if w["last_heartbeat"] is not None else None
        w["generation_seconds"] = round(w["generation_seconds"], 4)
        w["tokens_per_s"] = _rate(w["generated_tokens"], w["generation_seconds"])
        span = now - w["first_attempt"] if w["first_attempt"] is not None else None
        w["busy_fraction"] = round(min(1.0, w["generation_seconds"] / span), 4) if span and span > 0 else None
    return workers


def held_by_dead(scan: RunScan, states: dict[str, str], now: float, stale_after: float) -> list[dict]:
    """The keys (shards, or staged capture keys) whose newest attempt's process died holding them, none alive,
    no marker, no dead letter (app.base.dead_holders.died_holding, the rule the fleet re-sends them by). Each names
    the worker and host of that attempt and its last heartbeat."""
    out = []
    for key, state in sorted(states.items()):
        if state not in ("stale", "failed"):
            continue
        last = died_holding(scan.attempts.get(key) or [], now, stale_after)
        if last is None:
            continue
        beat = parse_time(last.get("heartbeat") or last.get("started"))
        out.append({"shard": key, "worker": last.get("worker"), "host": last.get("host"),
                    "last_heartbeat": iso(beat), "heartbeat_age_s": round(now - beat, 1) if beat else None})
    return out


def _rate(amount: float, seconds: float | None) -> float | None:
    return round(amount / seconds, 3) if seconds and seconds > 0 else None


def summarise(scan: RunScan, now: float, stale_after: float = DEFAULT_VISIBILITY_TIMEOUT) -> dict:
    """The complete, JSON-ready status of one run (without the broker's live view)."""
    settings = (scan.manifest or {}).get("settings", {})
    counts = run_counts(scan.produce, scan.manifest)
    states = shard_states(scan, now, stale_after)
    by_state = _count(states)
    total = int(counts.get("shards") or 0) or None
    t = RunTotals.of(scan.done.values())
    wall = t.wall_seconds
    workers = _workers(scan, now, stale_after)
    remaining = None if total is None else max(0, total - by_state["done"] - by_state["dead"])
    shard_rate = by_state["done"] / wall if wall else None
    status = {
        "run": scan.run_id,
        "created": (scan.manifest or {}).get("created"),
        "capture_mode": RunSettings.view(settings).capture_mode if settings else None,
        "queue": (scan.produce or {}).get("queue"),
        "produce_complete": bool((scan.produce or {}).get("complete")),
        "shards": {"total": total, **by_state, "remaining": remaining,
                   "waiting": None if remaining is None else max(0, remaining - by_state["running"]
                                                                 - by_state["failed"] - by_state["stale"])},
        # samples: the prompts' K samples each (`--samples-per-prompt`); runs before it have one per prompt
        "samples": {"total": counts.get("samples", counts.get("enqueued")), "done": t.samples, "ok": t.ok,
                    "stubs": t.stubs, "rejected": t.rejected, "rejected_by_reason": dict(t.rejected_by_reason),
                    "flags": dict(t.flags)},
        "tokens": {"prompt": t.prompt_tokens, "generated": t.generated_tokens,
                   "generation_seconds": round(t.generation_seconds, 4)},
        # Engine rate: each worker's tokens / its generation seconds, summed (the fleet's rate while all run).
        "rates": {"engine_tokens_per_s": round(sum(w["tokens_per_s"] or 0.0 for w in workers.values()), 3) or None,
                  "wall_tokens_per_s": _rate(t.generated_tokens, wall), "wall_seconds": round(wall, 3) if wall else None,
                  "first_finished": iso(t.first_finished), "last_finished": iso(t.last_finished)},
        "eta_seconds": round(remaining / shard_rate, 1) if remaining is not None and shard_rate else None,
        "stub_rate": t.stub_rate,
        "paused": scan.pause,
        # shards whose every attempt died with its process (a killed worker, a dead host): re-sent by the fleet
        "held_by_dead": held_by_dead(scan, {**states, **(shard_states(scan, now, stale_after, capture=True)
                                                       if settings and RunSettings.view(settings).staged
                                                       else {})},
                                     now, stale_after),
        "failed": [_failure(k, scan.attempts[k]) for k, s in sorted(states.items()) if s == "failed"],
        "dead": [{"shard": k, "reason": mask_text(v.reason)} for k, v in sorted(scan.dead.items())
                 if stage_of(k) == GENERATE],
        # How to bring them back after a fix (the letters and their attempts are archived, the shards re-sent).
        "retry_dead": f"regen retry-dead {scan.run_id}" if scan.dead else None,
        "workers": [_public_worker(w) for _, w in sorted(workers.items())],
    }
    if settings and RunSettings.view(settings).staged:
        status["capture"] = {**_count(shard_states(scan, now, stale_after, capture=True)),
                             "queue": RunSettings.view(settings).capture_queue}
    return status


def _failure(key: str, attempts: list[dict]) -> dict:
    errors = sorted((a for a in attempts if "error" in a), key=lambda a: a.get("failed") or "")
    return {"shard": key, "attempts": len(attempts), "errors": len(errors), "last_error": mask_text(str(errors[-1]["error"]))}


def _public_worker(w: dict) -> dict:
    return {**w, "first_attempt": iso(w["first_attempt"]), "last_seen": iso(w["last_seen"]),
            "current_since": iso(w["current_since"]), "last_heartbeat": iso(w["last_heartbeat"])}
