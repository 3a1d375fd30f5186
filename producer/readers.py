"""Streaming readers for the producer's inputs: `.jsonl`, `.jsonl.zst`, `.json` arrays, many files and globs.

Why streaming: inputs reach hundreds of GB (914K long conversations per dataset), so nothing here holds more
than one buffered block and one record at a time; memory does not grow with input size.

Every record is yielded as `(line, payload)`, where `line` is the 1-based physical line of a JSON Lines file
(or the 1-based element number of a JSON array) and `payload` is the line's raw bytes (JSON Lines; parsing is
left to the normaliser so undecodable lines become rejects) or the already-parsed element (JSON arrays).
Whitespace-only lines are not records and are not yielded. A JSON array that stops parsing midway yields one
`ReadFailure` in place of the rest of the file: nothing after it can be located reliably.

Only a file that cannot be read at all (missing, a folder, an unknown extension) raises `InputError`.
"""

from __future__ import annotations

import glob
import hashlib
import io
import os
from collections.abc import Iterator
from dataclasses import dataclass

import zstandard

from app.base.errors import InputError

JSONL_SUFFIXES = (".jsonl", ".ndjson")
ZST_SUFFIXES = (".jsonl.zst", ".ndjson.zst")
JSON_SUFFIXES = (".json",)
_BLOCK = 1 << 20


@dataclass(frozen=True)
class ReadFailure:
    """A record that could not be read (only JSON arrays produce these; JSON Lines defer to the normaliser)."""

    reason: str
    detail: str


def input_format(path: str) -> str:
    """`jsonl`, `jsonl.zst` or `json`, from the file name; InputError for anything else."""
    name = path.lower()
    if name.endswith(ZST_SUFFIXES):
        return "jsonl.zst"
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(JSON_SUFFIXES):
        return "json"
    raise InputError(f"{path}: unknown input format (expected .jsonl, .jsonl.zst or .json)")


def expand_inputs(patterns: list[str] | tuple[str, ...]) -> list[str]:
    """Expand globs to absolute file paths in the given order (each glob sorted), without repeats.

    A pattern that matches nothing, a missing file or an unknown extension is an InputError naming it:
    silently skipping an input would make a run's sample count quietly wrong.
    """
    out: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(glob.glob(pattern, recursive=True))
            if not matches:
                raise InputError(f"{pattern}: no input file matches this pattern")
        else:
            matches = [pattern]
        for path in matches:
            if not os.path.exists(path):
                raise InputError(f"{path}: no such input file")
            if not os.path.isfile(path):
                raise InputError(f"{path}: not a regular file")
            input_format(path)
            full = os.path.abspath(path)
            if full not in seen:
                seen.add(full)
                out.append(full)
    if not out:
        raise InputError("no input files given")
    return out


def file_sha256(path: str) -> str:
    """SHA-256 of the file's bytes (the compressed bytes for `.zst`), read in 1 MiB blocks."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as fh:
            while block := fh.read(_BLOCK):
                digest.update(block)
    except OSError as exc:
        raise InputError(f"{path}: cannot read ({exc.strerror or exc})") from None
    return digest.hexdigest()


def describe_input(path: str) -> dict:
    """The manifest's record of one input: path, size and sha256 (a re-run checks the file did not change)."""
    return {"path": path, "size": os.path.getsize(path), "sha256": file_sha256(path)}


class _CountingReader(io.RawIOBase):
    """Counts the bytes pulled from the file, so progress is reported in input bytes for every format."""

    def __init__(self, fh):
        self._fh = fh
        self.consumed = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = self._fh.readinto(buffer)
        self.consumed += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._fh.read(size)
        self.consumed += len(data)
        return data


class InputReader:
    """Iterate one input file's records; `consumed` is the number of file bytes read so far."""

    def __init__(self, path: str):
        self.path = path
        self.format = input_format(path)
        self._raw: _CountingReader | None = None

    @property
    def consumed(self) -> int:
        return self._raw.consumed if self._raw else 0

    def __iter__(self) -> Iterator[tuple[int, object]]:
        try:
            fh = open(self.path, "rb", buffering=0)  # noqa: SIM115 - closed in the finally below
        except OSError as exc:
            raise InputError(f"{self.path}: cannot open ({exc.strerror or exc})") from None
        self._raw = _CountingReader(fh)
        try:
            if self.format == "json":
                yield from _iter_json_array(self._raw)
            elif self.format == "jsonl.zst":
                stream = zstandard.ZstdDecompressor().stream_reader(self._raw, read_across_frames=True)
                yield from _iter_lines(io.BufferedReader(stream, buffer_size=_BLOCK), self.path)
            else:
                yield from _iter_lines(io.BufferedReader(self._raw, buffer_size=_BLOCK), self.path)
        finally:
            fh.close()


def _iter_lines(fh, path: str) -> Iterator[tuple[int, bytes]]:
    try:
        for number, line in enumerate(fh, 1):
            if line.strip():
                yield number, line
    except Exception as exc:  # a corrupt .zst stream: the file as a whole is unreadable past this point
        raise InputError(f"{path}: cannot read past this point ({exc})") from None


def _iter_json_array(fh) -> Iterator[tuple[int, object]]:
    import ijson

    buffered = io.BufferedReader(fh, _BLOCK)
    head = buffered.peek(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head and not head.startswith(b"["):
        raise InputError(f"{getattr(fh._fh, 'name', 'input')}: a .json input must hold one JSON array of rows")
    number = 0
    try:
        for number, item in enumerate(ijson.items(buffered, "item", use_float=True), 1):
            yield number, item
    except UnicodeDecodeError as exc:
        yield number + 1, ReadFailure("not_utf8", f"rest of the array unreadable: {exc}")
    except Exception as exc:  # ijson's JSONError / IncompleteJSONError and yajl's errors
        yield number + 1, ReadFailure("malformed_json", f"rest of the array unreadable: {exc}"[:300])
