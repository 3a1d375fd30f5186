"""Identifiers: stable sample ids, deterministic shard ids, and validation of anything that becomes a path.

A sample id is a hash of the normalised prompt (messages and tools), so the same prompt read from two files,
or read again on a re-run, gets the same id and is generated once. Shard ids are derived from the run and the
shard's ordinal, so the same inputs and settings always give the same shards. Every id that reaches storage is
validated first: no `..`, no separators, no odd bytes, so no message can make a worker write outside the root.
"""

from __future__ import annotations

import hashlib
import re

import orjson
from xxhash import xxh3_64_hexdigest

from app.base.errors import InvalidId

_SAFE_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def validate_id(value: str, what: str = "id") -> str:
    """Return `value` if it is safe as one path component; raise InvalidId otherwise."""
    if not isinstance(value, str) or not _SAFE_ID.fullmatch(value) or ".." in value:
        raise InvalidId(f"invalid {what} {value!r}: use letters, digits, '.', '_' and '-' (no '..', no '/')")
    return value


def sample_id(messages: list[dict], tools: object | None = None) -> str:
    """A 16-hex-digit id of the normalised prompt; key order inside messages does not matter.

    XXH3-64 of the canonical JSON: a stable, seedless, non-cryptographic hash (nothing here needs resistance
    to crafted collisions; an accidental one among 10^6 samples has odds ~3e-8), ~8x faster than blake2b on
    2 KB prompts, which matters at 50K prompts/s on one producer core.
    """
    return xxh3_64_hexdigest(orjson.dumps({"m": messages, "t": tools}, option=orjson.OPT_SORT_KEYS))


def prompt_sample_id(prompt_id: str, index: int) -> str:
    """Sample `index` of a prompt (`--samples-per-prompt`): the prompt's own id for the first, so a run of one
    sample per prompt has the ids it always had, and `{prompt}-s{index}` for the others."""
    return prompt_id if index == 0 else f"{prompt_id}-s{index}"


def shard_id(index: int) -> str:
    """Shards are numbered in input order; the number alone is deterministic for a given run."""
    return f"shard-{index:06d}"


def seed_for(run_seed: int, sid: str) -> int:
    """Per-sample seed from the run seed and the sample id (one shared seed correlates samples, docs/measured-facts.md)."""
    digest = hashlib.blake2b(f"{run_seed}:{sid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") & 0x7FFFFFFF
