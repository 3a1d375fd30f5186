"""Every input shape through the Qwen3.5/3.6 family's template conventions and real vocabulary, end to end.

The session's hybrid worker runs the tiny Qwen3.5 with the family-convention template (workers.tiny_chat_template)
and the family's 248K vocabulary (workers.tiny_vocab). tests/fixtures/chat/family_shapes.jsonl holds OpenAI tool
calls with object arguments (two in one turn, two tool responses in a row, a second call after them), a `tools`
column as a list and as a JSON string, ShareGPT `function_call`/`observation` turns, content parts and earlier
reasoning. It runs with `--regenerate last` and `all`, each row in a mode of its own (both thinking modes in each
run): no worker rejects a sample for its template, each record's prompt ids are the template's rendering in the
record's mode, the family's XML tool calls and grouped tool responses are in those prompts, and both trainers'
readers load the exports. String arguments (family_shapes_string_arguments.jsonl) wait for issue 43 item 1.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.cli import main
from tests.support.paths import FIXTURES_DIR
from tests.support.redis_db import HYBRID_BROKER
from tests.support.runs import produce, run_records, run_states, wait_run_done
from tests.support.workers import HYBRID_LAYERS

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
SHAPES = FIXTURES_DIR / "chat" / "family_shapes.jsonl"
STRING_ARGUMENTS = FIXTURES_DIR / "chat" / "family_shapes_string_arguments.jsonl"
RUNS = {"family-last": "last", "family-all": "all"}


def _with_modes(path: Path, folder: Path) -> Path:
    """The rows with their own `enable_thinking`, alternating, so each run holds both modes whatever the draw."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    out = folder / path.name
    out.write_text("".join(json.dumps({**row, "enable_thinking": i % 2 == 0}) + "\n" for i, row in enumerate(rows)))
    return out


def _produce(storage: Path, run: str, inputs: Path, model: Path, regenerate: str) -> dict:
    return produce(storage, run, [inputs], model, "--layers", HYBRID_LAYERS, "--regenerate", regenerate,
                   "--thinking-mix", "0.5", broker=HYBRID_BROKER)


@pytest.fixture(scope="module")
def family_storage(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("family-storage")


@pytest.fixture(scope="module")
def family_runs(hybrid_worker, family_storage, tiny_hybrid, tmp_path_factory):
    inputs = _with_modes(SHAPES, tmp_path_factory.mktemp("family-inputs"))
    states = {run: _produce(family_storage, run, inputs, tiny_hybrid, regenerate) for run, regenerate in RUNS.items()}
    for run in RUNS:
        wait_run_done(family_storage, run)
    return states


def _tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


@pytest.mark.parametrize("run", list(RUNS))
def test_every_shape_renders_on_the_worker_as_the_template_does_in_its_mode(family_runs, family_storage,
                                                                            tiny_hybrid, run):
    from workers.shard.generate import render_prompt
    from workers.tiny_vocab import QWEN3_6_MODEL_VOCAB, qwen3_6_tokenizer

    tok = _tokenizer(tiny_hybrid)
    # the real vocabulary (made once per process: the session's fixture made it already), not the small one
    assert tok.get_vocab() == qwen3_6_tokenizer().get_vocab()
    assert json.loads((tiny_hybrid / "config.json").read_text())["vocab_size"] == QWEN3_6_MODEL_VOCAB
    state, records = family_runs[run], run_records(family_storage, run)
    rows = len(SHAPES.read_text().splitlines())
    assert state["counts"]["enqueued"] == rows and len(records) >= rows
    rejected = [(r["sample_id"], r["reject_reason"], r["reject_detail"]) for r in records if r["status"] != "ok"]
    assert not rejected  # no template_error, nor any other reason
    assert {r["thinking"] for r in records} == {True, False}
    seen = set()
    for rec in records:
        prompt = rec["input_ids"][: rec["num_prompt_tokens"]]
        assert prompt == render_prompt(tok, rec["messages"], rec["tools"], rec["thinking"]), rec["sample_id"]
        assert rec["loss_mask"] == [0] * len(prompt) + [1] * rec["num_output_tokens"]
        text = tok.decode(prompt)
        assert text.endswith("<|im_start|>assistant\n<think>\n" if rec["thinking"] else
                             "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
        if calls:
            seen.add("calls")
            # the calls' own blocks (the tool instructions show the format with `function_name`)
            assert text.count("<tool_call>\n<function=get_") == len(calls)
            assert "<parameter=city>\n" in text and "</parameter>\n</function>\n</tool_call>" in text
        if rec["tools"]:
            seen.add("tools")
            assert "<tools>\n" + json.dumps(rec["tools"][0]) in text
        if "</tool_response>\n<tool_response>" in text:
            seen.add("grouped responses")
        if "Part one of the question.\nPart two" in text:
            seen.add("parts")
    # `--regenerate all` replaces each assistant turn, its calls included, by the model's own answer before the
    # next turn's prompt: only `last` prompts carry the dataset's calls
    assert seen == {"calls", "tools", "grouped responses", "parts"} - ({"calls"} if run == "family-all" else set())


def test_regenerate_all_makes_a_sample_of_every_assistant_turn_in_the_multi_step_rows(family_runs, family_storage):
    import orjson

    from producer.normalise import normalise
    from workers.shard.multiturn import turns_to_regenerate

    samples = [normalise(orjson.loads(raw), file=str(SHAPES), line=n + 1, regenerate="all")
               for n, raw in enumerate(SHAPES.read_bytes().splitlines())]
    by_conversation: dict[str, list[int]] = {}
    for rec in run_records(family_storage, "family-all"):
        by_conversation.setdefault(rec["conversation_id"], []).append(rec["turn"])
    want = {s["id"]: list(range(len(turns_to_regenerate(s["messages"])))) for s in samples}
    assert {cid: sorted(turns) for cid, turns in by_conversation.items()} == want
    assert max(len(turns) for turns in want.values()) >= 3  # the multi-step tool row: three assistant turns


@pytest.mark.parametrize("run", list(RUNS))
def test_both_trainers_readers_load_every_export(family_runs, family_storage, tmp_path, run):
    from specforge.algorithms.common.dflash_family_data import build_offline_reader, normalize_offline_sample
    from specforge.runtime.data_plane.feature_store import load_feature_file
    from speculators.train.data import ArrowDataset

    from workers.tiny_vocab import QWEN3_6_MODEL_VOCAB

    records = [r for r in run_records(family_storage, run) if r["status"] == "ok"]
    states = run_states(family_storage, run)
    for fmt in ("speculators", "specforge-dflash"):
        result = CliRunner().invoke(main, ["export", run, "--storage", str(family_storage), "--format", fmt,
                                           "--out", str(tmp_path / fmt)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
    ds = ArrowDataset(max_len=4096, datapath=str(tmp_path / "speculators"), on_missing="raise")
    assert len(ds) == len(records)
    for i, rec in enumerate(records):
        assert ds[i]["input_ids"].tolist() == states[rec["sample_id"]][0].tolist() == rec["input_ids"][:-1]
    refs = build_offline_reader("dflash", str(tmp_path / "specforge-dflash"), run_id="t", ttt_length=1,
                                max_len=4096).read()
    assert len(refs) == len(records)
    for ref in refs:
        raw = load_feature_file(ref.feature_store_uri[len("file://"):])
        assert max(raw["input_ids"].tolist()) < QWEN3_6_MODEL_VOCAB
        normalize_offline_sample(raw, max_len=4096)


def test_string_arguments_render_as_their_parsed_objects(hybrid_worker, family_storage, tiny_hybrid, tmp_path):
    from workers.shard.generate import render_prompt

    inputs = _with_modes(STRING_ARGUMENTS, tmp_path)
    for run, regenerate in (("family-strings-last", "last"), ("family-strings-all", "all")):
        _produce(family_storage, run, inputs, tiny_hybrid, regenerate)
        wait_run_done(family_storage, run)
        records = run_records(family_storage, run)
        assert records and all(r["status"] == "ok" for r in records), \
            [(r["sample_id"], r.get("reject_reason"), r.get("reject_detail")) for r in records]
        tok = _tokenizer(tiny_hybrid)
        for rec in records:
            text = tok.decode(rec["input_ids"][: rec["num_prompt_tokens"]])
            assert rec["input_ids"][: rec["num_prompt_tokens"]] == render_prompt(tok, rec["messages"], rec["tools"],
                                                                                 rec["thinking"])
            calls = [c for m in rec["messages"] for c in m.get("tool_calls") or []]
            assert text.count("<parameter=city>\n") == len(calls)  # each call's parsed argument, as XML
        assert regenerate == "all" or any(m.get("tool_calls") for r in records for m in r["messages"])
