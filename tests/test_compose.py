"""compose.yaml is checked for structure (no Docker engine here): GPU pinning, secrets, commands, Redis safety."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from app.cli import main as regen_cli
from deploy.gen_workers import render

REPO = Path(__file__).resolve().parents[1]
SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|AUTH|ACCESS_KEY", re.I)
# `${VAR}`, `${VAR:?message}` or `${VAR:-}` (empty default): never a literal, never a non-empty default.
VAR_REF = re.compile(r"\$\{[A-Z_][A-Z0-9_]*(?::\?[^}]*|:-)?\}")
SECRET_FLAGS = ("--requirepass", "--basic-auth", "--password", "-a")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def _workers(doc: dict) -> dict:
    return {name: s for name, s in doc["services"].items() if name.startswith("worker-")}


def _strings(node):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _strings(key)
            yield from _strings(value)
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item)
    elif isinstance(node, str):
        yield node


def _only_refs(value: str, separators: str = ":") -> bool:
    return VAR_REF.sub("", value).strip(separators) == "" and VAR_REF.search(value) is not None


def _argv(command) -> list[str]:
    return shlex.split(command) if isinstance(command, str) else list(command)


def test_compose_yaml_is_the_generator_output_for_four_gpus():
    assert (REPO / "compose.yaml").read_text() == render(4)


def test_every_worker_is_pinned_to_its_own_gpu_and_sees_it_as_device_0(compose):
    workers = _workers(compose)
    assert len(workers) == 4
    devices = []
    for service in workers.values():
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and reservation["capabilities"] == ["gpu"]
        (device,) = reservation["device_ids"]
        assert isinstance(device, str)
        devices.append(device)
        argv = _argv(service["command"])
        assert argv[:2] == ["regen", "worker"] and argv[argv.index("--gpus") + 1] == "0"
        assert service["ipc"] == "host" or service.get("shm_size")
        assert service["stop_grace_period"] == "2h"
        assert any(v.endswith(":/data/runs") for v in service["volumes"])
    assert sorted(devices) == ["0", "1", "2", "3"]


def test_the_generator_pins_n_distinct_gpus():
    doc = yaml.safe_load(render(7))
    ids = [s["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"][0] for s in _workers(doc).values()]
    assert ids == [str(i) for i in range(7)]


def test_no_secret_is_written_inline(compose):
    raw = (REPO / "compose.yaml").read_text()
    for s in _strings(compose):
        for password in re.findall(r"://[^/@\s:]*:([^@\s]+)@", s):
            assert _only_refs(password, ""), f"inline password in URL: {s}"
    for name, service in compose["services"].items():
        env = service.get("environment") or {}
        for key, value in env.items():
            if SECRET_NAME.search(key):
                assert _only_refs(str(value)), f"{name}: {key} must be ${{VAR}}, not {value!r}"
        argv = _argv(service.get("command") or [])
        for i, arg in enumerate(argv):
            flag, _, inline = arg.partition("=")
            if flag in SECRET_FLAGS:
                value = inline or argv[i + 1]
                assert _only_refs(value), f"{name}: {flag} must take ${{VAR}}, not {value!r}"
    for line in raw.splitlines():  # any `...PASSWORD: value` line, wherever it is, holds a reference
        m = re.match(r"\s*[A-Z_]*(PASSWORD|SECRET)[A-Z_]*:\s*(\S.*)$", line)
        if m:
            assert _only_refs(m[2]), line


def test_every_command_is_a_real_regen_subcommand_or_celery_flower(compose):
    for name, service in compose["services"].items():
        if "command" not in service or name == "redis":
            continue
        argv = _argv(service["command"])
        if argv[0] == "celery":
            assert "flower" in argv, name
            continue
        assert argv[0] == "regen" and argv[1] in regen_cli.commands, f"{name}: {argv[:2]}"
        sub = regen_cli.commands[argv[1]]
        known = {opt for p in sub.params for opt in getattr(p, "opts", [])}
        for arg in argv[2:]:
            if arg.startswith("--"):
                assert arg.split("=")[0] in known, f"{name}: regen {argv[1]} has no option {arg}"


def test_flower_runs_regens_flower_app_on_the_workers_broker(compose):
    """Flower lists regen's queues only on app/ops/flower.py's app (tests/ops/test_flower.py runs this command)."""
    import importlib

    flower = compose["services"]["flower"]
    argv = _argv(flower["command"])
    assert argv[:2] == ["celery", "-A"] and argv[3] == "flower"
    assert importlib.import_module(argv[2]).__name__ == "app.ops.flower"
    worker_broker = compose["services"]["worker-gpu0"]["environment"]["REGEN_BROKER_URL"]
    assert flower["environment"]["REGEN_BROKER_URL"] == worker_broker
    assert not any(k.startswith("CELERY_") for k in flower["environment"])  # it would win over REGEN_BROKER_URL


def test_redis_never_evicts_persists_with_aof_needs_a_password_and_has_a_healthcheck(compose):
    redis = compose["services"]["redis"]
    argv = _argv(redis["command"])
    assert argv[argv.index("--maxmemory-policy") + 1] == "noeviction"
    assert argv[argv.index("--appendonly") + 1] == "yes"
    assert _only_refs(argv[argv.index("--requirepass") + 1])
    test = " ".join(redis["healthcheck"]["test"])
    assert "redis-cli" in test and "$$REDIS_PASSWORD" in test and "ping" in test
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${REDIS_PASSWORD")


def test_the_producer_is_a_one_shot_under_its_own_profile(compose):
    producer = compose["services"]["producer"]
    assert producer["profiles"] == ["producer"] and producer["restart"] == "no"
    for name, service in compose["services"].items():
        if name != "producer":
            assert "profiles" not in service, name


def test_env_example_names_every_required_variable():
    example = (REPO / "deploy" / ".env.example").read_text()
    required = set(re.findall(r"\$\{([A-Z_]+):\?", render(4)))
    defined = set(re.findall(r"^#?\s*([A-Z_]+)=", example, re.M))
    assert required <= defined, required - defined
    assert not re.search(r"^(REDIS_PASSWORD|FLOWER_PASSWORD)=\S", example, re.M)
