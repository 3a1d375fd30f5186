"""`regen metrics`: scraped over HTTP on 127.0.0.1, the numbers equal what storage and Redis hold."""

from __future__ import annotations

import subprocess
import sys
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.support.redis_db import OPS_BROKER
from tests.support.status_run import DONE, STATUS_QUEUE, TOTAL_SHARDS, build_status_run, publish_synthetic

BROKER = OPS_BROKER


def _scrape(url: str) -> dict:
    """{(name, sorted labels): value} of one scrape."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def server(tmp_path, redis7):
    from app.ops.metrics import serve

    built = build_status_run(str(tmp_path))
    srv, thread = serve("127.0.0.1", 0, str(tmp_path), BROKER, [], [])
    yield f"http://127.0.0.1:{srv.server_port}/metrics", built
    srv.shutdown()
    thread.join(timeout=10)


def test_scrape_reports_queue_length_shards_tokens_and_stub_rate(server, redis7):
    url, built = server
    redis7.lpush(STATUS_QUEUE, b"a", b"b", b"c")
    m = _scrape(url)
    run = (("run", "r1"),)
    assert m[("regen_queue_length", (("queue", STATUS_QUEUE),))] == 3
    assert m[("regen_broker_up", ())] == 1
    for state, n in {"total": TOTAL_SHARDS, "done": 3, "failed": 1, "dead": 1, "running": 1}.items():
        assert m[("regen_shards", (("run", "r1"), ("state", state)))] == n
    generated = sum(built["summaries"][s]["generated_tokens"] for s in DONE)
    assert m[("regen_generated_tokens_total", run)] == generated == 450
    assert m[("regen_samples_total", run)] == 11
    assert m[("regen_stub_rate", run)] == pytest.approx(3 / 11, abs=1e-6)
    assert m[("regen_run_paused", run)] == 1
    assert m[("regen_worker_tokens_per_second", (("run", "r1"), ("worker", "gpu0@hostA")))] == pytest.approx(360 / 3.5,
                                                                                                           abs=1e-3)
    busy = m[("regen_worker_busy_fraction", (("run", "r1"), ("worker", "gpu1@hostA")))]
    assert 0 < busy <= 1


def test_metrics_are_computed_on_each_scrape(server, redis7):
    url, built = server
    assert _scrape(url)[("regen_shards", (("run", "r1"), ("state", "done")))] == 3
    publish_synthetic(built["store"], "shard-000006", "gpu1@hostA", 2, 0, 5, 20, 1.0)
    redis7.lpush(STATUS_QUEUE, b"x")
    m = _scrape(url)
    assert m[("regen_shards", (("run", "r1"), ("state", "done")))] == 4
    assert m[("regen_generated_tokens_total", (("run", "r1"),))] == 450 + 40
    assert m[("regen_queue_length", (("queue", STATUS_QUEUE),))] == 1


def test_an_unreachable_broker_is_a_metric_not_a_failed_scrape(tmp_path):
    from app.ops.metrics import serve

    build_status_run(str(tmp_path))
    srv, thread = serve("127.0.0.1", 0, str(tmp_path), "redis://:pw@127.0.0.1:1/0", ["r1"], [])
    try:
        m = _scrape(f"http://127.0.0.1:{srv.server_port}/metrics")
        assert m[("regen_broker_up", ())] == 0
        assert m[("regen_shards", (("run", "r1"), ("state", "done")))] == 3
    finally:
        srv.shutdown()
        thread.join(timeout=10)


def test_regen_metrics_command_serves_over_http(tmp_path, redis7):
    build_status_run(str(tmp_path))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "app.cli", "metrics", "--addr", "127.0.0.1", "--port", str(port),
                             "--storage", str(tmp_path), "--broker", "redis://:hunter2@127.0.0.1:6379/7"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        def scraped():
            try:
                return _scrape(f"http://127.0.0.1:{port}/metrics")
            except OSError:
                return None

        m = wait_for(scraped, 30, "regen metrics to answer")
        assert m[("regen_shards", (("run", "r1"), ("state", "done")))] == 3
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert b"hunter2" not in err and b"redis://:***@127.0.0.1:6379/7" in err
