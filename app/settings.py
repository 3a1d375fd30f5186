"""Every environment variable regen reads, read in one place: `Settings.from_env()`.

Rule: each process's entry point reads the environment once and installs the result as the process's settings
(`install` for a process's life, `scope` for one `regen` command); modules ask `current()` or are handed the
object, and never read `os.environ` themselves. Why: one list of names, defaults and parsing, and a process that
sees one configuration from start to end. The entry points: the `regen` command group (app/cli/__init__.py, read
on first use so `--help` reads nothing), the worker child (workers/worker_main.py), the CPU engine's own process
(workers/engine/process.py, handed its parent's settings), and Celery's command line: `celery -A
workers.celery_worker` (a worker) and `celery -A app.ops.flower flower` (Flower). Outside an entry point (a test, a script, a library caller) `current()` reads the environment
at that call, so a test that sets a variable is seen.

Every variable, its default and its meaning: docs/configuration.md ("Environment variables"); the fields below
name theirs. Flags that read a variable (`--storage` from `REGEN_STORAGE`, ...) are defined once, in
app/cli/options.py. What regen writes into a child's environment (its GPUs, its WorkerConfig, vLLM's switches)
is in app/process_env.py.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import orjson

from app.config import DEFAULT_BROKER_URL, DEFAULT_QUEUE, DEFAULT_VISIBILITY_TIMEOUT, BrokerSettings
from app.errors import ConfigError

DEFAULT_HEARTBEAT_S = 30.0
DEFAULT_MISSING_RUN_RETRIES = 5
DEFAULT_LOG_LEVEL = "INFO"


def _default_state_dir() -> str:
    return f"/var/tmp/regen-{os.getuid()}"


@dataclass(frozen=True)
class Settings:
    """One process's configuration; `from_env` builds it from the variables each field names."""

    # REGEN_BROKER_URL, REGEN_VISIBILITY_TIMEOUT, REGEN_UNACKED_RESTORE_INTERVAL
    broker: BrokerSettings = field(default_factory=BrokerSettings)
    storage_options: dict = field(default_factory=dict)  # REGEN_STORAGE_OPTIONS: fsspec options of URL roots
    heartbeat_s: float = DEFAULT_HEARTBEAT_S  # REGEN_HEARTBEAT_S: a worker's lease renewals (at least 0.5 s)
    state_dir: str = field(default_factory=_default_state_dir)  # REGEN_STATE_DIR: a worker host's attempt journal
    scratch: str | None = None  # REGEN_SCRATCH: where capture files go (None: /dev/shm, else the temp dir)
    # REGEN_SIDE_THREADS, stripped and lower-cased; workers/engine/scheduling.py decides what it means
    side_threads: str = ""
    missing_run_retries: int = DEFAULT_MISSING_RUN_RETRIES  # REGEN_MISSING_RUN_RETRIES (at least 0)
    log_level: str = DEFAULT_LOG_LEVEL  # REGEN_LOG_LEVEL: worker and engine processes
    queues: str = DEFAULT_QUEUE  # REGEN_QUEUES: what a worker child consumes (set by `regen worker`)
    worker_config: str | None = None  # REGEN_WORKER_CONFIG: a worker child's WorkerConfig as JSON (workers/process/context.py)
    bench_tasks: bool = False  # REGEN_BENCH_TASKS=1: the worker registers the fleet bench's task too

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every variable once; a malformed value (a number that is not one, storage options that are not a
        JSON object, a switch other than 0 or 1) is a one-line ConfigError naming the variable. Numbers below
        their floor are raised to it (a lease renewal of at least 0.5 s, retries of at least 0)."""
        env = os.environ if environ is None else environ
        return cls(
            broker=BrokerSettings(
                url=env.get("REGEN_BROKER_URL") or DEFAULT_BROKER_URL,
                visibility_timeout=_int(env, "REGEN_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT),
                unacked_restore_interval=_int(env, "REGEN_UNACKED_RESTORE_INTERVAL"),
            ),
            storage_options=_storage_options(env.get("REGEN_STORAGE_OPTIONS", "")),
            heartbeat_s=max(0.5, _float(env, "REGEN_HEARTBEAT_S", DEFAULT_HEARTBEAT_S)),
            state_dir=env.get("REGEN_STATE_DIR") or _default_state_dir(),
            scratch=env.get("REGEN_SCRATCH") or None,
            side_threads=env.get("REGEN_SIDE_THREADS", "").strip().lower(),
            missing_run_retries=max(0, _int(env, "REGEN_MISSING_RUN_RETRIES", DEFAULT_MISSING_RUN_RETRIES)),
            log_level=env.get("REGEN_LOG_LEVEL", DEFAULT_LOG_LEVEL),
            queues=env.get("REGEN_QUEUES", DEFAULT_QUEUE),
            worker_config=env.get("REGEN_WORKER_CONFIG") or None,
            bench_tasks=_switch(env, "REGEN_BENCH_TASKS"),
        )

    def broker_for(self, url: str | None = None, visibility_timeout: int | None = None) -> BrokerSettings:
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


def _storage_options(raw: str) -> dict:
    raw = raw.strip()
    if not raw:
        return {}
    try:
        options = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ConfigError(f"REGEN_STORAGE_OPTIONS is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise ConfigError("REGEN_STORAGE_OPTIONS must be a JSON object")
    return options


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not a number") from None


def _switch(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "")
    if raw not in ("", "0", "1"):
        raise ConfigError(f"{name}={raw!r}: use 1 (on) or 0 (off)")
    return raw == "1"


class _Scope:
    def __init__(self, settings: Settings | None):
        self.settings = settings


_scopes: list[_Scope] = []


def current() -> Settings:
    """This process's settings: the innermost installed ones (a lazy scope reads the environment on first use);
    where none are installed, the environment as it is at this call."""
    if not _scopes:
        return Settings.from_env()
    innermost = _scopes[-1]
    if innermost.settings is None:
        innermost.settings = Settings.from_env()
    return innermost.settings


def install(settings: Settings) -> Settings:
    """Make `settings` this process's for the rest of its life (a process's main, before anything else runs)."""
    _scopes[:] = [_Scope(settings)]
    return settings


@contextlib.contextmanager
def scope(settings: Settings | None = None) -> Iterator[None]:
    """`settings` are this process's while the block runs (one `regen` command); None: the environment, read
    once on the first `current()` inside the block."""
    entry = _Scope(settings)
    _scopes.append(entry)
    try:
        yield
    finally:
        _scopes.remove(entry)
