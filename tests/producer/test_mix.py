"""A run of both modes, several samples per prompt and a seeded mix by source, as the producer makes them:
the modes each sample is sent with, the ids and shards of a prompt's samples, a resume that adds samples, the
rows `--take` draws, the counts in the manifest, and the combinations refused at produce."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
from click.testing import CliRunner

from app.base.errors import ConfigError, ManifestMismatch
from app.base.storage import RunStore, Storage
from app.base.thinking_modes import draw_thinking
from app.cli import main
from producer.produce import produce
from producer.run_setup import ProduceOptions
from tests.support.producer import QUEUE, decode_queue, sharegpt_row, write_jsonl
from tests.support.redis_db import PRODUCER_REDIS


@pytest.fixture
def options(tmp_path, tiny_model):
    def make(inputs, **kw) -> ProduceOptions:
        base = dict(inputs=[str(p) for p in inputs], run_id="mix", storage=str(tmp_path / "store"),
                    model=str(tiny_model), broker=PRODUCER_REDIS, queue=QUEUE, shard_size=4)
        return ProduceOptions(**{**base, **kw})
    return make


def sent_samples(client) -> list[tuple[str, dict]]:
    return [(m["kwargs"]["shard_id"], s) for m in decode_queue(client) for s in m["kwargs"]["samples"]]


def rows_with_own_modes(n: int) -> list[dict]:
    rows = [sharegpt_row(i) for i in range(n)]
    rows[1]["enable_thinking"] = False
    rows[2]["enable_thinking"] = True
    rows[3]["thinking"] = False
    rows[4]["thinking"] = "some reasoning text"  # a dataset's reasoning column, not a mode
    return rows


def test_each_sample_is_sent_in_its_drawn_or_own_mode_and_the_manifest_counts_them(producer_redis, options,
                                                                                   tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", rows_with_own_modes(10))
    opts = options([path], thinking_mix=0.5, samples_per_prompt=2, seed=7)
    produce(opts)
    sent = sent_samples(producer_redis)
    assert len(sent) == 20
    by_line: dict[int, list[dict]] = {}
    for _, s in sent:
        by_line.setdefault(s["source"]["line"], []).append(s)
    for line, samples in by_line.items():
        for s in samples:
            own = {2: False, 3: True, 4: False}.get(line)
            if own is not None:
                assert (s["thinking"], s["mode_rule"]) == (own, "input")
            else:
                assert s["mode_rule"] == "mix" and s["thinking"] == draw_thinking(0.5, 7, s["id"])
    # both modes occur among the drawn ones, and the two samples of a prompt are drawn apart
    assert {s["thinking"] for _, s in sent if s["mode_rule"] == "mix"} == {True, False}
    store = RunStore(Storage(opts.storage), "mix")
    settings = store.storage.read_json(store.manifest_path)["settings"]
    counts = store.storage.read_json(store.produce_path)["counts"]
    assert counts["samples"] == 20 and counts["enqueued"] == 10
    assert counts["modes"] == dict(Counter("thinking" if s["thinking"] else "non_thinking" for _, s in sent))
    assert counts["mode_rules"] == {"input": 6, "mix": 14}
    assert settings["thinking_mix"] == 0.5 and settings["samples_per_prompt"] == 2
    assert settings["mode_sampling"]["thinking"]["temperature"] == 0.6
    assert settings["mode_sampling"]["non_thinking"]["top_p"] == 0.8
    # the template's own tails: nothing for thinking, the empty think block for non-thinking
    assert settings["mode_prompt_tails"]["thinking"] == []
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(opts.model)
    assert settings["mode_prompt_tails"]["non_thinking"] == tok.encode("<think>\n\n</think>\n\n",
                                                                       add_special_tokens=False)

    # The same seed on another run: the same modes; another seed: other draws.
    producer_redis.delete(QUEUE)
    produce(options([path], run_id="mix-again", thinking_mix=0.5, samples_per_prompt=2, seed=7))
    assert {s["id"]: s["thinking"] for _, s in sent_samples(producer_redis)} == {s["id"]: s["thinking"]
                                                                                  for _, s in sent}
    producer_redis.delete(QUEUE)
    produce(options([path], run_id="mix-other", thinking_mix=0.5, samples_per_prompt=2, seed=8))
    other = {s["id"]: s["thinking"] for _, s in sent_samples(producer_redis) if s["mode_rule"] == "mix"}
    assert other != {s["id"]: s["thinking"] for _, s in sent if s["mode_rule"] == "mix"}


def test_a_prompts_samples_have_their_own_ids_and_come_in_passes_of_shards(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(6)])
    produce(options([path], samples_per_prompt=3, sample_temperatures=[0.6, 0.9]))
    sent = sent_samples(producer_redis)
    shards = sorted({shard for shard, _ in sent})
    assert shards == [f"shard-{k:06d}" for k in range(6)]  # 2 shards (4 + 2) per pass, 3 passes
    firsts = [s for _, s in sent if "sample_index" not in s]
    assert len(firsts) == 6 and all("prompt_id" not in s for s in firsts)  # sample 0: the prompt's own id
    for _, s in sent:
        if "sample_index" in s:
            assert s["id"] == f"{s['prompt_id']}-s{s['sample_index']}"
    per_prompt = Counter(s.get("prompt_id", s["id"]) for _, s in sent)
    assert sorted(per_prompt.values()) == [3] * 6 and len({s["id"] for _, s in sent}) == 18
    assert "thinking" not in sent[0][1]  # a single-mode run's messages are as they were
    store = RunStore(Storage(str(tmp_path / "store")), "mix")
    assert store.storage.read_json(store.manifest_path)["settings"]["sample_temperatures"] == [0.6, 0.9]
    assert store.storage.read_json(store.produce_path)["counts"]["shards"] == 6


def test_resume_with_a_larger_k_sends_exactly_the_new_samples(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(10)])
    opts = options([path], thinking_mix=0.5, seed=3)
    produce(opts)
    first = sent_samples(producer_redis)
    store = RunStore(Storage(opts.storage), "mix")
    for shard in {shard for shard, _ in first}:  # the K=1 run finished
        store.storage.write_json(store.done_path(shard), {"attempt": "a"})
    producer_redis.delete(QUEUE)
    resumed = produce(ProduceOptions(run_id="mix", resume=True, storage=opts.storage, broker=PRODUCER_REDIS,
                                     queue=QUEUE, samples_per_prompt=2))
    added = sent_samples(producer_redis)
    assert resumed.accounting.shards_skipped_done == 3 and resumed.accounting.shards_sent == 3
    assert sorted(s["prompt_id"] for _, s in added) == sorted(s["id"] for _, s in first)  # one new per prompt
    assert all(s["sample_index"] == 1 for _, s in added)
    assert {shard for shard, _ in added}.isdisjoint({shard for shard, _ in first})
    manifest = store.storage.read_json(store.manifest_path)
    assert manifest["settings"]["samples_per_prompt"] == 2
    assert store.storage.read_json(store.produce_path)["counts"]["samples"] == 20
    # the new samples' modes are the ones a K=2 run of the same seed draws
    producer_redis.delete(QUEUE)
    produce(options([path], run_id="k2", thinking_mix=0.5, seed=3, samples_per_prompt=2))
    at_once = {s["id"]: (shard, s["thinking"]) for shard, s in sent_samples(producer_redis)}
    assert {s["id"]: (shard, s["thinking"]) for shard, s in first + added} == at_once
    with pytest.raises(ConfigError, match="never drop them"):
        produce(ProduceOptions(run_id="mix", resume=True, storage=opts.storage, broker=PRODUCER_REDIS, queue=QUEUE,
                               samples_per_prompt=1))


def test_take_draws_the_same_rows_for_the_same_seed_and_accounts_for_the_rest(producer_redis, options, tmp_path):
    a = write_jsonl(tmp_path / "tools.jsonl", [sharegpt_row(i, "tool") for i in range(12)])
    b = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_row(i, "chat") for i in range(20)] + [b"{broken"])
    c = write_jsonl(tmp_path / "other.jsonl", [sharegpt_row(i, "other") for i in range(5)])
    take = ["tools.jsonl=5", f"{tmp_path}/share*.jsonl=0.5"]

    def run(run_id, seed):
        producer_redis.delete(QUEUE)
        result = produce(options([a, b, c], run_id=run_id, take=take, seed=seed))
        lines = Counter()
        for _, s in sent_samples(producer_redis):
            lines[(s["source"]["file"], s["source"]["line"])] += 1
        return result.accounting, lines

    acc, lines = run("take1", 11)
    acc2, lines2 = run("take2", 11)
    _, lines3 = run("take3", 12)
    per_file = Counter(f for f, _ in lines)
    assert per_file == {str(a): 5, str(c): 5, str(b): per_file[str(b)]}
    # 21 records in the ShareGPT file (one broken): round(0.5 x 21) = 10 drawn, the broken one possibly among them
    counts = acc.to_dict()
    assert counts["take"] == {str(a): {"rows": 12, "taken": 5, "left_out": 7},
                              str(b): {"rows": 21, "taken": 10, "left_out": 11}}
    assert lines == lines2 and counts == acc2.to_dict()
    assert lines3 != lines
    assert counts["read"] == counts["enqueued"] + counts["duplicates"] + counts["rejected"] + counts["left_out"]
    assert counts["read"] == 38 and counts["left_out"] == 18
    store = RunStore(Storage(str(tmp_path / "store")), "take1")
    manifest = store.storage.read_json(store.manifest_path)
    assert manifest["settings"]["take"] == [{"glob": "tools.jsonl", "count": 5},
                                            {"glob": f"{tmp_path}/share*.jsonl", "fraction": 0.5}]
    assert store.storage.read_json(store.produce_path)["counts"]["left_out"] == 18


def test_the_pilots_sample_draws_from_the_rows_the_runs_take_draws(producer_redis, options, tmp_path):
    """`regen pilot --take` samples the mix the run will generate: only rows the run's `--take` (same seed) draws,
    and the count it forecasts from is the run's enqueued count."""
    from app.pilot.sample import sample_inputs

    a = write_jsonl(tmp_path / "tools.jsonl", [sharegpt_row(i, "tool") for i in range(12)])
    b = write_jsonl(tmp_path / "sharegpt.jsonl", [sharegpt_row(i, "chat") for i in range(20)])
    take = ["tools.jsonl=5", "sharegpt.jsonl=0.5"]
    result = produce(options([a, b], run_id="take-pilot", take=take, seed=7))
    sent = sorted(s["messages"][0]["content"] for _, s in sent_samples(producer_redis))
    sample = sample_inputs([str(a), str(b)], 1000, seed=7, take=take)
    assert (sample.read, sample.left_out) == (32, 17)
    assert sample.samples == result.accounting.enqueued == 15
    assert sorted(json.loads(line)["conversations"][0]["value"] for line in sample.lines) == sent
    assert sample_inputs([str(a), str(b)], 1000, seed=8, take=take).lines != sample.lines  # another draw
    whole = sample_inputs([str(a), str(b)], 1000, seed=7)
    assert (whole.samples, whole.left_out) == (32, 0)


def test_take_that_matches_no_input_or_twice_is_refused(producer_redis, options, tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [sharegpt_row(0)])
    with pytest.raises(ConfigError, match="matches none of the inputs"):
        produce(options([a], take=["b*.jsonl=3"]))
    with pytest.raises(ConfigError, match="matched by both"):
        produce(options([a], take=["a*=3", "*.jsonl=0.5"]))
    with pytest.raises(ConfigError, match="neither a row count"):
        produce(options([a], take=["a.jsonl=1.5"]))


def _cli(*args):
    return CliRunner().invoke(main, list(args))


@pytest.mark.parametrize("extra, message", [
    (["--thinking-mix", "0.5", "--no-thinking"], "drop --thinking/--no-thinking"),
    (["--thinking-mix", "0.3", "--temperature", "0"], "greedy"),
    (["--no-thinking", "--samples-per-prompt", "2", "--temperature", "0"], "copies of each other"),
    (["--sample-temperatures", "0.6,0.8", "--temperature", "0.7"], "give one"),
    (["--thinking-mix", "0.5", "--sample-temperatures", "0.5,0"], "greedy"),
])
def test_combinations_that_cannot_work_are_refused_in_one_line(tmp_path, tiny_model, extra, message):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(0)])
    result = _cli("produce", str(path), "--storage", str(tmp_path / "s"), "--model", str(tiny_model),
                  "--broker", PRODUCER_REDIS, *extra)
    assert result.exit_code == 2, result.output
    assert message in result.output and len(result.output.strip().splitlines()) == 1, result.output


def test_a_mix_is_refused_for_a_template_without_enable_thinking(tmp_path, tiny_model, options):
    model = tmp_path / "plain-template"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                            "'<|im_end|>\\n' }}{%- endfor %}{{ '<|im_start|>assistant\\n' }}")
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    for extra in ("chat_template.jinja",):
        (model / extra).unlink(missing_ok=True)
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(0)])
    with pytest.raises(ConfigError, match="renders both modes alike"):
        produce(options([path], model=str(model), thinking_mix=0.5))


def test_reopening_a_mixed_run_without_its_mix_is_refused(producer_redis, options, tmp_path):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(3)])
    produce(options([path], thinking_mix=0.5))
    with pytest.raises(ManifestMismatch, match="thinking_mix"):
        produce(options([path]))
    with pytest.raises(ManifestMismatch, match="samples_per_prompt"):
        produce(options([path], thinking_mix=0.5, samples_per_prompt=2))


def test_the_summary_shows_the_samples_per_mode_and_the_rows_left_out(producer_redis, tmp_path, tiny_model):
    path = write_jsonl(tmp_path / "in.jsonl", [sharegpt_row(i) for i in range(8)])
    result = _cli("produce", str(path), "--run", "summary", "--storage", str(tmp_path / "s"), "--model",
                  str(tiny_model), "--broker", PRODUCER_REDIS, "--queue", QUEUE, "--thinking-mix", "0.5",
                  "--samples-per-prompt", "2", "--take", "in.jsonl=6", "--sample-temperatures", "0.6,0.9")
    assert result.exit_code == 0, result.output
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in result.output.splitlines()
            if line.count("│") == 3}
    assert rows["rows read"] == "8" and rows["left out (--take)"] == "2" and rows["samples"] == "12"
    assert int(rows["thinking"]) + int(rows["non-thinking"]) == 12
    again = _cli("produce", "--resume", "summary", "--storage", str(tmp_path / "s"), "--broker", PRODUCER_REDIS,
                 "--queue", QUEUE, "--samples-per-prompt", "3")
    assert again.exit_code == 0, again.output
    store = RunStore(Storage(str(tmp_path / "s")), "summary")
    assert store.storage.read_json(store.produce_path)["counts"]["samples"] == 18
    refused = _cli("produce", "--resume", "summary", "--storage", str(tmp_path / "s"), "--broker", PRODUCER_REDIS,
                   "--thinking-mix", "0.2")
    assert refused.exit_code == 2 and "drop --thinking-mix" in refused.output
