"""Runs and shards on `s3://` through fsspec + s3fs, against a moto S3 server started by this module.

The endpoint reaches `Storage` the way it reaches a worker on another host: `REGEN_STORAGE_OPTIONS` (JSON)
in the environment, so every `Storage("s3://...")` -- in the producer, the workers' publish path, status --
opens the same bucket.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner

from app.base.hidden_file import HiddenFileReader
from app.base.jsonl_zst import loads_jsonl_zst
from app.base.storage import RunStore, Storage
from app.cli import main
from tests.support.models import build_tiny_model
from tests.support.polling import wait_for
from tests.support.ports import free_port
from tests.support.producer import decode_queue, sharegpt_row, write_jsonl
from tests.support.redis_db import redis_or_fail, redis_url
from tests.support.status_run import DONE, build_status_run, publish_synthetic

BUCKET = "regen-test"
BROKER = redis_url(7)


def _answers(endpoint: str) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(endpoint, timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    # moto's server runs in a process of its own: in this one, its Flask proxies (`current_app`, ...) would sit
    # in sys.modules, where vLLM's CPU kernel registration probes every module attribute and trips on them,
    # failing any engine a later test builds in-process.
    port = free_port()
    log = open(tmp_path_factory.mktemp("moto") / "server.log", "wb")  # noqa: SIM115
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    wait_for(lambda: server.poll() is not None or _answers(endpoint), 60, f"moto's S3 server on {endpoint}")
    assert server.poll() is None, f"moto's server exited with {server.returncode}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION",
                                            "REGEN_STORAGE_OPTIONS")}
    os.environ.update({"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1",
                       "REGEN_STORAGE_OPTIONS": json.dumps({"client_kwargs": {"endpoint_url": endpoint}})})
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    Storage(f"s3://{BUCKET}").fs.mkdir(BUCKET)
    yield endpoint
    server.terminate()
    server.wait(timeout=30)
    log.close()
    s3fs.S3FileSystem.clear_instance_cache()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture
def s3_root(s3_endpoint, request) -> str:
    return f"s3://{BUCKET}/{request.node.name.replace('[', '-').replace(']', '')[:60]}"


class _OrderRecorder:
    """Proxy over one Storage's filesystem that records object writes and, when the marker is written, what
    exists at that instant. Only this instance is wrapped; nothing global is patched."""

    def __init__(self, fs, watch: list[str], marker: str):
        self._fs, self.watch, self.marker = fs, watch, marker
        self.writes: list[str] = []
        self.seen_at_marker: dict | None = None

    def __getattr__(self, name):
        return getattr(self._fs, name)

    def open(self, path, mode="rb", **kw):
        if "w" in mode:
            self.writes.append(path)
        return self._fs.open(path, mode, **kw)

    def pipe_file(self, path, data, **kw):
        if path == self.marker:
            self.seen_at_marker = {p: self._fs.exists(p) for p in [*self.watch, self.marker]}
        self.writes.append(path)
        return self._fs.pipe_file(path, data, **kw)


def test_publish_shard_on_s3_writes_files_then_the_marker_and_reads_back(s3_root):
    storage = Storage(s3_root)
    assert not storage.is_local
    store = RunStore(storage, "r1")
    records_rel, hidden_rel = store.records_path("shard-000000", "a0"), store.hidden_path("shard-000000", "a0")
    full = [storage.path(records_rel), storage.path(hidden_rel)]
    recorder = _OrderRecorder(storage.fs, full, storage.path(store.done_path("shard-000000")))
    storage.fs = recorder
    summary = publish_synthetic(store, "shard-000000", "gpu0@h", 3, 1, 6, 9, 1.25)
    storage.fs = recorder._fs

    assert recorder.seen_at_marker == {full[0]: True, full[1]: True, recorder.marker: False}
    data_writes = [p for p in recorder.writes if "/attempts/" not in p]
    assert data_writes[-1] == recorder.marker and set(full) <= set(data_writes[:-1])
    # The object store agrees: the marker is not older than any file it names.
    modified = {p: storage.fs.info(p)["LastModified"] for p in [*full, recorder.marker]}
    assert modified[recorder.marker] >= max(modified[p] for p in full)

    marker = store.done_marker("shard-000000")
    assert marker["generated_tokens"] == summary["generated_tokens"] == 27
    records = loads_jsonl_zst(storage.read_bytes(marker["files"]["records"]["path"]))
    assert [r["sample_id"] for r in records] == [f"shard-000000-s{i}" for i in range(3)]
    with storage.open(marker["files"]["hidden"]["path"]) as fh:
        reader = HiddenFileReader(fh)
        assert len(reader) == 3
        token_ids, states = reader.read(2)  # random access: the last sample first, by seeking
        assert np.array_equal(token_ids, np.arange(6 + 9 - 1))
        rng = np.random.default_rng(6 + 9 - 1)
        assert np.array_equal(states, rng.integers(0, 2**16, size=(14, 2, 8), dtype=np.uint16))


def test_create_exclusive_on_s3_refuses_the_second_writer(s3_root):
    storage = Storage(s3_root)
    assert storage.create_exclusive("r1/done/x.json", b"first") is True
    assert storage.create_exclusive("r1/done/x.json", b"second") is False
    assert storage.read_bytes("r1/done/x.json") == b"first"


def test_create_exclusive_on_s3_is_decided_by_the_store_not_by_a_prior_check(s3_root):
    """Two deliveries of one shard that both looked before either wrote: the store's conditional PUT refuses
    the second. The wrapper makes every existence check answer "absent", which is that race frozen open."""

    class _StaleChecks:
        def __init__(self, fs):
            self._fs = fs

        def __getattr__(self, name):
            return getattr(self._fs, name)

        def exists(self, path, **kw):
            return False

    storage = Storage(s3_root)
    storage.fs = _StaleChecks(storage.fs)
    assert storage.create_exclusive("r1/done/y.json", b"first") is True
    assert storage.create_exclusive("r1/done/y.json", b"second") is False
    assert storage.read_bytes("r1/done/y.json") == b"first"


def test_done_shards_and_status_work_on_s3(s3_root):
    built = build_status_run(s3_root)
    assert built["store"].done_shards() == set(DONE)
    result = CliRunner().invoke(main, ["status", "r1", "--storage", s3_root, "--broker", BROKER, "--json",
                                       "--inspect-timeout", "0"])
    assert result.exit_code == 0, result.output
    s = json.loads(result.stdout)
    assert (s["shards"]["done"], s["shards"]["failed"], s["shards"]["dead"], s["shards"]["running"]) == (3, 1, 1, 1)
    assert s["tokens"]["generated"] == 450 and s["paused"]
    listing = json.loads(CliRunner().invoke(main, ["status", "--storage", s3_root, "--broker", BROKER,
                                                   "--json"]).stdout)
    assert [r["run"] for r in listing["runs"]] == ["r1"]


def test_produce_writes_its_run_to_s3_and_enqueues_s3_urls(s3_root, tmp_path):
    client = redis_or_fail(BROKER)
    client.flushdb()
    model = build_tiny_model(tmp_path / "model")
    inputs = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(5)])
    base = ["produce", str(inputs), "--run", "s3run", "--model", str(model), "--storage", s3_root,
            "--broker", BROKER, "--queue", "regen-s3-test", "--shard-size", "2"]
    dry = CliRunner().invoke(main, [*base, "--dry-run"])
    assert dry.exit_code == 0, dry.output
    assert client.llen("regen-s3-test") == 0
    real = CliRunner().invoke(main, base)
    assert real.exit_code == 0, real.output
    store = RunStore(Storage(s3_root), "s3run")
    manifest = store.storage.read_json(store.manifest_path)
    produced = store.storage.read_json(store.produce_path)
    assert manifest["run_id"] == "s3run" and produced["counts"]["shards"] == 3 and produced["complete"] is True
    messages = decode_queue(client, "regen-s3-test")
    assert len(messages) == 3 and {m["kwargs"]["storage"] for m in messages} == {s3_root}
    client.flushdb()


def test_storage_options_come_from_the_environment_only_for_urls(tmp_path, s3_endpoint):
    local = Storage(str(tmp_path / "local"))  # REGEN_STORAGE_OPTIONS is set, and must not reach the local fs
    assert local.is_local and os.path.isdir(local.root)
    assert Storage(f"s3://{BUCKET}").fs.client_kwargs["endpoint_url"] == s3_endpoint


@pytest.mark.parametrize("size", [1_000, 12 << 20])  # one PUT, and a multipart upload (s3fs sends 5 MiB parts)
def test_a_write_interrupted_on_s3_leaves_no_object(s3_root, size):
    """An attempt's file streamed while its shard generates must not appear if the shard fails midway: fsspec
    closes (and so commits) a file on any exit unless it was opened without autocommit and discarded."""
    storage = Storage(s3_root)
    with pytest.raises(OSError, match="engine gone"), storage.atomic_writer("runs/r/shards/s/a.hidden.rgh") as fh:
        fh.write(b"x" * size)
        raise OSError("engine gone")
    assert not storage.exists("runs/r/shards/s/a.hidden.rgh")
    storage.write_bytes("runs/r/shards/s/b.hidden.rgh", b"y" * size)  # and a clean exit still writes the object
    assert storage.read_bytes("runs/r/shards/s/b.hidden.rgh") == b"y" * size
