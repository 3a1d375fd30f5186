"""What `regen run` watches while its local workers work: the run's progress, and shards nothing will deliver.

Progress comes from the run's marker folders (storage is the record of what is done); `LostShardWatch` re-sends
what the broker lost and moves back the messages of shards whose holders died, so a run on one machine finishes
by itself after a worker is killed.
"""

from __future__ import annotations

import time

from app.base.clock import shared_now
from app.base.config import BrokerConfig
from app.base.dead_holders import DeadHolderCheck
from app.base.ledger import split_key
from app.base.storage import RunStore
from app.ops import fleet
from app.ops.status import RunScanner, summarise


def dead_shard_ids(store: RunStore) -> set[str]:
    """Shards with a dead letter in any stage: a staged shard dead in both stages is one dead shard."""
    return {split_key(key)[0] for key in store.dead_shards()}


def progress_counts(store: RunStore, staged: bool) -> tuple[int, int]:
    """(shards done, shards dead and not done) from two listings: `regen run`'s progress bar. A staged shard is
    done once both stages are."""
    done = store.done_shards()
    if staged:
        done = done & store.captured_shards()
    return len(done), len(dead_shard_ids(store) - done)


LOST_CHECK_S = 15.0  # how often `regen run` asks whether the broker lost a shard's message


class LostShardWatch:
    """Re-sends the run's shards whose messages the broker lost (app.ops.fleet.lost_from_broker): a worker killed
    between kombu's pop of a message and its unacked record leaves a shard nothing will deliver, and the run
    would wait forever. It re-sends only what two checks LOST_CHECK_S apart both found lost (a message is
    between the pop and the record for microseconds), through `regen reconcile`'s own path.

    Each check also moves back the messages of shards whose every attempt died holding them (a local worker
    SIGKILLed: its unacked messages would wait for the visibility timeout; app.base.dead_holders), listed in
    `resent_dead`."""

    def __init__(self, store: RunStore, broker_url: str, resend):
        self.store, self.broker_url, self.resend = store, broker_url, resend
        self.scanner = RunScanner(store)
        self.seen: int | None = None
        self.next_check = time.monotonic() + LOST_CHECK_S
        self.dead_holders = DeadHolderCheck(broker_url, BrokerConfig.from_env(broker_url).visibility_timeout)
        self.resent_dead: list[dict] = []

    def lost(self) -> int | None:
        stale_after = BrokerConfig.from_env(self.broker_url).visibility_timeout
        status = summarise(self.scanner.scan(), shared_now(self.broker_url), stale_after)
        queues = [q for q in (status.get("queue"), status.get("capture", {}).get("queue")) if q]
        lengths, unacked, error = fleet.queue_lengths(self.broker_url, queues)
        return None if error else fleet.lost_from_broker(status, lengths, unacked)

    def poll(self) -> int:
        """Check when due; returns how many shards it re-sent (0 most of the time)."""
        self.resent_dead = []
        if time.monotonic() < self.next_check:
            return 0
        self.next_check = time.monotonic() + LOST_CHECK_S
        self.resent_dead = [r for r in self.dead_holders.run() if r["run"] == self.store.run_id]
        lost = self.lost()
        confirmed = bool(lost and self.seen)
        self.seen = None if confirmed else lost
        if not confirmed:
            return 0
        self.resend()
        return lost
