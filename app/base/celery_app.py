"""The one Celery configuration shared by the producer, the workers and Flower.

JSON only (never pickle), late acks with prefetch 1, a `visibility_timeout` longer than the longest shard, no
results (outcomes live on storage), broker connections retried forever without cancelling running tasks, task
events on for Flower. Creating the app connects to nothing; `redis_client` is the plain Redis connection the
status views and the workers share. Why each setting: docs/faults.md#why-the-celery-settings-are-as-they-are.
"""

from __future__ import annotations

import os

from celery import Celery

from app.base.config import DEFAULT_QUEUE, BrokerConfig

GENERATE_TASK = "regen.generate_shard"
CAPTURE_TASK = "regen.capture_shard"
BENCH_DIRECT_TASK = "regen.bench_direct"


def celery_config(settings: BrokerConfig) -> dict:
    transport_options: dict = {"visibility_timeout": settings.visibility_timeout}
    if settings.unacked_restore_interval is not None:
        transport_options["unacked_restore_interval"] = settings.unacked_restore_interval
    if settings.url.startswith("filesystem://"):
        transport_options = {**transport_options, **filesystem_transport_options(settings.url)}
    return {
        "broker_url": settings.url,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "result_accept_content": ["json"],
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "broker_transport_options": transport_options,
        "result_backend_transport_options": {"visibility_timeout": settings.visibility_timeout},
        "task_ignore_result": True,
        "result_backend": None,
        "broker_connection_retry": True,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        "worker_cancel_long_running_tasks_on_connection_loss": False,
        "worker_send_task_events": True,
        # Workers send task events (what Flower shows); the producer does not add a `task-sent` event per
        # shard: it cost a quarter of the producer's time and Flower needs none of it.
        "task_send_sent_event": False,
        "task_default_queue": DEFAULT_QUEUE,
        "task_create_missing_queues": True,
        "worker_hijack_root_logger": False,
        "worker_redirect_stdouts": False,
        "broker_heartbeat": 0,
    }


def filesystem_transport_options(url: str) -> dict:
    """kombu's `filesystem://` transport (the embedded broker where no Redis runs) keeps messages in a folder.

    The folder is the URL's path: `filesystem:///var/tmp/regen-broker`.
    """
    folder = url[len("filesystem://") :] or "./.regen-broker"
    os.makedirs(folder, exist_ok=True)
    return {"data_folder_in": folder, "data_folder_out": folder, "processed_folder": folder,
            "control_folder": os.path.join(folder, "control"), "store_processed": False}


def create_app(settings: BrokerConfig | None = None) -> Celery:
    settings = settings or BrokerConfig.from_env()
    celery = Celery("regen", set_as_current=False)
    celery.conf.update(celery_config(settings))
    celery.conf.regen_settings = settings
    return celery


def redis_client(url: str, timeout: float = 3.0):
    """A Redis client on the broker `url` that gives up after `timeout` seconds instead of hanging a command."""
    import redis

    return redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
