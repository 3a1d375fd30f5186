"""GPU hosts without a GPU: device detection, presets, tensor-parallel sizing and the per-child environment.

`tests/fixtures/fake_gpu_host/nvidia-smi` is a FAKE (this machine has no GPU): it answers regen's one query with rows
the test chooses, in nvidia-smi's csv format, so the real parsing, presets and grouping run. Model folders
carry a real config.json and sparse weight files of the size under test (no disk is used).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path

import pytest
from click.testing import CliRunner

from app.base.errors import ConfigError
from app.cli import main
from tests.support.paths import FIXTURES_DIR
from tests.support.redis_db import redis_url
from workers.process.devices import PRESETS, choose_tensor_parallel, detect_gpus, encode_threads_for
from workers.process.plan import worker_configs
from workers.process.supervisor import Supervisor

FAKE_HOST = FIXTURES_DIR / "fake_gpu_host"
GIB = 1 << 30
H200 = "NVIDIA H200, 9.0, 143771"
B200 = "NVIDIA B200, 10.0, 183359"
RTX_PRO_6000 = "NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887"


@pytest.fixture
def fake_gpus(monkeypatch):
    """Put the FAKE nvidia-smi first on PATH; call the result with rows to declare the host's GPUs."""
    monkeypatch.setenv("PATH", f"{FAKE_HOST}{os.pathsep}{os.environ['PATH']}")

    def declare(*rows: str) -> None:
        monkeypatch.setenv("FAKE_NVIDIA_SMI_ROWS", "\n".join(f"{i}, {row}" for i, row in enumerate(rows)))

    return declare


def model_dir(tmp_path: Path, weights_gib: float, heads: int = 64, files: int = 4) -> str:
    """A model folder with a config.json and `files` sparse safetensors shards adding up to `weights_gib`."""
    path = tmp_path / f"model-{weights_gib:g}g-{heads}h"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "qwen3", "num_attention_heads": heads,
                                                  "num_hidden_layers": 64, "hidden_size": 5120}))
    for k in range(files):
        with open(path / f"model-{k:05d}-of-{files:05d}.safetensors", "wb") as fh:
            fh.truncate(int(weights_gib * GIB / files))
    return str(path)


def configs(model: str, **kw):
    args = {"cpu": False, "gpus": None, "model": model, "layers": [2, 17], "storage": None, "name": None,
            "max_attempts": 5, "engine_overrides": {}}
    args.update(kw)
    return worker_configs(**args)


def test_detect_gpus_reads_class_and_memory(fake_gpus):
    fake_gpus(H200, B200, RTX_PRO_6000, "NVIDIA A100-SXM4-80GB, 8.0, 81920")
    found = detect_gpus()
    assert [(d.index, d.device_class, d.memory_mib) for d in found] == [
        ("0", "sm_90", 143771), ("1", "sm_100", 183359), ("2", "sm_120", 97887), ("3", "sm_other", 81920)]
    assert found[2].name == "NVIDIA RTX PRO 6000 Blackwell Server Edition"


def test_one_child_per_gpu_with_the_class_preset_and_overrides(fake_gpus, tmp_path):
    fake_gpus(*[B200] * 4)
    model = model_dir(tmp_path, 54)  # a 27B bf16 model fits one B200
    got = configs(model, engine_overrides={"max_num_seqs": 96, "gpu_memory_utilization": None})
    host = socket.gethostname()
    assert [(c.hostname, visible) for c, visible in got] == [(f"gpu{i}@{host}", str(i)) for i in range(4)]
    for config, _ in got:
        assert config.device == "cuda" and config.device_class == "sm_100"
        assert config.engine["max_num_seqs"] == 96  # the override
        assert config.engine["gpu_memory_utilization"] == PRESETS["sm_100"]["gpu_memory_utilization"]  # the preset
        assert config.engine["tensor_parallel_size"] == 1 and config.engine["in_process"] is False


def test_a_cpu_worker_hosts_its_engine_in_a_process_of_its_own_unless_told_not_to(fake_gpus, tmp_path):
    from workers.engine.options import EngineOptions

    model = model_dir(tmp_path, 1)
    ((cpu, _),) = configs(model, cpu=True)
    assert cpu.engine["host_process"] is True and cpu.engine["in_process"] is True  # workers/engine/process.py
    ((cpu, _),) = configs(model, cpu=True, engine_overrides={"host_process": False})  # --no-engine-host
    assert cpu.engine["host_process"] is False
    fake_gpus(B200)
    ((gpu, _),) = configs(model)  # vLLM's own engine-core process already runs the model apart
    assert EngineOptions(model=model, **gpu.engine).host_process is False


@pytest.mark.parametrize(("rows", "cpu", "kw", "slots"), [
    ([], True, {}, 7),                                   # 64 sequences, shards of 64: one generating, one queued, one
                                                         # written, and four spare for the CPU's thin side-thread share
    ([B200], False, {}, 10),                             # 512 sequences: 8 shards fill the batch
    ([H200], False, {"shard_size": 100}, 5),             # 256 sequences in shards of 100 (the run's): 3 + 2
    ([RTX_PRO_6000], False, {"engine_overrides": {"max_num_seqs": 16}, "shard_size": 4}, 6),
    ([B200], False, {"task_slots": 2}, 2),               # --task-slots / REGEN_TASK_SLOTS
])
def test_task_slots_keep_the_batch_full_with_a_shard_queued_and_one_being_written(fake_gpus, tmp_path, rows, cpu,
                                                                                  kw, slots):
    fake_gpus(*rows)
    got = configs(model_dir(tmp_path, 16), cpu=cpu, **kw)
    assert [c.task_slots for c, _ in got] == [slots] * len(got)


@pytest.mark.parametrize(("device_class", "workers", "cpus", "threads"), [
    ("cpu", 1, 2, 2),          # the CPU engine needs every core: two idle-priority threads, as before
    ("cpu", 1, 64, 2),
    ("sm_100", 8, 112, 8),     # an 8 x B200 node: 14 cores per worker, less 2 for the engine, capped at 8
    ("sm_100", 8, 48, 4),      # 6 per worker, less 2
    ("sm_120", 4, 16, 2),      # 4 per worker, less 2
    ("sm_90", 8, 8, 2),        # fewer cores than that: never below 2
])
def test_encode_threads_scale_with_the_cores_each_gpu_worker_has(device_class, workers, cpus, threads):
    assert encode_threads_for(device_class, workers, cpus) == threads


def test_encode_threads_reach_each_child_and_can_be_overridden(fake_gpus, tmp_path):
    fake_gpus(*[B200] * 4)
    model = model_dir(tmp_path, 16)
    assert [c.encode_threads for c, _ in configs(model)] == [encode_threads_for("sm_100", 4)] * 4
    assert [c.encode_threads for c, _ in configs(model, encode_threads=5)] == [5] * 4  # --encode-threads
    assert [c.encode_threads for c, _ in configs(model, cpu=True)] == [2]


def test_gpus_option_selects_and_names_what_is_missing(fake_gpus, tmp_path):
    fake_gpus(*[RTX_PRO_6000] * 4)
    model = model_dir(tmp_path, 16)
    assert [v for _, v in configs(model, gpus="1,3")] == ["1", "3"]
    with pytest.raises(ConfigError, match=r"no such GPU 7 \(nvidia-smi sees 0, 1, 2, 3\)"):
        configs(model, gpus="1,7")


@pytest.mark.parametrize(("rows", "weights", "tp"), [
    ([RTX_PRO_6000] * 4, 50, 1),   # 27B bf16: fits one 96 GB card
    ([RTX_PRO_6000] * 4, 131, 4),  # 70B bf16: 2 cards would hold 65 GiB each, over 60% of an ~86 GiB budget
    ([H200] * 4, 131, 2),
    ([B200] * 8, 131, 2),
    ([B200] * 8, 380, 4),          # a ~190B bf16 model: 95 GiB per GPU of a ~165 GiB budget
])
def test_tensor_parallel_is_the_smallest_size_that_fits(fake_gpus, tmp_path, rows, weights, tp):
    fake_gpus(*rows)
    got = configs(model_dir(tmp_path, weights))
    assert len(got) == len(rows) // tp
    for k, (config, visible) in enumerate(got):
        group = [str(i) for i in range(k * tp, (k + 1) * tp)]
        assert visible == ",".join(group)
        assert config.hostname.split("@")[0] == "gpu" + "-".join(group)
        assert config.engine["tensor_parallel_size"] == tp


def test_a_model_too_big_for_the_host_is_refused_up_front(fake_gpus, tmp_path):
    fake_gpus(RTX_PRO_6000)
    model = model_dir(tmp_path, 131)
    with pytest.raises(ConfigError, match=r"weights 131.0 GiB do not fit 1 GPU\(s\) of 96 GiB"):
        configs(model)
    # an explicit size is the operator's call
    assert configs(model, tensor_parallel_size=1)[0][0].engine["tensor_parallel_size"] == 1


def test_tensor_parallel_must_divide_the_attention_heads(fake_gpus, tmp_path):
    fake_gpus(*[RTX_PRO_6000] * 8)
    # 2 GPUs are too few for 131 GiB; 4 and 8 do not divide 6 heads
    with pytest.raises(ConfigError, match="and the 6 attention heads"):
        configs(model_dir(tmp_path, 131, heads=6))
    assert configs(model_dir(tmp_path, 131, heads=12))[0][0].engine["tensor_parallel_size"] == 4


def test_unknown_memory_or_weights_leave_tensor_parallel_at_one(tmp_path, fake_gpus):
    fake_gpus("NVIDIA H200, 9.0, [N/A]", "NVIDIA H200, 9.0, [N/A]")
    assert detect_gpus()[0].memory_mib == 0
    assert choose_tensor_parallel(model_dir(tmp_path, 500), detect_gpus(), 0.9).size == 1
    fake_gpus(H200, H200)
    empty = tmp_path / "no-weights"
    empty.mkdir()
    assert choose_tensor_parallel(str(empty), detect_gpus(), 0.9).size == 1


def test_mixed_gpu_kinds_need_one_worker_command_each(fake_gpus, tmp_path):
    fake_gpus(H200, RTX_PRO_6000)
    with pytest.raises(ConfigError, match="mix sm_120 and sm_90"):
        configs(model_dir(tmp_path, 16))
    assert [v for _, v in configs(model_dir(tmp_path, 17), gpus="1")] == ["1"]


def test_each_child_is_pinned_to_its_gpus_before_it_starts(fake_gpus, tmp_path):
    fake_gpus(*[H200] * 4)
    got = configs(model_dir(tmp_path, 131))
    sup = Supervisor(got, redis_url(15), "regen")
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in sup.children] == ["0,1", "2,3"]
    for child in sup.children:
        config = json.loads(child.env["REGEN_WORKER_CONFIG"])
        assert config["engine"]["tensor_parallel_size"] == 2 and config["capture_layers"] == [2, 17]
        assert child.env["REGEN_QUEUES"] == "regen"
    cpu = Supervisor(configs("m", cpu=True), redis_url(15), "regen")
    assert cpu.children[0].env["CUDA_VISIBLE_DEVICES"] == ""  # a CPU worker never sees a GPU


def test_regen_worker_reports_a_bad_gpu_choice_in_one_line(fake_gpus, tiny_qwen3):
    fake_gpus(H200, H200)
    result = CliRunner().invoke(main, ["worker", "--model", str(tiny_qwen3), "--gpus", "0,5",
                                       "--broker", redis_url(15)])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == "regen: error: --gpus 0,5: no such GPU 5 (nvidia-smi sees 0, 1)"
    assert "Traceback" not in result.output


def test_regen_pilot_refuses_a_gpu_nvidia_smi_does_not_see_as_the_worker_does(fake_gpus, tiny_qwen3, tmp_path):
    """One selection of `--gpus` for the worker and the pilot (workers.process.devices.select_gpus): the pilot
    once dropped an unknown index silently and measured the others."""
    fake_gpus(H200, H200)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(main, ["pilot", str(prompts), "--model", str(tiny_qwen3), "--gpus", "0,5",
                                       "--storage", str(tmp_path / "store")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == "regen: error: --gpus 0,5: no such GPU 5 (nvidia-smi sees 0, 1)"
    assert "Traceback" not in result.output and not (tmp_path / "store" / "pilots").exists()
