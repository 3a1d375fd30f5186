#!/usr/bin/env bash
# The GPU hosts' Python on a CPU machine: vLLM's image and Ubuntu 24.04 run Python 3.12, so the checkout must
# install there. In a fresh virtualenv of that Python (default 3.12; PYVER=3.13 for another):
#   1. `pip install .` with the light dependencies only (no torch, no vLLM), then every regen command's --help
#      and an import of every module that needs neither vLLM nor torch at its top, from outside the checkout;
#   2. `pip install --dry-run` of the GPU install (`.[gpu,s3,monitor]`: the CUDA build of vLLM): pip resolves
#      it from PyPI's metadata without downloading the wheels or needing a GPU; the resolved vllm must be in
#      the gpu extra's range and its torch a CUDA build.
# Needs PyPI (both steps). About 2 min on this project's CI machine (measured in docs/configuration.md).
#   bash scripts/python_versions_check.sh            PYVER=3.13 bash scripts/python_versions_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
unset PYTHONPATH PYTHONHOME  # the virtualenv's interpreter must see the installed package, never the checkout
REPO=$PWD
PYVER=${PYVER:-3.12}
say() { printf '[python %s] %s\n' "$PYVER" "$*" >&2; }
fail() { say "FAILED: $*"; exit 1; }

PY=${REGEN_PYTHON:-}
if [ -z "$PY" ]; then
    for candidate in "python$PYVER" "$(command -v pyenv >/dev/null && pyenv root)/versions/$PYVER"*/bin/"python$PYVER"; do
        if [ -n "$candidate" ] && "$candidate" --version >/dev/null 2>&1; then PY=$candidate; break; fi
    done
fi
[ -n "$PY" ] || fail "no python$PYVER found (give one with REGEN_PYTHON=/path/to/python$PYVER)"
WORK=$(mktemp -d /tmp/regen-py"$PYVER".XXXXXX)
trap 'rm -rf "$WORK"' EXIT
T0=$(date +%s)
say "$("$PY" --version) at $PY; virtualenv in $WORK"
"$PY" -m venv "$WORK/venv" || fail "python$PYVER -m venv"
V=$WORK/venv/bin
"$V/pip" install --quiet --upgrade "pip>=25" >"$WORK/pip.log" 2>&1 || { tail -5 "$WORK/pip.log" >&2; fail "upgrading pip"; }

# 1. the package with its light dependencies, imported from outside the checkout (installed from a copy of the
#    checkout's files: setuptools writes build/ into the folder it builds)
mkdir "$WORK/src"
git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C "$WORK/src"
"$V/pip" install --quiet "$WORK/src" >"$WORK/install.log" 2>&1 || { tail -15 "$WORK/install.log" >&2; fail "pip install ."; }
T1=$(date +%s)
say "pip install . (light dependencies): $((T1 - T0))s"
(cd "$WORK" && "$V/regen" --version) || fail "regen --version"
(cd "$WORK" && "$V/python" -c "
from click.testing import CliRunner
from app.cli import main
for name in sorted(main.commands):
    result = CliRunner().invoke(main, [name, '--help'])
    assert result.exit_code == 0 and 'Usage: regen ' + name in result.output, (name, result.output[-2000:])
print(f'regen --help of {len(main.commands)} commands')") || fail "regen COMMAND --help"
(cd "$WORK" && "$V/python" - "$REPO") <<'EOF' || fail "importing the package's modules"
import importlib, pathlib, sys
import app
repo = pathlib.Path(sys.argv[1])
assert pathlib.Path(app.__file__).resolve().parents[1] != repo, "imported the checkout, not the installed package"
heavy = ("vllm", "torch")  # modules that import these at their top are the engine's and the exports': not here
names = []
for package in ("app", "producer", "workers"):
    for path in sorted((repo / package).rglob("*.py")):
        text = path.read_text()
        if any(f"\nimport {h}" in text or f"\nfrom {h}" in text for h in heavy) or path.name == "__main__.py":
            continue
        names.append(".".join(path.relative_to(repo).with_suffix("").parts).removesuffix(".__init__"))
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name.split(".")[0] not in ("vllm", "torch", "flower", "prometheus_client", "psutil", "datasets",
                                          "matplotlib", "pyarrow", "s3fs"):  # optional extras
            failed.append(f"{name}: {exc}")
    except Exception as exc:  # noqa: BLE001 - every failure is reported, none stops the walk
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(f"imported {len(names) - len(failed)} of {len(names)} modules on Python {sys.version.split()[0]}")
if failed:
    sys.exit("\n".join(failed))
EOF
T2=$(date +%s)
say "every command's --help and the modules' imports: $((T2 - T1))s"

# 2. the GPU install's resolution (no download of the wheels, no GPU)
"$V/pip" install --dry-run --quiet --report "$WORK/gpu.json" "$WORK/src[gpu,s3,monitor]" >"$WORK/gpu.log" 2>&1 \
    || { grep -v "^WARNING: Location" "$WORK/gpu.log" | tail -15 >&2; fail "pip install --dry-run .[gpu,s3,monitor]"; }
"$V/python" - "$WORK/gpu.json" "$REPO/pyproject.toml" <<'EOF' || fail "the resolved GPU install"
import json, sys, tomllib
from packaging.requirements import Requirement
report = json.load(open(sys.argv[1]))
versions = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
extra = tomllib.load(open(sys.argv[2], "rb"))["project"]["optional-dependencies"]["gpu"]
(vllm_req,) = [Requirement(r) for r in extra if Requirement(r).name == "vllm"]
assert "vllm" in versions, "the gpu extra resolved without vllm"
assert vllm_req.specifier.contains(versions["vllm"]), f"vllm {versions['vllm']} outside {vllm_req.specifier}"
assert "torch" in versions and "+cpu" not in versions["torch"], f"torch {versions.get('torch')}: not a CUDA build"
cuda = sorted(n for n in versions if n.startswith("nvidia-"))
assert cuda, "no CUDA runtime package in the resolution"
print(f"gpu extra resolves: vllm {versions['vllm']}, torch {versions['torch']}, {len(cuda)} nvidia-* packages, "
      f"{len(versions)} packages in all")
EOF
T3=$(date +%s)
say "pip install --dry-run .[gpu,s3,monitor]: $((T3 - T2))s; all: $((T3 - T0))s"
