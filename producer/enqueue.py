"""Publish shards as Celery tasks, one message per shard, through one reused producer connection.

One message per shard (the unit a worker generates and marks done) keeps the broker's work small. Compression
is `auto` by default (`choose_compression`: only for a large, unbounded backlog, since it costs producer CPU);
publishes go in kombu's publish batches, flushed before every queue-length check and on close; `max_pending`
bounds the queue with `LLEN`, asked only when the last length plus what was sent since reaches the cap.
Why, with the figures: docs/operating.md#how-the-producer-publishes.
"""

from __future__ import annotations

import queue as queue_module
import threading
import time
import warnings
from collections.abc import Callable

from app.base.celery_app import GENERATE_TASK, create_app
from app.base.config import BrokerConfig, mask_url
from app.base.errors import ConfigError, RetryableError
from app.base.library_patches import ORJSON_SERIALIZER, register_fast_codecs
from producer.sharding import Shard

COMPRESS_ABOVE = 4096
COMPRESS_MODES = ("auto", "zstd", "none")
BATCH_OPERATIONS = 32  # Redis commands (one LPUSH per shard) per pipeline
AUTO_COMPRESS_INPUT_BYTES = 1 << 30
QUEUE_DEPTH = 8  # shards handed to the publishing thread and not yet published
TRIM_EVERY = 64  # shards between malloc_trim calls (see _heap_trimmer)
_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_STOP = object()


def choose_compression(mode: str, max_pending: int | None, input_bytes: int) -> str:
    """`zstd` or `none` for `--compress MODE`; see the module docstring for why `auto` decides as it does."""
    if mode not in COMPRESS_MODES:
        raise ConfigError(f"unknown compression {mode!r} (auto, zstd or none)")
    if mode != "auto":
        return mode
    return "zstd" if max_pending is None and input_bytes > AUTO_COMPRESS_INPUT_BYTES else "none"


def _heap_trimmer() -> Callable[[], object] | None:
    """glibc's `malloc_trim(0)`, or None off glibc.

    Why: every shard allocates a few 100+ KB buffers (body, envelope, pipeline); glibc raises its mmap threshold
    after the first frees, so later ones come from the heap, and freed heap pages are kept: RSS crept up by
    ~40 MB over 200K prompts before levelling off. Trimming every `TRIM_EVERY` shards returns them (measured:
    flat RSS, <5% CPU), so peak memory does not depend on input size.
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


class ShardSender:
    """Context manager: `send(run_id, storage_url, shard)` hands a shard to the publishing thread; exit waits.

    Why a thread: LPUSHing a 100+ KB message makes the producer wait on Redis (socket buffers full, replies at
    the end of each pipeline) for about a quarter of its wall time; one publishing thread overlaps that wait
    with reading and normalising the next shard (both release the GIL while blocked). One thread keeps the
    publish order, and `send` blocks once `QUEUE_DEPTH` shards wait, so memory stays bounded. An error in the
    thread is raised from the next `send` or from `__exit__` as a RetryableError; a clean exit returns only
    after every shard was flushed to the broker.
    """

    def __init__(self, broker_url: str | None, queue: str, max_pending: int | None = None,
                 poll_interval: float = 0.2, sleep: Callable[[float], None] = time.sleep, compress: str = "zstd",
                 input_bytes: int = 0):
        self.settings = BrokerConfig.from_env(broker_url)
        self.queue = queue
        self.max_pending = max_pending
        self.compress = choose_compression(compress, max_pending, input_bytes) == "zstd"
        self._bound: int | None = None  # upper bound on the queue's length: last LLEN + shards sent since
        self.poll_interval = poll_interval
        self._sleep = sleep
        self.app = create_app(self.settings)
        self._is_redis = self.settings.url.startswith(_REDIS_SCHEMES)
        if self._is_redis:
            # The body goes into the envelope as JSON text (kombu tags it {"__type__": "bytes"}) instead of base64:
            # no encode/decode pass and 25% fewer bytes through Redis. Receivers read the encoding from each
            # message's properties, so workers need no matching setting; zstd bodies fall back to base64 tagging.
            options = dict(self.app.conf.broker_transport_options or {})
            options["body_encoding"] = None
            self.app.conf.broker_transport_options = options
        register_fast_codecs()
        self._producer = None
        self._batch = None
        self._redis = None
        self._inbox: queue_module.Queue = queue_module.Queue(maxsize=QUEUE_DEPTH)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._abort = False
        self.waits = 0
        self.length_checks = 0

    def __enter__(self) -> ShardSender:
        if self.max_pending is not None:
            if self._is_redis:
                import redis

                self._redis = redis.Redis.from_url(self.settings.url)
            else:
                warnings.warn(f"--max-pending needs a Redis broker; ignored for {mask_url(self.settings.url)}",
                              stacklevel=2)
        try:
            self._producer = self.app.producer_pool.acquire(block=True)
        except Exception as exc:
            raise RetryableError(f"cannot reach the broker {self.settings.masked_url}: {exc}") from None
        self._thread = threading.Thread(target=self._publish_loop, name="regen-publisher", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        try:
            if self._thread is not None:
                if exc_type is not None:
                    self._abort = True  # buffered messages are discarded, never half-sent
                self._put(_STOP)
                self._thread.join()
                self._thread = None
            if self._error is not None and exc_type is None:
                raise self._error
        finally:
            self._release()

    def send(self, run_id: str, storage_url: str, shard: Shard) -> None:
        """Queue one shard for publishing (blocks while `QUEUE_DEPTH` shards wait)."""
        self._put((run_id, storage_url, shard))

    def _put(self, item) -> None:
        while True:
            if self._error is not None and item is not _STOP:
                raise self._error
            if self._thread is None or not self._thread.is_alive():
                if item is _STOP:
                    return
                raise RetryableError("the publishing thread is not running (use ShardSender as a context manager)")
            try:
                self._inbox.put(item, timeout=0.2)
                return
            except queue_module.Full:
                continue

    def _publish_loop(self) -> None:
        """The publishing thread: owns the kombu producer and its batch from start to finish."""
        batch = None
        try:
            if hasattr(self._producer, "batch"):
                batch = self._producer.batch(max_size=BATCH_OPERATIONS)
                batch.__enter__()
                self._batch = batch
            trim, published = _heap_trimmer(), 0
            while not self._abort:
                item = self._inbox.get()
                if item is _STOP or self._abort:
                    break
                self._publish(*item)
                published += 1
                if trim is not None and published % TRIM_EVERY == 0:
                    trim(0)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            self._error = exc if isinstance(exc, RetryableError) else self._failure(exc)
            self._abort = True
        finally:
            self._batch = None
            if batch is not None:
                try:
                    if self._abort:
                        batch.__exit__(RuntimeError, RuntimeError("aborted"), None)  # discards what is buffered
                    else:
                        batch.__exit__(None, None, None)  # flushes
                except Exception as flush_error:
                    if self._error is None:
                        self._error = self._failure(flush_error)
            while True:  # unblock a sender waiting on a full inbox after an error
                try:
                    self._inbox.get_nowait()
                except queue_module.Empty:
                    break

    def _failure(self, exc: BaseException, what: str = "") -> RetryableError:
        return RetryableError(f"publishing {what}to {self.settings.masked_url} failed: {exc} "
                              "(re-run the same produce command: finished shards are skipped)")

    def flush(self) -> None:
        if self._batch is not None:
            self._batch.flush()

    def _release(self) -> None:
        if self._producer is not None:
            self._producer.release()
            self._producer = None
        if self._redis is not None:
            self._redis.close()

    def pending(self) -> int | None:
        return int(self._redis.llen(self.queue)) if self._redis is not None else None

    def wait_for_room(self) -> None:
        """Block while more than `max_pending` messages wait in the queue (workers drain it)."""
        if self._redis is None:
            return
        if self._bound is not None and self._bound <= self.max_pending:
            self._bound += 1
            return
        self.flush()
        self.length_checks += 1
        while (length := self.pending()) > self.max_pending:
            self.waits += 1
            self._sleep(self.poll_interval)
        self._bound = length + 1

    def _publish(self, run_id: str, storage_url: str, shard: Shard) -> None:
        self.wait_for_room()
        kwargs = {"run_id": run_id, "storage": storage_url, "shard_id": shard.id, "samples": shard.samples}
        try:
            self.app.send_task(
                GENERATE_TASK,
                kwargs=kwargs,
                queue=self.queue,
                producer=self._producer,
                compression="zstd" if self.compress and shard.approx_bytes > COMPRESS_ABOVE else None,
                serializer=ORJSON_SERIALIZER,
                task_id=f"{run_id}.{shard.id}",
                # Celery would otherwise walk all samples to build these (slow), and Flower shows them.
                argsrepr="()",
                kwargsrepr=f"{{run_id: {run_id}, shard_id: {shard.id}, samples: <{len(shard.samples)}>}}",
            )
        except Exception as exc:
            raise self._failure(exc, f"{shard.id} ") from None
