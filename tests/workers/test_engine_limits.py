"""Settings an engine is known to reject are refused in one line before any engine starts (workers/engine/limits.py):
`regen worker --cpu --run` on a run sampled with top_k and captured, `regen run --cpu --top-k N`, and a worker
started without `--run` that meets such a run's shard (tests/workers/test_task_guards.py)."""

from __future__ import annotations

from click.testing import CliRunner

from app.cli import main
from tests.support.redis_db import OPS_BROKER
from tests.support.runs import produce, prompts_file
from workers.engine.limits import unsupported


def test_only_top_k_with_capture_on_the_cpu_is_known_to_fail():
    assert "top_k 20" in unsupported("cpu", {"top_k": 20}, captures=True)
    assert unsupported("cpu", {"top_k": 0}, captures=True) is None
    assert unsupported("cpu", {"top_k": 20}, captures=False) is None
    assert unsupported("cuda", {"top_k": 20}, captures=True) is None


def test_a_cpu_worker_refuses_a_top_k_run_it_would_capture_in_one_line(tiny_qwen3, tmp_path, redis7):
    produce(tmp_path / "storage", "topk", [prompts_file(tmp_path, with_formats=False)], tiny_qwen3,
            "--top-k", "20", broker=OPS_BROKER)
    result = CliRunner().invoke(main, ["worker", "--cpu", "--run", "topk", "--storage", str(tmp_path / "storage"),
                                       "--broker", OPS_BROKER])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "refuses run topk" in lines[0] and "top_k 20" in lines[0], result.output


def test_regen_run_refuses_cpu_with_top_k_before_producing(tiny_qwen3, tmp_path):
    storage = tmp_path / "storage"
    result = CliRunner().invoke(main, ["run", str(prompts_file(tmp_path, with_formats=False)), "--model",
                                       str(tiny_qwen3), "--cpu", "--top-k", "20", "--storage", str(storage)])
    assert result.exit_code == 2 and "top_k 20" in result.output, result.output
    assert not storage.exists()
