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

from producer.estimate import Reservoir
from producer.normalise import Rejected, normalise, parse_line
from producer.readers import InputReader, ReadFailure, expand_inputs
from producer.sharding import Deduper


@dataclass
class InputSample:
    read: int  # lines read
    samples: int  # what `regen produce` would enqueue: read - rejected - duplicates
    rejected: int
    duplicates: int
    lines: list[bytes]  # the sampled lines, as the input holds them

    def write_jsonl(self, path: str) -> None:
        with open(path, "wb") as fh:
            for line in self.lines:
                fh.write(line.rstrip(b"\r\n") + b"\n")


def sample_inputs(inputs: list[str], size: int, seed: int, regenerate: str = "last",
                  max_prompt_chars: int = 0) -> InputSample:
    """Read every input once; a uniform sample (Algorithm R, `seed`) of up to `size` of the lines that become
    samples, and the counts."""
    reservoir = Reservoir(size, seed=seed)
    dedupe = Deduper()
    read = rejected = 0
    for path in expand_inputs(inputs):
        for line, payload in InputReader(path):
            read += 1
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
                       lines=list(reservoir.items))
