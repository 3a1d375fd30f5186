"""One host's pilot: a real `regen run` of the sample per candidate setting, measured from its storage.

Why the whole run and not the engine alone: the run is the fleet's path (task slots, prefetch, encoders, the
staged capture's second pass, the writes), none of which the engine alone would measure; start-up is outside
the measured window. The measurements go to `<storage>/pilots/<name>.json` for `--forecast-only` and
`regen produce --pilot`. Details: docs/pilot.md#how-a-hosts-pilot-runs.
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable

from app.base.errors import ConfigError
from app.base.ids import validate_id
from app.base.ledger import pause_state
from app.base.model_info import read_model_info
from app.base.storage import RunStore, Storage
from app.base.thinking import engine_refusal
from app.data.run_reader import RunReader
from app.data.verify import verify_run
from app.pilot.forecast import PILOT_VERSION, PILOTS_DIR, candidates, capture_failure, mtp_available
from app.pilot.measure import measure_run
from app.pilot.peak_memory import PeakMemory, memory_kind
from app.pilot.sample import sample_inputs
from producer.estimate import human_bytes
from producer.readers import expand_inputs
from producer.run_setup import ProduceOptions, check_lengths
from workers.process.devices import (
    choose_tensor_parallel,
    preset_for,
    select_gpus,
    task_slots_for,
    weights_bytes,
)
from workers.process.plan import check_max_model_len

REFERENCE_ROOM = 1.5  # a reference forward needs the checkpoint in bf16 plus activations: room for this much of it


def _host_devices(cpu: bool, gpus: str | None, model: str) -> dict:
    """This host's devices, and how many engines the pilot's runs start on them (one per tensor-parallel group,
    sized as `regen worker` sizes it)."""
    if cpu:
        return {"kind": "cpu", "class": "cpu", "count": 1, "names": ["cpu"], "indices": None, "engines": 1}
    found = select_gpus(gpus, use="--cpu to run the pilot on the CPU")  # an index it does not see is refused
    utilization = preset_for(found[0].device_class, {})["gpu_memory_utilization"]
    tp = choose_tensor_parallel(model, found, utilization).size
    return {"kind": "cuda", "class": found[0].device_class, "count": len(found), "names": [d.name for d in found],
            "indices": [d.index for d in found], "engines": max(1, len(found) // tp)}


BATCHES = 2  # the default sample fills every engine's batch twice over (docs/pilot.md: 2-3x the batch)


def sample_size_for(devices: dict, max_num_seqs: int, given: int | None) -> tuple[int, str | None]:
    """The pilot's sample size (the one given, else twice the host's batch) and a warning where the one given is
    smaller than the host's batch: its engines never fill, so the rates understate what the run will do."""
    batch = devices["engines"] * max_num_seqs
    if given is None:
        return BATCHES * batch, None
    if given < batch:
        return given, (f"warning: a sample of {given:,} is smaller than this host's batch, {batch:,} sequences "
                       f"({devices['engines']} engine(s) x max_num_seqs {max_num_seqs}): the engines never fill, so "
                       f"the measured rates understate the run's; --sample {BATCHES * batch} fills each twice")
    return given, None


def _run_candidate(candidate, run_args: list[str], scratch: str, devices: dict, log_path: str) -> tuple[int, int]:
    """One candidate's `regen run` in a process of its own: (exit status, peak memory bytes)."""
    cmd = [sys.executable, "-m", "app.cli", "run", *run_args, *candidate.run_args()]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=scratch, stdout=log, stderr=subprocess.STDOUT)
        with PeakMemory(proc.pid, devices["indices"]) as memory:
            rc = proc.wait()
    return rc, memory.peak


def reference_check(run_storage: str, run_id: str, model: str, n: int) -> dict:
    """`regen verify --reference n` on the candidate's finished run: its engines are gone, so the checkpoint is
    loaded after them, in transformers on this host's GPU where torch sees one (else its CPU), where it fits that
    device's free memory; what it found, or why it was skipped."""
    import psutil
    import torch  # seconds to import: only when a reference check runs

    device = "cuda" if torch.cuda.is_available() else "cpu"
    free = torch.cuda.mem_get_info()[0] if device == "cuda" else psutil.virtual_memory().available
    need = int(weights_bytes(model) * REFERENCE_ROOM)
    if need > free:
        return {"skipped": f"the checkpoint needs ~{human_bytes(need)}, {human_bytes(free)} free on the {device}"}
    report = verify_run(RunReader(run_storage, run_id), reference=n, sample=n, reference_device=device)
    bad = [p for p in report.problems if p.kind.startswith("reference") and p.severity == "error"]
    out = {"samples": n, "ok": not bad, "problem": f"{bad[0].sample}: {bad[0].detail}" if bad else None}
    out.update({k: v for k, v in (report.reference or {}).items() if isinstance(v, int | float | str)})
    return out


def _tail(path: str, lines: int = 6) -> str:
    with open(path, "rb") as fh:
        text = fh.read()[-4000:].decode(errors="replace")
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])


def _honoured(chosen: list, sampling: dict, say: Callable[[str], None]) -> list:
    """The candidates whose engines honour the run's thinking budget (app.base.thinking.engine_refusal); the others
    are left out, saying why (their `regen run` would refuse them)."""
    budget, close = sampling.get("thinking_budget"), sampling.get("thinking_close")
    kept = []
    for c in chosen:
        why = engine_refusal(budget, close, False, c.capture, c.speculative)
        if why:
            say(f"candidate {c.name} left out: {why}")
        else:
            kept.append(c)
    if not kept:
        raise ConfigError("no candidate setting can run with --thinking-budget (every one was left out, above)")
    return kept


def measure_host(say: Callable[[str], None], *, inputs, model, name, storage, broker, cpu, gpus, sample_size, seed,
                 layers, max_tokens, thinking, regenerate, thinking_mix=None, samples_per_prompt, take=(), preserve_thinking=False,
                 shard_size, max_model_len, vllm_args, only, keep_runs, timeout, sampling: dict,
                 reference_samples: int = 2) -> tuple[dict, str]:
    """Measure every candidate on this host; (the pilot JSON, the path it was written to). `say` gets each line
    of progress. `sampling`: temperature, top_p, top_k, min_p, max_prompt_tokens, sample_temperatures, where
    given (the run's otherwise)."""
    check_lengths(max_tokens, model)  # the model's bounds, before anything is written
    check_max_model_len(model, max_model_len)
    store = Storage(storage)
    if not store.is_local:
        raise ConfigError("--storage: the pilot's scratch runs need a local folder (its JSON can be copied anywhere)")
    name = validate_id(name or socket.gethostname(), "pilot name")
    info = read_model_info(model)
    devices = _host_devices(cpu, gpus, model)
    seqs = int(preset_for(devices["class"], {})["max_num_seqs"])
    sample_size, warning = sample_size_for(devices, seqs, sample_size)
    if warning:
        say(warning)

    def slots_for(max_num_seqs: int) -> int:
        return task_slots_for(max_num_seqs, shard_size, devices["class"])

    chosen = candidates(slots=slots_for(seqs), max_num_seqs=seqs, slots_for=slots_for, mtp=mtp_available(model),
                        only=[n.strip() for n in only.split(",") if n.strip()] if only else None)
    chosen = _honoured(chosen, sampling, say)
    files = expand_inputs(inputs)
    # the producer's own character cap on prompts, so the sample holds no line `regen produce` would reject
    char_cap = ProduceOptions(**({"max_prompt_tokens": sampling["max_prompt_tokens"]}
                                 if "max_prompt_tokens" in sampling else {})).prompt_char_cap
    sample = sample_inputs(files, sample_size, seed, regenerate=regenerate, max_prompt_chars=char_cap,
                           take=list(take))
    if not sample.lines:
        raise ConfigError(f"{', '.join(inputs)}: no line becomes a sample ({sample.rejected:,} rejected, "
                          f"{sample.duplicates:,} duplicates): nothing to measure")
    say(f"pilot {name}: {len(sample.lines)} of {sample.samples:,} samples; candidates "
        f"{', '.join(c.name for c in chosen)}")
    scratch = store.path(f"{PILOTS_DIR}/{name}.work")
    os.makedirs(scratch, exist_ok=True)
    sample_path = os.path.join(scratch, "sample.jsonl")
    sample.write_jsonl(sample_path)
    run_storage = os.path.join(scratch, "storage")
    shutil.rmtree(run_storage, ignore_errors=True)  # a fresh run per candidate, whatever an earlier pilot left
    base = [sample_path, "--model", os.path.abspath(model), "--storage", run_storage, "--layers", layers,
            "--max-tokens", str(max_tokens), "--shard-size", str(shard_size), "--seed", str(seed),
            "--regenerate", regenerate, "--timeout", str(timeout),
            *(["--thinking-mix", str(thinking_mix)] if thinking_mix is not None
              else ["--thinking" if thinking else "--no-thinking"]),
            *(["--samples-per-prompt", str(samples_per_prompt)] if samples_per_prompt > 1 else []),
            *(["--preserve-thinking"] if preserve_thinking else [])]
    base += ["--cpu"] if cpu else (["--gpus", ",".join(devices["indices"])])
    if broker:
        base += ["--broker", broker]
    if max_model_len:
        base += ["--max-model-len", str(max_model_len)]
    for key, value in sampling.items():
        base += ["--" + key.replace("_", "-"), str(value)]
    for arg in vllm_args:
        base += ["--vllm-arg", arg]
    results = []
    for candidate in chosen:
        log_path = os.path.join(scratch, f"{candidate.name}.log")
        say(f"candidate {candidate.name}: regen run {' '.join(candidate.run_args())} (log {log_path})")
        started = time.monotonic()
        rc, peak = _run_candidate(candidate, [*base, "--run", candidate.name], scratch, devices, log_path)
        entry = {"candidate": candidate.to_json(), "seconds_with_start_up": round(time.monotonic() - started, 3)}
        paused = pause_state(RunStore(Storage(run_storage), candidate.name))
        if paused and paused.details.get("check") == "capture":  # the capture check paused the candidate's run
            entry["capture_failed"] = paused.reason
        if rc != 0:
            entry["error"] = f"regen run exited {rc}: {_tail(log_path)}"
            say(f"candidate {candidate.name} failed: {entry['error']}")
        else:
            try:
                measured = measure_run(run_storage, candidate.name, devices["count"])
            except (ValueError, OSError, KeyError) as exc:
                entry["error"] = f"measuring its run: {exc}"
            else:
                measured["peak_memory_bytes"] = peak or None
                measured["peak_memory_what"] = memory_kind(devices["indices"])
                entry["measured"] = measured
                if reference_samples and measured["layers"]:
                    entry["reference"] = reference_check(run_storage, candidate.name, model, reference_samples)
        failure = capture_failure(entry)
        if failure:
            say(f"candidate {candidate.name}: capture failed, not recommended: {failure}")
        results.append(entry)
    pilot_json = {
        "version": PILOT_VERSION, "name": name, "host": socket.gethostname(),
        "created": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "device": devices,
        "model": info.to_manifest(),
        "inputs": {"files": [os.path.abspath(f) for f in files], "read": sample.read, "samples": sample.samples,
                   "rejected": sample.rejected, "duplicates": sample.duplicates,
                   **({"left_out": sample.left_out, "take": list(take)} if take else {})},
        "sample": {"size": len(sample.lines), "seed": seed},  # also the runs' seed (and their --take's)
        "settings": {"layers": layers, "max_tokens": max_tokens, "shard_size": shard_size, "thinking": thinking,
                     **({"thinking_mix": thinking_mix} if thinking_mix is not None else {}),
                     **({"samples_per_prompt": samples_per_prompt} if samples_per_prompt > 1 else {}),
                     **({"preserve_thinking": True} if preserve_thinking else {}),
                     "regenerate": regenerate, "max_model_len": max_model_len, "vllm_args": vllm_args,
                     "sampling": sampling},
        "candidates": results,
    }
    rel = f"{PILOTS_DIR}/{name}.json"
    store.write_json(rel, pilot_json)
    if not keep_runs:
        shutil.rmtree(run_storage, ignore_errors=True)
    return pilot_json, store.path(rel)

