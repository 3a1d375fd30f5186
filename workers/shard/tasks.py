"""The Celery tasks a worker runs: `generate_shard` and `capture_shard`, module-level functions.

Each is one delivery of one shard at one stage: `run_delivery` (workers.shard.delivery) runs the stage's work,
`generate_and_publish` or `capture_and_publish` below, between the delivery's policies (the claim, the guards, the
pauses, the retry policy); the work returns what it produced (`Done`), which the pauses read. `register` binds
the tasks to a worker's Celery app (workers.celery_worker calls it); only worker processes import this module.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time

from celery import Celery, Task

from app.base.celery_app import CAPTURE_TASK, GENERATE_TASK
from app.base.ledger import CAPTURE, GENERATE
from app.base.manifest import RunSettings, compression_level
from workers.process.context import WorkerContext
from workers.shard.capture_stage import capture_records
from workers.shard.delivery import GuardedTask, run_delivery
from workers.shard.generate import generate_records
from workers.shard.policy import Delivery, Done
from workers.shard.shard_output import hidden_file_stream, publish_shard

log = logging.getLogger("regen.tasks")


def generate_shard(task: Task, run_id: str, storage: str, shard_id: str, samples: list[dict]) -> str:
    """Task `regen.generate_shard`: generate a shard's samples (capturing their states inline, or handing them to
    the capture stage of a staged run) and publish them."""
    work = functools.partial(generate_and_publish, task, storage=storage, samples=samples, task_started=time.time())
    kwargs = {"run_id": run_id, "storage": storage, "shard_id": shard_id, "samples": samples}
    return run_delivery(task, GENERATE, kwargs, work)


def capture_shard(task: Task, run_id: str, storage: str, shard_id: str) -> str:
    """Task `regen.capture_shard`: the second stage of a staged run, the hidden states of a generated shard."""
    kwargs = {"run_id": run_id, "storage": storage, "shard_id": shard_id}
    return run_delivery(task, CAPTURE, kwargs, capture_and_publish)


def generate_and_publish(task: Task, ctx: WorkerContext, d: Delivery, *, storage: str, samples: list[dict],
                         task_started: float) -> Done:
    """Generation's work on a delivery that passed its guards: records (and inline states) written under the
    attempt's names, the completion marker created; a staged run's capture task sent (on the `storage` the
    message named); its records and capture checks handed to the pauses."""
    store, manifest, attempt = d.store, d.manifest, d.attempt
    settings = RunSettings.view(manifest["settings"])
    inline = settings.capture_inline
    with hidden_file_stream(store, d.shard, attempt) if inline else contextlib.nullcontext() as stream:
        records, summary = generate_records(ctx, manifest, d.run_id, d.shard, samples, stream)
    summary["task_started"] = round(task_started, 4)
    t_pub = time.time()
    won = publish_shard(store, d.shard, attempt, records, stream.written if inline else None, summary,
                        level=compression_level(settings), stale_after=d.stale_after)
    log.info("%s/%s timings: begin %.1f ms, engine-end->publish %.1f ms, publish %.1f ms", d.run_id, d.shard,
             (summary["engine_started"] - task_started) * 1000, (t_pub - summary["engine_finished"]) * 1000,
             (time.time() - t_pub) * 1000)
    if settings.staged and won:
        task.app.send_task(CAPTURE_TASK, kwargs={"run_id": d.run_id, "storage": storage, "shard_id": d.shard},
                           queue=settings.capture_queue)
    return Done("done" if won else "duplicate", records,
                [(r["sample_id"], r["capture_check"]) for r in records if r.get("capture_check")])


def capture_and_publish(ctx: WorkerContext, d: Delivery) -> Done:
    """The capture stage's work: the states of the generated records, published with the stage's marker."""
    won, outcomes = capture_records(ctx, d.store, d.manifest, d.shard, d.attempt, stale_after=d.stale_after)
    return Done("done" if won else "duplicate", checks=[(o.sample_id, o.as_record()) for o in outcomes])


def register(celery: Celery) -> None:
    """Register the tasks on `celery`: late acks, retries without a Celery limit (the attempt count on storage
    decides the dead letter), arguments checked before they run (`GuardedTask`)."""
    options = {"bind": True, "acks_late": True, "max_retries": None, "base": GuardedTask}
    celery.task(name=GENERATE_TASK, **options)(generate_shard)
    celery.task(name=CAPTURE_TASK, **options)(capture_shard)
