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
        tally = _Tally(reader, codec_samples)
        for info in reader.shards():
            tally.add_shard(info)
            records = list(reader.records(info))
            tally.add_outcomes(records)
            for rec in records:
                if rec.get("status") == "ok":
                    tally.add_ok(rec)
                    tally.add_codec(info, rec)
        dead = len(reader.store.dead_shards())
    if not tally.starts:
        raise ValueError(f"run {run_id} finished no shard: nothing to measure")
    return tally.result(devices, dead)


def _mode_tally() -> dict:
    return {"samples": 0, "generated_tokens": 0, "context_tokens": 0, "lengths": [], "at_cap": 0, "stubs": 0}


class _Tally:
    """What `measure_run` adds up over a run's shards and records: times, capture checks, stored bytes, outcomes,
    lengths (overall and per thinking mode) and the codec sample."""

    def __init__(self, reader: RunReader, codec_samples: int):
        self.reader, self.codec_samples = reader, codec_samples
        self.max_tokens = int(reader.run_settings.sampling.max_tokens)
        self.layers = len(reader.layers or [])
        self.hidden_size = int(reader.run_settings.hidden_size)
        self.starts, self.ends, self.generate_s, self.capture_s = [], [], 0.0, 0.0
        self.totals = RunTotals()
        self.stored_bytes = 0
        self.codec = {"samples": 0, "tokens": 0, "bytes": dict.fromkeys(CODEC_DTYPES, 0)}
        self.modes = {mode: _mode_tally() for mode in run_modes(reader.settings)}
        self.engine_modes, self.failures = ModeCounts(), []
        self.sample_lengths, self.trainable_tokens = [], 0
        self.outcomes = {name: {"samples": 0, "tokens": 0} for name in OUTCOMES}

    def add_shard(self, info) -> None:
        """A shard's window on the fleet's shared clock, its capture check, its stored states."""
        m, store = info.marker, self.reader.store
        engine_mode, checked, failed = shard_mode(m, info.captured)
        self.engine_modes.add(engine_mode, m.ok, checked, failed)
        failure = check_failure(info.shard_id, m, info.captured)
        if failure:
            self.failures.append(f"{info.shard_id} {failure[0]}: {failure[1]}")
        # both ends on the fleet's shared clock: the attempt's start and the marker's finish (the marker's
        # task_started is the host's own clock, and may be off by the host's drift)
        start = _epoch(store.attempt_record(info.shard_id, m.attempt).started)
        end = _epoch(m.finished)
        self.starts.append(start)
        self.ends.append(end)
        self.generate_s += end - start
        self.totals.add(m)
        if info.captured is not None:
            attempt = store.attempt_record(ledger.stage_key(info.shard_id, ledger.CAPTURE), info.captured.attempt)
            captured_end = _epoch(info.captured.finished)
            self.capture_s += captured_end - _epoch(attempt.started)
            self.ends.append(captured_end)
            self.stored_bytes += int(info.captured.hidden_file["bytes"])
        elif m.hidden_file:
            self.stored_bytes += int(m.hidden_file["bytes"])

    def add_outcomes(self, records: list) -> None:
        """Every record's outcome and whether the export's default filter keeps it (the trainable tokens)."""
        for rec, kept in zip(records, trainable(records), strict=True):
            tokens = int(rec.get("num_output_tokens") or 0)
            self.trainable_tokens += tokens if kept else 0
            what = self.outcomes[outcome(rec)]
            what["samples"] += 1
            what["tokens"] += tokens

    def add_ok(self, rec) -> None:
        """An ok record's reasoning and answer lengths, and its length, cap and stub in its thinking mode (the
        run's figures are the modes' summed)."""
        mode = record_mode(rec, self.reader.settings)
        n = int(rec["num_output_tokens"])
        thinking = mode == "thinking"
        answer = int(rec.get("num_answer_tokens") or 0)
        flags = set(rec.get("flags") or ())
        cut = rec.get("finish_reason") == "length" or bool(flags & CUT_FLAGS)  # its lengths are unknown
        self.sample_lengths.append([n - answer if thinking else 0, answer, cut, thinking, "missing_think_end" in flags])
        mine = self.modes.setdefault(mode, _mode_tally())
        mine["samples"] += 1
        mine["generated_tokens"] += n
        mine["context_tokens"] += len(rec["input_ids"]) - 1
        mine["lengths"].append(n)
        mine["at_cap"] += rec.get("finish_reason") == "length"
        mine["stubs"] += is_stub(rec.get("flags") or [])

    def add_codec(self, info, rec) -> None:
        """The first `codec_samples` samples' states encoded in each dtype (bytes per sample by dtype)."""
        codec = self.codec
        if not self.layers or codec["samples"] >= self.codec_samples:
            return
        got = self.reader.states(info, rec)
        if got is None:
            return
        ids, states = got
        codec["samples"] += 1
        codec["tokens"] += len(ids)
        for dtype in CODEC_DTYPES:
            codec["bytes"][dtype] += encode_sample(rec["sample_id"], ids, states, self.reader.layers,
                                                   stored=dtype).nbytes

    def result(self, devices: int, dead: int) -> dict:
        totals, modes = self.totals, self.modes.values()
        lengths = [n for m in modes for n in m["lengths"]]
        ok = len(lengths)
        at_cap, stubs = sum(m["at_cap"] for m in modes), sum(m["stubs"] for m in modes)
        return {
            "samples": totals.samples, "records": totals.records, "ok": totals.ok, "rejected": totals.rejected,
            "prompt_tokens": totals.prompt_tokens, "generated_tokens": totals.generated_tokens,
            "devices": devices,
            "dead_shards": dead,  # shards that failed for good: their samples are not in the figures
            "window_s": round(max(self.ends) - min(self.starts), 4),
            "generate_task_s": round(self.generate_s, 4),
            "capture_task_s": round(self.capture_s, 4),
            "context_tokens": sum(m["context_tokens"] for m in modes),
            "layers": self.layers,
            "hidden_size": self.hidden_size,
            "stored_states_bytes": self.stored_bytes,
            "codec": self.codec,
            "trainable_tokens": self.trainable_tokens,
            "outcomes": self.outcomes,
            "lengths": self.sample_lengths,
            "capture_check": {"checked": sum(c.checked for c in self.engine_modes.modes.values()),
                              "failed": self.engine_modes.failed, "failures": self.failures[:5],
                              "modes": self.engine_modes.as_dict()},
            "responses": {
                "max_tokens": self.max_tokens,
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
                      for mode, m in self.modes.items()},
        }
