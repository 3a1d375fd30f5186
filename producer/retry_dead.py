"""`regen retry-dead RUN [--shard ID ...]`: bring dead-lettered shards back after a fix.

Why not delete `dead/*.json` by hand: the dead letter and the attempts are the record of why a shard failed, and
the attempts would still count against it (the first new delivery would dead-letter it again at once). So each
chosen dead letter is archived with every attempt record of its key under `{run}/archive/{key}/{stamp}/`
(`dead.json`, `attempts/*.json`), then the attempts and the letter are removed, letter last: a retry cut short
leaves the shard dead, and running the command again finishes it (app.base.ledger.archive_dead). Then the shards are
re-sent: generation shards through `produce --resume` restricted to them (the inputs are re-read; shards are
deterministic), a staged capture's key as a capture task for its done shard.
"""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field, replace

from app.base.celery_app import create_app
from app.base.config import BrokerConfig
from app.base.errors import ConfigError, InputError
from app.base.ids import validate_id
from app.base.ledger import CAPTURE, GENERATE, archive_dead, split_key
from app.base.manifest import RunSettings, load
from app.base.storage import RunStore, Storage
from producer.produce import produce, send_captures, storage_url_for_workers
from producer.run_setup import ProduceOptions


@dataclass
class RetryResult:
    archived: dict[str, str] = field(default_factory=dict)  # key -> archive folder
    sent: int = 0
    captures: int = 0


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
    by_stage = {stage: [shard for shard, s in map(split_key, chosen) if s == stage] for stage in (GENERATE, CAPTURE)}
    _preflight(store, opts, bool(by_stage[GENERATE]))
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S.%fZ")
    for key in chosen:
        result.archived[key] = archive_dead(store, key, stamp)
    if by_stage[GENERATE]:
        only = frozenset(by_stage[GENERATE])
        result.sent = produce(replace(opts, resume=True, only_shards=only)).accounting.shards_sent
    if by_stage[CAPTURE]:
        app = create_app(BrokerConfig.from_env(opts.broker))
        result.captures = send_captures(store, app, storage_url_for_workers(store.storage), load(store)["settings"],
                                        by_stage[CAPTURE])
    return result


def _preflight(store: RunStore, opts: ProduceOptions, resends_inputs: bool) -> None:
    """Fail before anything is archived when the re-send cannot happen: a shard whose letter was archived but
    that was never re-sent would be neither dead nor queued, and a second retry-dead would no longer see it.
    The inputs' presence and sizes (produce re-checks their sha256) and the broker's connection are checked."""
    if resends_inputs:
        for entry in RunSettings.view(load(store).settings).inputs:
            if not os.path.isfile(entry["path"]) or os.path.getsize(entry["path"]) != entry["size"]:
                raise InputError(f"{entry['path']}: input of this run is missing or changed; restore it to retry")
    broker = BrokerConfig.from_env(opts.broker)
    try:
        with create_app(broker).connection_for_write() as conn:
            conn.ensure_connection(max_retries=1)
    except Exception as exc:  # kombu's OperationalError and the socket errors under it
        raise ConfigError(f"broker {broker.masked_url} does not answer ({exc}); nothing was archived") from exc

