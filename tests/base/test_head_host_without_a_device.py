"""A head host with vLLM's CUDA build and no GPU: `--vllm-arg` is checked by vLLM's own parser there too, and a
bad one is one line (app.base.vllm_args builds the parser without a device). The host is reproduced on this CPU
machine by tests/support/no_device_stand_in.py, in a process of its own; the script first shows that vLLM's
parser itself fails there, so the stand-in is the host the users have."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.support.paths import REPO

SCRIPT = """
import json, sys
from tests.support.no_device_stand_in import install_no_device_platform_stand_in
install_no_device_platform_stand_in()
from click.testing import CliRunner
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
from app.cli import main

out = {}
try:
    EngineArgs.add_cli_args(FlexibleArgumentParser())
    out["vllm"] = "parsed"
except RuntimeError as exc:
    out["vllm"] = str(exc)
base = ["produce", sys.argv[1], "--model", sys.argv[2], "--dry-run"]
for name, arg in (("good", "max-num-batched-tokens=8192"), ("typo", "max-num-batched-tokns=8192"),
                  ("bad value", "max_num_batched_tokens=lots")):
    result = CliRunner().invoke(main, [*base, "--vllm-arg", arg])
    out[name] = [result.exit_code, result.stdout, result.stderr, repr(result.exception)]
from vllm.platforms import current_platform
out["platform after"] = current_platform.device_type
print("RESULT " + json.dumps(out))
"""


def test_vllm_args_are_checked_on_a_host_with_no_device(tiny_qwen3, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n')
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(prompts), str(tiny_qwen3)], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert out["vllm"].startswith("Failed to infer device type"), out["vllm"]  # the host, reproduced
    code, stdout, stderr, _ = out["good"]
    assert code == 0 and "dry run of" in stdout and "export formats allowed" in stdout, (stdout, stderr)
    for case in ("typo", "bad value"):
        code, stdout, stderr, exc = out[case]
        assert code == 2 and stdout == "", (case, stdout)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("regen: error: --vllm-arg"), (case, stderr, exc)
    assert "max-num-batched-tokns" in out["typo"][2] and "lots" in out["bad value"][2]
    assert out["platform after"] == ""  # the parser's device was for the parser only
