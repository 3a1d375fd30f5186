"""The options several commands share, each defined once here with its environment variable and its default.

Rule: a flag that some environment variable may give is declared only here, so each variable has one meaning
(app.settings lists them all). A command may word the help for its own context; its flag, type and default
stay these. Why: `REGEN_STORAGE` and `REGEN_BROKER_URL` were declared six times each and could drift.

Defaults: `--storage` has none (commands that need a root require it; `regen worker` takes the root from each
message unless given), except `regen run`, which keeps its runs under `.regen/storage` so that the README's first
command needs no flag. `--broker` has none: the process's broker (`REGEN_BROKER_URL`, else
redis://127.0.0.1:6379/0) is used, except by `regen run`, which then uses the local Redis if it answers, else an
embedded one (app.embedded_broker).
"""

from __future__ import annotations

import click

STORAGE_HELP = "Storage root [env REGEN_STORAGE]."
BROKER_HELP = "Broker URL [env REGEN_BROKER_URL]."


def storage_option(*, required: bool = False, default: str | None = None, help: str | None = None):
    """`--storage ROOT` [env REGEN_STORAGE]; `default` only for `regen run` (shown in its help)."""
    return click.option("--storage", envvar="REGEN_STORAGE", required=required, default=default,
                        show_default=default is not None, help=help)


def broker_option(*, help: str | None = None):
    """`--broker URL` [env REGEN_BROKER_URL]; None means the process's broker (see the module docstring)."""
    return click.option("--broker", envvar="REGEN_BROKER_URL", default=None, help=help)


def model_option(*, help: str | None = None):
    """`--model FOLDER` [env REGEN_MODEL] (`regen produce`; `regen run` requires its own, without the variable)."""
    return click.option("--model", envvar="REGEN_MODEL", default=None, help=help)


def task_slots_option(*, help: str):
    """`--task-slots N` [env REGEN_TASK_SLOTS]; None: from the engine and the shard size (workers.process.devices)."""
    return click.option("--task-slots", type=click.IntRange(min=1), envvar="REGEN_TASK_SLOTS", default=None,
                        help=help)


def encode_threads_option(*, help: str):
    """`--encode-threads N` [env REGEN_ENCODE_THREADS]; None: from the device (workers.process.devices)."""
    return click.option("--encode-threads", type=click.IntRange(min=1), envvar="REGEN_ENCODE_THREADS", default=None,
                        help=help)


def engine_host_option(*, help: str):
    """`--engine-host/--no-engine-host` [env REGEN_ENGINE_HOST]; None: on for a CPU worker."""
    return click.option("--engine-host/--no-engine-host", envvar="REGEN_ENGINE_HOST", default=None, help=help)


def stand_in_engine_option(*, help: str):
    """`--stand-in-engine SPEC` [env REGEN_STAND_IN_ENGINE]; benchmarks and tests only (workers.engine.stand_in)."""
    return click.option("--stand-in-engine", "stand_in", default=None, envvar="REGEN_STAND_IN_ENGINE", metavar="SPEC",
                        help=help)


def vllm_arg_option(name: str, *, help: str):
    """`--vllm-arg KEY=VALUE`, repeatable [env REGEN_VLLM_ARGS, space-separated]; `name` is the parameter's."""
    return click.option("--vllm-arg", name, multiple=True, metavar="KEY=VALUE", envvar="REGEN_VLLM_ARGS", help=help)
