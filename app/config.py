"""The old name of app/settings.py's broker defaults and URL masking, kept only for workers/ (plan.py,
supervisor.py, tasks.py), which issue 32's move of the worker folder rewrites in parallel: when those import
app.settings, delete this file. Nothing else may import it (tests/test_layout.py).
"""

from app.settings import (  # noqa: F401
    DEFAULT_BROKER_URL,
    DEFAULT_CAPTURE_QUEUE,
    DEFAULT_QUEUE,
    DEFAULT_SHARD_SIZE,
    DEFAULT_VISIBILITY_TIMEOUT,
    BrokerSettings,
    mask_text,
    mask_url,
)
