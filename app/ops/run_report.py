"""`regen status`'s report: each run's storage-derived status (app.ops.status.summarise) with the broker's view
laid over it (queue lengths, unacked messages, live workers: app.ops.fleet.overlay); or, without a run, one
line per run under the root. The pilot's forecast beside a run produced with one is the command's to add
(app.pilot.forecast.compare_with_pilots): the pilot is a floor above this one.
"""

from __future__ import annotations

from app.base import dead_messages
from app.base.clock import shared_now
from app.base.config import mask_url
from app.base.manifest import load
from app.base.storage import RunStore, Storage
from app.ops import fleet
from app.ops.status import RunScanner, list_runs, summarise


def collect(storage_root: str, run_id: str | None, broker_url: str, inspect_timeout: float,
            stale_after: float, scanners: dict | None = None) -> dict:
    """One run's full status (RUN given) or the one-line-per-run overview; a JSON-ready dict."""
    scanners = {} if scanners is None else scanners
    storage = Storage(storage_root)
    runs = [run_id] if run_id else list_runs(storage)
    now = shared_now(broker_url)  # the clock leases are written on (app.base.clock)
    statuses = []
    for rid in runs:
        if rid not in scanners:
            store = RunStore(storage, rid)
            load(store)  # a clear error for a run that does not exist
            scanners[rid] = RunScanner(store)
        statuses.append(summarise(scanners[rid].scan(), now, stale_after))
    queues = sorted({q for s in statuses for q in (s.get("queue"), s.get("capture", {}).get("queue")) if q})
    lengths, unacked, q_error = fleet.queue_lengths(broker_url, queues)
    live, w_error = (None, None)
    if run_id and inspect_timeout > 0 and not q_error:
        live, w_error = fleet.live_workers(broker_url, inspect_timeout)
    errors = [e for e in (q_error, w_error) if e]
    rejected = None if q_error else dead_messages.count(broker_url)  # messages no worker could use
    for s in statuses:
        fleet.overlay(s, broker_url, lengths, unacked, live if not w_error else None, errors, now)
        s["broker"]["dead_messages"] = rejected
    if run_id:
        return {"storage": mask_url(storage.url), **statuses[0]}
    return {"storage": mask_url(storage.url), "broker": {"url": mask_url(broker_url), "queued": lengths,
                                                          "unacked": unacked, "dead_messages": rejected,
                                                          "error": "; ".join(errors) or None},
            "runs": [_run_line(s) for s in statuses]}


def _run_line(s: dict) -> dict:
    sh = s["shards"]
    return {"run": s["run"], "shards_total": sh["total"], "done": sh["done"], "queued": sh["queued"],
            "running": sh["running"], "failed": sh["failed"], "dead": sh["dead"], "samples_done": s["samples"]["done"],
            "generated_tokens": s["tokens"]["generated"], "stub_rate": s["stub_rate"],
            "paused": (s["paused"] or {}).get("reason") if s["paused"] else None}
