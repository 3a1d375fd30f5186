"""Test-only: put a token the target's sampling could not have produced into a stored record, the way an engine that
sampled wrongly would have written it, with the shard's marker naming the new records file's size and sha256.

Only the record's last generated token is replaced: the stored states cover `input_ids[:-1]`, so they stay the
target's own and only the token check can find the change (`regen verify --reference`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from app.base.jsonl_zst import dumps_jsonl_zst, loads_jsonl_zst
from app.base.storage import RunStore, Storage


def inject_last_token(root: Path, run_id: str, shard: str, sample_id: str, token: int) -> int:
    """Replace `sample_id`'s last generated token with `token`; returns its output position."""
    store = RunStore(Storage(str(root)), run_id)
    marker_path = Path(root) / store.done_path(shard)
    marker = json.loads(marker_path.read_text())
    info = marker["files"]["records"]
    path = Path(root) / info["path"]
    records = loads_jsonl_zst(path.read_bytes())
    rec = next(r for r in records if r["sample_id"] == sample_id)
    rec["input_ids"][-1] = int(token)
    data = dumps_jsonl_zst(records)
    path.write_bytes(data)
    info["bytes"], info["sha256"] = len(data), hashlib.sha256(data).hexdigest()
    marker_path.write_text(json.dumps(marker))
    return int(rec["num_output_tokens"]) - 1
