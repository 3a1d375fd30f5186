"""The pilot's sample of the real input: a seeded uniform sample of the lines a run would enqueue.

Why here: the pilot must measure what the run will generate, so its sample goes through the producer's own
readers, normalisation and dedupe (the lines a run would reject or drop as duplicates are counted, never sampled),
and the count of samples it returns is the one `regen produce` would enqueue. The sample is kept as the input's
own lines (a `.json` array element re-serialised), written to a `.jsonl` file that `regen run` then reads exactly
as it reads any input, so the pilot's runs normalise every line the way the real run will.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from app.base.config import DEFAULT_REGENERATE
from producer.estimate import Reservoir
from producer.normalise import Rejected, normalise, parse_line
from producer.readers import InputReader, ReadFailure, expand_inputs, file_sha256
from producer.sharding import Deduper
from producer.take import Selection, match_rules, parse_take, select


@dataclass
class InputSample:
    read: int  # lines read
    samples: int  # what `regen produce` would enqueue: read - rejected - duplicates
    rejected: int
    duplicates: int
    lines: list[bytes]  # the sampled lines, as the input holds them
    left_out: int = 0  # rows a `--take` did not draw: never parsed, as in the run

    def write_jsonl(self, path: str) -> None:
        with open(path, "wb") as fh:
            for line in self.lines:
                fh.write(line.rstrip(b"\r\n") + b"\n")


def take_selections(items: list[str], paths: list[str], seed: int) -> dict[str, Selection]:
    """The rows `--take GLOB=N|FRACTION` draws from each input it names, drawn as `regen produce` draws them
    with run seed `seed` (producer.take), so the pilot samples the mix the run will generate."""
    if not items:
        return {}
    matched = match_rules([parse_take(t) for t in items], paths)
    return {path: select(path, file_sha256(path), rule, seed) for path, rule in matched.items()}


def sample_inputs(inputs: list[str], size: int, seed: int, regenerate: str = DEFAULT_REGENERATE,
                  max_prompt_chars: int = 0, take: list[str] | None = None) -> InputSample:
    """Read every input once; a uniform sample (Algorithm R, `seed`) of up to `size` of the lines that become
    samples, and the counts. `take`: the run's `--take` rules; rows they leave out are never sampled."""
    reservoir = Reservoir(size, seed=seed)
    dedupe = Deduper()
    read = rejected = left_out = 0
    paths = expand_inputs(inputs)
    chosen = take_selections(take or [], paths, seed)
    for path in paths:
        keep = chosen[path].keep if path in chosen else None
        for ordinal, (line, payload) in enumerate(InputReader(path)):
            read += 1
            if keep is not None and not keep[ordinal]:
                left_out += 1
                continue
            try:
                if isinstance(payload, ReadFailure):
                    raise Rejected(payload.reason, payload.detail)
                row = parse_line(payload) if type(payload) is bytes else payload
                sample = normalise(row, file=path, line=line, regenerate=regenerate, max_prompt_chars=max_prompt_chars)
            except Rejected:
                rejected += 1
                continue
            if dedupe.first_time(sample["id"]):
                reservoir.offer(payload if type(payload) is bytes else orjson.dumps(payload))
    return InputSample(read=read, samples=reservoir.seen, rejected=rejected, duplicates=dedupe.duplicates,
                       lines=list(reservoir.items), left_out=left_out)
