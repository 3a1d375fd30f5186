"""What one finished pilot run measured, read from its storage (the record of what was done).

Why from storage: the pilot's runs are real `regen run`s, so their markers, attempt records and records hold
every figure, written by the workers a production run uses; only peak memory is polled from outside. The
window, the capture pass's share, the capture check's results, the bytes per sample by states dtype, each
sample's reasoning and answer lengths and the trainable tokens are read or recomputed from them. Each figure:
docs/pilot.md#what-a-pilot-run-measured.
"""

from __future__ import annotations

import datetime as dt
import statistics

import numpy as np

from app.base import ledger
from app.base.hidden_file import encode_sample
from app.base.quality import is_stub
from app.base.run_totals import RunTotals
from app.base.storage import Storage
from app.base.thinking_modes import record_mode, run_modes
from app.data.engine_modes import ModeCounts, check_failure, shard_mode
from app.data.outcomes import CUT_FLAGS, OUTCOMES, outcome, trainable
from app.data.run_reader import RunReader

CODEC_DTYPES = ("bf16", "fp8-e4m3")  # the lossless default and the lossy opt-in
BF16_BYTES = 2


def _epoch(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    return dt.datetime.fromisoformat(value).timestamp()


def percentile(values: list[int], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation, numpy's default; 0 for no values."""
    return float(np.percentile(values, q)) if values else 0.0


def measure_run(storage: str, run_id: str, devices: int, codec_samples: int = 64) -> dict:
    """The measurements of a finished run (see the module docstring); JSON-ready."""
    with RunReader(Storage(storage), run_id) as reader:
        max_tokens = int(reader.run_settings.sampling.max_tokens)
        layers = len(reader.layers or [])
        hidden_size = int(reader.run_settings.hidden_size)
        starts, ends, generate_s, capture_s = [], [], 0.0, 0.0
        totals = RunTotals()
        lengths, at_cap, stubs, context_tokens, stored_bytes = [], 0, 0, 0, 0
        codec = {"samples": 0, "tokens": 0, "bytes": dict.fromkeys(CODEC_DTYPES, 0)}
        modes = {mode: {"samples": 0, "generated_tokens": 0, "context_tokens": 0, "lengths": [], "at_cap": 0,
                        "stubs": 0} for mode in run_modes(reader.settings)}
        engine_modes, failures = ModeCounts(), []
        sample_lengths, trainable_tokens = [], 0
        outcomes = {name: {"samples": 0, "tokens": 0} for name in OUTCOMES}
        for info in reader.shards():
            m = info.marker
            engine_mode, checked, failed = shard_mode(m, info.captured)
            engine_modes.add(engine_mode, m.ok, checked, failed)
            failure = check_failure(info.shard_id, m, info.captured)
            if failure:
                failures.append(f"{info.shard_id} {failure[0]}: {failure[1]}")
            # both ends on the fleet's shared clock: the attempt's start and the marker's finish (the marker's
            # task_started is the host's own clock, and may be off by the host's drift)
            start = _epoch(reader.store.attempt_record(info.shard_id, m.attempt).started)
            end = _epoch(m.finished)
            starts.append(start)
            ends.append(end)
            generate_s += end - start
            totals.add(m)
            if info.captured is not None:
                key = ledger.stage_key(info.shard_id, ledger.CAPTURE)
                attempt = reader.store.attempt_record(key, info.captured.attempt)
                captured_end = _epoch(info.captured.finished)
                capture_s += captured_end - _epoch(attempt.started)
                ends.append(captured_end)
                stored_bytes += int(info.captured.hidden_file["bytes"])
            elif m.hidden_file:
                stored_bytes += int(m.hidden_file["bytes"])
            records = list(reader.records(info))
            for rec, kept in zip(records, trainable(records), strict=True):
                tokens = int(rec.get("num_output_tokens") or 0)
                trainable_tokens += tokens if kept else 0
                what = outcomes[outcome(rec)]
                what["samples"] += 1
                what["tokens"] += tokens
            for rec in records:
                if rec.get("status") != "ok":
                    continue
                n = int(rec["num_output_tokens"])
                thinking = record_mode(rec, reader.settings) == "thinking"
                answer = int(rec.get("num_answer_tokens") or 0)
                flags = set(rec.get("flags") or ())
                cut = rec.get("finish_reason") == "length" or bool(flags & CUT_FLAGS)  # its lengths are unknown
                sample_lengths.append([n - answer if thinking else 0, answer, cut, thinking,
                                       "missing_think_end" in flags])
                lengths.append(n)
                at_cap += rec.get("finish_reason") == "length"
                stubs += is_stub(rec.get("flags") or [])
                context_tokens += len(rec["input_ids"]) - 1
                mine = modes.setdefault(record_mode(rec, reader.settings), {
                    "samples": 0, "generated_tokens": 0, "context_tokens": 0, "lengths": [], "at_cap": 0, "stubs": 0})
                mine["samples"] += 1
                mine["generated_tokens"] += n
                mine["context_tokens"] += len(rec["input_ids"]) - 1
                mine["lengths"].append(n)
                mine["at_cap"] += rec.get("finish_reason") == "length"
                mine["stubs"] += is_stub(rec.get("flags") or [])
                if layers and codec["samples"] < codec_samples:
                    got = reader.states(info, rec)
                    if got is not None:
                        ids, states = got
                        codec["samples"] += 1
                        codec["tokens"] += len(ids)
                        for dtype in CODEC_DTYPES:
                            codec["bytes"][dtype] += encode_sample(rec["sample_id"], ids, states, reader.layers,
                                                                   stored=dtype).nbytes
        dead = len(reader.store.dead_shards())
    if not starts:
        raise ValueError(f"run {run_id} finished no shard: nothing to measure")
    window = max(ends) - min(starts)
    ok = len(lengths)
    return {
        "samples": totals.samples, "records": totals.records, "ok": totals.ok, "rejected": totals.rejected,
        "prompt_tokens": totals.prompt_tokens, "generated_tokens": totals.generated_tokens,
        "devices": devices,
        "dead_shards": dead,  # shards that failed for good: their samples are not in the figures
        "window_s": round(window, 4),
        "generate_task_s": round(generate_s, 4),
        "capture_task_s": round(capture_s, 4),
        "context_tokens": context_tokens,
        "layers": layers,
        "hidden_size": hidden_size,
        "stored_states_bytes": stored_bytes,
        "codec": codec,
        "trainable_tokens": trainable_tokens,
        "outcomes": outcomes,
        "lengths": sample_lengths,
        "capture_check": {"checked": sum(c.checked for c in engine_modes.modes.values()), "failed": engine_modes.failed,
                          "failures": failures[:5], "modes": engine_modes.as_dict()},
        "responses": {
            "max_tokens": max_tokens,
            "median": float(statistics.median(lengths)) if lengths else 0.0,
            "p90": percentile(lengths, 90),
            "at_cap_share": at_cap / ok if ok else 0.0,
            "stub_share": stubs / ok if ok else 0.0,
        },
        # the same per mode (a mixed run's thinking and non-thinking samples: their lengths differ by far)
        "modes": {mode: {"samples": m["samples"], "generated_tokens": m["generated_tokens"],
                         "context_tokens": m["context_tokens"],
                         "median": float(statistics.median(m["lengths"])) if m["lengths"] else 0.0,
                         "p90": percentile(m["lengths"], 90),
                         "at_cap_share": m["at_cap"] / m["samples"] if m["samples"] else 0.0,
                         "stub_share": m["stubs"] / m["samples"] if m["samples"] else 0.0}
                  for mode, m in modes.items()},
    }
