"""Staged capture: a prefill-only pass over a finished shard's stored `input_ids`.

Generation without capture keeps all of the GPU's KV memory for batch size; this pass (max_tokens=1, on
its own queue, possibly on other GPUs) then captures the states for the exact ids the records hold. The
stored states cover `input_ids[:-1]`, the same tokens an inline capture covers, so both modes give files
a trainer reads the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from app.base.documents import CaptureMarker
from app.base.manifest import RunSettings, compression_level
from app.base.records import read_records
from app.base.storage import RunStore
from workers.engine.fault_hook import capture_faults
from workers.engine.recapture import CheckOutcome, CheckPolicy, Pending
from workers.engine.request import GenRequest
from workers.shard import capture_check
from workers.shard.shard_output import hidden_file_stream, publish_marker
from workers.shard.states import encode_into, repair_states, states_dtype, zero_embedding_ids

if TYPE_CHECKING:
    from workers.process.context import WorkerContext


def capture_records(ctx: WorkerContext, store: RunStore, manifest: dict, shard_id: str, attempt: str,
                    stale_after: float | None = None) -> tuple[bool, list[CheckOutcome]]:
    """Capture the states of a finished shard's ok records into the attempt's file; (True if this attempt's
    capture marker won (another attempt's may have been written first: then this one's file is removed), the
    capture check's outcomes).

    The capture check (workers.shard.capture_check) re-captures its chosen samples in a batch of their own,
    after this batch of the whole shard: the same prefill in another batch composition."""
    marker = store.done_marker(shard_id)
    records = read_records(store.storage.read_bytes(marker.records_file["path"]), marker.records_file["path"])
    layers = RunSettings.view(manifest["settings"]).vllm_layer_ids
    level = compression_level(manifest["settings"])
    stored = states_dtype(manifest["settings"])
    requests = [
        GenRequest(str(i), r["input_ids"], {"temperature": 1.0, "max_tokens": 1, "seed": 0},
                   capture=True, include_output_tokens=False)
        for i, r in enumerate(records) if r.get("status") == "ok"
    ]
    futures = {}
    problems: dict[str, list[str]] = {}
    repaired: dict[str, dict] = {}
    index = {}
    policy = CheckPolicy.of(manifest["settings"])
    zero_ids = zero_embedding_ids(manifest["settings"])
    to_check: list[Pending] = []
    faults = capture_faults()  # None but in the tests
    # As in generate: each sample's states go into the attempt's file as soon as they are checked and encoded.
    with hidden_file_stream(store, shard_id, f"{attempt}c") as stream:

        def on_done(res) -> None:  # on the engine's delivery thread: the check and the encoding go to the pool
            i = int(res.request_id)
            rec = records[i]
            expected = rec["input_ids"][:-1]
            states = res.captured_states[:len(expected)]
            if faults is not None:
                states, _ = faults.corrupt(store.run_id, rec["sample_id"], states)
            wanted, first = ctx.capture_checks.wants(rec["sample_id"], policy)
            if wanted:
                to_check.append(Pending(i, rec["sample_id"], expected, states, duplicate=first))
            futures[i] = ctx.encode_pool.submit(encode_into, stream, rec["sample_id"], expected,
                                                res.captured_token_ids, states, layers, level, True,
                                                stored=stored, zero_ids=zero_ids, hold_repairable=True)

        ctx.engine.run(requests, on_done)
        outcomes = capture_check.run_checks(ctx, to_check, layers)
        placed, held = {}, {}
        for i in sorted(futures):
            issues, position, _ = futures[i].result()
            if position is None:  # zero or non-finite rows: captured again before anything is stored
                held[i] = (records[i]["sample_id"], records[i]["input_ids"][:-1], issues)
            else:
                placed[i] = (issues, position)
        for i, (issues, position, _, note) in repair_states(ctx, stream, held, layers, level, stored,
                                                            zero_ids).items():
            placed[i] = (issues, position)
            repaired[records[i]["sample_id"]] = note
        for i, (issues, position) in sorted(placed.items()):
            if issues:
                problems[records[i]["sample_id"]] = issues
            index[records[i]["sample_id"]] = position
        checks = {}
        for outcome in outcomes:
            checks[outcome.sample_id] = outcome.as_record()
            if not outcome.ok:
                problems.setdefault(outcome.sample_id, []).append(capture_check.FLAG)
    written = stream.written
    # `repaired`: samples whose first capture had zero or non-finite rows, captured again (workers.shard.states.repair_states)
    body = CaptureMarker.new(shard_id, attempt, written.info(), index, problems, ctx.worker_name,
                             ctx.engine_mode_key, {**capture_check.summary(outcomes), "samples": checks}, repaired)
    won = publish_marker(store, store.captured_path(shard_id), body, [written.path], shard_id, stale_after)
    return won, outcomes
