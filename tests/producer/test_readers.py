"""Readers stream every format, account for every line, and refuse unreadable files with one line."""

from __future__ import annotations

import json

import pytest
import zstandard

from app.base.errors import InputError
from producer.readers import InputReader, ReadFailure, describe_input, expand_inputs, file_sha256


def test_jsonl_yields_raw_lines_with_physical_line_numbers_and_skips_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"a": 2}\nnot json\n')
    assert list(InputReader(str(path))) == [(1, b'{"a": 1}\n'), (4, b'{"a": 2}\n'), (5, b"not json\n")]


def test_jsonl_zst_streams_the_same_records(tmp_path):
    raw = b"".join(json.dumps({"i": i}).encode() + b"\n" for i in range(1000))
    path = tmp_path / "a.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress(raw))
    records = list(InputReader(str(path)))
    assert len(records) == 1000
    assert records[999] == (1000, b'{"i": 999}\n')


def test_json_array_is_streamed_element_by_element(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps([{"prompt": "a"}, {"prompt": "b", "x": 1.5}, 3]))
    assert list(InputReader(str(path))) == [(1, {"prompt": "a"}), (2, {"prompt": "b", "x": 1.5}), (3, 3)]


def test_json_array_broken_midway_becomes_one_reject_not_an_exception(tmp_path):
    path = tmp_path / "a.json"
    path.write_text('[{"prompt": "a"}, {"prompt": ')
    records = list(InputReader(str(path)))
    assert records[0] == (1, {"prompt": "a"})
    assert records[1][0] == 2 and isinstance(records[1][1], ReadFailure)
    assert records[1][1].reason == "malformed_json"


def test_json_that_is_not_an_array_is_an_input_error(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text('{"prompt": "a"}')
    with pytest.raises(InputError, match="obj.json"):
        list(InputReader(str(path)))


def test_expand_inputs_globs_keep_order_and_drop_repeats(tmp_path):
    for name in ("b.jsonl", "a.jsonl", "c.json"):
        (tmp_path / name).write_text("")
    got = expand_inputs([str(tmp_path / "c.json"), str(tmp_path / "*.jsonl"), str(tmp_path / "a.jsonl")])
    assert [p.rsplit("/", 1)[1] for p in got] == ["c.json", "a.jsonl", "b.jsonl"]


@pytest.mark.parametrize(("name", "message"), [("missing.jsonl", "no such input file"),
                                               ("data.csv", "unknown input format"),
                                               ("nothing-*.jsonl", "no input file matches")])
def test_unreadable_inputs_raise_input_error_naming_the_file(tmp_path, name, message):
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(InputError, match=message) as info:
        expand_inputs([str(tmp_path / name)])
    assert name in str(info.value) and "\n" not in str(info.value)


def test_describe_input_records_size_and_sha256(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"prompt": "x"}\n')
    d = describe_input(str(path))
    assert d == {"path": str(path), "size": 16, "sha256": file_sha256(str(path))}
    assert len(d["sha256"]) == 64
