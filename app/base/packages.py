"""Optional packages (pyproject.toml's extras), checked when a command starts rather than when it first needs one.

Why: a missing package found half-way (pyarrow at an export's first shard, datasets when its last step
assembles the dataset) is a traceback after hours of work, and leaves a half-written output behind. A command
that will need a package imports it here first, so a missing one is one line with the pip command to run.
"""

from __future__ import annotations

import importlib

from app.base.errors import ConfigError

# The requirement to install for each optional module, as pyproject.toml's extras pin it.
REQUIREMENTS = {
    "pyarrow": "pyarrow>=15",  # data: `regen export --format parquet`
    "datasets": "datasets>=3",  # data: speculators' dataset
    "matplotlib": "matplotlib>=3.8",  # data: `regen stats --html`
    "torch": "torch",  # cpu / gpu (vLLM pins it): `.pt` and `.ckpt` exports, `regen verify --reference`
    "s3fs": "s3fs>=2024.12",  # s3: `s3://` storage
    "prometheus_client": "prometheus_client>=0.20",  # monitor: `regen metrics`
}


def require(module: str, what: str) -> None:
    """Import `module` now; if it is missing, a ConfigError saying what needs it and how to install it."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise ConfigError(f"{what} needs {module}: pip install '{REQUIREMENTS.get(module, module)}'") from None
