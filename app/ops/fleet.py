"""The broker's live view of the fleet: queue lengths and which worker runs which shard right now.

Queue length: Celery's Redis transport keeps a queue as a Redis list named after it (plus one list per extra
priority step, `{queue}\\x06\\x16{p}`), so `LLEN` is exact and cheap. Messages fetched but not yet acked sit in
the transport's `unacked` hash instead (shown separately).

Workers: `control.ping` finds the workers that answer, then `inspect().active(safe=True)` asks those what they
run; `safe` returns the short `kwargsrepr` the producer sets instead of a shard's prompts. regen's workers
answer mid-shard (thread pool), but a solo-pool worker does not (docs/measured-facts.md), and a busy host may miss the
timeout, so a silent worker is not a dead one: status then falls back to the newest attempt file it wrote
(app.ops.status). The broker is pinged with a plain Redis client first, so an
unreachable broker gives a one-line error at once instead of Celery's endless connection retries.
"""

from __future__ import annotations

import re

from app.base.celery_app import create_app, redis_client
from app.base.config import BrokerConfig, mask_text, mask_url
from app.ops.status import blank_worker, iso

PRIORITY_SEP = "\x06\x16"
PRIORITY_STEPS = (3, 6, 9)  # kombu's default steps besides 0, which uses the bare queue name
_KW = re.compile(r"""['"]?(run_id|shard_id)['"]?\s*:\s*['"]?([A-Za-z0-9._-]+)""")


def queue_lengths(url: str, queues: list[str]) -> tuple[dict[str, int], int | None, str | None]:
    """({queue: waiting messages}, unacked messages, error) from a Redis broker; error is a masked line."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return {}, None, f"queue length needs a Redis broker, not {mask_text(url.split('://')[0])}://"
    try:
        client = redis_client(url)
        with client.pipeline(transaction=False) as pipe:
            for q in queues:
                pipe.llen(q)
                for p in PRIORITY_STEPS:
                    pipe.llen(f"{q}{PRIORITY_SEP}{p}")
            pipe.hlen("unacked")
            values = pipe.execute()
        client.close()
    except Exception as exc:  # any broker trouble is reported, never raised: storage still has the answers
        return {}, None, mask_text(f"{type(exc).__name__}: {exc}")
    step = 1 + len(PRIORITY_STEPS)
    lengths = {q: sum(values[i * step:(i + 1) * step]) for i, q in enumerate(queues)}
    return lengths, values[-1], None


def _shard_of(request: dict) -> tuple[str | None, str | None]:
    kwargs = request.get("kwargs")
    if isinstance(kwargs, dict):
        return kwargs.get("run_id"), kwargs.get("shard_id")
    found = dict(_KW.findall(str(kwargs or "")))
    return found.get("run_id"), found.get("shard_id")


def live_workers(url: str, timeout: float = 1.0) -> tuple[dict[str, dict], str | None]:
    """({worker: {online, tasks: [{run, shard, since}]}}, error) for the workers that answer within `timeout`."""
    try:
        redis_client(url).ping()
    except Exception as exc:
        return {}, mask_text(f"{type(exc).__name__}: {exc}")
    app = create_app(BrokerConfig(url=url))
    app.conf.broker_connection_max_retries = 1
    try:
        names = [name for reply in app.control.ping(timeout=timeout) or [] for name in reply]
        active = app.control.inspect(destination=names, timeout=timeout).active(safe=True) if names else {}
    except Exception as exc:
        return {}, mask_text(f"{type(exc).__name__}: {exc}")
    finally:
        app.close()
    out = {}
    for name in names:
        tasks = []
        for request in (active or {}).get(name) or []:
            run, shard = _shard_of(request)
            tasks.append({"run": run, "shard": shard, "since": request.get("time_start")})
        out[name] = {"online": True, "tasks": tasks}
    return out, None


def overlay(status: dict, broker_url: str, lengths: dict[str, int], unacked: int | None, live: dict[str, dict] | None,
            errors: list[str], now: float) -> dict:
    """Lay the broker's view over a storage-derived run status (app.ops.status) in place; returns it.

    A worker that answered is authoritative about what it runs now (its `state` running or idle, never dead), and
    its `last_seen` is now. `live` None
    means the workers were not asked; then `online` is None (unknown) for every worker.
    """
    status["broker"] = {"url": mask_url(broker_url), "queued": lengths, "unacked": unacked,
                        "error": "; ".join(errors) or None}
    status["shards"]["queued"] = lengths.get(status.get("queue") or "")
    if "capture" in status:
        status["capture"]["queued"] = lengths.get(status["capture"]["queue"])
    lost = lost_from_broker(status, lengths, unacked)
    status["lost_from_broker"] = lost and {"shards": lost, "reconcile": f"regen reconcile {status['run']}"}
    by_name = {w["name"]: w for w in status["workers"]}
    for name, info in (live or {}).items():
        w = by_name.get(name)
        if w is None:
            w = by_name[name] = blank_worker(name, "broker")
        mine = [t for t in info["tasks"] if t["run"] == status["run"]]
        # it answered, so it lives (a worker restarted under the name of one that died holding a shard, too)
        w.update(current_shard=mine[0]["shard"] if mine else None,
                 current_since=iso(mine[0]["since"]) if mine else None, source="broker", last_seen=iso(now),
                 state="running" if mine else "idle")
    for w in by_name.values():
        w["online"] = None if live is None else w["name"] in live
    status["workers"] = [by_name[n] for n in sorted(by_name)]
    return status


def lost_from_broker(status: dict, lengths: dict[str, int], unacked: int | None) -> int | None:
    """How many of the run's shards nothing will deliver again: waiting, failed or stale on storage while Redis
    holds no message that could be theirs (the run's queues empty, no unacked message at all).

    Why it happens: kombu's Redis transport pops a message and records it as unacked only afterwards, in the
    consumer, so a worker killed in between loses it from Redis for good. Storage is the record, so `regen
    reconcile` re-sends such shards (a copy of a shard that is in fact still coming is harmless: storage keeps
    one output). None when it cannot be told: the queues were not read, a message is waiting or unacked
    anywhere (it may be one of the run's), the producer has not finished, or the run is paused.
    """
    if unacked is None or unacked or status.get("paused") or not status.get("produce_complete"):
        return None
    queues = [status.get("queue")] + ([status["capture"]["queue"]] if "capture" in status else [])
    if any(lengths.get(q) is None or lengths[q] for q in queues):
        return None
    shards = status["shards"]
    lost = (shards.get("waiting") or 0) + shards.get("failed", 0) + shards.get("stale", 0)
    if "capture" in status:
        lost += status["capture"].get("failed", 0) + status["capture"].get("stale", 0)
    return lost or None
