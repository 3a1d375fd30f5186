"""The produce pipeline: read -> normalise -> dedupe -> shard -> (skip done) -> publish, with accounting.

It is safe to run again because shards are deterministic and storage, not Redis, records what is done: a
finished produce enqueues nothing, an interrupted one re-sends every shard without a marker, and `--resume`
(`regen reconcile`) sends exactly the shards with no marker and no dead letter. Memory stays flat.
Each case: docs/faults.md#why-produce-is-safe-to-run-again.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from app.base import ledger
from app.base.celery_app import CAPTURE_TASK
from app.base.errors import ConfigError
from app.base.ids import validate_id
from app.base.manifest import RunSettings, grow_samples_per_prompt, load, open_or_create
from app.base.states_codec import resolve as resolve_states_dtype
from app.base.storage import RunStore, Storage
from producer.accounting import (
    Accounting,
    RejectLog,
    read_produce_state,
    write_produce_state,
)
from producer.enqueue import ShardSender
from producer.estimate import Estimate, Reservoir, build_estimate, count_prompt_tokens, count_responses
from producer.normalise import Rejected, normalise, parse_line
from producer.readers import InputReader, ReadFailure, expand_inputs
from producer.run_setup import (
    ProduceOptions,
    build_settings,
    check_producer_settings,
    derive_run_id,
    options_from_manifest,
    producer_settings,
    verify_inputs,
)
from producer.sharding import Deduper, shard_samples
from producer.take import Selection, rules_from_manifest, selections
from producer.template_check import BATCH as CHECK_BATCH
from producer.template_check import TemplateCheck
from producer.thinking_modes import ModeCounts, pass_samples

JSON_ARRAY_ITEM_BYTES = 1024  # rough size of a parsed .json array element, only used to choose compression
PROGRESS_EVERY = 512

ProgressFn = Callable[[int, int], None]  # called with (input bytes read so far, total input bytes)


@dataclass
class ProduceResult:
    run_id: str
    status: str  # "produced", "already_produced" or "dry_run"
    accounting: Accounting
    inputs: list[str]
    estimate: Estimate | None = None
    storage_url: str | None = None
    layers: dict | None = None  # a dry run's resolved capture layers (the manifest's `layers`; None: capture off)


def iter_samples(paths: list[str], opts: ProduceOptions, acc: Accounting, rejects: RejectLog, dedupe: Deduper,
                 progress: ProgressFn | None = None, take: dict[str, Selection] | None = None,
                 check: TemplateCheck | None = None) -> Iterator[tuple[dict, int]]:
    """Every record of every input, counted once as read and then as left out (`take`), a reject, a duplicate
    or a yielded sample (a prompt: its samples are made from it, producer.thinking_modes). `check`: the run's render
    check (producer.template_check); a sample it refuses is a reject."""
    regenerate, cap = opts.regenerate, opts.prompt_char_cap
    first_time = dedupe.first_time
    done_bytes = 0
    total_bytes = sum(os.path.getsize(p) for p in paths)
    read = enqueued = 0  # locals in the hot loop, written back to `acc` on every exit path
    take = take or {}
    pending: list[tuple[dict, int, int]] = []  # normalised, awaiting the render check: (sample, bytes, line)

    def checked(path: str) -> Iterator[tuple[dict, int]]:
        for (sample, nbytes, line), problem in zip(pending, check.problems([p[0] for p in pending]), strict=True):
            if problem is not None:
                rejects.add(path, line, *problem)
            elif first_time(sample["id"]):
                yield sample, nbytes
        pending.clear()

    try:
        for path in paths:
            reader = InputReader(path)
            keep = take[path].keep if path in take else None
            ordinal = -1
            for line, payload in reader:
                read += 1
                if progress is not None and read % PROGRESS_EVERY == 0:
                    progress(done_bytes + reader.consumed, total_bytes)
                if keep is not None:
                    ordinal += 1
                    if not keep[ordinal]:
                        acc.left_out_by_file[path] += 1
                        continue
                try:
                    if type(payload) is bytes:
                        nbytes = len(payload)
                        row = parse_line(payload)
                    elif isinstance(payload, ReadFailure):
                        raise Rejected(payload.reason, payload.detail)
                    else:
                        nbytes, row = JSON_ARRAY_ITEM_BYTES, payload
                    sample = normalise(row, file=path, line=line, regenerate=regenerate, max_prompt_chars=cap)
                except Rejected as exc:
                    rejects.add(path, line, exc.reason, exc.detail)
                    continue
                if check is not None:
                    pending.append((sample, nbytes, line))
                    if len(pending) >= CHECK_BATCH:
                        for item in checked(path):
                            enqueued += 1
                            yield item
                elif first_time(sample["id"]):
                    enqueued += 1
                    yield sample, nbytes
            if pending:
                for item in checked(path):
                    enqueued += 1
                    yield item
            done_bytes += reader.consumed
            if progress is not None:
                progress(done_bytes, total_bytes)
    finally:
        acc.read += read
        acc.enqueued += enqueued
        acc.duplicates = dedupe.duplicates


def plain_input_bytes(paths: list[str]) -> int:
    """Roughly how many bytes of prompts the inputs hold (a `.zst` file counted at 4x its size)."""
    return sum(os.path.getsize(p) * (4 if p.lower().endswith(".zst") else 1) for p in paths)


@contextlib.contextmanager
def template_check(settings: dict, opts: ProduceOptions, paths: list[str]) -> Iterator[TemplateCheck | None]:
    """The run's render check (producer.template_check; None for a run that records no template), its pool
    stopped on the way out."""
    check = TemplateCheck.for_run(settings, opts.render_processes or 1)
    try:
        yield check
    finally:
        if check is not None:
            check.close()


def storage_url_for_workers(storage: Storage) -> str:
    """What workers get: an absolute path for local storage (a relative one means nothing on another host)."""
    return storage.root if storage.is_local else storage.url


def _open_store(opts: ProduceOptions, run_id: str) -> RunStore:
    if not opts.storage:
        raise ConfigError("--storage (or REGEN_STORAGE) is required: the root folder or URL runs are written to")
    return RunStore(Storage(opts.storage), run_id)


def _dry_run(opts: ProduceOptions, run_id: str, paths: list[str], settings: dict,
             progress: ProgressFn | None) -> ProduceResult:
    typed = RunSettings.view(settings)
    model, layers = typed.model, typed.layers
    acc = Accounting()
    reservoir = Reservoir(opts.estimate_sample, seed=opts.seed)
    take = selections(rules_from_manifest(typed.take), typed.inputs, opts.seed)
    per_prompt = int(typed.samples_per_prompt)
    modes = ModeCounts()
    with template_check(settings, opts, paths) as check, RejectLog(acc) as rejects:
        for sample, _ in iter_samples(paths, opts, acc, rejects, Deduper(), progress, take, check):
            reservoir.offer(sample)
            modes.count_prompt(sample, per_prompt, settings)
    acc.mode_counts = modes.to_dict()
    acc.shards = per_prompt * -(-acc.enqueued // opts.shard_size)
    acc.check_identity()
    counts = (count_prompt_tokens(model["path"], reservoir.items, opts.thinking, opts.preserve_thinking)
              if reservoir.items else [])
    estimate = build_estimate(
        samples=acc.enqueued * per_prompt,
        token_counts=counts,
        max_tokens=opts.max_tokens,
        assumed_response_tokens=opts.assumed_response_tokens,
        layers=len(layers["vllm_ids"]) if layers else 0,
        hidden_size=model["hidden_size"],
        response_counts=count_responses(reservoir.items),
        states_dtype=resolve_states_dtype(opts.states_dtype),
    )
    return ProduceResult(run_id, "dry_run", acc, paths, estimate=estimate, layers=layers)


def produce(opts: ProduceOptions, progress: ProgressFn | None = None) -> ProduceResult:
    """Run `regen produce` (or `--resume`) with `opts`; see the module docstring for re-run behaviour."""
    if opts.resume:
        if not opts.run_id:
            raise ConfigError("--resume needs the run id (regen produce --resume RUN, or regen reconcile RUN)")
        store = _open_store(opts, validate_id(opts.run_id, "run id"))
        manifest = load(store)
        state = read_produce_state(store)
        opts = options_from_manifest(manifest, state and state.get("producer_settings"), opts)
        paths = verify_inputs(RunSettings.view(manifest.settings).inputs)
        settings = manifest["settings"]
        if opts.samples_per_prompt != RunSettings.view(settings).samples_per_prompt:
            settings = grow_samples_per_prompt(store, manifest, opts.samples_per_prompt)
        run_id = store.run_id
    else:
        paths = expand_inputs(opts.inputs)
        run_id = validate_id(opts.run_id or derive_run_id(paths[0]), "run id")
        run_settings = build_settings(opts, paths)
        settings = run_settings.to_dict()
        if opts.dry_run:
            return _dry_run(opts, run_id, paths, settings, progress)
        store = _open_store(opts, run_id)
        state = read_produce_state(store)
        manifest, _ = open_or_create(store, run_settings)
        if "chat_template" not in manifest["settings"]:  # reopened as it was made: unchecked (app.base.manifest)
            settings.pop("chat_template", None)
        check_producer_settings(state and state.get("producer_settings"), producer_settings(opts), run_id)
        if state and state.get("complete"):
            return ProduceResult(run_id, "already_produced", Accounting(**_counts_only(state["counts"])), paths,
                                 storage_url=storage_url_for_workers(store.storage))
    if opts.dry_run:
        return _dry_run(opts, run_id, paths, settings, progress)

    storage_url = storage_url_for_workers(store.storage)
    done = store.done_shards()
    dead = ledger.dead(store, ledger.GENERATE)
    only = opts.only_shards
    acc = Accounting()
    started = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    psettings = producer_settings(opts)
    write_produce_state(store, producer_settings=psettings, accounting=None, complete=False, queue=opts.queue,
                        started=started)
    take = selections(rules_from_manifest(RunSettings.view(settings).take), RunSettings.view(settings).inputs,
                      opts.seed)
    modes = ModeCounts()
    with template_check(settings, opts, paths) as check, ShardSender(
            opts.broker, opts.queue, opts.max_pending, compress=opts.compress,
            input_bytes=plain_input_bytes(paths)) as sender, RejectLog(acc, store) as rejects:
        for shard in sample_shards(paths, opts, settings, acc, rejects, modes, take, progress, check):
            acc.shards += 1
            if shard.id in done:
                acc.shards_skipped_done += 1
                continue
            if only is not None and shard.id not in only:
                acc.shards_not_selected += 1
                continue
            if shard.id in dead:
                acc.shards_skipped_dead += 1
                continue
            sender.send(run_id, storage_url, shard)
            acc.shards_sent += 1
            acc.samples_sent += len(shard.samples)
        if opts.resume and only is None and RunSettings.view(settings).staged:
            send_captures(store, sender.app, storage_url, settings, ledger.missing_captures(store))
    acc.mode_counts = modes.to_dict()
    acc.take_rows = {path: sel.rows for path, sel in take.items()}
    acc.check_identity(int(RunSettings.view(settings).samples_per_prompt))
    write_produce_state(store, producer_settings=psettings, accounting=acc, complete=True, queue=opts.queue,
                        started=started)
    return ProduceResult(run_id, "produced", acc, paths, storage_url=storage_url)


def sample_shards(paths: list[str], opts: ProduceOptions, settings: dict, acc: Accounting, rejects: RejectLog,
                  modes: ModeCounts, take: dict[str, Selection], progress: ProgressFn | None = None,
                  check: TemplateCheck | None = None):
    """The run's shards: pass k (one per sample of a prompt, `--samples-per-prompt`) makes sample k of every
    prompt, in input order, into shards numbered on from the previous pass's.

    Why passes rather than a prompt's K samples side by side: pass k's shards are the same whatever K is, so a
    `--resume` with a larger K finds the earlier passes' shards done and sends only the new samples' shards,
    and a run produced with K at once has the shards a K=1 run resumed to K has. Only the first pass counts
    rows (read, rejects, duplicates, left out); the later ones read the inputs again to the same prompts."""
    first = 0
    for k in range(int(RunSettings.view(settings).samples_per_prompt)):
        if k == 0:
            prompts = iter_samples(paths, opts, acc, rejects, Deduper(), progress, take, check)
        else:
            again = Accounting()
            prompts = iter_samples(paths, opts, again, RejectLog(again), Deduper(), None, take, check)
        made = 0
        for shard in shard_samples(pass_samples(prompts, k, settings, modes), opts.shard_size, first):
            made += 1
            yield shard
        first += made


def send_captures(store: RunStore, app, storage_url: str, settings: dict, shards: list[str]) -> int:
    """Send a staged capture task for each of `shards` (generated, not captured) on the run's capture queue:
    `--resume` for captures whose message was lost, `regen retry-dead` for dead-lettered ones."""
    queue = RunSettings.view(settings).capture_queue
    for shard in shards:
        app.send_task(CAPTURE_TASK, kwargs={"run_id": store.run_id, "storage": storage_url, "shard_id": shard},
                      queue=queue)
    return len(shards)


def _counts_only(counts: dict | None) -> dict:
    counts = dict(counts or {})
    counts.pop("rejected", None)
    counts["rejected_by_reason"] = Counter(counts.get("rejected_by_reason") or {})
    return {k: v for k, v in counts.items() if k in Accounting.__dataclass_fields__}
