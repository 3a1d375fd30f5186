"""A real vLLM OpenAI server that extracts hidden states: the endpoint behind speculators' `on_missing="generate"`.

It is started as speculators' `scripts/launch_vllm.py` starts one (`extract_hidden_states` with the layers the
drafter reads, the last one included, plus a hidden-states connector that writes one safetensors file per
request), with the CPU settings regen's own engines use. vLLM's stock connector needs CUDA, so the server loads
regen's CPU-capable subclass (workers/engine/capture_connector.py) by module path, as the workers do.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.support.engines import vllm_or_fail
from tests.support.paths import REPO
from tests.support.polling import wait_for
from tests.support.ports import free_port


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/models", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@contextlib.contextmanager
def hidden_state_server(model: Path, layers: list[int], scratch: Path, log_path: Path, timeout: float = 300):
    """Yield the server's `/v1` URL; it writes states under `scratch`; stopped (its whole group) after."""
    vllm_or_fail()
    port = free_port()
    speculative = {"method": "extract_hidden_states", "num_speculative_tokens": 1,
                   "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}}}
    transfer = {"kv_connector": "CpuCapableHiddenStatesConnector",
                "kv_connector_module_path": "workers.engine.capture_connector", "kv_role": "kv_producer",
                "kv_connector_extra_config": {"shared_storage_path": str(scratch)}}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--max-model-len", "2048", "--max-num-seqs", "8", "--enforce-eager",
            "--no-enable-chunked-prefill", "--no-enable-prefix-caching", "--kv-cache-memory-bytes", str(256 << 20),
            "--distributed-executor-backend", "uni", "--speculative-config", json.dumps(speculative),
            "--kv-transfer-config", json.dumps(transfer)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            wait_for(lambda: _answers(url) or proc.poll() is not None, timeout, f"vLLM server (log {log_path})")
            if proc.poll() is not None:
                pytest.fail(f"vLLM server exited early:\n{log_path.read_text(errors='replace')[-3000:]}")
            yield url
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
