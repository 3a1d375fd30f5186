"""compose.yaml is checked for structure and by compose v2 itself (`docker compose config`, no engine needed):
GPU pinning, secrets, commands, Redis safety, the CPU profile, ports on 127.0.0.1. The check that brings it up on
a real engine is scripts/compose_check.sh (too long for CI; docs/compose-check.md has its output)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
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
    return {name: s for name, s in doc["services"].items() if name.startswith("worker-gpu")}


def _cpu_workers(doc: dict) -> dict:
    return {name: s for name, s in doc["services"].items() if name.startswith("worker-cpu")}


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
    """The program's own argv: a service run through `sh -c "...; exec PROGRAM ARGS"` is read after `exec`, with
    each `${VAR:-default}` as its default and a bare `${VAR}` as VAR."""
    argv = shlex.split(command) if isinstance(command, str) else list(command)
    if argv[:2] != ["sh", "-c"]:
        return argv
    script = argv[2].rsplit("exec ", 1)[1]
    script = re.sub(r"\$\{([A-Z_]+)(?::[-?]([^}]*))?\}", lambda m: m[2] if m[2] is not None else m[1], script)
    return shlex.split(script.replace("$$", "$"))


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
        assert argv[argv.index("--run") + 1] == "" and argv[argv.index("--queue") + 1] == ""  # REGEN_RUN, REGEN_QUEUES
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
    # a GPU host's workers: the head named by REGEN_BROKER_URL, else this project's Redis, the one Flower watches
    assert worker_broker == "${REGEN_BROKER_URL:-" + flower["environment"]["REGEN_BROKER_URL"] + "}"
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


def test_the_head_gpu_hosts_and_the_laptop_each_have_a_profile(compose):
    """`--profile gpu up` on a GPU host starts its workers and nothing of the head's; `--profile head up` the head
    (broker, Flower, exporter, the run's producer); `--profile cpu up` a whole job on a laptop, no GPU worker."""
    head = ["head", "cpu"]
    expected = {"redis": head, "flower": head, "metrics": head, "producer": ["head"], "producer-cpu": ["cpu"]}
    expected.update({name: ["gpu"] for name in _workers(compose)})
    expected.update({name: ["cpu"] for name in _cpu_workers(compose)})
    assert {name: s.get("profiles") for name, s in compose["services"].items()} == expected
    for name in ("producer", "producer-cpu"):
        assert compose["services"][name]["restart"] == "no"


def test_only_gpu_workers_run_the_gpu_image(compose):
    """The head host needs no CUDA image: the head, both producers and the CPU workers run the CPU image."""
    for name, service in compose["services"].items():
        if name == "redis":
            assert service["image"] == "${REDIS_IMAGE:-redis:7}"
            continue
        gpu = name.startswith("worker-gpu")
        assert service["image"] == ("${REGEN_IMAGE:-regen:latest}" if gpu else "${REGEN_CPU_IMAGE:-regen:cpu}"), name
        assert service["build"]["dockerfile"] == ("deploy/Dockerfile" if gpu else "deploy/Dockerfile.cpu"), name


def test_the_cpu_profile_runs_the_tiny_model_job_after_the_producer(compose):
    producer = _argv(compose["services"]["producer-cpu"]["command"])
    assert producer[:2] == ["regen", "produce"]
    assert producer[producer.index("--model") + 1] == "/opt/regen/tiny-qwen3"  # built into the CPU image
    assert "--top-k" not in producer  # Qwen3's sampling on the CPU too (app.base.library_patches.fix_vllm_cpu_expand)
    run = producer[producer.index("--run") + 1]
    workers = _cpu_workers(compose)
    assert len(workers) == 2
    for name, service in workers.items():
        argv = _argv(service["command"])
        assert argv[:3] == ["regen", "worker", "--cpu"] and argv[argv.index("--run") + 1] == run, name
        assert service["depends_on"]["producer-cpu"]["condition"] == "service_completed_successfully"
        assert service["depends_on"]["redis"]["condition"] == "service_healthy"
        assert "deploy" not in service and service["volumes"] == producer_volumes(compose)[:1]
    assert len({s["hostname"] for s in workers.values()}) == 2  # worker names cpuN@host differ


def producer_volumes(compose) -> list[str]:
    return compose["services"]["producer-cpu"]["volumes"]


def test_the_generator_makes_n_cpu_workers():
    doc = yaml.safe_load(render(1, cpu_workers=5))
    assert sorted(_cpu_workers(doc)) == [f"worker-cpu{i}" for i in range(5)]
    assert render(1, cpu_workers=5).startswith("# Generated by `python deploy/gen_workers.py 1 --cpu-workers 5`")


def test_every_published_port_binds_127_0_0_1_by_default(compose):
    for name, service in compose["services"].items():
        for port in service.get("ports", []):
            bind = re.fullmatch(r"\$\{([A-Z_]+)_BIND:-127\.0\.0\.1\}:\$\{[A-Z_]+_PORT:-\d+\}:\d+", port)
            assert bind, f"{name}: {port}"


def test_redis_writes_its_aof_on_its_volume_whatever_the_image(compose):
    """redis:7 works in /data; the CPU image, which serves as Redis where no registry answers, works elsewhere."""
    redis = compose["services"]["redis"]
    argv = _argv(redis["command"])
    assert argv[argv.index("--dir") + 1] == "/data" and "redis-data:/data" in redis["volumes"]


def _compose_v2() -> str | None:
    for candidate in (os.environ.get("REGEN_COMPOSE_BIN"),
                      str(Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins" / "docker-compose"),
                      "/usr/local/lib/docker/cli-plugins/docker-compose", "/usr/libexec/docker/cli-plugins/docker-compose",
                      shutil.which("docker-compose")):
        if candidate and os.access(candidate, os.X_OK):
            out = subprocess.run([candidate, "version"], capture_output=True, text=True).stdout
            if re.search(r"version v?2\.", out):
                return candidate
    return None


ENV = {"REDIS_PASSWORD": "p1", "FLOWER_USER": "u", "FLOWER_PASSWORD": "p2"}


def _config(tmp_path, env: dict, *profiles: str) -> subprocess.CompletedProcess:
    binary = _compose_v2()
    if binary is None:
        pytest.skip("no Docker Compose v2 (bash scripts/install_compose.sh installs it)")
    env_file = tmp_path / "check.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    clean = {k: v for k, v in os.environ.items() if not re.match(r"(REDIS|FLOWER|REGEN|METRICS|AWS)_", k)}
    args = [binary, "-f", str(REPO / "compose.yaml"), "--env-file", str(env_file)]
    args += [a for p in profiles for a in ("--profile", p)]
    return subprocess.run([*args, "config", "--format", "json"], capture_output=True, text=True, env=clean, timeout=60)


def test_compose_v2_reads_every_profile_with_only_the_secrets_set(tmp_path):
    """What compose itself makes of the file (merge keys, interpolation, defaults), profile by profile."""
    proc = _config(tmp_path, ENV, "gpu", "head", "cpu")
    assert proc.returncode == 0, proc.stderr
    services = json.loads(proc.stdout)["services"]
    for g in range(4):
        w = services[f"worker-gpu{g}"]
        assert w["deploy"]["resources"]["reservations"]["devices"] == [
            {"driver": "nvidia", "device_ids": [str(g)], "capabilities": ["gpu"]}]
        assert w["ipc"] == "host" and w["stop_grace_period"] == "2h0m0s" and w["image"] == "regen:latest"
        assert w["environment"]["REGEN_BROKER_URL"] == "redis://:p1@redis:6379/0"
    for name, service in services.items():
        for port in service.get("ports", []):
            assert port["host_ip"] == "127.0.0.1", (name, port)
    assert services["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "u:p2"
    assert services["worker-cpu0"]["image"] == "regen:cpu" and "deploy" not in services["worker-cpu0"]
    cpu_only = _config(tmp_path, ENV, "cpu")
    assert set(json.loads(cpu_only.stdout)["services"]) == {"redis", "flower", "metrics", "producer-cpu",
                                                             "worker-cpu0", "worker-cpu1"}


def test_compose_v2_refuses_to_start_without_the_secrets(tmp_path):
    proc = _config(tmp_path, {"FLOWER_USER": "u", "FLOWER_PASSWORD": "p2"}, "cpu")
    assert proc.returncode != 0 and "set REDIS_PASSWORD in .env" in proc.stderr


def test_env_example_names_every_required_variable():
    example = (REPO / "deploy" / ".env.example").read_text()
    required = set(re.findall(r"\$\{([A-Z_]+):\?", render(4)))
    defined = set(re.findall(r"^#?\s*([A-Z_]+)=", example, re.M))
    assert required <= defined, required - defined
    assert not re.search(r"^(REDIS_PASSWORD|FLOWER_PASSWORD)=\S", example, re.M)


def _services(tmp_path, env: dict, *profiles: str) -> dict:
    proc = _config(tmp_path, env, *profiles)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)["services"]


def _parsed(service: dict) -> tuple[str, dict]:
    """The service's regen command as regen's own command line parses it (types, bounds, choices): (command,
    its parameters)."""
    argv = _argv(service["command"])
    assert argv[0] == "regen", argv
    command = regen_cli.commands[argv[1]]
    with command.make_context(argv[1], argv[2:], resilient_parsing=False) as ctx:
        return argv[1], ctx.params


def test_a_gpu_host_joins_any_head_by_url_with_no_head_service_and_no_flower_login(tmp_path):
    """A GPU host's project: the workers only, on the head's URL and the shared storage, the run's queues by
    default (REGEN_QUEUES to choose) and the host's worker options; compose needs no Flower login there."""
    url = "redis://:p1@head.lan:6379/0"
    env = {"REDIS_PASSWORD": "p1", "REGEN_BROKER_URL": url, "REGEN_RUN": "qwen36", "REGEN_STORAGE_DIR": "/nfs/regen",
           "REGEN_WORKER_ARGS": "--task-slots 10 --max-num-seqs 256"}
    services = _services(tmp_path, env, "gpu")
    assert set(services) == {f"worker-gpu{g}" for g in range(4)}
    for name, w in services.items():
        assert w["environment"]["REGEN_BROKER_URL"] == url
        assert all(dep["required"] is False for dep in w["depends_on"].values())  # no head in this project
        assert {"type": "bind", "source": "/nfs/regen", "target": "/data/runs", "bind": {"create_host_path": True}} \
            in w["volumes"]
        command, params = _parsed(w)
        assert command == "worker" and params["run_id"] == "qwen36" and params["queues"] == ("",)
        assert params["task_slots"] == 10 and params["max_num_seqs"] == 256, name
    staged = _services(tmp_path, {**env, "REGEN_QUEUES": "regen,regen.capture"}, "gpu")
    assert _parsed(staged["worker-gpu0"])[1]["queues"] == ("regen,regen.capture",)


def test_the_heads_producer_takes_the_runs_options(tmp_path):
    """REGEN_PRODUCE_ARGS: the pilot's recommended produce line (less inputs, run, storage, model) reaches the
    producer's command line, which regen produce parses as given."""
    args = "--layers eagle3 --max-tokens 8192 --capture staged --thinking-mix 0.5 --take sharegpt*.jsonl=0.5 --seed 3"
    services = _services(tmp_path, {**ENV, "REGEN_RUN": "qwen36", "REGEN_PRODUCE_ARGS": args}, "head")
    assert set(services) == {"redis", "flower", "metrics", "producer"}
    command, params = _parsed(services["producer"])
    assert command == "produce" and params["run_id"] == "qwen36" and params["inputs"] == ("/inputs/*.jsonl",)
    assert (params["layers"], params["max_tokens"], params["capture"], params["thinking_mix"], params["seed"]) == \
        ("eagle3", 8192, "staged", 0.5, 3)
    assert params["take"] == ("sharegpt*.jsonl=0.5",) and params["max_pending"] == 2000  # `set -f`: no globbing
    assert services["producer"]["environment"]["REGEN_BROKER_URL"] == "redis://:p1@redis:6379/0"


@pytest.mark.parametrize(("login", "starts"), [("u:p2", True), ("u:", False), (":p2", False), (":", False)])
def test_flower_without_both_halves_of_its_login_refuses_to_start(login, starts, tmp_path):
    """Flower's login is checked as it starts (a GPU host, which runs no Flower, sets none)."""
    script = _services(tmp_path, ENV, "head")["flower"]["command"][2].replace("$$", "$")
    assert script.endswith("; exec celery -A app.ops.flower flower --port=5555")
    script = script.rsplit("exec ", 1)[0] + "echo flower would start"  # no Flower here: what would start it
    proc = subprocess.run(["sh", "-c", script], capture_output=True, text=True, env={"FLOWER_BASIC_AUTH": login})
    assert (proc.returncode, proc.stdout.strip() == "flower would start") == ((0, True) if starts else (78, False))
    assert starts or proc.stderr.strip() == "regen: set FLOWER_USER and FLOWER_PASSWORD in .env"


@pytest.mark.parametrize("argv", [["worker", "--gpus", "0", "--run", "", "--queue", "", "--model", "/models/target"],
                                  ["produce", "/inputs/*.jsonl", "--run", "", "--model", "/models/target"]])
def test_an_unset_regen_run_stops_the_gpu_services_in_one_line(argv, tmp_path):
    """REGEN_RUN is not a required variable (compose would then refuse the cpu profile too): the services say it."""
    env = {**os.environ, "REGEN_STORAGE": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "app.cli", *argv], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "regen: error: --run is empty: give the run id (with compose, set REGEN_RUN in .env)"


def _apt_mirror(root: Path) -> subprocess.CompletedProcess:
    """scripts/compose_check.sh's apt_mirror on a machine whose apt sources lie under `root`, under the script's
    own `set -Eeuo pipefail`."""
    script = (REPO / "scripts" / "compose_check.sh").read_text()
    function = re.search(r"^apt_mirror\(\) \{.*?^\}", script, re.M | re.S)[0]
    return subprocess.run(["bash", "-c", f"set -Eeuo pipefail\n{function}\napt_mirror {shlex.quote(str(root))}"],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(("files", "mirror"), [
    # Debian 12 as installed: deb822 only, no /etc/apt/sources.list (the grep naming it exited 2 and, under
    # pipefail, ended the compose check 3 s in with no message)
    ({"sources.list.d/debian.sources": "Types: deb\nURIs: http://mirror.example/debian\nSuites: bookworm\n"
                                       "Components: main\n\nTypes: deb\nURIs: http://deb.debian.org/debian-security\n"},
     "http://mirror.example/debian"),
    ({"sources.list": "deb http://ftp.example.org/debian bookworm main\n"}, "http://ftp.example.org/debian"),
    ({}, ""),  # nothing found: the script falls back to deb.debian.org
])
def test_the_compose_checks_mirror_lookup_reads_deb822_and_one_line_sources(files, mirror, tmp_path):
    for name, text in files.items():
        (tmp_path / "etc" / "apt" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "etc" / "apt" / name).write_text(text)
    proc = _apt_mirror(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == mirror
