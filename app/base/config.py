"""Every environment variable regen reads, read in one place: `Config.from_env()`.

Rule: each process's entry point reads the environment once and installs the result (`install`, `scope`);
modules ask `current()` or are handed the object and never read `os.environ`, so there is one list of names,
defaults and parsing, and a process sees one configuration throughout. Every variable: docs/configuration.md
("Environment variables"); the entry points and the rest: docs/configuration.md#how-settings-are-read.
The broker URL is passed through untouched; whatever prints it uses `mask_url`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from urllib.parse import urlsplit

import orjson

from app.base.errors import ConfigError

DEFAULT_BROKER_URL = "redis://127.0.0.1:6379/0"
DEFAULT_QUEUE = "regen"
DEFAULT_CAPTURE_QUEUE = "regen.capture"
# Which assistant turns a run regenerates (`--regenerate`; producer.normalise.REGENERATE_MODES): the last.
DEFAULT_REGENERATE = "last"
# Samples per shard (one Celery message): `regen produce --shard-size`; workers size their task slots by it.
DEFAULT_SHARD_SIZE = 64
# Redis re-delivers an unacked message after this many seconds *even if it is still running* (docs/measured-facts.md), so it
# must exceed the longest shard. Four hours covers a 64-sample shard of long thinking traces on one GPU.
DEFAULT_VISIBILITY_TIMEOUT = 4 * 3600

# Storage URL schemes regen accepts (fsspec's names for them; s3fs is the `s3` extra, the others their packages).
STORAGE_SCHEMES = ("file", "local", "memory", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "hdfs",
                   "webhdfs", "sftp", "ssh", "oss", "oci")
_URL_SCHEME = re.compile(r"[a-z][a-z0-9+.-]*://", re.I)
_URL_PASSWORD = re.compile(r"(?P<scheme>[a-z0-9+.-]+://)(?P<user>[^:@/]*):(?P<password>[^@/]+)@", re.I)


def mask_url(url: str) -> str:
    """Return `url` with any password replaced by `***` (user names are kept, they help debugging)."""
    return _URL_PASSWORD.sub(lambda m: f"{m['scheme']}{m['user']}:***@", url)


def mask_text(text: str) -> str:
    """Mask every URL password inside a free-form text (an exception message, a log line)."""
    return mask_url(text)


@dataclass(frozen=True)
class BrokerConfig:
    """Everything Celery needs to reach the broker; one instance is shared by producer, workers and Flower."""

    url: str = DEFAULT_BROKER_URL
    visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT
    # Seconds between calls of kombu's unacked sweep (None: kombu's 10); kombu 5.7.0 scans on every 10th call
    # only, and then restores every message older than the visibility timeout (docs/configuration.md).
    unacked_restore_interval: int | None = None

    @classmethod
    def from_env(cls, url: str | None = None, visibility_timeout: int | None = None) -> BrokerConfig:
        """This process's broker settings (`REGEN_BROKER_URL` and the timeouts, from `current()`), with a URL or
        timeout given on a command line winning."""
        return current().broker_for(url, visibility_timeout)

    @property
    def masked_url(self) -> str:
        return mask_url(self.url)

    def __repr__(self) -> str:
        """Masked: these settings ride on the Celery app's configuration (`conf.regen_settings`), which every
        worker hands out as text to `celery inspect conf` and Flower's worker pages."""
        return (f"BrokerConfig(url={self.masked_url!r}, visibility_timeout={self.visibility_timeout}, "
                f"unacked_restore_interval={self.unacked_restore_interval})")


DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_MISSING_RUN_RETRIES = 5
DEFAULT_LOG_LEVEL = "INFO"
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # what both logging and Celery's --loglevel take
SIDE_THREADS = ("idle", "batch", "normal")  # REGEN_SIDE_THREADS: workers.engine.scheduling says what each does


def _default_state_dir() -> str:
    return f"/var/tmp/regen-{os.getuid()}"


@dataclass(frozen=True)
class Config:
    """One process's configuration; `from_env` builds it from the variables each field names."""

    # REGEN_BROKER_URL, REGEN_VISIBILITY_TIMEOUT, REGEN_UNACKED_RESTORE_INTERVAL
    broker: BrokerConfig = field(default_factory=BrokerConfig)
    storage_options: dict = field(default_factory=dict)  # REGEN_STORAGE_OPTIONS: fsspec options of URL roots
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # REGEN_HEARTBEAT_S: a worker's lease renewals (at least 0.5 s)
    state_dir: str = field(default_factory=_default_state_dir)  # REGEN_STATE_DIR: a worker host's attempt journal
    scratch: str | None = None  # REGEN_SCRATCH: where capture files go (None: /dev/shm, else the temp dir)
    side_threads: str = ""  # REGEN_SIDE_THREADS: "" (the device's default) or one of SIDE_THREADS (workers.engine.scheduling)
    missing_run_retries: int = DEFAULT_MISSING_RUN_RETRIES  # REGEN_MISSING_RUN_RETRIES (at least 0)
    log_level: str = DEFAULT_LOG_LEVEL  # REGEN_LOG_LEVEL: worker and engine processes (upper-cased)
    queues: str = DEFAULT_QUEUE  # REGEN_QUEUES: what a worker child consumes (set by `regen worker`)
    worker_config: str | None = None  # REGEN_WORKER_CONFIG: a worker child's WorkerConfig as JSON (workers.process.context)
    bench_tasks: bool = False  # REGEN_BENCH_TASKS=1: the worker registers the fleet bench's task too
    # REGEN_FAULT_INJECTION_FOR_TESTS: tests only, a JSON file of {run id: fault} whose runs' captures a worker
    # corrupts on purpose (workers.doubles.capture_faults_for_tests); None everywhere else
    fault_injection_for_tests: str | None = None
    storage_counts: str | None = None  # REGEN_STORAGE_COUNTS=DIR: count storage operations (app.base.storage_counts)
    # VLLM_USE_V2_MODEL_RUNNER=0 (vLLM's own variable): its engines run the V1 model runner, which the loop stop
    # needs on a GPU (app.base.loops.gpu_runner_refusal)
    vllm_v1_runner: bool = False

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Read every variable once; a malformed value (a number that is not one or is below 1 where 0 means
        nothing, a broker URL without a scheme, storage options or a worker config that are not a JSON object, a
        switch other than 0 or 1, a name outside its list) is a one-line ConfigError naming the variable.
        Numbers below their floor are raised to it (a lease renewal of at least 0.5 s, retries of at least 0)."""
        env = os.environ if environ is None else environ
        return cls(
            broker=BrokerConfig(
                url=_broker_url(env.get("REGEN_BROKER_URL") or DEFAULT_BROKER_URL),
                visibility_timeout=_positive(env, "REGEN_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT),
                unacked_restore_interval=_positive(env, "REGEN_UNACKED_RESTORE_INTERVAL"),
            ),
            storage_options=_json_object("REGEN_STORAGE_OPTIONS", env.get("REGEN_STORAGE_OPTIONS", "")) or {},
            heartbeat_s=max(0.5, _float(env, "REGEN_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)),
            state_dir=env.get("REGEN_STATE_DIR") or _default_state_dir(),
            scratch=env.get("REGEN_SCRATCH") or None,
            side_threads=_one_of(env, "REGEN_SIDE_THREADS", SIDE_THREADS),
            missing_run_retries=max(0, _int(env, "REGEN_MISSING_RUN_RETRIES", DEFAULT_MISSING_RUN_RETRIES)),
            log_level=_log_level(env.get("REGEN_LOG_LEVEL") or DEFAULT_LOG_LEVEL),
            queues=_queues(env.get("REGEN_QUEUES", DEFAULT_QUEUE)),
            worker_config=_worker_config(env.get("REGEN_WORKER_CONFIG") or None),
            bench_tasks=_switch(env, "REGEN_BENCH_TASKS"),
            fault_injection_for_tests=env.get("REGEN_FAULT_INJECTION_FOR_TESTS") or None,
            storage_counts=env.get("REGEN_STORAGE_COUNTS") or None,
            vllm_v1_runner=env.get("VLLM_USE_V2_MODEL_RUNNER", "").strip().lower() in ("0", "false"),
        )

    def broker_for(self, url: str | None = None, visibility_timeout: int | None = None) -> BrokerConfig:
        """These broker settings, with a URL or timeout given on a command line winning."""
        return replace(self.broker, url=url or self.broker.url,
                       visibility_timeout=visibility_timeout or self.broker.visibility_timeout)


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def _positive(env: Mapping[str, str], name: str, default: int | None = None) -> int | None:
    value = _int(env, name, default)
    if value is not None and value < 1:
        raise ConfigError(f"{name}={value}: use a number of seconds of at least 1")
    return value


def _json_object(name: str, raw: str) -> dict | None:
    raw = raw.strip()
    if not raw:
        return None
    try:
        options = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError(f"{name} must be a JSON object")
    return options


def _worker_config(raw: str | None) -> str | None:
    if raw is not None:
        _json_object("REGEN_WORKER_CONFIG", raw)  # kept as text: workers.process.context builds the WorkerConfig from it
    return raw


def _broker_url(url: str) -> str:
    return check_broker_url(url, "REGEN_BROKER_URL")


# Brokers Celery reaches over the network (a host is required) and the two that live on this machine.
NETWORK_BROKERS = ("redis", "rediss", "sentinel", "amqp", "amqps", "pyamqp", "sqs")
LOCAL_BROKERS = ("filesystem", "memory")


def _shown(url: str) -> str:
    """`url` for a message: its password masked, even where it has no scheme for mask_url to find."""
    return re.sub(r":[^:@/]*@", ":***@", mask_url(url))


def check_broker_url(url: str, name: str | None) -> str:
    """`url` when it is a broker URL regen can use: a scheme Celery knows, and for a network broker a host and a
    port in 1..65535 (if given); else a one-line ConfigError naming the variable `name` (None: a flag's value,
    which click names)."""
    what = f"{name}={_shown(url)!r}" if name else repr(_shown(url))
    if not _URL_SCHEME.match(url):
        raise ConfigError(f"{what} is not a URL (e.g. redis://host:6379/0)")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in NETWORK_BROKERS + LOCAL_BROKERS:
        raise ConfigError(f"{what}: unknown broker scheme {scheme!r} (redis://, rediss://, amqp://, ...)")
    if scheme in NETWORK_BROKERS and scheme != "sqs":
        if not parts.hostname:
            raise ConfigError(f"{what} names no host (e.g. {scheme}://host:6379/0)")
        try:
            port = parts.port
        except ValueError:
            port = -1
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError(f"{what}: the port must be a number from 1 to 65535")
    return url


def check_storage_url(root: str) -> str:
    """`root` when it can be a storage root: a path, or a URL whose scheme fsspec knows, with its bucket or host;
    else a one-line ConfigError."""
    if not root.strip():
        raise ConfigError("empty: give a folder or a URL (s3://bucket/runs)")
    if "://" not in root:
        return root
    scheme, rest = root.split("://", 1)
    if scheme.lower() not in STORAGE_SCHEMES:
        raise ConfigError(f"{_shown(root)!r}: unknown storage scheme {scheme!r} (a folder, file://, s3://, gs://, "
                          "az://, ...)")
    if scheme.lower() not in ("file", "local", "memory") and not rest.split("/", 1)[0]:
        raise ConfigError(f"{_shown(root)!r} names no bucket or host (e.g. {scheme}://bucket/runs)")
    return root


def _one_of(env: Mapping[str, str], name: str, allowed: tuple[str, ...]) -> str:
    value = env.get(name, "").strip().lower()
    if value and value not in allowed:
        raise ConfigError(f"{name}={value!r}: expected {', '.join(repr(a) for a in allowed[:-1])} or {allowed[-1]!r}")
    return value


def _log_level(raw: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(f"REGEN_LOG_LEVEL={raw!r}: use one of {', '.join(LOG_LEVELS)}")
    return level


def _queues(raw: str) -> str:
    names = [q.strip() for q in raw.split(",")]
    if not all(names):
        raise ConfigError(f"REGEN_QUEUES={raw!r}: comma-separated queue names, none empty")
    return ",".join(names)


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None
    if not math.isfinite(value):
        raise ConfigError(f"{name}={raw!r} is not a finite number")
    return value


def _switch(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
    return raw == "1"


class _Scope:
    def __init__(self, settings: Config | None):
        self.settings = settings


_scopes: list[_Scope] = []


def current() -> Config:
    """This process's settings: the innermost installed ones (a lazy scope reads the environment on first use);
    where none are installed, the environment as it is at this call."""
    if not _scopes:
        return Config.from_env()
    innermost = _scopes[-1]
    if innermost.settings is None:
        innermost.settings = Config.from_env()
    return innermost.settings


def install(settings: Config) -> Config:
    """Make `settings` this process's for the rest of its life (a process's main, before anything else runs)."""
    _scopes[:] = [_Scope(settings)]
    return settings


@contextlib.contextmanager
def scope(settings: Config | None = None) -> Iterator[None]:
    """`settings` are this process's while the block runs (one `regen` command); None: the environment, read
    once on the first `current()` inside the block."""
    entry = _Scope(settings)
    _scopes.append(entry)
    try:
        yield
    finally:
        _scopes.remove(entry)
