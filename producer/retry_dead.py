"""`regen retry-dead RUN [--shard ID ...]`: bring dead-lettered shards back after a fix.

Why not delete `dead/*.json` by hand: the dead letter and the attempts are the record of why a shard failed, and
the attempts would still count against it (the first new delivery would dead-letter it again at once). So each
chosen dead letter is archived with every attempt record of its key under `{run}/archive/{key}/{stamp}/`
(`dead.json`, `attempts/*.json`), then the attempts and the letter are removed, letter last: a retry cut short
leaves the shard dead, and running the command again finishes it. Then the shards are re-sent: generation
shards through `produce --resume` restricted to them (the inputs are re-read; shards are deterministic), a
staged capture key (`{shard}.capture`) as a capture task for its done shard.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field, replace

from app.errors import ConfigError
from app.ids import validate_id
from app.storage import RunStore, Storage
from producer.run_setup import ProduceOptions

CAPTURE_SUFFIX = ".capture"


@dataclass
class RetryResult:
    archived: dict[str, str] = field(default_factory=dict)  # key -> archive folder
    sent: int = 0
    captures: int = 0


def archive_dead(store: RunStore, key: str, stamp: str) -> str:
    """Move `key`'s dead letter and attempt records under `archive/{key}/{stamp}/`; return that folder."""
    from workers.shard_output import sweep_temporaries

    storage = store.storage
    folder = store.archive_dir(key, stamp)
    storage.write_json(f"{folder}/dead.json", storage.read_json(store.dead_path(key)))
    sweep_temporaries(store, key, stale_after=None)  # what its dead attempts left half-written
    names = [n for n in storage.listdir(store.attempts_dir(key)) if n.endswith(".json") and not n.startswith(".")]
    for name in names:
        storage.write_bytes(f"{folder}/attempts/{name}", storage.read_bytes(f"{store.attempts_dir(key)}/{name}"))
    for name in names:
        storage.delete(f"{store.attempts_dir(key)}/{name}")
    storage.delete(store.dead_path(key))
    return folder


def retry_dead(opts: ProduceOptions, shards: list[str]) -> RetryResult:
    if not opts.storage:
        raise ConfigError("--storage (or REGEN_STORAGE) is required")
    store = RunStore(Storage(opts.storage), validate_id(opts.run_id or "", "run id"))
    if not store.exists():
        raise ConfigError(f"run {store.run_id} not found under {opts.storage}")
    dead = store.dead_shards()
    chosen = sorted(dead)
    if shards:
        unknown = [s for s in shards if s not in dead]
        if unknown:
            raise ConfigError(f"not dead-lettered in run {store.run_id}: {', '.join(unknown)} "
                              f"(dead: {', '.join(sorted(dead)) or 'none'})")
        chosen = sorted(set(shards))
    result = RetryResult()
    if not chosen:
        return result
    _preflight(store, opts, any(not k.endswith(CAPTURE_SUFFIX) for k in chosen))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    for key in chosen:
        result.archived[key] = archive_dead(store, key, stamp)
    generate = frozenset(k for k in chosen if not k.endswith(CAPTURE_SUFFIX))
    if generate:
        from producer.produce import produce

        result.sent = produce(replace(opts, resume=True, only_shards=generate)).accounting.shards_sent
    captures = [k[: -len(CAPTURE_SUFFIX)] for k in chosen if k.endswith(CAPTURE_SUFFIX)]
    if captures:
        result.captures = _send_captures(store, opts, captures)
    return result


def _preflight(store: RunStore, opts: ProduceOptions, resends_inputs: bool) -> None:
    """Fail before anything is archived when the re-send cannot happen: a shard whose letter was archived but
    that was never re-sent would be neither dead nor queued, and a second retry-dead would no longer see it.
    The inputs' presence and sizes (produce re-checks their sha256) and the broker's connection are checked."""
    import os

    from app.celery_app import create_app
    from app.config import BrokerSettings
    from app.errors import InputError
    from app.manifest import load

    if resends_inputs:
        for entry in load(store)["settings"].get("inputs", []):
            if not os.path.isfile(entry["path"]) or os.path.getsize(entry["path"]) != entry["size"]:
                raise InputError(f"{entry['path']}: input of this run is missing or changed; restore it to retry")
    broker = BrokerSettings.from_env(opts.broker)
    try:
        with create_app(broker).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # kombu's OperationalError and the socket errors under it
        raise ConfigError(f"broker {broker.masked_url} does not answer ({exc}); nothing was archived") from exc


def _send_captures(store: RunStore, opts: ProduceOptions, shards: list[str]) -> int:
    from app.celery_app import CAPTURE_TASK, create_app
    from app.config import DEFAULT_CAPTURE_QUEUE, BrokerSettings
    from app.manifest import load

    settings = load(store)["settings"]
    storage_url = store.storage.root if store.storage.is_local else store.storage.url
    app = create_app(BrokerSettings.from_env(opts.broker))
    queue = settings.get("capture_queue", DEFAULT_CAPTURE_QUEUE)
    for shard in shards:
        app.send_task(CAPTURE_TASK, kwargs={"run_id": store.run_id, "storage": storage_url, "shard_id": shard},
                      queue=queue)
    return len(shards)
