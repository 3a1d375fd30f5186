"""`regen produce` end to end against the local Redis: shards, re-runs, resume, rejects, dry run, CLI errors."""

from __future__ import annotations

import json

import orjson
import pytest
from click.testing import CliRunner

from app.base.celery_app import GENERATE_TASK
from app.base.errors import ManifestMismatch
from app.base.storage import RunStore, Storage
from app.cli import main
from producer.enqueue import ShardSender
from producer.produce import produce
from producer.run_setup import ProduceOptions
from producer.sharding import Shard
from tests.support.paths import FORMATS_DIR
from tests.support.producer import QUEUE, decode_queue, sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS


@pytest.fixture
def options(tmp_path, tiny_config_model):
    def make(inputs, **kw) -> ProduceOptions:
        base = dict(inputs=[str(p) for p in inputs], run_id="r1", storage=str(tmp_path / "store"),
                    model=str(tiny_config_model), broker=PRODUCER_REDIS, queue=QUEUE, shard_size=4)
        return ProduceOptions(**{**base, **kw})
    return make


def store_of(opts: ProduceOptions) -> RunStore:
    return RunStore(Storage(opts.storage), opts.run_id)


def test_produce_enqueues_one_message_per_shard_with_the_samples(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i, "q" * 1200) for i in range(10)])
    opts = options([path], compress="zstd")
    result = produce(opts)
    assert producer_redis.llen(QUEUE) == 3
    messages = decode_queue(producer_redis)
    assert [m["kwargs"]["shard_id"] for m in messages] == ["shard-000000", "shard-000001", "shard-000002"]
    assert [len(m["kwargs"]["samples"]) for m in messages] == [4, 4, 2]
    assert {m["task"] for m in messages} == {GENERATE_TASK}
    first = messages[0]["kwargs"]
    assert first["run_id"] == "r1" and first["storage"] == str(tmp_path / "store")
    assert set(first["samples"][0]) == {"id", "messages", "tools", "source"}
    assert first["samples"][0]["source"] == {"file": str(path), "line": 1, "source_id": "row-0"}
    assert [m["compression"] for m in messages] == ["application/zstd", "application/zstd", None]  # last: 2 rows < 4 KB
    assert result.accounting.to_dict()["shards_sent"] == 3
    state = json.loads((tmp_path / "store/r1/produce.json").read_text())
    assert state["complete"] is True and state["counts"]["enqueued"] == 10
    assert state["counts"]["shards"] == 3
    assert "counts" not in json.loads((tmp_path / "store/r1/run.json").read_text())  # the manifest is write-once


def test_small_shards_are_sent_uncompressed(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(0)])
    produce(options([path], compress="zstd"))
    assert [m["compression"] for m in decode_queue(producer_redis)] == [None]


def test_second_produce_of_the_same_run_enqueues_nothing(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(10)])
    produce(options([path]))
    producer_redis.delete(QUEUE)
    again = produce(options([path]))
    assert again.status == "already_produced"
    assert producer_redis.llen(QUEUE) == 0


def test_interrupted_produce_is_continued_by_running_it_again(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(10)])
    opts = options([path])
    produce(opts)
    store = store_of(opts)
    state = store.storage.read_json(store.produce_path)
    store.storage.write_json(store.produce_path, {**state, "complete": False})
    store.storage.write_json(store.done_path("shard-000000"), {"attempt": "a"})
    producer_redis.delete(QUEUE)
    result = produce(opts)
    assert result.status == "produced"
    assert [m["kwargs"]["shard_id"] for m in decode_queue(producer_redis)] == ["shard-000001", "shard-000002"]


def test_resume_sends_exactly_the_shards_without_a_completion_marker(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(22)])
    opts = options([path])
    produce(opts)
    store = store_of(opts)
    for shard in ("shard-000000", "shard-000002", "shard-000003", "shard-000005"):
        store.storage.write_json(store.done_path(shard), {"attempt": "a"})
    producer_redis.delete(QUEUE)
    result = produce(ProduceOptions(run_id="r1", resume=True, storage=opts.storage, broker=PRODUCER_REDIS, queue=QUEUE))
    sent = [m["kwargs"]["shard_id"] for m in decode_queue(producer_redis)]
    assert sent == ["shard-000001", "shard-000004"]
    assert result.accounting.shards == 6 and result.accounting.shards_skipped_done == 4
    # the samples are the same ones the first produce put in those shards
    assert [len(m["kwargs"]["samples"]) for m in decode_queue(producer_redis)] == [4, 4]


def test_resume_refuses_a_changed_input_naming_it(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(3)])
    opts = options([path])
    produce(opts)
    write_jsonl(path, [sharegpt_row(i) for i in range(4)])
    result = CliRunner().invoke(main, ["reconcile", "r1", "--storage", opts.storage, "--broker", PRODUCER_REDIS])
    assert result.exit_code == 2
    assert f"{path}: input changed" in result.output


def test_bad_lines_of_every_kind_become_rejects_and_good_lines_are_enqueued(producer_redis, options, tmp_path):
    rows = [
        sharegpt_row(1),                                                      # 1 good
        b'{"conversations": [',                                               # 2 malformed_json
        b'{"prompt": "caf\xe9"}',                                             # 3 not_utf8
        {"conversations": []},                                                # 4 no_conversation (empty)
        {"text": "no conversation column"},                                   # 5 no_conversation (missing)
        {"conversations": [{"from": "narrator", "value": "x"}]},              # 6 unknown_role
        {"messages": [{"role": "system", "content": "only a system turn"}]},  # 7 nothing_to_answer
        {"prompt": "x" * 500},                                                # 8 prompt_too_long
        [1, 2, 3],                                                            # 9 not_an_object
        {"messages": [{"role": "user", "content": ""}]},                      # 10 empty_content
        sharegpt_row(1),                                                      # 11 duplicate of line 1
        sharegpt_row(2),                                                      # 12 good
    ]
    path = write_jsonl(tmp_path / "mixed.jsonl", rows)
    opts = options([path], max_prompt_chars=400)
    result = produce(opts)
    rejects = [orjson.loads(line) for line in (tmp_path / "store/r1/rejects.jsonl").read_bytes().splitlines()]
    assert [(r["file"], r["line"], r["reason"]) for r in rejects] == [
        (str(path), 2, "malformed_json"),
        (str(path), 3, "not_utf8"),
        (str(path), 4, "no_conversation"),
        (str(path), 5, "no_conversation"),
        (str(path), 6, "unknown_role"),
        (str(path), 7, "nothing_to_answer"),
        (str(path), 8, "prompt_too_long"),
        (str(path), 9, "not_an_object"),
        (str(path), 10, "empty_content"),
    ]
    acc = result.accounting
    assert (acc.read, acc.enqueued, acc.duplicates, acc.rejected) == (12, 2, 1, 9)
    assert acc.read == acc.enqueued + acc.duplicates + acc.rejected
    samples = [s for m in decode_queue(producer_redis) for s in m["kwargs"]["samples"]]
    assert [s["source"]["line"] for s in samples] == [1, 12]
    counts = json.loads((tmp_path / "store/r1/produce.json").read_text())["counts"]
    assert counts["rejected_by_reason"]["no_conversation"] == 2 and counts["duplicates"] == 1


def test_duplicates_across_files_are_sent_once(producer_redis, options, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt_row(i) for i in range(5)])
    b = write_jsonl(tmp_path / "b.jsonl", [sharegpt_row(i) for i in range(3, 8)])
    result = produce(options([a, b]))
    assert (result.accounting.enqueued, result.accounting.duplicates) == (8, 2)


def test_every_dataset_shape_file_is_produced_without_rejects(producer_redis, options):
    files = sorted(FORMATS_DIR.glob("*.jsonl"))
    result = produce(options(files, shard_size=64))
    assert result.accounting.read == len(files) and result.accounting.rejected == 0
    (message,) = decode_queue(producer_redis)
    last_roles = {s["source"]["file"].rsplit("/", 1)[1]: s["messages"][-1]["role"] for s in message["kwargs"]["samples"]}
    assert last_roles == {"dolphin_reasoning.jsonl": "user", "gsm8k_singleturn.jsonl": "user",
                          "hermes_toolcall.jsonl": "tool", "sharegpt_multiturn.jsonl": "user",
                          "ultrachat_messages.jsonl": "user"}


def test_reopening_a_run_with_a_different_setting_is_refused_naming_the_field(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(3)])
    produce(options([path]))
    with pytest.raises(ManifestMismatch, match=r"sampling\.temperature"):
        produce(options([path], temperature=0.9))
    with pytest.raises(ManifestMismatch, match="shard_size"):
        produce(options([path], shard_size=8))
    with pytest.raises(ManifestMismatch, match="max_prompt_chars"):
        produce(options([path], max_prompt_chars=10))


def test_max_pending_waits_while_the_queue_is_longer_than_the_cap(producer_redis):
    sleeps = []

    def drain(_seconds):  # stands in for a worker: each wait, one message leaves the queue
        sleeps.append(_seconds)
        producer_redis.lpop(QUEUE)

    shard = Shard(0, "shard-000000", [], 0)
    with ShardSender(PRODUCER_REDIS, QUEUE, max_pending=2, sleep=drain) as sender:
        for _ in range(6):
            sender.send("r1", "/tmp/x", shard)
            assert producer_redis.llen(QUEUE) <= 3
    assert len(sleeps) == sender.waits > 0


def test_dry_run_enqueues_nothing_and_prints_the_disk_estimate(producer_redis, tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i, "hello world " * 20) for i in range(50)])
    store = tmp_path / "store"
    result = CliRunner().invoke(main, ["produce", str(path), "--storage", str(store), "--model", str(tiny_model),
                                       "--broker", PRODUCER_REDIS, "--queue", QUEUE, "--dry-run",
                                       "--estimate-sample", "10", "--max-tokens", "1000"])
    assert result.exit_code == 0, result.output
    assert producer_redis.llen(QUEUE) == 0
    assert not store.exists() or not any(store.iterdir())
    out = " ".join(result.output.split())
    assert "estimate from 10 of 50 prompts" in out
    assert "response tokens: 25,000 assumed, 50,000 at most" in out
    assert "disk, raw:" in out and "disk, compressed:" in out and "1.45" in out


def test_dry_run_token_count_honours_thinking(tiny_model):
    from producer.estimate import count_prompt_tokens

    sample = {"messages": [{"role": "user", "content": "hi"}], "tools": None}
    on, off = count_prompt_tokens(str(tiny_model), [sample], True), count_prompt_tokens(str(tiny_model), [sample], False)
    assert off[0] > on[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["produce", "missing.jsonl"], "missing.jsonl: no such input file"),
        (["produce"], "give INPUTS to produce, or --resume RUN"),
        (["produce", "{formats}/gsm8k_singleturn.jsonl", "--layers", "dflash:99"], "layers 'dflash:99'"),
        (["produce", "{formats}/gsm8k_singleturn.jsonl", "--resume", "r1"], "do not also give INPUTS"),
        (["produce", "--resume", "r1", "--max-tokens", "5"], "drop --max-tokens"),
        (["produce", "--resume", "nope"], "no run 'nope'"),
        (["produce", "{formats}/gsm8k_singleturn.jsonl", "--run", "../evil"], "invalid run id"),
    ],
)
def test_bad_cli_input_gives_one_line_and_exit_code_2(tmp_path, tiny_config_model, args, needle):
    args = [a.format(formats=FORMATS_DIR) for a in args]
    runner = CliRunner()
    result = runner.invoke(main, [*args, "--storage", str(tmp_path / "s"), "--broker", PRODUCER_REDIS] +
                           (["--model", str(tiny_config_model)] if "--resume" not in args else []))
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("regen: error:") and needle in lines[0], result.output


def test_click_usage_errors_exit_2_without_traceback():
    result = CliRunner().invoke(main, ["produce", "x.jsonl", "--capture", "sometimes"])
    assert result.exit_code == 2 and "Traceback" not in result.output and "'sometimes'" in result.output


def test_default_run_id_comes_from_the_first_input_name(producer_redis, tmp_path, tiny_config_model):
    path = write_jsonl(tmp_path / "My Data.v2.jsonl", [sharegpt_row(0)])
    result = CliRunner().invoke(main, ["produce", str(path), "--storage", str(tmp_path / "s"), "--model",
                                       str(tiny_config_model), "--broker", PRODUCER_REDIS, "--queue", QUEUE])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "s" / "My-Data.v2" / "run.json").exists()


def test_json_array_and_zst_inputs_are_produced_like_jsonl(producer_redis, options, tmp_path):
    import zstandard

    arr = tmp_path / "a.json"
    arr.write_text(json.dumps([sharegpt_row(i) for i in range(3)] + [{"bad": 1}]))
    zst = tmp_path / "b.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(json.dumps(sharegpt_row(i)).encode() + b"\n" for i in range(2, 6))))
    result = produce(options([arr, zst], shard_size=64))
    acc = result.accounting
    assert (acc.read, acc.enqueued, acc.duplicates, acc.rejected) == (8, 6, 1, 1)
    (message,) = decode_queue(producer_redis)
    assert [(s["source"]["file"].rsplit("/", 1)[1], s["source"]["line"]) for s in message["kwargs"]["samples"]] == [
        ("a.json", 1), ("a.json", 2), ("a.json", 3), ("b.jsonl.zst", 2), ("b.jsonl.zst", 3), ("b.jsonl.zst", 4)]


def test_regenerate_all_sends_turns_to_regenerate_in_place(producer_redis, options):
    produce(options([FORMATS_DIR / "sharegpt_multiturn.jsonl"], regenerate="all"))
    (sample,) = decode_queue(producer_redis)[0]["kwargs"]["samples"]
    assert [(m["role"], m["content"] is None) for m in sample["messages"]] == [
        ("user", False), ("assistant", True)] * 3


@pytest.mark.parametrize(("extra", "compression"), [
    ({"compress": "none"}, None),
    ({}, None),  # auto: a small input parks little in Redis, so compression would only cost
    ({"max_pending": 1000, "compress": "zstd"}, "application/zstd"),
])
def test_compress_mode_decides_the_message_encoding(producer_redis, options, tmp_path, extra, compression):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i, "q" * 1200) for i in range(8)])
    produce(options([path], **extra))
    messages = decode_queue(producer_redis)
    assert [m["compression"] for m in messages] == [compression, compression]
    assert [len(m["kwargs"]["samples"]) for m in messages] == [4, 4]


def test_auto_compression_compresses_only_a_large_unbounded_backlog():
    from producer.enqueue import AUTO_COMPRESS_INPUT_BYTES, choose_compression

    big, small = AUTO_COMPRESS_INPUT_BYTES + 1, AUTO_COMPRESS_INPUT_BYTES // 2
    assert choose_compression("auto", None, big) == "zstd"
    assert choose_compression("auto", 5000, big) == "none"  # --max-pending bounds what Redis holds
    assert choose_compression("auto", None, small) == "none"
    assert choose_compression("zstd", 5000, small) == "zstd" and choose_compression("none", None, big) == "none"


def test_max_pending_asks_redis_only_when_the_cap_could_be_reached(producer_redis):
    shard = Shard(0, "shard-000000", [], 0)
    with ShardSender(PRODUCER_REDIS, QUEUE, max_pending=100) as sender:
        for _ in range(10):
            sender.send("r1", "/tmp/x", shard)
    assert producer_redis.llen(QUEUE) == 10
    assert sender.length_checks == 1  # the first send; 1 + 9 more can never exceed 100
    producer_redis.rpush(QUEUE, *[b"x"] * 95)  # someone else filled the queue: the next sender must look again
    with ShardSender(PRODUCER_REDIS, QUEUE, max_pending=100, sleep=lambda _s: producer_redis.lpop(QUEUE)) as sender:
        for _ in range(10):
            sender.send("r1", "/tmp/x", shard)
    assert producer_redis.llen(QUEUE) <= 101
    assert sender.length_checks > 1 and sender.waits > 0


def test_a_publish_error_in_the_sending_thread_fails_produce_and_sends_nothing(producer_redis):
    from app.base.errors import RetryableError

    good = Shard(0, "shard-000000", [{"id": "a"}], 0)
    bad = Shard(1, "shard-000001", [{"id": object()}], 0)  # not JSON: the publish raises in the thread
    with pytest.raises(RetryableError, match="shard-000001"), ShardSender(PRODUCER_REDIS, QUEUE) as sender:
        sender.send("r1", "/tmp/x", good)
        sender.send("r1", "/tmp/x", bad)
        for _ in range(20):
            sender.send("r1", "/tmp/x", good)
    assert producer_redis.llen(QUEUE) == 0  # the batch holding the good shards was discarded, not half-sent


_WORKER_INBOX: dict = {}  # the test task below is registered once per app; each test points it at its own list


@pytest.mark.parametrize("compress", ["zstd", "none"])
def test_a_real_celery_worker_receives_the_shard_as_sent(producer_redis, options, tmp_path, compress):
    """The orjson body and envelope, zstd level 1 (or none) and batched publishes decode in a stock Celery worker."""
    import threading

    from celery.contrib.testing.worker import start_worker

    from app.base.celery_app import create_app
    from app.base.config import BrokerConfig

    received: list[dict] = []
    got_all = threading.Event()
    _WORKER_INBOX.update(received=received, got_all=got_all)
    app = create_app(BrokerConfig(url=PRODUCER_REDIS))
    if GENERATE_TASK not in app.tasks:
        @app.task(name=GENERATE_TASK)
        def generate_shard(run_id, storage, shard_id, samples):
            inbox = _WORKER_INBOX["received"]
            inbox.append({"run_id": run_id, "storage": storage, "shard_id": shard_id, "samples": samples})
            if len(inbox) == 2:
                _WORKER_INBOX["got_all"].set()

    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i, "long question " * 100) for i in range(6)])
    produce(options([path], compress=compress))
    assert [m["compression"] for m in decode_queue(producer_redis)] == (
        ["application/zstd", None] if compress == "zstd" else [None, None])
    with start_worker(app, pool="solo", perform_ping_check=False, queues=[QUEUE], loglevel="WARNING",
                      shutdown_timeout=10):
        assert got_all.wait(timeout=20), f"worker received {len(received)} of 2 shards"
    assert [r["shard_id"] for r in received] == ["shard-000000", "shard-000001"]
    assert [len(r["samples"]) for r in received] == [4, 2]
    assert received[0]["samples"][0]["messages"][0]["content"].startswith("long question")


def test_dry_run_with_capture_off_estimates_no_disk(tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(5)])
    result = produce(ProduceOptions(inputs=[str(path)], model=str(tiny_model), capture="off", dry_run=True))
    assert result.status == "dry_run" and result.estimate.layers == 0
    assert "capture off" in "\n".join(result.estimate.lines())
