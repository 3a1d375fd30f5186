"""Workers started together on one host get a vLLM cache folder each (app/process_env.own_vllm_cache): vLLM's
torch.compile cache is written without a lock, and engines built at the same moment corrupted a shared one."""

from __future__ import annotations

import os

from app.base.process_env import own_vllm_cache, worker_child_env


def test_each_worker_on_a_host_gets_its_own_stable_vllm_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    gpu0 = worker_child_env("{}", "0", "redis://h/0", "regen", name="gpu0@host")
    gpu1 = worker_child_env("{}", "1", "redis://h/0", "regen", name="gpu1@host")
    assert gpu0["VLLM_CACHE_ROOT"] == os.path.join(str(tmp_path), "vllm", "regen-gpu0@host")
    assert gpu1["VLLM_CACHE_ROOT"] != gpu0["VLLM_CACHE_ROOT"]
    # a restarted worker (same name) finds its own folder again
    assert worker_child_env("{}", "0", "redis://h/0", "regen", name="gpu0@host")["VLLM_CACHE_ROOT"] == \
        gpu0["VLLM_CACHE_ROOT"]


def test_the_operators_vllm_cache_root_is_kept_as_the_root_and_names_stay_in_it(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "cache"))
    env = worker_child_env("{}", None, "redis://h/0", "regen", name="cpu@host")
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "cache" / "regen-cpu@host")
    assert own_vllm_cache({"VLLM_CACHE_ROOT": "/c"}, "../../x y") == "/c/regen-.._.._x_y"
    # without a name nothing is chosen for the child: it inherits the operator's root as it is
    assert worker_child_env("{}", None, "redis://h/0", "regen")["VLLM_CACHE_ROOT"] == str(tmp_path / "cache")
