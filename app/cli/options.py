"""The options several commands share, each defined once here with its environment variable and its default.

Rule: a flag that an environment variable may give is declared only here, so each variable has one meaning
(they once were declared six times each and could drift); a command may reword the help, never the flag, type
or default. URLs are checked when the command line is parsed. A renamed flag keeps its old spelling as a
hidden, deprecated alias (`renamed`). Defaults and names:
docs/configuration.md#shared-options-and-their-defaults.
"""

from __future__ import annotations

import rich_click as click
from click.core import ParameterSource

from app.base.config import DEFAULT_CAPTURE_QUEUE, DEFAULT_QUEUE, check_broker_url, check_storage_url
from app.base.errors import ConfigError

STORAGE_HELP = "Storage root: a folder (NFS for several hosts) or an fsspec URL (s3://bucket/runs) [env REGEN_STORAGE]."
BROKER_HELP = "Broker URL, e.g. redis://:PASSWORD@head:6379/0 [env REGEN_BROKER_URL; default redis://127.0.0.1:6379/0]."


def _from_variable(param, ctx) -> str | None:
    """The variable a value came from, where it came from one (its message names it, not only the flag)."""
    if param is not None and ctx is not None and ctx.get_parameter_source(param.name) is ParameterSource.ENVIRONMENT:
        return param.envvar if isinstance(param.envvar, str) else None
    return None


class BrokerURL(click.ParamType):
    """A broker URL: a known scheme, and a host and a valid port where the transport has them."""

    name = "URL"

    def convert(self, value, param, ctx):
        try:
            return check_broker_url(value, _from_variable(param, ctx))
        except ConfigError as exc:
            self.fail(str(exc), param, ctx)


class StorageRoot(click.ParamType):
    """A storage root: a path, or a URL whose scheme fsspec knows, with its bucket or host."""

    name = "ROOT"

    def convert(self, value, param, ctx):
        try:
            return check_storage_url(value)
        except ConfigError as exc:
            variable = _from_variable(param, ctx)
            self.fail(f"{variable}: {exc}" if variable else str(exc), param, ctx)


def storage_option(*, required: bool = False, default: str | None = None, help: str | None = None):
    """`--storage ROOT` [env REGEN_STORAGE]; `default` only for `regen run` and the pilot (shown in their help).
    No `default=None` is passed: click 8.5 does not enforce `required=True` when a default is given, None too."""
    extra = {"default": default} if default is not None else {}
    return click.option("--storage", envvar="REGEN_STORAGE", type=StorageRoot(), required=required,
                        show_default=default is not None, help=help or STORAGE_HELP, **extra)


def broker_option(*, help: str | None = None):
    """`--broker URL` [env REGEN_BROKER_URL]; None means the process's broker (see the module docstring)."""
    return click.option("--broker", envvar="REGEN_BROKER_URL", type=BrokerURL(), default=None,
                        help=help or BROKER_HELP)


def model_option(*, help: str | None = None):
    """`--model FOLDER` [env REGEN_MODEL] (`regen produce`; `regen run` requires its own, without the variable)."""
    return click.option("--model", envvar="REGEN_MODEL", default=None, metavar="FOLDER",
                        help=help or "Local target-model folder (config.json, tokenizer) [env REGEN_MODEL; required for a "
                                    "new run, no default; --resume takes the run's].")


def queue_option(*, help: str):
    """`--queue NAME` for a command that publishes to one queue (the run's generation queue)."""
    return click.option("--queue", default=DEFAULT_QUEUE, metavar="NAME", help=help)


def consume_queue_option():
    """`regen worker --queue NAME[,NAME]`, repeatable [env REGEN_QUEUES, the variable its worker processes read];
    the old spelling `--queues` stays as a deprecated alias. None: the run's queues (workers.process.plan)."""
    return renamed("--queues", "--queue", "queues", multiple=True, envvar="REGEN_QUEUES", metavar="NAME[,NAME]",
                   help=f"A queue to consume (repeatable, or comma-separated) [env REGEN_QUEUES; default: with "
                        f"--run, the run's queue, and {DEFAULT_CAPTURE_QUEUE} too for a staged run; else "
                        f"{DEFAULT_QUEUE}].")


def task_slots_option(*, help: str):
    """`--task-slots N` [env REGEN_TASK_SLOTS]; None: from the engine and the shard size (workers.process.devices)."""
    return click.option("--task-slots", type=click.IntRange(min=1), envvar="REGEN_TASK_SLOTS", default=None,
                        help=help)


def encode_threads_option(*, help: str):
    """`--encode-threads N` [env REGEN_ENCODE_THREADS]; None: from the device (workers.process.devices)."""
    return click.option("--encode-threads", type=click.IntRange(min=1, max=256), envvar="REGEN_ENCODE_THREADS",
                        default=None, help=help)


def engine_host_option(*, help: str):
    """`--engine-host/--no-engine-host` [env REGEN_ENGINE_HOST]; None: on for a CPU worker."""
    return click.option("--engine-host/--no-engine-host", envvar="REGEN_ENGINE_HOST", default=None, help=help)


def stand_in_engine_option(*, help: str):
    """`--stand-in-engine SPEC` [env REGEN_STAND_IN_ENGINE]; benchmarks and tests only (workers.doubles.stand_in)."""
    return click.option("--stand-in-engine", "stand_in", default=None, envvar="REGEN_STAND_IN_ENGINE", metavar="SPEC",
                        help=help)


def vllm_arg_option(name: str, *, help: str):
    """`--vllm-arg KEY=VALUE`, repeatable [env REGEN_VLLM_ARGS, space-separated]; `name` is the parameter's."""
    return click.option("--vllm-arg", name, multiple=True, metavar="KEY=VALUE", envvar="REGEN_VLLM_ARGS", help=help)


def max_model_len_option(*, help: str):
    """`--max-model-len N`: the engine's context (prompt + response); None: the run's max_prompt_tokens +
    max_tokens, capped at the model's max_position_embeddings (workers.process.plan.settings_from_run)."""
    return click.option("--max-model-len", type=click.IntRange(min=16), default=None, metavar="TOKENS", help=help)


_ALIASES = "regen.renamed"


def renamed(old: str, *decls: str, **kwargs):
    """`click.option(*decls, **kwargs)`, also answering to `old`, its name before one name per concept: hidden
    from the help, said to be deprecated on stderr when used, refused together with the new name."""
    new = next(d for d in decls if d.startswith("--"))
    user_callback = kwargs.pop("callback", None)

    def take_alias(ctx, param, value):
        given = ctx.meta.get(_ALIASES, {}).get(param.name)
        if given is not None:
            if ctx.get_parameter_source(param.name) is ParameterSource.COMMANDLINE:
                raise click.UsageError(f"{old} is {new}'s old name: give {new} only", ctx)
            value = given
        return user_callback(ctx, param, value) if user_callback else value

    def note_alias(ctx, param, value):
        if ctx.get_parameter_source(param.name) is not ParameterSource.COMMANDLINE:
            return
        click.echo(f"regen: {old} is deprecated: use {new}", err=True)
        ctx.meta.setdefault(_ALIASES, {})[dest] = value

    def decorator(f):
        f = click.option(*decls, callback=take_alias, **kwargs)(f)
        option = f.__click_params__[-1]
        nonlocal dest
        dest = option.name
        alias_kwargs = {k: v for k, v in kwargs.items() if k in ("type", "multiple", "is_flag")}
        return click.option(old, f"renamed_{dest}", hidden=True, expose_value=False, callback=note_alias,
                            is_eager=True, **alias_kwargs)(f)

    dest = ""
    return decorator
