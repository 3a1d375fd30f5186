"""Corrupt one stored sample's states the way a faulty capture would have written them: through the project's own
writer (app/base/hidden_file.py), so every part CRC is valid, and with the shard's marker naming the new file's size and
sha256. Only the checks that look at the values themselves can then find it, which is what the tests using this
want to show (`regen verify`'s row checks, `--reference`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from app.base.hidden_file import HiddenFileReader, HiddenFileWriter, encode_sample
from app.base.storage import RunStore, Storage


def rewrite_states(root: Path, run_id: str, shard: str, change: Callable[[str, np.ndarray, np.ndarray], np.ndarray | None],
                   staged: bool = False) -> list[str]:
    """Re-write `shard`'s hidden file with `change(sample_id, token_ids, states)` applied to each sample (None keeps
    it), then make the marker's bytes and sha256 true again. Returns the ids of the samples changed."""
    store = RunStore(Storage(str(root)), run_id)
    marker_rel = store.captured_path(shard) if staged else store.done_path(shard)
    marker = store.storage.read_json(marker_rel)
    hidden = marker["hidden"] if staged else marker["files"]["hidden"]
    path = Path(root) / hidden["path"]
    samples, changed = [], []
    with path.open("rb") as fh:
        reader = HiddenFileReader(fh)
        for i, entry in enumerate(reader.entries):
            tokens, states = reader.read(i)
            new = change(entry["sample_id"], tokens, states.copy())
            if new is not None:
                changed.append(entry["sample_id"])
                states = new
            samples.append(encode_sample(entry["sample_id"], tokens, np.ascontiguousarray(states, dtype=np.uint16),
                                         list(entry["layers"])))
    tmp = path.with_name(path.name + ".rewrite")
    with tmp.open("wb") as fh:
        writer = HiddenFileWriter(fh)
        for sample in samples:
            writer.append(sample)
        size = writer.close()
    tmp.replace(path)
    hidden["bytes"] = size
    if "sha256" in hidden:
        hidden["sha256"] = hashlib.sha256(path.read_bytes()).hexdigest()
    (Path(root) / marker_rel).write_text(json.dumps(marker))
    return changed
