"""The environment is read once, in one place: every variable's default and parsing, the process's installed config,
and the code's rule that no other module reads the environment (app/base/config.py)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

from app.base.config import (
    DEFAULT_BROKER_URL,
    DEFAULT_VISIBILITY_TIMEOUT,
    BrokerConfig,
    Config,
    current,
    install,
    scope,
)
from app.base.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
CODE = [p for package in ("app", "producer", "workers") for p in sorted((ROOT / package).rglob("*.py"))]


def test_an_empty_environment_gives_every_default():
    s = Config.from_env({})
    assert s.broker == BrokerConfig(DEFAULT_BROKER_URL, DEFAULT_VISIBILITY_TIMEOUT, None)
    assert (s.storage_options, s.heartbeat_s, s.scratch, s.side_threads, s.missing_run_retries) == ({}, 30.0, None, "", 5)
    assert (s.log_level, s.queues, s.worker_config, s.bench_tasks) == ("INFO", "regen", None, False)
    assert s.state_dir == f"/var/tmp/regen-{os.getuid()}" == Config().state_dir


def test_each_variable_reaches_its_field():
    s = Config.from_env({
        "REGEN_BROKER_URL": "redis://:pw@h:1/2", "REGEN_VISIBILITY_TIMEOUT": "60",
        "REGEN_UNACKED_RESTORE_INTERVAL": "5", "REGEN_STORAGE_OPTIONS": '{"anon": true}', "REGEN_HEARTBEAT_S": "0.1",
        "REGEN_STATE_DIR": "/x/state", "REGEN_SCRATCH": "/x/scratch", "REGEN_SIDE_THREADS": " IDLE ",
        "REGEN_MISSING_RUN_RETRIES": "-3", "REGEN_LOG_LEVEL": "DEBUG", "REGEN_QUEUES": "regen,regen.capture",
        "REGEN_WORKER_CONFIG": '{"model": "m"}', "REGEN_BENCH_TASKS": "1", "REGEN_STORAGE_COUNTS": "/x/counts"})
    assert s.broker == BrokerConfig("redis://:pw@h:1/2", 60, 5)
    assert s.storage_counts == "/x/counts" and Config.from_env({}).storage_counts is None
    assert s.storage_options == {"anon": True}
    assert s.heartbeat_s == 0.5 and s.missing_run_retries == 0  # clamped, as the lease and retry loops need
    assert (s.state_dir, s.scratch, s.side_threads, s.log_level) == ("/x/state", "/x/scratch", "idle", "DEBUG")
    assert (s.queues, s.worker_config, s.bench_tasks) == ("regen,regen.capture", '{"model": "m"}', True)
    assert s.broker_for("redis://other/0").url == "redis://other/0" and s.broker_for(None).url == s.broker.url
    assert s.broker_for(visibility_timeout=7).visibility_timeout == 7


@pytest.mark.parametrize(("env", "message"), [
    ({"REGEN_HEARTBEAT_S": "soon"}, "REGEN_HEARTBEAT_S='soon' is not a number"),
    ({"REGEN_MISSING_RUN_RETRIES": "many"}, "REGEN_MISSING_RUN_RETRIES='many' is not an integer"),
    ({"REGEN_UNACKED_RESTORE_INTERVAL": "1.5"}, "REGEN_UNACKED_RESTORE_INTERVAL='1.5' is not an integer"),
    ({"REGEN_BENCH_TASKS": "yes"}, "REGEN_BENCH_TASKS='yes': use 1 .on. or 0 .off."),
    ({"REGEN_HEARTBEAT_S": "nan"}, "REGEN_HEARTBEAT_S='nan' is not a finite number"),
    ({"REGEN_HEARTBEAT_S": "inf"}, "REGEN_HEARTBEAT_S='inf' is not a finite number"),
    ({"REGEN_VISIBILITY_TIMEOUT": "0"}, "REGEN_VISIBILITY_TIMEOUT=0: use a number of seconds of at least 1"),
    ({"REGEN_VISIBILITY_TIMEOUT": "-60"}, "REGEN_VISIBILITY_TIMEOUT=-60: use a number of seconds of at least 1"),
    ({"REGEN_UNACKED_RESTORE_INTERVAL": "0"}, "REGEN_UNACKED_RESTORE_INTERVAL=0: use a number of seconds"),
    ({"REGEN_BROKER_URL": "127.0.0.1:6379"}, "REGEN_BROKER_URL='127.0.0.1:6379' is not a URL"),
    ({"REGEN_BROKER_URL": "user:secret@h:6379"}, r"REGEN_BROKER_URL='user:\*\*\*@h:6379' is not a URL"),
    ({"REGEN_SIDE_THREADS": "low"}, "REGEN_SIDE_THREADS='low': expected 'idle', 'batch' or 'normal'"),
    ({"REGEN_LOG_LEVEL": "LOUD"}, "REGEN_LOG_LEVEL='LOUD': use one of DEBUG, INFO, WARNING, ERROR, CRITICAL"),
    ({"REGEN_QUEUES": "regen,,regen.capture"}, "REGEN_QUEUES='regen,,regen.capture': comma-separated queue names"),
    ({"REGEN_QUEUES": ""}, "REGEN_QUEUES='': comma-separated queue names"),
    ({"REGEN_WORKER_CONFIG": "{model"}, "REGEN_WORKER_CONFIG is not valid JSON"),
    ({"REGEN_WORKER_CONFIG": "[1]"}, "REGEN_WORKER_CONFIG must be a JSON object"),
])
def test_a_malformed_value_is_refused_in_one_line_naming_the_variable(env, message):
    with pytest.raises(ConfigError, match=message) as info:
        Config.from_env(env)
    assert "\n" not in str(info.value)


def test_names_are_read_as_the_code_compares_them():
    s = Config.from_env({"REGEN_LOG_LEVEL": "debug", "REGEN_QUEUES": "regen, regen.capture",
                           "REGEN_SIDE_THREADS": " Normal "})
    assert (s.log_level, s.queues, s.side_threads) == ("DEBUG", "regen,regen.capture", "normal")


def test_unparsable_values_fail_where_they_always_did():
    with pytest.raises(ConfigError, match="REGEN_VISIBILITY_TIMEOUT='4h' is not an integer"):
        Config.from_env({"REGEN_VISIBILITY_TIMEOUT": "4h"})
    with pytest.raises(ConfigError, match="REGEN_STORAGE_OPTIONS is not valid JSON"):
        Config.from_env({"REGEN_STORAGE_OPTIONS": "{endpoint"})
    with pytest.raises(ConfigError, match="REGEN_STORAGE_OPTIONS must be a JSON object"):
        Config.from_env({"REGEN_STORAGE_OPTIONS": "[1]"})


def test_a_scope_reads_the_environment_once_and_ends_with_its_block(monkeypatch):
    monkeypatch.setenv("REGEN_HEARTBEAT_S", "7")
    with scope():
        monkeypatch.setenv("REGEN_HEARTBEAT_S", "8")  # not read yet: the first current() reads
        first = current()
        monkeypatch.setenv("REGEN_HEARTBEAT_S", "9")
        assert current() is first and first.heartbeat_s == 8
        with scope(Config(heartbeat_s=3)):
            assert current().heartbeat_s == 3
        assert current() is first
    assert current().heartbeat_s == 9  # outside every scope: the environment as it is now


def test_installed_settings_are_the_processs_and_broker_settings_follow_them(monkeypatch):
    import app.base.config as settings_module

    monkeypatch.setattr(settings_module, "_scopes", [])  # this test's process-wide state, restored after it
    monkeypatch.setenv("REGEN_VISIBILITY_TIMEOUT", "99")
    install(Config.from_env())
    monkeypatch.setenv("REGEN_VISIBILITY_TIMEOUT", "11")
    assert BrokerConfig.from_env().visibility_timeout == 99
    assert BrokerConfig.from_env("redis://given/0", 5) == BrokerConfig("redis://given/0", 5, None)


def _environ_uses(path: Path) -> list[tuple[int, str]]:
    """(line, what) for each `os.environ`, `os.getenv`, `os.putenv` or bare `environ` in a module."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "putenv", "unsetenv"):
            out.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name) and node.id in ("environ", "getenv"):
            out.append((node.lineno, node.id))
    return out


def test_only_the_settings_module_reads_the_environment_and_only_process_env_writes_it():
    allowed = {ROOT / "app" / "base" / "config.py", ROOT / "app" / "base" / "process_env.py"}
    found = [f"{p.relative_to(ROOT)}:{line} {what}" for p in CODE if p not in allowed for line, what in _environ_uses(p)]
    assert not found, "\n".join(found)


def test_flags_that_read_a_variable_are_declared_in_one_module():
    declared = [f"{p.relative_to(ROOT)}" for p in CODE if "envvar=" in p.read_text()]
    assert declared == ["app/cli/options.py"]


def test_every_variable_the_code_names_is_documented():
    names = {n for p in CODE for n in re.findall(r"\bREGEN_[A-Z0-9_]+\b", p.read_text())}
    documented = set(re.findall(r"`(REGEN_[A-Z0-9_]+)`", (ROOT / "docs" / "configuration.md").read_text()))
    assert len(names) > 15 and names <= documented, sorted(names - documented)


# Settings whose default belongs to one definition (app.base.config's DEFAULT_*, app.base.manifest's COMPRESSION_LEVEL
# and RunSettings): a parameter or class field of the same name elsewhere takes it from there or has none.
DEFINITIONS = ("app/base/config.py", "app/base/manifest.py")
ONE_DEFAULT = ("level", "compression_level", "regenerate", "samples_per_prompt", "shard_size", "queue",
               "capture_queue", "thinking_mix")
# The queue names, spelled only where they are defined.
DEFINED_STRINGS = {"regen.capture": "app/base/config.py"}


def spelled_defaults(path: str, source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        pairs = []
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            a = node.args
            positional = a.posonlyargs + a.args
            pairs += zip(positional[len(positional) - len(a.defaults):], a.defaults, strict=True)
            pairs += [(k, d) for k, d in zip(a.kwonlyargs, a.kw_defaults, strict=True) if d is not None]
            pairs = [(arg.arg, d) for arg, d in pairs]
        elif isinstance(node, ast.ClassDef):
            pairs += [(s.target.id, s.value) for s in node.body
                      if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name) and s.value is not None]
        for name, default in pairs if path not in DEFINITIONS else ():
            if name in ONE_DEFAULT and isinstance(default, ast.Constant) and default.value is not None:
                found.append(f"{path}:{default.lineno} {name}={default.value!r}")
        if isinstance(node, ast.Constant) and node.value in DEFINED_STRINGS and DEFINED_STRINGS[node.value] != path:
            found.append(f"{path}:{node.lineno} {node.value!r}")
    return found


def test_no_module_spells_a_default_defined_elsewhere():
    found = [f for p in CODE for f in spelled_defaults(str(p.relative_to(ROOT)), p.read_text())]
    assert not found, found


def test_the_defaults_check_sees_a_second_spelling():
    snippet = ("def write(rows, level: int = 3): ...\n"
               "class Options:\n    regenerate: str = 'last'\n    queue: str = DEFAULT_QUEUE\n"
               "CAPTURE = 'regen.capture'\n")
    assert [f.split(" ", 1)[1] for f in spelled_defaults("workers/x.py", snippet)] == [
        "level=3", "regenerate='last'", "'regen.capture'"]
    assert spelled_defaults("app/base/config.py", "DEFAULT_CAPTURE_QUEUE = 'regen.capture'\n") == []
    assert spelled_defaults("app/base/manifest.py", "class RunSettings:\n    samples_per_prompt: int = 1\n") == []


# The run's settings are read typed, through app.base.manifest.RunSettings.view: no module reads a stored setting by
# name.
_RAW_SETTING = re.compile(r"""settings["']?\]?\s*(?:\[\s*["']|\.get\(\s*["'])""")
_RAW_ALLOWED = {"app/base/manifest.py"}


def test_no_module_reads_a_stored_run_setting_by_name():
    raw = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in CODE if str(p.relative_to(ROOT)) not in _RAW_ALLOWED
           for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1) if _RAW_SETTING.search(line)]
    assert not raw, "read run settings typed (app.base.manifest.RunSettings.view):\n" + "\n".join(raw)


@pytest.mark.parametrize("line", ['x = settings["capture_mode"]', "q = reader.settings.get('quality')",
                                  'm = manifest["settings"]["model"]'])
def test_the_raw_settings_rule_sees_a_read(line):
    assert _RAW_SETTING.search(line)
