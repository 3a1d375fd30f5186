"""Session fixtures for the hybrid target (Qwen3.5: Gated DeltaNet + full attention): the tiny model in both
checkpoint shapes, and one real `regen worker --cpu` on the text-only shape, shared by every hybrid test.

Import them into a test module (`from tests.hybrid_fixtures import hybrid_worker, tiny_hybrid, ...`). The hybrid
worker has Redis db 9 to itself, so it never takes the dense worker's shards (db 3), nor they its.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import flushed_redis, session_worker, worker_env
from tests.redis_urls import redis_url

HYBRID_BROKER = redis_url(9)
# vLLM ids 1 and 2 are linear-attention layers' outputs, 4 the full-attention layer's (the last, before the norm)
HYBRID_LAYERS = "vllm:1,2,4"
HYBRID_KINDS = ["linear_attention", "linear_attention", "full_attention"]
# An operator's engine setting the hybrid worker starts with: the tests check that it reaches the engine.
OPERATOR_ARG = "max_num_batched_tokens=6144"


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3_5

    return Path(build_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5"))))


@pytest.fixture(scope="session")
def tiny_hybrid_mm(tmp_path_factory) -> Path:
    from workers.tiny_model import build_tiny_qwen3_5

    return Path(build_tiny_qwen3_5(str(tmp_path_factory.mktemp("tiny-qwen3_5-mm")), multimodal=True))


@pytest.fixture(scope="session")
def hybrid_redis():
    return flushed_redis(HYBRID_BROKER)


@pytest.fixture(scope="session")
def hybrid_worker(tiny_hybrid, hybrid_redis, tmp_path_factory):
    """One real CPU worker on the text-only hybrid for the session: generate and staged-capture queues."""
    with session_worker(tiny_hybrid, HYBRID_LAYERS, "hybrid", tmp_path_factory.mktemp("hybrid-worker-logs"),
                        worker_env(HYBRID_BROKER), ("--vllm-arg", OPERATOR_ARG)) as worker:
        yield worker
