"""The record schema in code (app.base.records): records are written only with fields it knows, in their types, and
read with the defaults older records imply; a malformed one is named by path and line."""

from __future__ import annotations

import io

import pytest

from app.base.documents import MalformedDocument
from app.base.jsonl_zst import dumps_jsonl_zst
from app.base.records import RECORD_FIELDS, Record, encode_records, iter_records, read_records


def _ok(**extra) -> dict:
    return {"run_id": "r", "shard_id": "shard-000000", "sample_id": "s0", "index": 0, "status": "ok",
            "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1], "num_prompt_tokens": 1, "num_output_tokens": 2,
            "flags": [], "seconds": 0.5, **extra}


def test_a_record_round_trips_and_reads_typed():
    data = encode_records([_ok(), {"sample_id": "s1", "status": "rejected", "reject_reason": "prompt_too_long",
                                   "reject_detail": "9 tokens"}])
    ok, rejected = read_records(data, "shards/x/a.records.jsonl.zst")
    assert isinstance(ok, Record) and ok.ok and not rejected.ok
    assert ok == _ok() and ok.sample_id == "s0"


def test_an_older_record_reads_with_the_defaults_it_implies():
    (rec,) = read_records(dumps_jsonl_zst([_ok()]), "old")  # no sample_index, budget_closed, loop_stopped
    assert rec.sample_index == 0 and rec.budget_closed is False and rec.loop_stopped is False
    assert all(RECORD_FIELDS[k].added_later for k in ("prompt_id", "sample_index", "thinking", "sampling"))


def test_the_writer_refuses_a_field_outside_the_schema_or_of_the_wrong_type():
    with pytest.raises(ValueError, match="fields outside app.base.records.RECORD_FIELDS: tag"):
        encode_records([_ok(tag="x")])
    with pytest.raises(ValueError, match="'input_ids' is str"):
        encode_records([_ok(input_ids="1 2 3")])


@pytest.mark.parametrize(("row", "says"), [
    ({"sample_id": "s0", "status": "done"}, "status 'done'"),
    ({"sample_id": "s0", "status": "ok", "input_ids": [1]}, "ok record without loss_mask"),
    (_ok(loss_mask="0 1 1"), "'loss_mask' is str, not list"),
])
def test_a_malformed_record_is_refused_naming_path_and_line(row, says):
    data = dumps_jsonl_zst([_ok(), row])
    with pytest.raises(MalformedDocument, match=f"^shards/x/a.records.jsonl.zst line 2: .*{says}"):
        read_records(data, "shards/x/a.records.jsonl.zst")
    with pytest.raises(MalformedDocument, match="line 2"):
        list(iter_records(io.BytesIO(data), "shards/x/a.records.jsonl.zst"))
