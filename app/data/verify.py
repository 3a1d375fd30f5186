"""`regen verify`: prove a run on storage is complete, intact and self-consistent before anyone trains on it.

Why: the failures that hurt drafter training are silent (zero states, a truncated copy, a shard that never
ran). Every check needs only the run itself (markers with sizes and sha256, per-part CRCs, record ids, the
producer's counts); `--reference N` recomputes states with plain transformers. Problems are errors or
warnings; an incomplete run is an error unless `--allow-incomplete`; `--sample N` decodes only N samples'
states. Details: docs/checking.md#what-verify-rests-on.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import orjson
import zstandard

from app.base.documents import MalformedDocument
from app.base.hidden_file import CorruptHiddenFile, HiddenFileReader
from app.base.ids import shard_id as shard_name
from app.base.layers import ascending_problem
from app.base.records import iter_records, turn_sample_id
from app.data.engine_modes import ModeCounts, check_failure, shard_mode
from app.data.fanout import WHOLE, Part, open_reader, ordered_map, worker_reader
from app.data.run_reader import RunReader, ShardInfo
from app.data.verify_checks import Problem, ShardResult, check_mode, check_states
from app.data.verify_prompts import prompt_check
from app.data.verify_reference import reference_check
from app.data.verify_sampled import check_index_entry, decode_sample


@dataclass
class VerifyReport:
    run_id: str
    accounting: dict
    shards: dict[str, int]
    problems: list[Problem]
    reference: dict | None = None
    incomplete: dict | None = None  # what is missing and why (None when the run is complete)
    sampled: dict | None = None  # what a sampled verify read and did not read
    modes: ModeCounts | None = None  # samples and capture checks per engine mode (app.data.engine_modes)
    part: str | None = None  # `I/N` when only that part's shards were checked (verify_run says what that means)

    def headline(self) -> str | None:
        """The report's first line when the run is incomplete."""
        if not self.incomplete:
            return None
        i = self.incomplete
        why = []
        if i["dead_shards"]:
            why.append(f"{i['dead_shards']} shards dead-lettered ({i['dead_samples']:,} samples)")
        if i["missing_shards"]:
            why.append(f"{i['missing_shards']} shards without a completion marker ({i['missing_shard_samples']:,} "
                       "samples)")
        if i["producer_unfinished"]:
            why.append("the producer has not finished enqueuing")
        return f"INCOMPLETE: {i['missing_samples']:,} samples missing: " + "; ".join(why)

    def errors(self, strict: bool = False) -> list[Problem]:
        return [p for p in self.problems if strict or p.severity == "error"]

    def ok(self, strict: bool = False) -> bool:
        return not self.errors(strict)

    def to_dict(self, strict: bool = False) -> dict:
        return {"run_id": self.run_id, **({"part": self.part} if self.part else {}), "ok": self.ok(strict),
                "headline": self.headline(),
                "incomplete": self.incomplete, "accounting": self.accounting, "shards": self.shards,
                "reference": self.reference, "sampled": self.sampled,
                "engine_modes": self.modes.as_dict() if self.modes else {},
                "problems": [asdict(p) for p in self.problems]}


def _read_records_file(res: ShardResult, reader: RunReader, info: dict) -> bytes | None:
    """Size and sha256 of the records file a marker names, and its bytes (it is small); None when missing.
    Hidden files are checked in `verify_shard`, in the pass that decodes them."""
    if not _size_check(res, reader, "records", info):
        return None
    digest, data = _hash_file(reader, info["path"], keep=True)
    _sha_check(res, "records", info, digest)
    return data


def _hash_file(reader: RunReader, path: str, keep: bool) -> tuple[str, bytes]:
    """sha256 of a whole file in one read, and its bytes when `keep`."""
    h = hashlib.sha256()
    kept = bytearray()
    with reader.storage.open(path) as fh:
        while chunk := fh.read(1 << 22):
            h.update(chunk)
            if keep:
                kept += chunk
    return h.hexdigest(), bytes(kept)


def _size_check(res: ShardResult, reader: RunReader, what: str, info: dict) -> bool:
    """False (and a problem) when the file is missing; a size that differs from the marker's is a problem too."""
    path = info.get("path")
    try:
        size = reader.storage.size(path)
    except FileNotFoundError:
        res.add("missing_file", f"{what} file {path} named by the marker does not exist")
        return False
    if "bytes" in info and size != info["bytes"]:
        res.add("size_mismatch", f"{what} file {path}: {size} bytes, marker says {info['bytes']}")
    return True


def _sha_check(res: ShardResult, what: str, info: dict, digest: str) -> None:
    if "sha256" in info and digest != info["sha256"]:
        res.add("sha256_mismatch", f"{what} file {info.get('path')}: sha256 differs from the marker's")


class OnePassSha256:
    """A hidden file seen through a forward-only window that hashes every byte it passes.

    Why: a shard's hidden file is gigabytes on real models, and on an object store reading it once for the
    marker's sha256 and again to decode its samples doubles what verify pulls over the network. Verify decodes
    samples in record order, which is file order, so sample reads only move forward: every byte they read or
    skip is fed to the hash, and `finish()` hashes the tail (index, footer). A backward seek (samples out of
    file order) gives the one-pass hash up; `finish()` then returns None and the caller hashes the file apart.
    """

    def __init__(self, fh):
        self.fh, self.pos, self.hash = fh, 0, hashlib.sha256()
        fh.seek(0)

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence != 0:
            raise ValueError("OnePassSha256 seeks from the start only")
        if self.hash is not None and offset >= self.pos:
            self._advance(offset - self.pos)
        else:
            self.hash = None
            self.fh.seek(offset)
            self.pos = offset
        return self.pos

    def read(self, n: int) -> bytes:
        data = self.fh.read(n)
        if self.hash is not None:
            self.hash.update(data)
        self.pos += len(data)
        return data

    def _advance(self, n: int) -> None:
        while n > 0 and (chunk := self.read(min(n, 1 << 22))):
            n -= len(chunk)

    def finish(self) -> str | None:
        """The whole file's sha256, or None when the reads were not one forward pass."""
        if self.hash is None:
            return None
        while self.read(1 << 22):
            pass
        return self.hash.hexdigest()


def expected_mask(n_prompt: int, n_output: int, rec: dict) -> list[int] | None:
    """The loss mask a record must have: 0 over the prompt, 1 over the output but 0 over the ids the engine forced
    (`forced`: [first, end) spans in input_ids, only in the output, only in a record that says `budget_closed` or
    `loop_stopped`); None when `forced` cannot be right."""
    mask = [0] * n_prompt + [1] * n_output
    forced = rec.get("forced") or []
    if forced and not (rec.get("budget_closed") or rec.get("loop_stopped")):
        return None
    for first, end in forced:
        if not n_prompt <= first < end <= n_prompt + n_output:
            return None
        mask[first:end] = [0] * (end - first)
    return mask


def _check_record(res: ShardResult, rec: dict, run_id: str) -> bool:
    sid = rec.get("sample_id")
    try:
        ids, mask = rec["input_ids"], rec["loss_mask"]
        n_p, n_o = int(rec["num_prompt_tokens"]), int(rec["num_output_tokens"])
    except (KeyError, TypeError, ValueError) as exc:
        res.add("record_fields", f"ok record lacks {exc}", sid)
        return False
    good = True
    if rec.get("run_id") != run_id or rec.get("shard_id") != res.shard:
        res.add("record_place", f"record says run {rec.get('run_id')!r} shard {rec.get('shard_id')!r}", sid)
        good = False
    if len(ids) != n_p + n_o:
        res.add("token_count", f"{len(ids)} input_ids != {n_p} prompt + {n_o} output tokens", sid)
        good = False
    if mask != expected_mask(n_p, n_o, rec):
        forced = f" but 0 over the forced ids {rec['forced']}" if rec.get("forced") else ""
        res.add("loss_mask", f"loss_mask (sum {sum(mask)}, len {len(mask)}) is not {n_p} zeros then {n_o} "
                             f"ones{forced}", sid)
        good = False
    return good


def verify_shard(reader: RunReader, info: ShardInfo, decode: bool = True) -> ShardResult:
    """Every check that concerns one done shard; independent of other shards (runs in a thread pool).
    `decode` False (sampled verify): states are not read, each sample's index entry is checked instead."""
    res = ShardResult(info.shard_id, "done")
    m = info.marker
    res.worker = m.get("worker")
    if m.get("shard_id") != info.shard_id:
        res.add("marker", f"marker names shard {m.get('shard_id')!r}")
    files = m.get("files") or {}
    raw = _read_records_file(res, reader, files["records"]) if "records" in files else None
    if "records" not in files:
        res.add("marker", "marker names no records file")
    hidden_info = None
    if reader.capture_mode == "inline":
        hidden_info = files.get("hidden")
        if hidden_info is None:
            res.add("marker", "inline-capture run, but the marker names no hidden file")
    elif reader.capture_mode == "staged":
        if info.captured is not None:
            hidden_info = info.captured.get("hidden")
        elif info.shard_id in reader.dead_capture_shards():
            res.add("capture_dead", "staged capture was dead-lettered: records without states", severity="warning")
        else:
            res.add("capture_missing", "no captured/ marker: staged capture has not finished")
    hreader = fh = window = None
    if hidden_info is not None and _size_check(res, reader, "hidden", hidden_info):
        try:
            fh = reader.storage.open(hidden_info["path"])
            hreader = HiddenFileReader(fh)
            if decode:
                window = hreader.fh = OnePassSha256(fh)
        except FileNotFoundError:
            res.add("missing_file", f"hidden file {hidden_info['path']} named by the marker does not exist")
        except CorruptHiddenFile as exc:
            res.add("hidden_unreadable", f"{hidden_info['path']}: {exc}")
    try:
        if raw is not None:
            _check_records(res, reader, info, raw, hreader, decode)
        if fh is not None and decode:
            digest = window.finish() if window is not None else None
            if digest is None:  # unreadable, or samples read out of file order: hash it apart
                fh.close()
                fh = None
                digest, _ = _hash_file(reader, hidden_info["path"], keep=False)
            _sha_check(res, "hidden", hidden_info, digest)
    finally:
        if fh is not None:
            fh.close()
    res.stale_rows = None  # this shard's row table: not kept with its result
    _name_leftovers(res, reader, info.shard_id)
    return res


def _name_leftovers(res: ShardResult, reader: RunReader, shard: str) -> None:
    """Temporaries (`.name.tmp-*`) left in a finished shard's folder: a duplicate delivery whose holder died
    mid-write after its twin published. They hold no data anyone reads (only markers name files) but can be
    gigabytes each; the fleet sweeps them once their attempt is dead, and verify names what is still there."""
    folder = reader.store.rel("shards", shard)
    left = reader.storage.temporaries(folder)
    if not left:
        return
    sizes = 0
    for name, _ in left:
        with contextlib.suppress(FileNotFoundError):
            sizes += reader.storage.size(f"{folder}/{name}")
    names = ", ".join(name for name, _ in left[:3]) + (f" and {len(left) - 3} more" if len(left) > 3 else "")
    res.add("leftover_temporaries", f"{len(left)} temporaries ({sizes:,} bytes) in {folder}: {names}; a live "
            "duplicate removes its own, the fleet sweeps dead attempts' (a redelivery of the shard, an idle "
            "worker's dead-holder check)", severity="warning")


def _check_records(res: ShardResult, reader: RunReader, info: ShardInfo, raw: bytes,
                   hreader: HiddenFileReader | None, decode: bool = True) -> None:
    m = info.marker
    hidden_size = reader.run_settings.hidden_size
    rejected: Counter = Counter()
    seen_hidden: set[int] = set()
    turns: dict[str, list[dict]] = {}
    prompts, _ = prompt_check(reader.settings)
    try:
        for rec in iter_records(io.BytesIO(raw), m.records_file["path"]):
            res.records += 1
            sid = rec.get("sample_id")
            turns.setdefault(rec.get("conversation_id") or sid, []).append(rec)
            if rec.get("status") == "rejected":
                res.rejected += 1
                rejected[rec.get("reject_reason")] += 1
                continue
            if rec.get("status") != "ok":
                res.add("record_status", f"status {rec.get('status')!r}", sid)
                continue
            res.ok += 1
            good = _check_record(res, rec, reader.run_id) and check_mode(res, rec, reader.settings)
            if good and prompts is not None:
                good = prompts.check(res, rec, reader.settings)
            if hreader is None or "input_ids" not in rec:
                continue
            pos = hreader.by_id.get(sid)
            if pos is None:
                res.add("hidden_missing", "no states for this sample in the shard's hidden file", sid)
                continue
            seen_hidden.add(pos)
            hidx = (rec.get("hidden") or {}).get("index")
            if reader.capture_mode == "inline" and hidx != pos:
                res.add("hidden_index", f"record says hidden index {hidx}, file has it at {pos}", sid)
            checked = (check_states(res, rec, hreader, pos, reader, hidden_size) if decode
                       else check_index_entry(res, rec, hreader.entries[pos], reader, hidden_size))
            if checked and good:
                res.good_samples.append(sid)
    except (zstandard.ZstdError, orjson.JSONDecodeError, OSError) as exc:
        res.add("records_unreadable", f"{type(exc).__name__}: {exc}")
        return
    except MalformedDocument as exc:  # a record outside the schema (app.base.records.RECORD_FIELDS)
        res.add("record_malformed", str(exc))
        return
    res.conversations = len(turns)
    check_turns(res, turns)
    if hreader is not None and len(seen_hidden) != len(hreader):
        res.add("hidden_extra", f"hidden file holds {len(hreader) - len(seen_hidden)} samples no ok record names")
    for key, got in (("samples", res.conversations), ("records", res.records), ("ok", res.ok)):
        if key in m and m[key] != got:
            res.add("count_mismatch", f"marker says {m[key]} {key}, records file has {got}")
    if "rejected" in m and dict(m["rejected"]) != dict(rejected):
        res.add("count_mismatch", f"marker rejects {m['rejected']} != records' {dict(rejected)}")


def check_turns(res: ShardResult, turns: dict[str, list[dict]]) -> None:
    """A multi-turn conversation's records are its turns 0, 1, ... in order, ids `{conversation}-t{turn}`, and
    only the last may be rejected (a rejected turn ends the conversation)."""
    for conv, recs in turns.items():
        if len(recs) == 1 and "turn" not in recs[0]:
            continue
        got = [r.get("turn") for r in recs]
        ids_ok = all(r.get("sample_id") == turn_sample_id(conv, r.get("turn")) for r in recs)
        if got != list(range(len(recs))) or not ids_ok:
            res.add("turns", f"conversation {conv}: records are turns {got}, not 0..{len(recs) - 1} in order")
        elif any(r.get("status") != "ok" for r in recs[:-1]):
            res.add("turns", f"conversation {conv}: a turn before the last is not ok")


def _expected_sizes(reader: RunReader, counts: dict) -> dict[str, int]:
    """Samples the producer put in each shard: shard_size each, the last of each pass (one pass per sample of a
    prompt, producer.produce.sample_shards) the remainder."""
    n, size, enq = int(counts.get("shards") or 0), int(reader.run_settings.shard_size or 0), counts.get("enqueued")
    if not n or not size or enq is None:
        return {}
    passes = int(reader.run_settings.samples_per_prompt)
    per_pass = n // passes
    sizes = {shard_name(k): size for k in range(n)}
    for k in range(passes):
        sizes[shard_name((k + 1) * per_pass - 1)] = int(enq) - size * (per_pass - 1)
    return sizes


def verify_run(reader: RunReader, reference: int = 0, workers: int = 4,
               progress: Callable[[str], None] | None = None, allow_incomplete: bool = False,
               sample: float | None = None, processes: int = 1, part: Part = WHOLE,
               reference_device: str = "cpu") -> VerifyReport:
    """Check the run; `allow_incomplete`: missing shards are warnings; `sample`: decode the states of only this
    many samples (a count >= 1, or a fraction of the ok samples below 1); see the module docstring.

    Fan-out: `processes` > 1 checks the shards in that many worker processes instead of `workers` threads (the
    report is the same). `part` checks only that part's shards (every N-th of the producer's shards): their
    problems, and the run-wide checks (producer, accounting), whose counts for the other parts' shards come from
    their markers; each of those shards' markers is held to its records by the part that owns it, so the run is
    verified when every part exits 0, and the parts' shard problems together are the whole run's."""
    problems: list[Problem] = []
    gap = "warning" if allow_incomplete else "error"
    produce = reader.produce_state()
    counts = (produce or {}).get("counts") or {}
    if produce is None:
        problems.append(Problem("produce_missing", None, None, "no produce.json: cannot check the accounting"))
    elif not produce.get("complete"):
        problems.append(Problem("produce_incomplete", None, None, "the producer has not finished enqueuing",
                                severity=gap))
    _, skipped = prompt_check(reader.settings)
    if skipped is not None:
        problems.append(skipped)
    if reader.layers is not None and (mislabelled := ascending_problem(reader.layers)):
        problems.append(Problem("layers_order", None, None, mislabelled))
    expected = _expected_sizes(reader, counts)
    done, dead = set(reader.done_shards()), reader.dead_generate_shards()
    every = reader.expected_shards()
    mine = set(part.pick(every))
    results: list[ShardResult] = []
    infos = [i for i in (reader.shard(s) for s in sorted(done) if s in mine) if i is not None]
    decode = sample is None
    with ThreadPoolExecutor(max(1, workers)) as threads:
        found = (ordered_map(_verify_task, [(i.shard_id, decode) for i in infos], processes, open_reader,
                             (reader.storage.url, reader.run_id)) if processes > 1
                 else threads.map(lambda i: verify_shard(reader, i, decode=decode), infos))
        for res in found:
            results.append(res)
            if progress:
                progress(res.shard)
    for name in every:
        if name in done or name not in mine:
            continue
        res = ShardResult(name, "dead" if name in dead else "missing")
        if name in dead:
            res.add("dead", "dead-lettered: " + _dead_reason(reader, name), severity=gap)
        else:
            res.add("missing", "no completion marker and not dead-lettered", severity=gap)
        results.append(res)
    for res in results:
        if (res.state == "done" and res.shard in expected and res.conversations != expected[res.shard]
                and res.records):
            res.add("shard_size", f"{res.conversations} samples, the producer enqueued {expected[res.shard]}")
        if expected and res.shard not in expected:
            res.add("unexpected_shard", "shard not among the producer's shards")
    others = [_marker_counts(reader, s) for s in sorted(done - mine)]  # other parts' shards, by their markers
    accounting, dead_samples, missing_samples = _accounting(counts, results, others, expected, every, done, dead,
                                                            gap, problems)
    sampled = None
    if sample is not None:
        sampled = decode_sample(reader, [r for r in results if r.state == "done"], sample)
    modes = ModeCounts()
    for info in infos:  # the engine that made each shard's states, and what its capture check found
        mode, checked, failed = shard_mode(info.marker, info.captured)
        modes.add(mode, int(info.marker.get("ok") or 0), checked, failed)
        failure = check_failure(info.shard_id, info.marker, info.captured)
        if failure:
            problems.append(Problem("capture_check", info.shard_id, failure[0], failure[1]))
    for res in sorted(results, key=lambda r: r.shard):
        problems += res.problems
    shard_counts = Counter(r.state for r in results)
    report = VerifyReport(reader.run_id, accounting, dict(shard_counts), problems, sampled=sampled, modes=modes)
    if not part.whole:
        report.part = str(part)
    dead_shards = sum(1 for s in every if s not in done and s in dead)
    missing_shards = sum(1 for s in every if s not in done and s not in dead)
    unfinished = produce is not None and not produce.get("complete")
    if dead_shards or missing_shards or unfinished:
        report.incomplete = {"missing_samples": dead_samples + missing_samples, "dead_shards": dead_shards,
                             "dead_samples": dead_samples, "missing_shards": missing_shards,
                             "missing_shard_samples": missing_samples, "producer_unfinished": unfinished}
    if reference:
        pool = [(r.shard, s) for r in sorted(results, key=lambda r: r.shard) for s in r.good_samples]
        report.reference = reference_check(reader, pool, reference, problems, device=reference_device)
    return report


def _accounting(counts: dict, results: list[ShardResult], others: list[tuple[int, int, int]], expected: dict,
                every: list[str], done: set[str], dead, gap: str, problems: list[Problem]) -> tuple[dict, int, int]:
    """The run's accounting from the producer's counts, the checked shards' results and the other parts' markers,
    with a problem added where its identity fails; also the samples of dead-lettered and of missing shards."""
    written = sum(r.conversations for r in results if r.state == "done") + sum(o[0] for o in others)
    dead_samples = sum(expected.get(s, 0) for s in every if s not in done and s in dead)
    missing_samples = sum(expected.get(s, 0) for s in every if s not in done and s not in dead)
    accounting = {
        "read": counts.get("read"), "enqueued": counts.get("enqueued"), "duplicates": counts.get("duplicates"),
        "rejected_producer": counts.get("rejected"), "written": written,
        "written_ok": sum(r.ok for r in results) + sum(o[1] for o in others),
        "rejected_worker": sum(r.rejected for r in results) + sum(o[2] for o in others),
        "dead_lettered": dead_samples, "missing": missing_samples,
    }
    if counts:
        # read = prompts enqueued + duplicates + rejected + left out (`--take`), and the samples made of the
        # prompts (K each) = written + dead-lettered; with one sample per prompt and no take the two are
        # today's one identity, read = written + duplicates + rejected + dead-lettered.
        left_out = int(counts.get("left_out") or 0)
        samples = int(counts.get("samples", counts["enqueued"]))
        accounting.update(left_out=left_out, samples=samples)
        extra = samples - int(counts["enqueued"])  # the prompts' samples beyond their first
        rhs = written + int(counts["duplicates"]) + int(counts["rejected"]) + left_out + dead_samples - extra
        accounting["identity_holds"] = int(counts["read"]) == rhs
        if not accounting["identity_holds"]:
            # Short by exactly the samples of unfinished shards: the run is incomplete, not inconsistent.
            short_by_missing = int(counts["read"]) == rhs + missing_samples
            more = (f" + left out {left_out}" if left_out else "") + (
                f" - {extra} samples beyond each prompt's first" if extra else "")
            problems.append(Problem("accounting", None, None,
                                    f"read {counts['read']} != written {written} + duplicates {counts['duplicates']} "
                                    f"+ rejected {counts['rejected']} + dead-lettered {dead_samples}{more} "
                                    f"({missing_samples} samples in missing shards)",
                                    severity=gap if short_by_missing else "error"))
    return accounting, dead_samples, missing_samples


def _marker_counts(reader: RunReader, shard: str) -> tuple[int, int, int]:
    """(samples, ok records, worker-rejected records) of a done shard from its marker (records when it has none)."""
    m = reader.store.done_marker(shard) or {}
    if "samples" in m and "ok" in m:
        return int(m["samples"]), int(m["ok"]), sum((m.get("rejected") or {}).values())
    recs = list(reader.records(ShardInfo(shard, m)))
    convs = {r.get("conversation_id") or r.get("sample_id") for r in recs}
    return (len(convs), sum(r.get("status") == "ok" for r in recs),
            sum(r.get("status") == "rejected" for r in recs))


# -- worker processes (`--processes`) ---------------------------------------------------------------------
def _verify_task(task: tuple[str, bool]) -> ShardResult:
    shard, decode = task
    res = verify_shard(reader := worker_reader(), reader.shard(shard), decode=decode)
    res.stale_rows = None  # per shard only; not worth sending back
    return res


def _dead_reason(reader: RunReader, name: str) -> str:
    try:
        letter = reader.dead_letter(name)
    except orjson.JSONDecodeError:
        return "?"
    return "?" if letter is None else letter.reason[:200]
